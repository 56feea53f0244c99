"""The front end's connections to the daemon: a few client-socket connections used in
turn (the daemon tokenizes one prompt at a time per connection), reconnected when
lost, and the status socket for readiness, the model's name and the metrics. The
daemon's optional ``generate`` features (``Pong.features``) are learnt with a ping on
each new connection: a daemon restarted with more features is seen at once."""

from __future__ import annotations

import asyncio
import time

from .. import defaults
from ..client import AsyncClient, status
from ..protocol import StatusSnapshot
from .errors import ApiError

#: Seconds a status snapshot is reused for the model name (not for /ready).
STATUS_TTL_S = 5.0


def unavailable(what: str, exc: BaseException) -> ApiError:
    return ApiError(503, f"cannot reach sclsd {what}: {exc or type(exc).__name__}", None,
                    "daemon_unavailable")


class DaemonPool:
    """Connections to one daemon (see the module docstring)."""

    def __init__(self, socket: str, status_socket: str, connections: int = 4,
                 max_frame_bytes: int = defaults.MAX_FRAME_BYTES) -> None:
        self.socket = socket
        self.status_socket = status_socket
        self.max_frame_bytes = max_frame_bytes
        self.features: frozenset[str] = frozenset()
        """What the daemon said it applies at the last new connection's ping."""
        self._clients: list[AsyncClient | None] = [None] * max(1, connections)
        self._locks = [asyncio.Lock() for _ in self._clients]
        self._turn = 0
        self._snapshot: StatusSnapshot | None = None
        self._snapshot_at = 0.0

    async def client(self) -> AsyncClient:
        """The next connection in turn, (re)connected if need be; 503 if the daemon is away."""
        i = self._turn
        self._turn = (i + 1) % len(self._clients)
        c = self._clients[i]
        if c is not None and c.connected:
            return c
        async with self._locks[i]:
            c = self._clients[i]
            if c is None or not c.connected:
                if c is not None:
                    await c.close()
                self._clients[i] = None
                try:
                    c = await AsyncClient(self.socket, self.max_frame_bytes).connect()
                except OSError as exc:
                    raise unavailable(f"at {self.socket}", exc) from None
                try:
                    pong = await asyncio.wait_for(c.ping(), 10.0)
                except (OSError, asyncio.TimeoutError) as exc:
                    await c.close()
                    raise unavailable(f"at {self.socket}", exc) from None
                self.features = frozenset(pong.features)
                self._clients[i] = c
        return c

    async def ping(self, timeout: float = 2.0) -> None:
        """A round trip on a client connection (raises :class:`ApiError` 503 if none)."""
        c = await self.client()
        try:
            await asyncio.wait_for(c.ping(), timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            raise unavailable(f"at {self.socket}", exc) from None

    async def status(self, max_age: float = 0.0) -> StatusSnapshot:
        """The daemon's status snapshot, at most ``max_age`` seconds old."""
        now = time.monotonic()
        if self._snapshot is not None and now - self._snapshot_at <= max_age:
            return self._snapshot
        try:
            snap = await asyncio.to_thread(status, self.status_socket, False, 5.0)
        except Exception as exc:  # noqa: BLE001 - OSError, or the daemon refusing (RequestError)
            raise unavailable(f"status at {self.status_socket}", exc) from None
        self._snapshot, self._snapshot_at = snap, time.monotonic()
        return snap

    async def metrics(self) -> str:
        try:
            return await asyncio.to_thread(status, self.status_socket, True, 5.0)
        except Exception as exc:  # noqa: BLE001 - as in status()
            raise unavailable(f"status at {self.status_socket}", exc) from None

    async def close(self) -> None:
        for c in self._clients:
            if c is not None:
                await c.close()
        self._clients = [None] * len(self._clients)
