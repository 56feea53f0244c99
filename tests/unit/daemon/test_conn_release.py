"""A connection that ends is let go of once, whatever raises on the way: its ``on_close``
(which cancels its requests) runs when its transport is gone, even while its read loop
waits on a handler, and even when closing it raises. Under uvloop, as the daemon runs."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
import uvloop

from sclsd import protocol as P
from sclsd.daemon.sockets import Conn, FrameServer

WAIT_S = 10.0
#: Loop turns the lost connection is streamed to before the test gives up on its release
#: (it comes within a few: the first write after the peer's abort fails; 2 turns measured).
STREAM_TURNS = 1000


def _run(main: Callable[[], Coroutine[Any, Any, None]]) -> list[dict[str, Any]]:
    """Run ``main`` on uvloop; returns what reached the loop's exception handler."""
    errors: list[dict[str, Any]] = []

    async def wrapped() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: errors.append(ctx))
        await main()

    uvloop.run(wrapped())
    return errors


def test_a_lost_transport_releases_the_connection_while_its_handler_waits(tmp_path: Path) -> None:
    path = str(tmp_path / "a.sock")
    closed: list[Conn] = []

    async def main() -> None:
        conns: list[Conn] = []
        released = asyncio.Event()
        handler_waits = asyncio.Event()
        let_go = asyncio.Event()

        async def handle(conn: Conn, msg: P.Ping) -> None:
            conns.append(conn)
            handler_waits.set()
            await let_go.wait()  # as admission waits on the tokenizer

        def on_close(conn: Conn) -> None:
            closed.append(conn)
            released.set()

        srv = FrameServer("t", path, P.client_decoder, handle, on_close=on_close)
        await srv.start()
        reader, writer = await asyncio.open_unix_connection(path)
        writer.write(P.frame(P.Ping(nonce=1)))
        await asyncio.wait_for(handler_waits.wait(), WAIT_S)
        writer.transport.abort()  # the client is gone, unread events and all

        async def stream() -> None:  # events keep coming for it, as deltas do
            # One event per loop turn, no real sleep: the write that finds the peer gone is
            # what ends the transport (its read side saw only an EOF; without writes it is
            # never released), so the stream is the cause to keep up, not a condition to poll,
            # and the code under test has no event for "written" to await: each turn flushes
            # the event sent the turn before while the loop polls the socket. Bounded, so a
            # connection never let go of fails the test instead of streaming forever.
            for _ in range(STREAM_TURNS):
                if released.is_set():
                    return
                conns[0].send(P.Pong(nonce=2))
                await asyncio.sleep(0)

        streamer = asyncio.create_task(stream())
        try:
            # Released while the handler still waits: the read loop cannot notice yet.
            await streamer  # bounded: it ends once released, or after STREAM_TURNS events
            assert released.is_set(), f"not let go of after {STREAM_TURNS} events"
            assert not let_go.is_set() and conns[0].closed
            conns[0].send(P.Pong(nonce=3))  # a late event for it goes nowhere, quietly
            await asyncio.sleep(0)
        finally:
            let_go.set()
            await streamer
            await srv.stop()

    errors = _run(main)
    assert len(closed) == 1, "on_close runs exactly once"
    assert not errors, errors[:2]


def test_on_close_runs_even_when_closing_the_connection_raises(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(tmp_path / "b.sock")
    closed: list[Conn] = []

    def broken_flush(self: Conn) -> None:
        raise RuntimeError("unable to perform operation on <UnixTransport>; the handler is closed")

    monkeypatch.setattr(Conn, "flush", broken_flush)

    async def main() -> None:
        released = asyncio.Event()

        def on_close(conn: Conn) -> None:
            closed.append(conn)
            released.set()

        srv = FrameServer("t", path, P.client_decoder, lambda conn, msg: None, on_close=on_close)
        await srv.start()
        reader, writer = await asyncio.open_unix_connection(path)
        writer.write(P.frame(P.Ping(nonce=1)))
        await writer.drain()
        writer.close()  # a clean hang-up: the read loop ends and closes the connection
        try:
            await asyncio.wait_for(released.wait(), WAIT_S)
        finally:
            await srv.stop()

    _run(main)
    assert len(closed) == 1
