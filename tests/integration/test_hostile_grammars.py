"""Structured output that would crash or exhaust a process costs only its own request.

A real daemon with a fake worker that enforces grammars (``[workers.options] grammar``).
The daemon compiles grammars in child processes (``[grammar]``): a ``$ref`` chain 1,000
deep and a Lark grammar of 5,000 chained rules (which overflow llguidance's stack), an
``allOf`` of 200 patterns (which makes it allocate gigabytes) are each refused with
``bad_request`` naming the limit, in seconds; the daemon's own memory does not grow
(bound: :data:`RSS_GROWTH`), and a bystander streaming meanwhile is served in full.
A grammar that passes the daemon's check and cannot be built in the worker (65,600
rules: llguidance panics on the worker's vocabulary) ends that request with
``bad_request`` while its batch's other row is served: never retried, no worker dropped.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("llguidance")

from sclsd import protocol as P  # noqa: E402
from sclsd.client import AsyncClient, RequestError  # noqa: E402
from sclsd.launch import DaemonProcess, launch  # noqa: E402

#: Longest a hostile grammar may take to be refused (grammar.timeout_s is 4 s here).
REFUSE_S = 15.0
#: Most the daemon's resident memory may grow over one hostile grammar and its bystander.
RSS_GROWTH = 40 * 1024**2


def start(tmp: Path, **grammar: object) -> DaemonProcess:
    return launch({
        "daemon": {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 30.0, "log_level": "debug"},
        "model": {"name": "fake"},
        "scheduler": {"policy": "scls", "slice_len": 8, "gamma_s": 0.05},
        "workers": {"spawn": 1, "engine": "fake", "threads": 1,
                    "options": {"grammar": True, "decode_s": 0.01}},
        "grammar": {"processes": 2, "timeout_s": 4.0, "memory_bytes": 256 * 1024**2, **grammar},
    }, log=tmp / "sclsd.log", wait_workers=1, timeout=120)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = start(tmp_path_factory.mktemp("grammars"))
    yield d
    assert d.stop(timeout=30) == 0, d.log.read_text()[-3000:]


def rss(d: DaemonProcess) -> int:
    for line in Path(f"/proc/{d.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def ref_chain(n: int = 1000) -> P.Structured:
    defs: dict[str, object] = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}},
                                         "required": ["x"]} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return P.Structured(kind="json_schema", value=json.dumps({"$defs": defs, "$ref": "#/$defs/d0"},
                                                             separators=(",", ":")))


def lark_chain(n: int = 5000) -> P.Structured:
    rules = ["start: r0", *(f'r{i}: r{i + 1} "a"' for i in range(n)), f'r{n}: "b"']
    return P.Structured(kind="lark", value="\n".join(rules))


def all_of(n: int = 200) -> P.Structured:
    pats = [{"pattern": f"^(a|b)*{'x' * (i % 7)}.*c{i}.*$"} for i in range(n)]
    return P.Structured(kind="json_schema", value=json.dumps({"type": "string", "allOf": pats}))


def wide_lark(n: int = 65_600) -> P.Structured:
    """Checks in about a second without a vocabulary; with one, llguidance asserts fewer
    than 65,525 symbols and panics."""
    def name(i: int) -> str:
        digits = "0123456789abcdefghijklmnopqrstuvwxyz"
        out = ""
        while True:
            i, k = divmod(i, 36)
            out = digits[k] + out
            if not i:
                return "r" + out
    names = [name(i) for i in range(n)]
    return P.Structured(kind="lark", value="start:" + "|".join(names) + "\n"
                        + "\n".join(f"{x}:A" for x in names) + '\nA:"a"\n')


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


async def hostile_with_bystander(d: DaemonProcess, hostile: P.Structured) -> tuple[RequestError, float]:
    """Send ``hostile`` while a bystander streams and another waits for its grammar; both
    bystanders must be served. (the refusal, seconds it took)."""
    async with AsyncClient(d.sock) as c:
        stream = asyncio.ensure_future(c.complete(prompt="bystander", max_tokens=120, ignore_eos=True,
                                                  temperature=0.0))
        t0 = time.monotonic()
        with pytest.raises(RequestError) as info:
            await c.complete(prompt="hostile", max_tokens=8, structured=hostile)
        took = time.monotonic() - t0
        good = await c.complete(prompt="json please", max_tokens=60, temperature=0.0,
                                structured=P.Structured(kind="json_schema", value=json.dumps(SCHEMA)))
        done = await stream
    assert done.finish_reason == "length" and done.usage.completion_tokens == 120
    # The fake model's byte tokenizer spells its EOS (id 2) as the byte 2.
    assert good.finish_reason == "stop" and isinstance(json.loads((good.text or "").rstrip("\x02"))["ok"], bool)
    return info.value, took


@pytest.mark.parametrize(("make", "names"), [
    (ref_chain, ("SIGSEGV",)),
    (lark_chain, ("SIGSEGV",)),
    # Whichever its child meets first (tests/unit/daemon/test_grammar_checks.py: each alone).
    (all_of, ("grammar.memory_bytes = 268435456", "grammar.timeout_s = 4 s")),
])
def test_a_hostile_grammar_is_refused_and_the_daemon_serves_on(daemon: DaemonProcess, make,
                                                                names: tuple[str, ...]) -> None:
    before = rss(daemon)
    err, took = asyncio.run(hostile_with_bystander(daemon, make()))
    grown = rss(daemon) - before
    print(f"{make.__name__}: refused in {took:.2f} s; daemon RSS {before / 2**20:.0f} MiB, "
          f"{grown / 2**20:+.1f} MiB; {err.message}")
    assert err.code == "bad_request" and err.message.startswith("structured output: ")
    assert any(n in err.message for n in names) and took < REFUSE_S
    assert grown < RSS_GROWTH
    assert daemon.proc.poll() is None


def test_a_grammar_too_slow_to_check_is_refused_naming_the_time_limit(tmp_path: Path) -> None:
    # 45,000 choices: about 5 s of llguidance's lexer on a 2-core machine, past timeout_s = 0.5.
    with start(tmp_path, timeout_s=0.5) as d:
        many = P.Structured(kind="choice", value=json.dumps([f"option {i}" for i in range(45_000)]))
        err, took = asyncio.run(hostile_with_bystander(d, many))
        print(f"45k choices: refused in {took:.2f} s: {err.message}")
        assert err.code == "bad_request" and "grammar.timeout_s = 0.5 s" in err.message
        assert 0.5 <= took < REFUSE_S


def test_a_grammar_the_worker_cannot_build_fails_that_request_alone(daemon: DaemonProcess) -> None:
    async def go() -> tuple[RequestError, P.Done]:
        async with AsyncClient(daemon.sock) as c:
            # One batch: the worker serves both rows together, or the poison row alone first.
            other = asyncio.ensure_future(c.complete(prompt="neighbour", max_tokens=40, ignore_eos=True,
                                                     temperature=0.0))
            with pytest.raises(RequestError) as info:
                await c.complete(id="poison", prompt="poison", max_tokens=8, structured=wide_lark())
            return info.value, await other

    pid = daemon.status().workers[0].pid
    err, other = asyncio.run(go())
    assert err.code == "bad_request" and "its grammar could not be built" in err.message
    assert "panic" in err.message
    assert other.finish_reason == "length" and other.usage.completion_tokens == 40
    st = daemon.status()
    assert [w.pid for w in st.workers] == [pid] and st.worker_losses == []
    # Never retried: one batch row of it reached the worker.
    log = daemon.log.read_text()
    assert log.count("could not be built") >= 1
    assert sum(1 for line in log.splitlines() if "-> worker=" in line and "poison" in line) <= 1
