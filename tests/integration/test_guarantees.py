"""The daemon's guarantees towards clients, each against a real daemon with fake-engine workers.

One test per guarantee: nothing lost under pipelining; invalid UTF-8 refused per
frame, the connection kept; one daemon per socket; an unservable config refused
(exit 2 naming the key); start-up errors in one line; bounds on half-sent frames,
huge prompts and one uid's share. The guarantees about workers are in
``test_guarantees_workers.py``, which shares the helpers below.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from sclsd import protocol as P
from sclsd.client import Client
from sclsd.launch import DaemonProcess as Daemon
from sclsd.launch import launch as launch_daemon
from sclsd.launch import short_dir, toml_text

from .opshelp import REPO, reference_tokens
from .rawclient import Raw

READY_S = 30.0  # a generous bound for worker start-up on a loaded machine


# --------------------------------------------------------------------------- launching


def sections(*, daemon: dict[str, Any] | None = None, scheduler: dict[str, Any] | None = None,
             workers: dict[str, Any] | None = None, options: dict[str, Any] | None = None,
             model: str = "fake") -> dict[str, dict[str, Any]]:
    """A config: fake model and workers, slice 8, Γ = 0.02 s, with these changes."""
    d: dict[str, Any] = {"heartbeat_interval_s": 0.25, "heartbeat_timeout_s": 30.0, "drain_timeout_s": 10.0,
                         "log_level": "info", **(daemon or {})}
    s: dict[str, Any] = {"policy": "scls", "slice_len": 8, "gamma_s": 0.02, **(scheduler or {})}
    w: dict[str, Any] = {"spawn": 2, "engine": "fake", "threads": 1, "restart_backoff_s": 0.2, **(workers or {})}
    w["options"] = {"decode_s": 0.0, **(options or {})}
    return {"daemon": d, "model": {"name": model}, "scheduler": s, "workers": w}


def launch(tmp: Path, *, cwd: Path = REPO, wait: int | None = None, env: dict[str, str] | None = None,
           **changes: Any) -> Daemon:
    """Start a daemon (log: ``tmp/sclsd.log``; ``env``: more of its environment) and wait
    until its status socket answers with ``wait`` workers registered (default:
    ``workers.spawn``)."""
    cfg = sections(**changes)
    # TMPDIR: the daemon's private run directory lands here, removed with the test's files
    # even when the daemon cannot remove it (SIGKILL).
    (tmp / "tmp").mkdir(exist_ok=True)
    n = cfg["workers"]["spawn"] if wait is None else wait
    return launch_daemon(cfg, log=tmp / "sclsd.log", env={"TMPDIR": str(tmp / "tmp"), **(env or {})}, cwd=cwd,
                         wait_workers=n, timeout=READY_S)


def write_config(tmp: Path, **changes: Any) -> tuple[Path, Path]:
    """A config file in ``tmp`` for a daemon expected to exit, with its sockets in a new
    short directory: (file, directory)."""
    short = short_dir()
    cfg = sections(**changes)
    cfg["daemon"] = {"socket": f"{short}/sclsd.sock", "status_socket": f"{short}/status.sock",
                     "worker_endpoint": f"ipc://{short}/workers.ipc", **cfg["daemon"]}
    path = tmp / "sclsd.toml"
    path.write_text(toml_text(cfg))
    return path, short


def finish(d: Daemon) -> int:
    """Stop the daemon (SIGTERM; SIGKILL if it hangs; its directory removed); its exit code."""
    return d.stop(timeout=30)


@contextlib.contextmanager
def daemon_factory(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    """``make(**sections)`` starts a daemon; each is stopped (exit 0 checked) at the end."""
    daemons: list[Daemon] = []

    def make(**sections: Any) -> Daemon:
        sub = tmp_path / f"d{len(daemons)}"
        sub.mkdir()
        d = launch(sub, **sections)
        daemons.append(d)
        return d

    try:
        yield make
    finally:
        codes = [(finish(d), d) for d in daemons]
    for rc, d in codes:
        assert rc in (0, -signal.SIGKILL), f"daemon exited {rc}:\n{d.log_text()}"


@pytest.fixture
def started(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    with daemon_factory(tmp_path) as make:
        yield make


def poll(pred: Callable[[], Any], timeout: float, what: str, d: Daemon | None = None,
         every: float = 0.05) -> Any:
    """Call ``pred`` (a status round trip, a /proc read) until it is truthy, at most ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}"
                                 + (f":\n{d.log_text()}" if d is not None else ""))
        time.sleep(every)


def run_to_exit(cfg: Path, *args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    """Run a daemon on ``cfg`` that is expected to exit (TMPDIR beside the config)."""
    tmpdir = cfg.parent / "tmp"
    tmpdir.mkdir(exist_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TMPDIR=str(tmpdir))
    return subprocess.run([sys.executable, "-m", "sclsd.daemon", "--config", str(cfg), *args],
                          capture_output=True, text=True, timeout=60, env=env, cwd=cwd)


def one_line_error(r: subprocess.CompletedProcess[str]) -> str:
    """Exit 2 and exactly one non-empty stderr line, ``sclsd: ...``, no traceback; the line."""
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert len(lines) == 1 and lines[0].startswith("sclsd:"), r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    return lines[0]


def greedy(d: Daemon, prompt: list[int], n: int = 12) -> list[int]:
    with Client(d.sock, timeout=30) as c:
        done = c.complete(prompt_ids=prompt, max_tokens=n, temperature=0.0, ignore_eos=True)
    assert done.token_ids is not None and done.finish_reason == "length", done
    return done.token_ids


async def until_pong(c: Raw, nonce: int, timeout: float = 20.0) -> list[Any]:
    """Send a ping and read up to its pong: every event in between (a round trip)."""
    c.send(P.Ping(nonce=nonce))
    seen: list[Any] = []
    while True:
        ev = await c.recv(timeout)
        if isinstance(ev, P.Pong) and ev.nonce == nonce:
            return seen
        seen.append(ev)


def terminals(evs: list[Any]) -> list[Any]:
    return [e for e in evs if isinstance(e, (P.Done, P.Error))]


# --------------------------------------------------------------------------- pipelining

N_PIPELINED = 2000


def test_pipelined_requests_each_get_exactly_one_terminal_event(started: Callable[..., Daemon]) -> None:
    d = started(scheduler={"slice_len": 16})
    rng = random.Random(7)
    specs = [P.Generate(id=f"p{i}", prompt_ids=[rng.randrange(3, 256) for _ in range(rng.randint(1, 24))],
                        max_tokens=128, temperature=0.0, ignore_eos=True, stream=False)
             for i in range(N_PIPELINED)]

    async def ended_by_daemon(c: Raw) -> None:
        """Once the daemon read every frame and holds no request, ping: whatever has no
        terminal event by the pong was lost (no need to wait for a timeout)."""
        while True:
            st = await asyncio.to_thread(d.status)
            if st.counters["accepted"] + st.counters["refused"] >= N_PIPELINED and st.live_requests == 0 \
                    and st.admitting == 0:
                c.send(P.Ping(nonce=1))
                return
            await asyncio.sleep(0.1)

    async def run() -> Raw:
        c = await Raw.open(d.sock)
        c.writer.write(b"".join(P.frame(g) for g in specs))  # one write: all pipelined
        watch = asyncio.create_task(ended_by_daemon(c))
        open_ids = {g.id for g in specs}
        try:
            while open_ids:
                ev = await c.recv(30)
                if isinstance(ev, (P.Done, P.Error)):
                    open_ids.discard(ev.id)
                elif isinstance(ev, P.Pong):
                    break
        except (asyncio.TimeoutError, asyncio.IncompleteReadError) as exc:
            watch.cancel()
            raise AssertionError(f"{exc!r} with {len(open_ids)} requests open\n{d.log_text()}") from None
        await asyncio.wait_for(watch, 30)
        lost = sorted(map(str, open_ids))
        assert not lost, (f"{len(lost)} requests without a terminal event, e.g. {lost[:5]}; "
                          f"connection-level events: {c.events[None][:3]}")
        # A second terminal event for any of them would come before this pong.
        await until_pong(c, 99)
        await c.close()
        return c

    c = asyncio.run(run())
    for g in specs:
        evs = c.events[g.id]
        assert isinstance(evs[0], P.Accepted), (g.id, evs[:2])
        ends = terminals(evs)
        assert len(ends) == 1 and ends[0] is evs[-1], (g.id, ends)
        assert isinstance(ends[0], P.Done) and ends[0].finish_reason == "length", (g.id, ends[0])
        assert ends[0].usage.completion_tokens == 128
    for g in specs[:: N_PIPELINED // 20]:  # the tokens too: those of one unsliced pass
        assert g.prompt_ids is not None
        assert c.events[g.id][-1].token_ids == reference_tokens(g.prompt_ids, 128), g.id
    st = poll(lambda: (s := d.status()).live_requests == 0 and s, 10, "no live requests", d)
    assert st.counters["accepted"] == st.counters["finished"] == N_PIPELINED, st.counters


# --------------------------------------------------------------------------- invalid UTF-8

MARK = "MARKERMARKER"  # a 12-character fixstr in msgpack: 0xac + the bytes
BAD_STRINGS = {"not utf-8": b"\xff\xfe", "lone surrogate": b"\xed\xa0\x80"}
NUL_STRING = b"a\x00b"
FIELDS: dict[str, Callable[[str], dict[str, Any]]] = {
    "prompt": lambda s: {"prompt": s},
    "id": lambda s: {"id": s, "prompt": "hi"},
    "stop": lambda s: {"prompt": "hi", "stop": [s]},
    "messages.content": lambda s: {"messages": [{"role": "user", "content": s}]},
    "messages.role": lambda s: {"messages": [{"role": s, "content": "hi"}]},
}


def generate_body(fields: dict[str, Any], raw: bytes) -> bytes:
    """A msgpack ``generate`` whose MARK string is replaced by the bytes ``raw`` (any bytes)."""
    body = msgspec.msgpack.encode({"type": "generate", "max_tokens": 4, "stream": False, **fields})
    old = bytes([0xA0 | len(MARK)]) + MARK.encode()
    assert body.count(old) == 1 and len(raw) < 32
    return body.replace(old, bytes([0xA0 | len(raw)]) + raw)


def test_invalid_utf8_is_refused_per_frame_and_the_connection_kept(started: Callable[..., Daemon]) -> None:
    d = started(options={"decode_s": 0.002})

    async def run() -> None:
        c = await Raw.open(d.sock)
        # Accepted before the bad frames (200 x 2 ms: most likely still running meanwhile).
        c.send(P.Generate(id="before", prompt_ids=[5, 6, 7], max_tokens=200, ignore_eos=True, stream=False))
        assert isinstance(await c.recv(), P.Accepted)
        nonce = 0
        for name, make in FIELDS.items():
            for kind, raw in BAD_STRINGS.items():
                extra = {} if name == "id" else {"id": f"x-{name}-{kind}"}
                c.send_bytes(generate_body({**extra, **make(MARK)}, raw))
                nonce += 1
                got = [e for e in await until_pong(c, nonce) if getattr(e, "id", "") != "before"]
                assert len(got) == 1, (name, kind, got)
                assert isinstance(got[0], P.Error) and got[0].code == "bad_request", (name, kind, got)
                assert "UTF-8" in got[0].message, got[0]
            # NUL is valid UTF-8: served like any other text, except as a role (not one of the three).
            rid = f"nul-{name}"
            extra = {} if name == "id" else {"id": rid}
            c.send_bytes(generate_body({**extra, **make(MARK)}, NUL_STRING))
            nonce += 1
            got = [e for e in await until_pong(c, nonce) if getattr(e, "id", "") != "before"]
            if name == "messages.role":
                assert len(got) == 1 and isinstance(got[0], P.Error) and got[0].code == "bad_request", got
                continue
            rid = "a\x00b" if name == "id" else rid
            assert got and isinstance(got[0], P.Accepted) and got[0].id == rid, (name, got)
            await c.until_terminal({rid}, 20)
            ends = terminals(c.events[rid])
            assert len(ends) == 1 and isinstance(ends[0], P.Done), (name, ends)
        # The same connection still serves.
        await until_pong(c, 1000)
        c.send(P.Generate(id="after", prompt="hello", max_tokens=3, ignore_eos=True, stream=False))
        await c.until_terminal({"after", "before"}, 30)
        for rid in ("after", "before"):
            ends = terminals(c.events[rid])
            assert len(ends) == 1 and isinstance(ends[0], P.Done) and ends[0].finish_reason == "length", ends
        assert c.events["before"][-1].usage.completion_tokens == 200
        await c.close()

    asyncio.run(run())
    assert d.proc.poll() is None
    assert poll(lambda: d.status().live_requests == 0, 10, "no live requests", d)


# --------------------------------------------------------------------------- one daemon per socket


def test_second_daemon_on_the_same_sockets_exits_2_and_the_first_keeps_serving(
        started: Callable[..., Daemon]) -> None:
    d = started()
    ipc_inode = os.stat(d.endpoint[len("ipc://"):]).st_ino
    api_inode = os.stat(d.sock).st_ino
    r = run_to_exit(d.config, "--log-level", "warning")
    line = one_line_error(r)
    assert f"pid {d.proc.pid}" in line, line
    # At the config's own log level too: exit 2, and the one "sclsd:" line is the error.
    r = run_to_exit(d.config)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert [x for x in r.stderr.splitlines() if x.startswith("sclsd:")] == [line], r.stderr
    # The first daemon's sockets are untouched and answer.
    assert os.stat(d.endpoint[len("ipc://"):]).st_ino == ipc_inode
    assert os.stat(d.sock).st_ino == api_inode
    with Client(d.sock, timeout=10) as c:
        c.ping()
    assert greedy(d, [9, 8, 7]) == reference_tokens([9, 8, 7], 12)
    assert len(d.status().workers) == 2


# --------------------------------------------------------------------------- unservable


@pytest.mark.parametrize("case", ["gamma_inf", "fake_engine_real_model", "fake_vocab_too_small"])
def test_unservable_config_exits_2_naming_the_key(tmp_path: Path, case: str) -> None:
    if case == "gamma_inf":
        cfg, short = write_config(tmp_path, scheduler={"gamma_s": float("inf")})
        key = "scheduler.gamma_s"
    elif case == "fake_vocab_too_small":
        # Fewer ids than the fake model's byte tokenizer: every worker would be refused.
        cfg, short = write_config(tmp_path, options={"vocab": 10})
        key = "workers.options.vocab = 10"
    else:
        cfg, short = write_config(tmp_path, model="tiny-random")
        key = "workers.engine"
    try:
        line = one_line_error(run_to_exit(cfg))
    finally:
        shutil.rmtree(short, ignore_errors=True)
    assert key in line, line


# --------------------------------------------------------------------------- start-up errors

STARTUP_ERRORS: dict[str, tuple[dict[str, Any], str]] = {
    "missing model file": ({"model": "/nonexistent/model.gguf", "workers": {"engine": "hf"}}, "model.name"),
    "missing profile": ({"scheduler": {"profile": "/nonexistent.json"}}, "scheduler.profile"),
    "unknown group": ({"daemon": {"socket_group": "nosuchgroup-sclsd"}}, "daemon.socket_group"),
}


@pytest.mark.parametrize("case", list(STARTUP_ERRORS))
def test_start_up_errors_end_in_one_line_and_exit_2(tmp_path: Path, case: str) -> None:
    changes, key = STARTUP_ERRORS[case]
    cfg, short = write_config(tmp_path, **changes)
    try:
        line = one_line_error(run_to_exit(cfg))
    finally:
        shutil.rmtree(short, ignore_errors=True)
    assert key in line, line


# --------------------------------------------------------------------------- resource bounds


def test_half_sent_frame_is_dropped_after_frame_timeout(started: Callable[..., Daemon]) -> None:
    d = started(daemon={"frame_timeout_s": 0.5})

    async def run() -> None:
        stalled = await Raw.open(d.sock)
        other = await Raw.open(d.sock)
        loop = asyncio.get_running_loop()
        stalled.send_bytes(b"\x80" * 1000, declared=1 << 20)  # 1 MiB announced, 1000 bytes sent
        await stalled.writer.drain()
        t0 = loop.time()
        # Meanwhile the other connection is served.
        other.send(P.Generate(id="o1", prompt_ids=[4, 5], max_tokens=5, ignore_eos=True))
        await other.until_terminal({"o1"}, 10)
        assert isinstance(other.events["o1"][-1], P.Done)
        ev = await stalled.recv(10)
        waited = loop.time() - t0
        assert isinstance(ev, P.Error) and ev.code == "bad_frame", ev
        assert 0.3 <= waited < 5.0, waited
        with pytest.raises(asyncio.IncompleteReadError):
            await stalled.recv(5)  # then closed
        await until_pong(other, 5)
        await stalled.close()
        await other.close()

    asyncio.run(run())
    assert "frame incomplete" in d.log.read_text()


def test_huge_text_prompt_is_refused_quickly_without_delaying_others(started: Callable[..., Daemon],
                                                                     tmp_path: Path) -> None:
    # A real tokenizer (SmolLM2's, ~2.5 s for 4 MB here): the refusal must not wait for it.
    secret = tmp_path / "worker.secret"
    secret.write_text("ab" * 32 + "\n")
    secret.chmod(0o600)
    d = started(model="tiny-random", workers={"spawn": 0, "engine": "hf"},
                daemon={"worker_secret_file": str(secret)})
    # One fake-engine worker of the same vocabulary, started apart, serves the bystander.
    with open(tmp_path / "ext.log", "wb") as out:
        ext = subprocess.Popen([sys.executable, "-m", "worker.main", "--connect", d.endpoint, "--id", "ext",
                                "--engine", "fake", "--vocab", "49152", "--secret-file", str(secret)],
                               stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        poll(lambda: len(d.status().workers) == 1, READY_S, "the external worker registered", d)

        async def run() -> None:
            big = await Raw.open(d.sock)
            other = await Raw.open(d.sock)
            loop = asyncio.get_running_loop()
            frame = P.frame(P.Generate(id="huge", prompt="x" * 4_000_000, max_tokens=4))
            t0 = loop.time()
            big.writer.write(frame)
            other.send(P.Generate(id="by", prompt="bystander", max_tokens=8, ignore_eos=True))
            ev = await big.recv(10)
            refused_after = loop.time() - t0
            await other.until_terminal({"by"}, 10)
            served_after = loop.time() - t0
            assert isinstance(ev, P.Error) and ev.code == "prompt_too_long" and ev.id == "huge", ev
            assert refused_after < 1.0, refused_after
            assert isinstance(other.events["by"][-1], P.Done), other.events["by"]
            assert served_after < 2.0, served_after
            await big.close()
            await other.close()

        asyncio.run(run())
        assert poll(lambda: d.status().live_requests == 0, 10, "no live requests", d)
    finally:
        ext.terminate()
        try:
            ext.wait(timeout=20)
        except subprocess.TimeoutExpired:
            ext.kill()
            ext.wait()


def test_one_uid_holds_at_most_its_share_of_the_queue(started: Callable[..., Daemon]) -> None:
    d = started(daemon={"max_queued_requests": 20, "uid_share": 0.5}, options={"decode_s": 0.05})

    async def run() -> None:
        c = await Raw.open(d.sock)
        # 400 tokens at 0.4 s per slice of 8: none ends while the test looks.
        for i in range(11):
            c.send(P.Generate(id=f"u{i}", prompt_ids=[3, 4, 5], max_tokens=400, ignore_eos=True,
                              stream=False))
        evs = [await c.recv(10) for _ in range(11)]
        assert [type(e) for e in evs[:10]] == [P.Accepted] * 10, evs
        assert isinstance(evs[10], P.Error) and evs[10].code == "overloaded" and evs[10].id == "u10", evs[10]
        assert "uid_share" in evs[10].message, evs[10]
        st = await asyncio.to_thread(d.status)
        assert st.live_requests == 10 and st.admitting == 0, st
        await c.close()  # cancels its requests

    asyncio.run(run())
    assert poll(lambda: d.status().live_requests == 0, 10, "places freed", d)
