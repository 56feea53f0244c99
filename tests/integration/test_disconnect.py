"""A client that goes away cancels its requests, at once and without errors.

Against a real daemon with fake-engine workers: a client with 2,000 requests in
flight hangs up (and one that aborts its connection), and sclsd-http is killed
with streams open; the daemon must hold nothing of theirs a few seconds later: no live request, no KV kept for them, no
error or traceback in its log, and the next client served at once.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sclsd import protocol as P
from sclsd.client import Client
from sclsd.http.process import start_http, stop_http
from sclsd.launch import DaemonProcess as Daemon

from .rawclient import Raw
from .test_guarantees import daemon_factory, poll

N = 2000
#: How long the daemon may take to let go of a gone client's requests.
RELEASE_S = 10.0
#: Requests the client sees accepted before it hangs up (the rest are still being admitted).
ACCEPTED_FIRST = 300


@pytest.fixture
def started(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    with daemon_factory(tmp_path) as make:
        yield make


def _errors(log: str) -> list[str]:
    """Log lines at error level or above, and traceback lines."""
    return [line for line in log.splitlines()
            if " ERROR " in line or " CRITICAL " in line or "Traceback" in line]


def _flood(d: Daemon, abort: bool) -> float:
    """Pipeline ``N`` long requests on one connection, wait until the daemon holds them
    all, go away (close, or abort the transport), and return the seconds until the
    daemon holds none of them."""

    async def run() -> float:
        c = await Raw.open(d.sock)
        c.writer.write(b"".join(P.frame(P.Generate(id=f"r{i}", prompt=f"tell me about {i}",
                                                   max_tokens=1024, ignore_eos=True, stream=True))
                                for i in range(N)))
        # Hang up while the daemon still admits the frames (text prompts: its read loop
        # waits on the tokenizer) and streams their tokens, so its writes fail meanwhile.
        accepted = 0
        while accepted < ACCEPTED_FIRST:
            accepted += isinstance(await c.recv(30), P.Accepted)
        if abort:
            c.writer.transport.abort()
        else:
            await c.close()
        return time.monotonic()

    gone = asyncio.run(run())
    poll(lambda: (s := d.status()).live_requests == 0 and s.kv_cache_usage == 0.0 and s.pool_size == 0,
         RELEASE_S, "the gone client's requests to be cancelled", d)
    return time.monotonic() - gone


@pytest.mark.parametrize("abort", [False, True], ids=["close", "abort"])
def test_a_client_that_hangs_up_cancels_all_its_requests(started: Callable[..., Daemon],
                                                         abort: bool) -> None:
    # Slow tokens: without the cancel, these requests would stay live for minutes.
    d = started(options={"decode_s": 0.002}, daemon={"max_queued_requests": 4 * N})
    took = _flood(d, abort)
    st = d.status()
    assert st.counters["accepted"] >= ACCEPTED_FIRST
    assert st.live_requests == 0 and st.running_requests == 0 and st.queued_tokens == 0
    # Let the batches already on workers come back: nothing is kept for the gone requests.
    poll(lambda: all(w.batches_inflight == 0 for w in d.status().workers), RELEASE_S,
         "the workers to be idle", d)
    assert d.status().kv_cache_usage == 0.0
    errors = _errors(d.log_text())
    assert not errors, f"{len(errors)} error lines, e.g. {errors[:3]}"
    # The daemon serves the next client at once: nothing of the gone one holds its place.
    with Client(d.sock, timeout=30) as c:
        t0 = time.monotonic()
        done = c.complete(id="next", prompt_ids=[5, 6, 7], max_tokens=8, ignore_eos=True)
        waited = time.monotonic() - t0
    assert done.usage.completion_tokens == 8
    assert waited < 5.0, f"an 8-token request took {waited:.1f}s after the flood"
    print(f"live = 0 {took:.2f}s after the client went away ({'abort' if abort else 'close'})")


STREAMS = 500


def test_killing_the_http_front_end_cancels_its_streams(started: Callable[..., Daemon]) -> None:
    """sclsd-http dies (SIGKILL) with streams open: its daemon connection closes, and each
    of its requests is cancelled as any gone client's."""
    d = started(options={"decode_s": 0.0}, daemon={"max_queued_requests": 4 * STREAMS, "uid_share": 1.0})
    proc, url = start_http(d.sock, d.status_sock)
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"prompt": "hello", "max_tokens": 1024, "ignore_eos": True, "stream": True,
                       "temperature": 0}).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    socks = []
    try:
        for _ in range(STREAMS):
            s = socket.create_connection((host, int(port)), timeout=30)
            s.sendall(request)
            socks.append(s)
        # Killed while the daemon still admits some of them and streams the others.
        poll(lambda: d.status().live_requests >= STREAMS // 2, 30, "half the streams live", d)
        proc.kill()
        proc.wait(10)
        gone = time.monotonic()
        poll(lambda: (s := d.status()).live_requests == 0 and s.pool_size == 0, RELEASE_S,
             "sclsd-http's requests to be cancelled", d)
        took = time.monotonic() - gone
    finally:
        for s in socks:
            s.close()
        stop_http(proc)
    st = d.status()
    assert st.counters["accepted"] >= STREAMS // 2
    errors = _errors(d.log_text())
    assert not errors, f"{len(errors)} error lines, e.g. {errors[:3]}"
    print(f"live = 0 {took:.2f}s after sclsd-http was killed with {STREAMS} streams open")
