"""Back-pressure on a client connection: the transport's flow control (``pause_writing`` /
``resume_writing``) bounds what a client leaves unread, without a timer polling the buffer."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

from sclsd import protocol as P
from sclsd.daemon import sockets
from sclsd.daemon.sockets import Conn, FrameServer

BOUND = 64 * 1024


async def _server(path: str, conns: list[Conn], burst: int,
                  handled: asyncio.Event | None = None) -> FrameServer:
    def handle(conn: Conn, msg: P.Ping) -> None:
        if conn not in conns:
            conns.append(conn)
        for i in range(burst):  # ~13 bytes each: one ping asks for a lot of output
            conn.send(P.Pong(nonce=msg.nonce * burst + i))
        if handled is not None:
            handled.set()

    srv = FrameServer("t", path, P.client_decoder, handle, max_buffer=BOUND)
    await srv.start()
    return srv


def test_a_client_that_stops_reading_is_paused_then_dropped(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(sockets, "SLOW_GRACE_S", 0.2)
    path = str(tmp_path / "a.sock")

    async def main() -> None:
        dropped = asyncio.Event()
        slow = Conn._slow

        def _slow(self: Conn, size: int) -> None:
            slow(self, size)
            dropped.set()

        monkeypatch.setattr(Conn, "_slow", _slow)
        conns: list[Conn] = []
        handled = asyncio.Event()
        srv = await _server(path, conns, burst=2000, handled=handled)
        reader, writer = await asyncio.open_unix_connection(path)
        writer.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        try:
            # One ping at a time, each answered by ~26 KB: more than the bound and the
            # kernel's buffers in all, never near the hard cap within one loop turn.
            for nonce in range(1, 26):
                if dropped.is_set():
                    break
                handled.clear()
                writer.write(P.frame(P.Ping(nonce=nonce)))
                await asyncio.wait_for(handled.wait(), 10)
            # Never read: the transport paused the connection, and after the grace it goes.
            assert conns[0]._paused
            await asyncio.wait_for(dropped.wait(), 10)
            assert conns[0].closed
        finally:
            writer.transport.abort()
            await srv.stop()

    asyncio.run(main())


def test_a_burst_beyond_the_bound_reaches_a_client_that_reads(tmp_path: Path) -> None:
    burst = 20_000  # ~260 KB, four times the bound, produced in one loop turn
    path = str(tmp_path / "b.sock")

    async def main() -> None:
        conns: list[Conn] = []
        srv = await _server(path, conns, burst=burst)
        reader, writer = await asyncio.open_unix_connection(path)
        try:
            writer.write(P.frame(P.Ping(nonce=1)))
            got = 0
            while got < burst:
                header = await asyncio.wait_for(reader.readexactly(P.FRAME_HEADER.size), 10)
                (size,) = P.FRAME_HEADER.unpack(header)
                assert isinstance(P.server_decoder.decode(await reader.readexactly(size)), P.Pong)
                got += 1
            assert not conns[0].closed and not conns[0]._paused
        finally:
            writer.transport.abort()
            await srv.stop()

    asyncio.run(main())
