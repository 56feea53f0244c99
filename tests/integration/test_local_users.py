"""What another local user can do to the daemon through its files and its socket, against
real processes: a run directory others may write to stops the daemon in one line before it
makes anything there, and a client of the socket cannot take sclsd-http's request ids."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sclsd import protocol as P
from sclsd.http.process import start_http, stop_http
from sclsd.launch import DaemonProcess as Daemon

from .rawclient import Raw
from .test_guarantees import daemon_factory, one_line_error, poll, run_to_exit, write_config

httpx2 = pytest.importorskip("httpx2")

SQUATTED = 40


@pytest.fixture
def started(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    with daemon_factory(tmp_path) as make:
        yield make


def test_a_run_directory_others_may_write_to_stops_the_daemon_in_one_line(tmp_path: Path) -> None:
    cfg, short = write_config(tmp_path)
    try:
        short.chmod(0o777)
        line = one_line_error(run_to_exit(cfg, "--log-level", "warning"))
        assert str(short) in line and "writable by others" in line, line
        assert list(short.iterdir()) == [], "nothing was made in it"
    finally:
        shutil.rmtree(short, ignore_errors=True)


def test_a_client_cannot_take_the_ids_sclsd_http_uses_next(started: Callable[..., Daemon]) -> None:
    d = started(options={"decode_s": 0.01}, daemon={"uid_share": 1.0})
    proc, url = start_http(d.sock, d.status_sock)
    try:
        body = {"prompt": "hi", "max_tokens": 2, "temperature": 0, "ignore_eos": True}
        first = httpx2.post(url + "/v1/completions", json=body, timeout=30)
        assert first.status_code == 200, first.text
        # sclsd-http's ids are a per-process prefix and a counter: the next ones are plain to see.
        seen = first.json()["id"].removeprefix("cmpl-")
        prefix, n = seen[:-8], int(seen[-8:], 16)
        ids = [f"{kind}-{prefix}{k:08x}" for k in range(n + 1, n + 1 + SQUATTED)
               for kind in ("cmpl", "chatcmpl")]

        async def squat() -> Raw:
            c = await Raw.open(d.sock)
            for rid in ids:  # long requests: live while sclsd-http serves its own
                c.send(P.Generate(id=rid, prompt="x", max_tokens=1000, ignore_eos=True, stream=False))
            while len(c.events) < len(ids):
                await c.recv(30)
            assert all(isinstance(c.events[r][0], P.Accepted) for r in ids)
            return c

        async def run() -> list[int]:
            squatter = await squat()
            try:
                async with httpx2.AsyncClient(timeout=60) as http:
                    replies = await asyncio.gather(*(http.post(url + "/v1/completions", json=body)
                                                     for _ in range(SQUATTED // 2)))
            finally:
                await squatter.close()
            for r in replies:
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["finish_reason"] == "length", r.text
            return [int(r.json()["id"][-8:], 16) for r in replies]

        served = asyncio.run(run())
        assert min(served) == n + 1, "sclsd-http used the very ids the other client holds"
        print(json.dumps({"http_ok": len(served), "squatted": len(ids)}))
    finally:
        stop_http(proc)
    poll(lambda: d.status().live_requests == 0, 10, "the squatter's requests cancelled", d)
