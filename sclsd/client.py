"""Client library for the sclsd Unix-socket API, synchronous and asyncio.

Synchronous::

    with Client("/run/sclsd/sclsd.sock") as c:
        for ev in c.generate(prompt="Hello", max_tokens=32):
            if isinstance(ev, Delta):
                print(ev.text, end="", flush=True)
        print(c.complete(prompt="2+2=", max_tokens=4).text)

asyncio (many concurrent requests over one connection)::

    async with AsyncClient(path) as c:
        async for ev in c.stream(prompt="Hello"):
            ...
        done = await c.complete(prompt_ids=[1, 2, 3], max_tokens=8)

A stream yields :class:`Accepted`, then :class:`Delta` events, and ends with
exactly one :class:`Done`; a refusal or failure raises :class:`RequestError`.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal, overload

from . import defaults
from . import protocol as P
from .protocol import Accepted, Delta, Done, Error, Pong, StatusSnapshot

__all__ = [
    "Client", "AsyncClient", "RequestError", "Accepted", "Delta", "Done", "Error",
    "StatusSnapshot", "status",
]

#: The client socket: ``$SCLSD_SOCKET``, else the system install's.
DEFAULT_SOCKET = os.environ.get("SCLSD_SOCKET", defaults.SOCKET)
#: The status socket: ``$SCLSD_STATUS_SOCKET``, else the system install's.
DEFAULT_STATUS_SOCKET = os.environ.get("SCLSD_STATUS_SOCKET", defaults.STATUS_SOCKET)


class RequestError(Exception):
    """The daemon answered ``error``: refused, or failed after acceptance."""

    def __init__(self, err: Error) -> None:
        super().__init__(f"{err.code}: {err.message}")
        self.code = err.code
        self.message = err.message
        self.id = err.id


def _generate_msg(kw: dict[str, Any]) -> P.Generate:
    kw = dict(kw)
    if "messages" in kw and kw["messages"] is not None:
        kw["messages"] = [m if isinstance(m, P.ChatMessage) else P.ChatMessage(**m) for m in kw["messages"]]
    kw.setdefault("id", uuid.uuid4().hex[:16])
    return P.Generate(**kw)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("daemon closed the connection")
        buf += chunk
    return bytes(buf)


class Client:
    """Blocking client; one request at a time per connection."""

    def __init__(self, path: str = DEFAULT_SOCKET, timeout: float | None = None) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()

    def send(self, msg: Any) -> None:
        self.sock.sendall(P.frame(msg))

    def recv(self) -> Any:
        (n,) = P.FRAME_HEADER.unpack(_recv_exact(self.sock, P.FRAME_HEADER.size))
        return P.server_decoder.decode(_recv_exact(self.sock, n))

    def ping(self) -> Pong:
        self.send(P.Ping(nonce=1))
        while True:
            ev = self.recv()
            if isinstance(ev, Pong):
                return ev

    def generate(self, **params: Any) -> Iterator[Accepted | Delta | Done]:
        """Submit one request and yield its events up to and including ``Done``."""
        msg = _generate_msg(params)
        self.send(msg)
        while True:
            ev = self.recv()
            if isinstance(ev, Error):
                if ev.id in (None, msg.id):
                    raise RequestError(ev)
                continue
            if getattr(ev, "id", None) != msg.id:
                continue
            yield ev
            if isinstance(ev, Done):
                return

    def complete(self, **params: Any) -> Done:
        """Submit one non-streaming request and return its ``Done`` (with text and ids)."""
        params.setdefault("stream", False)
        done = None
        for ev in self.generate(**params):
            if isinstance(ev, Done):
                done = ev
        assert done is not None
        return done

    def drain_worker(self, worker: str, resume: bool = False) -> P.WorkerStateReply:
        """Admin: take ``worker`` out of rotation (or put it back with ``resume``)."""
        self.send(P.DrainWorker(worker=worker, resume=resume))
        while True:
            ev = self.recv()
            if isinstance(ev, P.WorkerStateReply) and ev.worker == worker:
                return ev
            if isinstance(ev, Error) and ev.id is None:
                raise RequestError(ev)

    def cancel(self, rid: str, any_connection: bool = False) -> Done | None:
        """Cancel a request by id; ``any_connection`` (admin only) reaches other clients'.

        Returns the request's ``Done`` when it was this connection's, else None once the
        daemon confirmed (a ``ping`` round trip); raises :class:`RequestError` when refused.
        """
        self.send(P.Cancel(id=rid, any_connection=any_connection))
        self.send(P.Ping(nonce=7))
        result: Done | None = None
        while True:
            ev = self.recv()
            if isinstance(ev, Error) and ev.id == rid:
                raise RequestError(ev)
            if isinstance(ev, Done) and ev.id == rid:
                result = ev
            if isinstance(ev, Pong):
                return result


class AsyncClient:
    """asyncio client multiplexing many requests over one connection."""

    def __init__(self, path: str = DEFAULT_SOCKET) -> None:
        self.path = path
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._queues: dict[str, asyncio.Queue[Any]] = {}
        self._pongs: dict[int, asyncio.Future[Pong]] = {}
        self._nonce = itertools.count(1)
        self._task: asyncio.Task[None] | None = None
        self._failure: BaseException | None = None

    async def connect(self) -> AsyncClient:
        self._reader, self._writer = await asyncio.open_unix_connection(self.path, limit=1 << 20)
        self._task = asyncio.create_task(self._read_loop())
        return self

    async def __aenter__(self) -> AsyncClient:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            try:
                await self._writer.wait_closed()
            except (ConnectionError, OSError):
                pass
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - closing anyway
                pass

    async def _read_loop(self) -> None:
        assert self._reader is not None
        try:
            while True:
                header = await self._reader.readexactly(P.FRAME_HEADER.size)
                (n,) = P.FRAME_HEADER.unpack(header)
                ev = P.server_decoder.decode(await self._reader.readexactly(n))
                if isinstance(ev, Pong):
                    fut = self._pongs.pop(ev.nonce, None)
                    if fut is not None and not fut.done():
                        fut.set_result(ev)
                    continue
                rid = getattr(ev, "id", None)
                q = self._queues.get(rid) if rid is not None else None
                if q is not None:
                    q.put_nowait(ev)
                elif isinstance(ev, Error) and rid is None:
                    # A connection-level error (bad frame ...): every waiter learns of it.
                    for q in self._queues.values():
                        q.put_nowait(ev)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            self._failure = exc
        finally:
            err = ConnectionError("connection to sclsd lost")
            for q in self._queues.values():
                q.put_nowait(err)
            for fut in self._pongs.values():
                if not fut.done():
                    fut.set_exception(err)

    def _send(self, msg: Any) -> None:
        if self._writer is None:
            raise ConnectionError("not connected")
        self._writer.write(P.frame(msg))

    async def ping(self) -> Pong:
        nonce = next(self._nonce)
        fut: asyncio.Future[Pong] = asyncio.get_running_loop().create_future()
        self._pongs[nonce] = fut
        self._send(P.Ping(nonce=nonce))
        return await fut

    async def stream(self, **params: Any) -> AsyncIterator[Accepted | Delta | Done]:
        """Submit one request; yield its events up to and including ``Done``."""
        msg = _generate_msg(params)
        q: asyncio.Queue[Any] = asyncio.Queue()
        self._queues[msg.id] = q  # type: ignore[index]
        try:
            self._send(msg)
            assert self._writer is not None
            await self._writer.drain()
            while True:
                ev = await q.get()
                if isinstance(ev, BaseException):
                    raise ev
                if isinstance(ev, Error):
                    raise RequestError(ev)
                yield ev
                if isinstance(ev, Done):
                    return
        finally:
            self._queues.pop(msg.id, None)  # type: ignore[arg-type]

    async def complete(self, **params: Any) -> Done:
        """Submit one non-streaming request and return its ``Done``."""
        params.setdefault("stream", False)
        done = None
        async for ev in self.stream(**params):
            if isinstance(ev, Done):
                done = ev
        assert done is not None
        return done

    def cancel(self, rid: str) -> None:
        self._send(P.Cancel(id=rid))


@overload
def status(path: str = ..., metrics: Literal[False] = ..., timeout: float = ...) -> StatusSnapshot: ...


@overload
def status(path: str = ..., *, metrics: Literal[True], timeout: float = ...) -> str: ...


@overload
def status(path: str, metrics: Literal[True], timeout: float = ...) -> str: ...


@overload
def status(path: str = ..., metrics: bool = ..., timeout: float = ...) -> StatusSnapshot | str: ...


def status(path: str = DEFAULT_STATUS_SOCKET, metrics: bool = False,
           timeout: float = 10.0) -> StatusSnapshot | str:
    """Ask the status socket for a snapshot (a :class:`~sclsd.protocol.StatusSnapshot`)
    or, with ``metrics``, for the Prometheus text exposition.

    Raises ``OSError`` when the socket cannot be reached and :class:`RequestError`
    when the daemon refuses (e.g. ``forbidden``).
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(P.frame(P.MetricsRequest() if metrics else P.StatusRequest()))
        (n,) = P.FRAME_HEADER.unpack(_recv_exact(s, P.FRAME_HEADER.size))
        reply = P.status_reply_decoder.decode(_recv_exact(s, n))
    if isinstance(reply, Error):
        raise RequestError(reply)
    if metrics:
        if not isinstance(reply, P.MetricsReply):
            raise ConnectionError(f"status socket answered {type(reply).__name__} to metrics")
        return reply.text
    if not isinstance(reply, P.StatusReply):
        raise ConnectionError(f"status socket answered {type(reply).__name__} to status")
    return reply.status
