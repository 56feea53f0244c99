"""A raw frame-level client for tests: sends anything, records every event."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any

import msgspec

from sclsd import protocol as P


class Raw:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.events: dict[str | None, list[Any]] = defaultdict(list)

    @classmethod
    async def open(cls, path: str) -> Raw:
        r, w = await asyncio.open_unix_connection(path, limit=1 << 22)
        return cls(r, w)

    def send(self, msg: Any) -> None:
        self.writer.write(P.frame(msg))

    def send_obj(self, obj: Any) -> None:
        body = msgspec.msgpack.encode(obj)
        self.writer.write(P.FRAME_HEADER.pack(len(body)) + body)

    def send_bytes(self, body: bytes, declared: int | None = None) -> None:
        n = len(body) if declared is None else declared
        self.writer.write(P.FRAME_HEADER.pack(n) + body)

    async def recv(self, timeout: float = 30.0) -> Any:
        header = await asyncio.wait_for(self.reader.readexactly(4), timeout)
        (n,) = P.FRAME_HEADER.unpack(header)
        ev = P.server_decoder.decode(await asyncio.wait_for(self.reader.readexactly(n), timeout))
        self.events[getattr(ev, "id", None)].append(ev)
        return ev

    async def until_terminal(self, ids: set[str], timeout: float = 120.0) -> None:
        """Read until every id has a Done or an Error."""
        open_ids = set(ids)
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while open_ids:
            ev = await self.recv(max(0.1, end - loop.time()))
            if isinstance(ev, (P.Done, P.Error)) and ev.id in open_ids:
                open_ids.discard(ev.id)

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except (ConnectionError, OSError):
            pass
