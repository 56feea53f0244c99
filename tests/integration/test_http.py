"""``sclsd-http`` driven with the official ``openai`` SDK, in front of a daemon with one
``hf`` worker on the tiny random Llama (processes, sockets and HTTP as deployed)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

openai = pytest.importorskip("openai")
httpx2 = pytest.importorskip("httpx2")

from sclsd.client import Client, status  # noqa: E402
from sclsd.http.process import start_http, stop_http  # noqa: E402
from sclsd.launch import DaemonProcess, launch  # noqa: E402

SLICE = 8
MAX_QUEUED = 3
OPEN = 2 * SLICE + 3  # model.default_max_tokens: what a body without max_tokens gets


class Http:
    """A running ``sclsd-http``."""

    def __init__(self, d: DaemonProcess) -> None:
        self.proc, self.url = start_http(d.sock, d.status_sock)

    def stop(self) -> int:
        return stop_http(self.proc)


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[DaemonProcess, Http]]:
    d = launch({"model": {"name": "tiny-random", "default_max_tokens": OPEN},
                "scheduler": {"policy": "scls", "slice_len": SLICE},
                "daemon": {"max_queued_requests": MAX_QUEUED, "uid_share": 1.0},
                "workers": {"engine": "hf", "spawn": 1, "threads": 1}},
               wait_workers=1, timeout=180)
    try:
        http = Http(d)
    except BaseException:
        d.stop()
        raise
    yield d, http
    assert http.stop() == 0
    assert d.stop() == 0, d.log_text()


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from sclsd.tokenizer import load

    return load("tiny-random")


def sdk(http: Http) -> Any:
    return openai.OpenAI(base_url=http.url + "/v1", api_key="none", max_retries=0, timeout=120)


def live(d: DaemonProcess) -> int:
    return status(d.status_sock).live_requests


def wait_idle(d: DaemonProcess, timeout: float = 10.0) -> float:
    """Seconds until the daemon holds no live request (polls its status)."""
    t0 = time.monotonic()
    while live(d):
        assert time.monotonic() - t0 < timeout, f"{live(d)} requests still live"
        time.sleep(0.05)
    return time.monotonic() - t0


def test_completions_and_chat_with_usage_from_the_tokenizer(stack, tokenizer) -> None:
    d, http = stack
    client = sdk(http)
    prompt = "The capital of France is"
    c = client.completions.create(model="tiny-random", prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert c.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert c.usage.completion_tokens == 12 and c.choices[0].finish_reason == "length"
    # The same request through the daemon's own socket gives the same text.
    with Client(d.sock, timeout=60) as sc:
        ref = sc.complete(prompt=prompt, max_tokens=12, temperature=0.0, ignore_eos=True)
    assert c.choices[0].text == ref.text
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}]
    chat = client.chat.completions.create(model="tiny-random", messages=msgs, max_completion_tokens=9,
                                          temperature=0, extra_body={"ignore_eos": True})
    # Rendered with the tokenizer's own chat template, with the generation prompt.
    want = tokenizer.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert chat.usage.prompt_tokens == len(want)
    assert chat.usage.completion_tokens == 9 and chat.choices[0].message.role == "assistant"
    assert [m.id for m in client.models.list().data] == ["tiny-random"]


def test_a_body_without_max_tokens_gets_the_daemons_default(stack) -> None:
    """The openai SDK sends no ``max_tokens`` unless told (nor do langchain, pydantic-ai and
    the agents SDK): such a request generates up to ``model.default_max_tokens``, not
    ``model.max_gen``; one that names more than the default, within the limit, gets it."""
    _, http = stack
    client = sdk(http)
    eos = {"ignore_eos": True}
    c = client.completions.create(model="tiny-random", prompt="Once upon", temperature=0, extra_body=eos)
    assert (c.usage.completion_tokens, c.choices[0].finish_reason) == (OPEN, "length")
    msgs = [{"role": "user", "content": "Tell me a story."}]
    chat = client.chat.completions.create(model="tiny-random", messages=msgs, temperature=0, extra_body=eos)
    assert (chat.usage.completion_tokens, chat.choices[0].finish_reason) == (OPEN, "length")
    stream = client.chat.completions.create(model="tiny-random", messages=msgs, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body=eos)
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert [u.completion_tokens for u in usage] == [OPEN]
    more = client.completions.create(model="tiny-random", prompt="Once upon", temperature=0,
                                     max_tokens=OPEN + 5, extra_body=eos)
    assert more.usage.completion_tokens == OPEN + 5


def test_streaming_chat_and_completion(stack) -> None:
    _, http = stack
    client = sdk(http)
    msgs = [{"role": "user", "content": "Count to ten."}]
    whole = client.chat.completions.create(model="tiny-random", messages=msgs, max_tokens=20,
                                           temperature=0, extra_body={"ignore_eos": True})
    stream = client.chat.completions.create(model="tiny-random", messages=msgs, max_tokens=20,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    text, reason, usage = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            text += ch.delta.content or ""
            reason = ch.finish_reason or reason
    assert text == whole.choices[0].message.content and reason == "length"
    assert usage is not None and usage.model_dump() == whole.usage.model_dump()
    parts = [c.choices[0].text for c in client.completions.create(
        model="tiny-random", prompt="Once upon", max_tokens=10, stream=True, temperature=0)]
    assert "".join(parts)


def test_n_choices_and_logprobs(stack) -> None:
    _, http = stack
    client = sdk(http)
    c = client.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": "Go"}],
                                       n=2, max_tokens=8, temperature=1.0, seed=3, logprobs=True,
                                       top_logprobs=4, extra_body={"ignore_eos": True})
    assert [ch.index for ch in c.choices] == [0, 1]
    assert c.choices[0].message.content != c.choices[1].message.content
    assert c.usage.completion_tokens == 16
    for ch in c.choices:
        content = ch.logprobs.content
        assert len(content) == 8
        for e in content:
            assert len(e.top_logprobs) == 4 and e.logprob <= 0.0
            assert e.top_logprobs[0].logprob >= e.logprob  # the top one is at least as likely
    greedy = client.completions.create(model="tiny-random", prompt="Hello", max_tokens=6, temperature=0,
                                       logprobs=3, extra_body={"ignore_eos": True})
    lp = greedy.choices[0].logprobs
    # Greedy picks the likeliest token: the chosen one heads its top list.
    assert [max(t, key=t.get) for t in lp.top_logprobs] == lp.tokens
    assert "".join(lp.tokens) == greedy.choices[0].text


def test_stop_string_across_a_slice_boundary(stack, tokenizer) -> None:
    d, http = stack
    client = sdk(http)
    prompt = "Tell me a story."
    kw: dict[str, Any] = dict(max_tokens=3 * SLICE, temperature=1.0, seed=1234)
    with Client(d.sock, timeout=60) as sc:  # the reference: the same seeded request, no stop
        ids = sc.complete(prompt=prompt, ignore_eos=True, **kw).token_ids
    assert ids is not None and len(ids) == 3 * SLICE
    # The text of the last token of slice 1 and the first of slice 2.
    before, upto = tokenizer.decode(ids[: SLICE - 1]), tokenizer.decode(ids[: SLICE + 1])
    assert upto.startswith(before)
    stop = upto[len(before):]
    full = tokenizer.decode(ids)
    # The seed is fixed, so this holds on every run; if the model or sampler changes and it
    # does not, pick another seed rather than weaken the test.
    assert stop.strip() and full.find(stop) == len(before), f"no usable boundary text ({stop!r})"
    c = client.completions.create(model="tiny-random", prompt=prompt, stop=[stop],
                                  extra_body={"ignore_eos": True}, **kw)
    ch = c.choices[0]
    assert ch.finish_reason == "stop" and ch.text == before
    kept = next(k for k in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:k]))
    assert kept == SLICE + 1
    assert c.usage.completion_tokens == kept  # not the 3 slices' worth generated


def test_errors_unknown_model_bad_parameter(stack) -> None:
    _, http = stack
    client = sdk(http)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="llama-70b", prompt="x")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-random", prompt="x", temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-random", prompt="x", max_tokens=100_000)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-random", prompt="x", extra_body={"guided_json": 5})
    assert e.value.body["param"] == "guided_json"
    r = httpx2.get(http.url + "/health")
    assert r.status_code == 200
    assert httpx2.get(http.url + "/ready").json()["ready"] is True
    assert "sclsd:" in httpx2.get(http.url + "/metrics").text


def test_overload_429_and_disconnect_mid_stream_cancels_in_the_daemon(stack) -> None:
    d, http = stack
    wait_idle(d)
    (worker,) = [w.id for w in status(d.status_sock).workers]
    long = {"model": "tiny-random", "prompt": "x", "max_tokens": 1000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with Client(d.sock, timeout=30) as admin:
        # The worker out of rotation (we run as the daemon's uid: an admin): accepted requests
        # wait in the pool, so they are live for as long as the test needs.
        admin.drain_worker(worker)
        try:
            with httpx2.Client(base_url=http.url, timeout=60) as h:
                streams = [h.stream("POST", "/v1/completions", json=long) for _ in range(MAX_QUEUED)]
                for s in streams:
                    assert s.__enter__().status_code == 200  # answered once the daemon accepted it
                assert live(d) == MAX_QUEUED
                with pytest.raises(openai.RateLimitError) as e:
                    sdk(http).completions.create(model="tiny-random", prompt="y", max_tokens=2)
                assert e.value.body["code"] == "overloaded"
                # Clients going away mid-stream: their requests end in the daemon at once.
                for s in streams:
                    s.__exit__(None, None, None)
                assert wait_idle(d, timeout=5.0) < 5.0
        finally:
            admin.drain_worker(worker, resume=True)
    # A streamed request served after the resume, for a client that leaves after the first
    # tokens: cancelled mid-generation, not run to its 1000 tokens.
    with httpx2.Client(base_url=http.url, timeout=60) as h:
        with h.stream("POST", "/v1/completions", json=long) as r:
            lines = r.iter_lines()
            while not next(lines).startswith("data: {"):
                pass
    assert wait_idle(d, timeout=5.0) < 5.0
    counters = status(d.status_sock).counters
    assert counters.get("cancelled", 0) >= MAX_QUEUED + 1, counters


def test_api_bench_http_mode(tmp_path) -> None:
    """``sclsd-bench api --http`` runs end to end (its numbers belong to docs/benchmarks.md)."""
    out = tmp_path / "api.json"
    r = subprocess.run([sys.executable, "-m", "sclsd.bench.cli", "api", "--http", "--duration", "1",
                        "--warmup", "0.3", "--connections", "4", "--inflight", "2",
                        "--latency-requests", "20", "--no-progress", "--json", str(out)],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["rps"] > 0 and res["config"]["via"] == "http"
    assert res["lost"] == 0 and res["errors"] == {} and res["wrong_length"] == 0
    assert res["daemon_live_after"] == 0 and res["daemon_finished"] == res["total_requests"]


def sclsctl(d: DaemonProcess, *args: str, status_sock: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sclsd.ctl", "--socket", d.sock, "--status-socket",
                           status_sock or d.status_sock, *args], capture_output=True, text=True, timeout=120)


def test_client_and_sclsctl_grow_the_same_parameters(stack) -> None:
    d, _ = stack
    with Client(d.sock, timeout=60) as c:
        two = c.complete(prompt="Hi", n=2, max_tokens=5, temperature=1.0, seed=9, ignore_eos=True,
                         logprobs=True, top_logprobs=1)
        assert [x.usage.completion_tokens for x in two] == [5, 5] and two[0].text != two[1].text
        assert all(len(x.logprobs or []) == 5 for x in two)
        one = c.complete(prompt="Hi", max_tokens=3, min_p=0.1, presence_penalty=0.5, user="me")
        assert one.usage.completion_tokens <= 3
    r = sclsctl(d, "submit", "Hello", "--n", "2", "--logprobs", "2", "--system", "Be brief.",
                "--top-p", "0.9", "--temperature", "0.8", "--stop", "zzz", "--max-tokens", "4")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("--- choice") == 2 and r.stderr.count("choice ") == 2
    for stream in ([], ["--stream"]):  # the prompt's tokens after the first, their sum, the perplexity
        r = sclsctl(d, "submit", "The capital of France is", "--raw", "--prompt-logprobs", "1", "--max-tokens", "2",
                    *stream)
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        first = lines.index("prompt:")
        last = next(i for i, x in enumerate(lines) if x.startswith("prompt log-probability"))
        tokens = [float(m.group(2)) for x in lines[first + 1:last]
                  if (m := re.match(r"""\s*(['"]).*?\1\s+(-?[0-9.]+)""", x))]
        summary = lines[last].split()
        assert len(tokens) >= 3 and summary[4] == str(len(tokens)) and all(t <= 0 for t in tokens)
        assert abs(float(summary[2]) - sum(tokens)) < 1e-3 * len(tokens)
    help_text = sclsctl(d, "submit", "--help").stdout
    for flag in ("--top-p", "--stop", "--system", "--n", "--logprobs", "--prompt-logprobs", "(default: 128)",
                 "(default: 1.0)"):
        assert flag in help_text, flag


def test_sclsctl_rough_edges(stack) -> None:
    d, _ = stack
    # `sclsctl status | head -1`: no BrokenPipe traceback.
    r = subprocess.run(f"{sys.executable} -m sclsd.ctl --status-socket {d.status_sock} status | head -1",
                       shell=True, capture_output=True, text=True, timeout=60)
    assert r.stdout.startswith("sclsd ") and "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr
    # Status-socket connections (sclsctl top polls) are logged at debug, not info.
    before = d.log_text(10**7).count("status conn=")
    assert sclsctl(d, "top", "--iterations", "3", "--interval", "0.1").returncode == 0
    assert d.log_text(10**7).count("status conn=") == before


def test_sclsctl_drain_wait_names_the_status_socket_it_cannot_reach(monkeypatch, capsys) -> None:
    """The wait polls the status socket: its failure must not be reported as the client
    socket's (the drain itself went through the client socket)."""
    import sclsd.ctl as ctl
    from sclsd.protocol import WorkerStateReply

    class Draining:
        def __init__(self, *a: Any, **kw: Any) -> None:
            pass

        def __enter__(self) -> Draining:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def drain_worker(self, worker: str, resume: bool = False) -> WorkerStateReply:
            return WorkerStateReply(worker=worker, state="draining", batches_inflight=1)

    monkeypatch.setattr(ctl, "Client", Draining)
    rc = ctl.main(["--socket", "/tmp/client.sock", "--status-socket", "/tmp/no-such-status.sock",
                   "drain", "w0", "--wait"])
    err = capsys.readouterr().err
    assert rc == 1 and "cannot reach sclsd status at /tmp/no-such-status.sock" in err
    assert "/tmp/client.sock" not in err
