"""The budget for half-sent frames: who is charged, who is closed, and a frame server that
keeps to it over real Unix sockets (the daemon-level test with several uids is
``tests/integration/test_frame_budget.py``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path

import pytest

from sclsd import protocol as P
from sclsd.config import ConfigError, from_dict
from sclsd.daemon.framebudget import FrameBudget
from sclsd.daemon.sockets import Conn, FrameServer, frame_budget

from .conftest import until

KIB = 1024
#: Seconds a frame server gets to charge or release what the test expects (it takes a few
#: loop turns; the bound only keeps a broken budget from hanging the test).
WAIT_S = 10.0


def test_a_uid_over_its_budget_closes_the_connection_that_went_over() -> None:
    evicted: list[str] = []
    b: FrameBudget[str] = FrameBudget(total=100, per_uid=40, evict=lambda k, why: evicted.append(k))
    assert b.charge("a1", 7, 20) is None
    assert b.charge("a2", 7, 15) is None
    why = b.charge("a2", 7, 10)  # 45 > 40: a2 goes, a1 keeps its 20
    assert why is not None and "max_partial_frame_bytes_per_uid" in why and "uid 7" in why
    assert (b.held, b.holding("a1"), b.holding("a2"), b.uid_holding(7), b.closed) == (20, 20, 0, 20, 1)
    assert evicted == []  # the caller closes the charging connection itself
    assert b.charge("other", 8, 40) is None  # other uids are not touched by uid 7's budget
    b.release("a1")
    b.release("a1")  # twice: no-op
    assert (b.held, b.uid_holding(7), b.uid_holding(8)) == (40, 0, 40)


def test_the_global_budget_closes_the_heaviest_uids_largest_connection_not_the_bystander() -> None:
    evicted: list[tuple[str, str]] = []
    b: FrameBudget[str] = FrameBudget(total=100, per_uid=60, evict=lambda k, why: evicted.append((k, why)))
    for key, n in (("x1", 30), ("x2", 25)):  # uid 1 holds 55
        assert b.charge(key, 1, n) is None
    assert b.charge("y1", 2, 20) is None  # uid 2 holds 20
    assert b.charge("z1", 3, 20) is None  # uid 3 holds 20: 95 in all
    # 10 more for the bystander y1 would make 105: uid 1's largest connection goes.
    assert b.charge("y1", 2, 10) is None
    assert [k for k, _ in evicted] == ["x1"] and "max_partial_frame_bytes" in evicted[0][1]
    assert (b.held, b.holding("x1"), b.holding("y1"), b.closed) == (75, 0, 30, 1)
    # When the charging connection is itself the largest of the heaviest uid, it goes.
    b2: FrameBudget[str] = FrameBudget(total=50, per_uid=50)
    assert b2.charge("big", 1, 40) is None and b2.charge("small", 2, 5) is None
    assert b2.charge("big", 1, 10) is not None
    assert (b2.held, b2.holding("small")) == (5, 5)
    with pytest.raises(ValueError):
        FrameBudget(total=10, per_uid=20)


def test_the_budget_keys_are_validated() -> None:
    ok = from_dict({"daemon": {"max_frame_bytes": 1 << 20, "max_partial_frame_bytes_per_uid": 1 << 20,
                               "max_partial_frame_bytes": 1 << 20}}).daemon
    assert ok.max_partial_frame_bytes == ok.max_partial_frame_bytes_per_uid == 1 << 20
    defaults = from_dict({}).daemon
    assert defaults.max_partial_frame_bytes >= defaults.max_partial_frame_bytes_per_uid >= defaults.max_frame_bytes
    with pytest.raises(ConfigError, match="daemon.max_partial_frame_bytes_per_uid"):
        from_dict({"daemon": {"max_frame_bytes": 1 << 20, "max_partial_frame_bytes_per_uid": 1 << 19}})
    with pytest.raises(ConfigError, match="daemon.max_partial_frame_bytes ="):
        from_dict({"daemon": {"max_partial_frame_bytes": 1 << 20}})


def _watch(budget: FrameBudget[Conn]) -> asyncio.Event:
    """An event set after every charge and release of ``budget`` (the test's own object, its
    methods wrapped on the instance): the frame server's read loops change the budget as
    bytes arrive, and the test awaits those changes instead of polling on a timer."""
    changed = asyncio.Event()
    charge, release = budget.charge, budget.release

    def charged(holder: Conn, uid: int, n: int) -> str | None:
        try:
            return charge(holder, uid, n)
        finally:
            changed.set()

    def released(holder: Conn) -> None:
        try:
            release(holder)
        finally:
            changed.set()

    budget.charge = charged  # type: ignore[method-assign]
    budget.release = released  # type: ignore[method-assign]
    return changed


async def _settled(changed: asyncio.Event, pred: Callable[[], bool]) -> None:
    """Wait until ``pred()`` holds, re-checked at each change of the budget; after
    ``WAIT_S`` the caller's assertion says what the budget holds instead."""
    with contextlib.suppress(TimeoutError):
        await until(changed, pred, WAIT_S)


async def _read_event(reader: asyncio.StreamReader) -> object:
    (n,) = P.FRAME_HEADER.unpack(await asyncio.wait_for(reader.readexactly(4), 10))
    return P.server_decoder.decode(await asyncio.wait_for(reader.readexactly(n), 10))


def test_a_frame_server_keeps_half_sent_frames_within_the_budget(tmp_path: Path) -> None:
    """One uid (this process): 3 connections each hold 100 KiB of a 200 KiB frame against a
    per-uid budget of 256 KiB: the third is closed with ``overloaded`` and holds nothing; a
    bystander's whole frames are never charged and are answered; completed frames release
    their bytes."""
    path = str(tmp_path / "b.sock")

    async def main() -> None:
        budget = frame_budget(512 * KIB, 256 * KIB)
        changed = _watch(budget)
        pings: list[int] = []

        def handle(conn: Conn, msg: object) -> None:
            if isinstance(msg, P.Ping):
                pings.append(msg.nonce)
                conn.send(P.Pong(nonce=msg.nonce))

        srv = FrameServer("t", path, P.client_decoder, handle, max_frame=256 * KIB,
                          max_buffer=256 * KIB, budget=budget)
        await srv.start()
        streams = [await asyncio.open_unix_connection(path) for _ in range(4)]
        try:
            # A 200 KiB frame (a ping and trailing bytes) whose bytes come in two parts.
            body = P.encode(P.Ping(nonce=1))
            frame_size = 200 * KIB
            payload = body + b"\x00" * (frame_size - len(body))
            for i, (_, w) in enumerate(streams[:3]):
                w.write(P.FRAME_HEADER.pack(frame_size) + payload[:100 * KIB])
                await w.drain()
                want = (min(i + 1, 2) * 100 * KIB, int(i == 2))  # (held, closed): the third goes

                def reached(want: tuple[int, int] = want) -> bool:
                    return (budget.held, budget.closed) == want

                await _settled(changed, reached)
                assert (budget.held, budget.closed) == want, (i, budget.held, budget.closed)
            ev = await _read_event(streams[2][0])
            assert isinstance(ev, P.Error) and ev.code == "overloaded", ev
            assert "max_partial_frame_bytes_per_uid" in ev.message
            assert await streams[2][0].read() == b""  # then closed
            assert budget.closed == 1 and budget.held == 200 * KIB
            # The bystander (same uid, whole frames) is served at once, never charged.
            r, w = streams[3]
            w.write(P.frame(P.Ping(nonce=7)))
            assert await _read_event(r) == P.Pong(nonce=7)
            assert budget.closed == 1
            # The rest of a frame arrives: its bytes are released (the frame itself is a bad
            # one, trailing bytes, answered per frame with the connection kept).
            r0, w0 = streams[0]
            w0.write(payload[100 * KIB:])
            ev = await _read_event(r0)
            assert isinstance(ev, P.Error) and ev.code == "bad_frame", ev
            assert budget.held == 100 * KIB
            # A connection that goes away releases what it held.
            streams[1][1].close()
            await _settled(changed, lambda: budget.held == 0)
            assert budget.held == 0
        finally:
            for _, w in streams:
                w.close()
            await srv.stop()

    asyncio.run(main())
