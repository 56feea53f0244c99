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
Leaving an :class:`AsyncClient` stream early (``break``, or the task cancelled)
cancels the request in the daemon.

``n=K`` fans one request out as ``K`` requests (ids ``ID-0`` .. ``ID-{K-1}``, seeds
``seed + i`` when a seed is given, so sampled choices differ but stay
reproducible): ``complete(n=K)`` returns the ``K`` :class:`Done` in order and a
stream yields the events of all of them, each with its id.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from typing import Any, Literal, overload

from . import defaults
from . import protocol as P
from .protocol import Accepted, Delta, Done, Error, Pong, StatusSnapshot

__all__ = [
    "Client", "AsyncClient", "RequestError", "FrameTooLarge", "Accepted", "Delta", "Done", "Error",
    "StatusSnapshot", "status",
]

#: The client socket: ``$SCLSD_SOCKET``, else the system install's.
DEFAULT_SOCKET = os.environ.get("SCLSD_SOCKET", defaults.SOCKET)
#: The status socket: ``$SCLSD_STATUS_SOCKET``, else the system install's.
DEFAULT_STATUS_SOCKET = os.environ.get("SCLSD_STATUS_SOCKET", defaults.STATUS_SOCKET)


def unreachable(exc: OSError, path: str, what: str = "client socket") -> OSError:
    """``exc`` (from connecting to ``path``) again, of the same class, its message naming the
    socket and how to point at another: Python's own says only "No such file or directory"."""
    why = exc.strerror or str(exc)
    out = type(exc)(exc.errno, f"cannot reach sclsd's {what} at {path}: {why} (is the daemon "
                    f"running, and listening there? pass the path it uses, or set $SCLSD_"
                    f"{'STATUS_' if what == 'status socket' else ''}SOCKET)")
    out.__cause__ = exc
    return out


class RequestError(Exception):
    """The daemon answered ``error``: refused, or failed after acceptance."""

    def __init__(self, err: Error) -> None:
        super().__init__(f"{err.code}: {err.message}")
        self.code = err.code
        self.message = err.message
        self.id = err.id


class FrameTooLarge(ValueError):
    """A message would not fit the daemon's ``max_frame_bytes``; it was not sent (the daemon
    would close the connection on it, failing every other request on it too)."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"the request takes {size} bytes, more than the daemon's frame limit "
                         f"of {limit} bytes (daemon.max_frame_bytes)")
        self.size = size
        self.limit = limit


def _generate_msg(kw: dict[str, Any]) -> P.Generate:
    kw = dict(kw)
    if "messages" in kw and kw["messages"] is not None:
        kw["messages"] = [m if isinstance(m, P.ChatMessage) else P.ChatMessage(**m) for m in kw["messages"]]
    kw.setdefault("id", uuid.uuid4().hex[:16])
    return P.Generate(**kw)


def generate_msgs(kw: dict[str, Any]) -> list[P.Generate]:
    """The ``generate`` messages for one call: one, or ``n`` (see the module docstring)."""
    kw = dict(kw)
    n = kw.pop("n", None)
    if n is None:
        return [_generate_msg(kw)]
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 128:
        raise ValueError(f"n must be an integer in 1..128, got {n!r}")
    base = kw.pop("id", None) or uuid.uuid4().hex[:16]
    seed = kw.pop("seed", None)
    if n == 1:
        return [_generate_msg({**kw, "id": base, "seed": seed})]
    return [_generate_msg({**kw, "id": f"{base}-{i}", "seed": None if seed is None else seed + i})
            for i in range(n)]


def _in_order(msgs: list[P.Generate], dones: dict[str, Done]) -> list[Done]:
    return [dones[m.id] for m in msgs if m.id is not None]


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
        try:
            self.sock.connect(path)
        except OSError as exc:
            self.sock.close()
            raise unreachable(exc, path) from exc

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
        """Submit one request (``n`` of them with ``n``) and yield its events up to and
        including ``Done`` (of each). A refusal or failure of one cancels the others."""
        yield from self._events(generate_msgs(params))

    @overload
    def complete(self, *, n: int, **params: Any) -> list[Done]: ...

    @overload
    def complete(self, **params: Any) -> Done: ...

    def complete(self, **params: Any) -> Done | list[Done]:
        """Submit one non-streaming request and return its ``Done`` (with text and ids);
        with ``n``, the list of the ``n`` choices' ``Done`` in order."""
        params.setdefault("stream", False)
        fan_out = "n" in params
        msgs = generate_msgs(params)
        dones: dict[str, Done] = {}
        for ev in self._events(msgs):
            if isinstance(ev, Done):
                dones[ev.id] = ev
        out = _in_order(msgs, dones)
        return out if fan_out else out[0]

    def _events(self, msgs: list[P.Generate]) -> Iterator[Accepted | Delta | Done]:
        """:meth:`generate` for messages already built."""
        ids = {m.id for m in msgs}
        for m in msgs:
            self.send(m)
        left = set(ids)
        while left:
            ev = self.recv()
            if isinstance(ev, Error):
                if ev.id is None or ev.id in left:
                    for rid in left - {ev.id}:
                        self.send(P.Cancel(id=rid))  # type: ignore[arg-type]
                    raise RequestError(ev)
                continue
            if getattr(ev, "id", None) not in ids:
                continue
            yield ev
            if isinstance(ev, Done):
                left.discard(ev.id)

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
    """asyncio client multiplexing many requests over one connection.

    ``max_frame_bytes``: the daemon's frame limit; a request that would exceed it raises
    :class:`FrameTooLarge` before anything of it is sent.
    """

    def __init__(self, path: str = DEFAULT_SOCKET, max_frame_bytes: int = defaults.MAX_FRAME_BYTES) -> None:
        self.path = path
        self.max_frame_bytes = max_frame_bytes
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._queues: dict[str, asyncio.Queue[Any]] = {}
        self._pongs: dict[int, asyncio.Future[Pong]] = {}
        self._nonce = itertools.count(1)
        self._task: asyncio.Task[None] | None = None
        self._failure: BaseException | None = None
        self._out: list[bytes] = []

    @property
    def connected(self) -> bool:
        """Connected, and the connection has not been lost since."""
        return self._task is not None and not self._task.done()

    async def connect(self) -> AsyncClient:
        try:
            self._reader, self._writer = await asyncio.open_unix_connection(self.path, limit=1 << 20)
        except OSError as exc:
            raise unreachable(exc, self.path) from exc
        self._task = asyncio.create_task(self._read_loop())
        return self

    async def __aenter__(self) -> AsyncClient:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._writer is not None:
            self._flush()
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
        self._send_frame(P.frame(msg))

    def _send_frame(self, frame: bytes) -> None:
        """Queue a frame; the frames of one loop turn go out in one write (one system call
        for many concurrent requests, as the daemon does for its replies)."""
        if self._writer is None or self._writer.is_closing():
            raise ConnectionError("not connected")
        if not self._out:
            asyncio.get_running_loop().call_soon(self._flush)
        self._out.append(frame)

    def _flush(self) -> None:
        out, self._out = self._out, []
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(b"".join(out))

    async def ping(self) -> Pong:
        nonce = next(self._nonce)
        fut: asyncio.Future[Pong] = asyncio.get_running_loop().create_future()
        self._pongs[nonce] = fut
        self._send(P.Ping(nonce=nonce))
        return await fut

    async def stream(self, **params: Any) -> AsyncGenerator[Accepted | Delta | Done, None]:
        """Submit one request (``n`` with ``n``); yield its events up to and including
        ``Done`` (of each). Leaving early cancels what has not finished."""
        async for ev in self.events(generate_msgs(params)):
            yield ev

    async def events(self, msgs: list[P.Generate]) -> AsyncIterator[Accepted | Delta | Done]:
        """Send these ``generate`` messages (each with an ``id``) and yield their events as they
        come until each has its ``Done``. A refusal or failure of one raises
        :class:`RequestError` and cancels the others; so does leaving early. A message that
        would exceed ``max_frame_bytes`` raises :class:`FrameTooLarge` before any is sent."""
        frames = [P.frame(m) for m in msgs]
        for f in frames:
            if len(f) - P.FRAME_HEADER.size > self.max_frame_bytes:
                raise FrameTooLarge(len(f) - P.FRAME_HEADER.size, self.max_frame_bytes)
        q: asyncio.Queue[Any] = asyncio.Queue()
        left: set[str] = set()
        for m in msgs:
            assert m.id is not None, "events() needs messages with ids"
            self._queues[m.id] = q
            left.add(m.id)
        try:
            for f in frames:
                self._send_frame(f)
            assert self._writer is not None
            await self._writer.drain()
            while left:
                ev = await q.get()
                if isinstance(ev, BaseException):
                    left.clear()  # the connection is gone: nothing to cancel
                    raise ev
                if isinstance(ev, Error):
                    left.discard(ev.id or "")
                    raise RequestError(ev)
                yield ev
                if isinstance(ev, Done):
                    left.discard(ev.id)
        finally:
            for m in msgs:
                self._queues.pop(m.id, None)  # type: ignore[arg-type]
            for rid in left:
                try:
                    self._send(P.Cancel(id=rid))
                except (ConnectionError, RuntimeError):
                    break  # not connected: the daemon cancels a lost connection's requests

    @overload
    async def complete(self, *, n: int, **params: Any) -> list[Done]: ...

    @overload
    async def complete(self, **params: Any) -> Done: ...

    async def complete(self, **params: Any) -> Done | list[Done]:
        """Submit one non-streaming request and return its ``Done``; with ``n``, the list of
        the ``n`` choices' ``Done`` in order."""
        params.setdefault("stream", False)
        fan_out = "n" in params
        msgs = generate_msgs(params)
        dones: dict[str, Done] = {}
        async for ev in self.events(msgs):
            if isinstance(ev, Done):
                dones[ev.id] = ev
        out = _in_order(msgs, dones)
        return out if fan_out else out[0]

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
        try:
            s.connect(path)
        except OSError as exc:
            raise unreachable(exc, path, "status socket") from exc
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
