"""Overload and misbehaving clients: admission bounds, cancel and disconnect free places,
slow readers are dropped, and 2,000 concurrent connections all get served."""

from __future__ import annotations

import asyncio
import random
import re
import resource

import pytest

from sclsd import protocol as P
from sclsd.client import status

from .opshelp import start, stop, wait_for
from .rawclient import Raw

MAX_REQ = 8
MAX_TOK = 1500


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    d = start(tmp_path_factory.mktemp("overload"),
              # One uid here: the global bounds are under test, not the per-uid share.
              daemon={"max_queued_requests": MAX_REQ, "max_queued_tokens": MAX_TOK, "uid_share": 1.0,
                      "max_frame_bytes": 65536, "max_conn_buffer_bytes": 65536},
              options={"decode_s": 0.05})
    yield d
    assert stop(d) == 0, d.log_text()


def _long(rid: str, n_prompt: int = 3) -> P.Generate:
    # 400 tokens at 0.4 s per slice of 8: far longer than any test waits.
    return P.Generate(id=rid, prompt_ids=[7] * n_prompt, max_tokens=400, ignore_eos=True)


def _live(daemon) -> int:
    return daemon.status().live_requests


def test_request_bound_refuses_at_once_and_a_disconnect_frees_places(daemon) -> None:
    async def run() -> None:
        a = await Raw.open(daemon.sock)
        for i in range(MAX_REQ):
            a.send(_long(f"a{i}"))
        for _ in range(MAX_REQ):
            assert isinstance(await a.recv(), P.Accepted)
        b = await Raw.open(daemon.sock)
        b.send(_long("b0"))
        ev = await b.recv(timeout=5)  # the very next event: refused, not queued
        assert isinstance(ev, P.Error) and ev.code == "overloaded" and ev.id == "b0", ev
        st = await asyncio.to_thread(daemon.status)
        assert st.live_requests == MAX_REQ and st.limits.max_queued_requests == MAX_REQ
        # The client goes away: its requests are cancelled and their places freed.
        await a.close()
        await asyncio.to_thread(wait_for, lambda: _live(daemon) == 0, 10, "places freed", daemon)
        b.send(P.Generate(id="b1", prompt_ids=[1, 2], max_tokens=3, ignore_eos=True))
        await b.until_terminal({"b1"}, 30)
        assert isinstance(b.events["b1"][0], P.Accepted) and isinstance(b.events["b1"][-1], P.Done)
        await b.close()

    asyncio.run(run())
    log = daemon.log.read_text()
    assert re.search(r"conn=\d+ disconnected: \d+ requests cancelled \(id=[^)]*\d+:a0", log) and "refused id=b0" in log
    text = status(daemon.status_sock, metrics=True)
    assert re.search(r'sclsd:request_refused_total\{code="overloaded",model_name="fake",'
                     r'reason="max_queued_requests"\} [1-9]', text), text


def test_token_bound_and_cancel_by_id(daemon) -> None:
    async def run() -> None:
        a = await Raw.open(daemon.sock)
        a.send(_long("big1", 1000))
        assert isinstance(await a.recv(), P.Accepted)
        b = await Raw.open(daemon.sock)
        b.send(_long("big2", 1000))  # 1000 + 1000 tokens > 1500
        ev = await b.recv(timeout=5)
        assert isinstance(ev, P.Error) and ev.code == "overloaded" and "tokens" in ev.message, ev
        b.send(_long("small", 100))  # fits under the token bound
        assert isinstance(await b.recv(), P.Accepted)
        # Another connection cannot cancel it (ids are guessable)...
        b.send(P.Cancel(id="big1"))
        ev = await b.recv(timeout=5)
        assert isinstance(ev, P.Error) and ev.code == "unknown_id", ev
        assert (await asyncio.to_thread(daemon.status)).live_requests == 2
        # ...its owner can: a terminal done(cancelled), and the tokens are free again.
        a.send(P.Cancel(id="big1"))
        await a.until_terminal({"big1"}, 10)
        done = a.events["big1"][-1]
        assert isinstance(done, P.Done) and done.finish_reason == "cancelled", done
        b.send(_long("big3", 1000))
        ev = await b.recv(timeout=5)
        assert isinstance(ev, P.Accepted) and ev.id == "big3", ev
        await a.close()
        await b.close()
        await asyncio.to_thread(wait_for, lambda: _live(daemon) == 0, 10, "b cancelled", daemon)

    asyncio.run(run())
    assert daemon.status().queued_tokens == 0


def test_slow_reader_is_dropped_and_hurts_no_one(daemon) -> None:
    async def run() -> None:
        slow = await Raw.open(daemon.sock)
        slow.send(P.Generate(id="slow1", prompt_ids=[3, 4], max_tokens=400, ignore_eos=True))
        # Never read; ask for far more output than max_conn_buffer_bytes (64 KiB) plus what
        # the kernel buffers.
        ping = P.frame(P.Ping(nonce=123456))
        for _ in range(40):
            slow.writer.write(ping * 10_000)
            try:
                await asyncio.wait_for(slow.writer.drain(), 10)
            except (ConnectionError, OSError):
                break  # the daemon dropped us: the point
        await asyncio.to_thread(wait_for, lambda: "slow client" in daemon.log.read_text(), 20,
                                "slow client dropped", daemon)
        good = await Raw.open(daemon.sock)
        good.send(P.Generate(id="good", prompt_ids=[5], max_tokens=10, ignore_eos=True))
        await good.until_terminal({"good"}, 30)
        assert isinstance(good.events["good"][-1], P.Done)
        await good.close()
        slow.writer.transport.abort()

    asyncio.run(run())
    assert daemon.proc.poll() is None
    wait_for(lambda: _live(daemon) == 0, 10, "slow client's request cancelled", daemon)
    assert re.search(r"disconnected: 1 requests cancelled \(id=\d+:slow1\)", daemon.log.read_text())


N_CONNS = 2000


def test_2000_concurrent_connections_every_request_completes(tmp_path) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < N_CONNS + 200:
        pytest.skip(f"hard RLIMIT_NOFILE {hard} is below {N_CONNS} connections")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))

    def low_soft_limit() -> None:
        # The usual default: the daemon has to raise its own soft limit to hold 2,000 clients.
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))

    d = start(tmp_path, preexec_fn=low_soft_limit, daemon={"log_level": "info"},
              scheduler={"slice_len": 8, "gamma_s": 0.005})
    rng = random.Random(11)
    specs = [P.Generate(id=f"m{i}", prompt_ids=[rng.randrange(3, 256) for _ in range(rng.randint(1, 20))],
                        max_tokens=rng.randint(1, 20), ignore_eos=True, stream=bool(i % 2))
             for i in range(N_CONNS)]

    async def one(g: P.Generate) -> list:
        c = await Raw.open(d.sock)
        c.send(g)
        await c.until_terminal({g.id}, 240)
        await c.close()
        return c.events[g.id]

    async def run() -> list[list]:
        return await asyncio.gather(*(one(g) for g in specs))

    try:
        results = asyncio.run(run())
        st = d.status()
    finally:
        rc = stop(d)
    assert rc == 0
    for g, evs in zip(specs, results, strict=True):
        assert isinstance(evs[0], P.Accepted), (g.id, evs[0])
        assert isinstance(evs[-1], P.Done) and evs[-1].usage.completion_tokens == g.max_tokens, (g.id, evs[-1])
        assert sum(isinstance(e, (P.Done, P.Error)) for e in evs) == 1
    assert st.live_requests == 0 and st.counters["finished"] == N_CONNS
    assert "open-file limit" in d.log.read_text()


def test_a_busy_loop_still_accepts_every_pending_connection_at_once(tmp_path) -> None:
    """Regression: asyncio.start_unix_server on uvloop accepted about one connection per
    loop turn, so under load thousands of new clients waited seconds for their first byte
    to be read. FrameServer accepts everything pending on each wake-up: counted in loop
    turns, not seconds."""
    import os
    import socket
    import time

    import uvloop

    from sclsd.daemon.sockets import FrameServer

    path = str(tmp_path / "a.sock")
    n = 300

    async def run() -> int:
        served = 0

        def handle(conn, msg) -> None:
            nonlocal served
            served += 1
            conn.send(P.Pong(nonce=msg.nonce))

        srv = FrameServer("t", path, P.client_decoder, handle)
        await srv.start()
        turns = 0
        stop = False

        async def busy() -> None:  # a loop turn that takes 5 ms, like a daemon under load
            nonlocal turns
            while not stop:
                t = time.perf_counter()
                while time.perf_counter() - t < 0.005:
                    pass
                turns += 1
                await asyncio.sleep(0)

        b = asyncio.create_task(busy())
        socks = []
        for _ in range(n):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(path)
            s.sendall(P.frame(P.Ping(nonce=1)))
            socks.append(s)
        start = turns
        while served < n and turns - start < 2000:
            await asyncio.sleep(0)
        used = turns - start
        stop = True
        await b
        for s in socks:
            s.close()
        await srv.stop()
        assert served == n
        return used

    used = uvloop.run(run())
    assert used < 50, f"{n} pending connections took {used} loop turns to be served"
    assert not os.path.exists(path)


def test_a_burst_beyond_the_bound_reaches_a_client_that_reads(tmp_path) -> None:
    """Output over max_conn_buffer_bytes in one go (thousands of requests ending in one
    round, here pongs) is fine for a client that keeps reading: only one that stops
    reading is dropped."""
    d = start(tmp_path, daemon={"max_frame_bytes": 65536, "max_conn_buffer_bytes": 65536},
              workers={"spawn": 0})
    try:
        # ~300 KB of pongs (each lists the daemon's features), produced within a loop turn or two.
        pong = len(P.frame(P.Pong(nonce=99_999, features=list(P.GENERATE_FEATURES))))
        n = 300_000 // pong

        async def run() -> int:
            c = await Raw.open(d.sock)
            c.writer.write(b"".join(P.frame(P.Ping(nonce=i)) for i in range(n)))
            got = 0
            while got < n:
                ev = await c.recv(30)
                assert isinstance(ev, P.Pong), ev
                got += 1
            await c.close()
            return got

        assert n * pong > 4 * 65536 and asyncio.run(run()) == n
        assert "slow client" not in d.log.read_text()
    finally:
        assert stop(d) == 0, d.log_text()
