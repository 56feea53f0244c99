"""Unix-socket servers: framing, peer credentials, bounded output, per-connection state.

Both the client API and the status socket use the same framing (4-byte
big-endian length + one msgpack map). This module only moves frames; what a
message means is decided by the handler the daemon passes in.

What a hostile or broken peer can do is bounded here: a frame is at most
``max_frame`` bytes (larger: ``frame_too_large`` and the connection closes), a
connection's unread output is bounded (past ``max_buffer`` bytes the transport
pauses writing, and a client that then stops reading is dropped, so a slow
reader never makes the daemon hang or grow), what half-sent frames hold is
charged to the daemon's :class:`~.framebudget.FrameBudget` (global and per uid; a
connection over it is closed), and a peer whose uid is not on the allow-list is
refused before its first frame.
"""

from __future__ import annotations

import asyncio
import grp
import logging
import os
import socket
import stat
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import protocol as P
from .errors import StartupError
from .framebudget import NO_UID, FrameBudget

log = logging.getLogger("sclsd.api")

_PEERCRED = struct.Struct("3i")


def _has_group(gid: int) -> bool:
    try:
        grp.getgrgid(gid)
        return True
    except KeyError:
        return False


def listener_pid(path: str) -> tuple[bool, int | None]:
    """Does a process accept connections on the Unix socket at ``path``, and which (the pid
    SO_PEERCRED gives for a listener: the process that called ``listen``; None where unknown)?"""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except OSError:
        return False, None
    try:
        cred = peer_cred(probe)
        return True, cred.pid if cred is not None and cred.pid > 0 else None
    finally:
        probe.close()


@dataclass(frozen=True)
class PeerCred:
    pid: int
    uid: int
    gid: int


def peer_cred(sock: socket.socket | None) -> PeerCred | None:
    """The connecting process's pid/uid/gid (SO_PEERCRED), where the platform has it."""
    if sock is None or not hasattr(socket, "SO_PEERCRED"):
        return None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    except OSError:
        return None
    return PeerCred(*_PEERCRED.unpack(raw))


#: Seconds a connection may stay above its output bound without reading anything.
SLOW_GRACE_S = 1.0
#: Above this many times its output bound a connection is dropped at once, read or not.
HARD_CAP_FACTOR = 16


@dataclass(eq=False)
class Conn:
    """One client connection. ``send`` never blocks, and a client that does not read
    cannot make the daemon hang or grow. Back-pressure comes from the transport (flow
    control, as uvicorn's ``flow_control``): its write buffer's high-water mark is
    ``max_buffer``, and it calls :meth:`pause_writing` when the unread output passes it
    and :meth:`resume_writing` when the client took it back below the low-water mark.
    While paused the client must take some of it every ``SLOW_GRACE_S`` seconds, or it
    is disconnected; past ``HARD_CAP_FACTOR × max_buffer`` it is disconnected at once.
    A burst (thousands of requests finishing in one round) is fine for a client that
    keeps reading.

    Frames sent during one turn of the event loop are joined and written with one
    call at the end of the turn: a batch's results for a pipelining client cost one
    system call, not one per event.
    """

    writer: asyncio.StreamWriter
    cid: int
    max_buffer: int
    peer: PeerCred | None = None
    closed: bool = False
    """Nothing more is sent: we closed it, or its transport is gone."""
    released: bool = False
    """Its server let go of it (its requests were cancelled): at most once."""
    _pending: list[bytes] = field(default_factory=list)
    _pending_bytes: int = 0
    _paused: bool = False
    """The transport said its write buffer is above the high-water mark."""
    _grace: asyncio.TimerHandle | None = None
    _written: int = 0
    _taken_at_grace: int = 0

    def unread(self) -> int:
        """Bytes sent to this client and not yet taken by it."""
        return self._pending_bytes + self.writer.transport.get_write_buffer_size()

    def taken(self) -> int:
        """Bytes the client (or the kernel's socket buffer on its behalf) has taken so far."""
        return self._written - self.writer.transport.get_write_buffer_size()

    def send(self, msg: Any) -> None:
        if self.closed:
            return
        body = P.frame(msg)
        if not self._pending:
            asyncio.get_running_loop().call_soon(self.flush)
        self._pending.append(body)
        self._pending_bytes += len(body)
        if self._pending_bytes > self.max_buffer:
            self._check_hard_cap()

    def flush(self) -> None:
        """Write what ``send`` queued (called once per loop turn; safe to call any time,
        the transport gone included: what cannot be written any more is dropped)."""
        transport = self.writer.transport
        if not self._pending or self.closed or transport.is_closing():
            self._pending.clear()
            self._pending_bytes = 0
            return
        data = b"".join(self._pending) if len(self._pending) > 1 else self._pending[0]
        self._pending.clear()
        self._pending_bytes = 0
        self._written += len(data)
        try:
            self.writer.write(data)  # past the high-water mark, the transport pauses us
        except RuntimeError:
            # uvloop closes a transport whose write failed (the peer hung up) and raises
            # on any later write; the connection's end follows from connection_lost.
            return
        if self._paused:
            self._check_hard_cap()

    # ------------------------------------------------------------------ flow control

    def pause_writing(self) -> None:
        """The unread output passed ``max_buffer``: the client must take some of it within
        ``SLOW_GRACE_S``."""
        self._paused = True
        if self._grace is None and not self.closed:
            self._taken_at_grace = self.taken()
            self._grace = asyncio.get_running_loop().call_later(SLOW_GRACE_S, self._grace_over)

    def resume_writing(self) -> None:
        """The client took its output back below the low-water mark."""
        self._paused = False
        if self._grace is not None:
            self._grace.cancel()
            self._grace = None

    def _grace_over(self) -> None:
        self._grace = None
        if self.closed or not self._paused:
            return
        taken = self.taken()
        if taken <= self._taken_at_grace:
            self._slow(self.unread())  # read nothing for SLOW_GRACE_S while over the bound
        else:
            self._taken_at_grace = taken
            self._grace = asyncio.get_running_loop().call_later(SLOW_GRACE_S, self._grace_over)

    def _check_hard_cap(self) -> None:
        size = self.unread()
        if size > HARD_CAP_FACTOR * self.max_buffer:
            self._slow(size)

    def _slow(self, size: int) -> None:
        log.warning("conn=%d slow client: %d bytes unread, disconnecting", self.cid, size)
        self.abort()

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            self._pending.clear()
            if self._grace is not None:
                self._grace.cancel()
            self.writer.transport.abort()

    def close(self) -> None:
        """Close after writing what was sent (never raises: the transport may be gone)."""
        if not self.closed:
            try:
                self.flush()  # what was sent goes out before the close
            finally:
                self.lost()
                self.writer.close()

    def lost(self) -> None:
        """The transport is gone (or going): nothing more is sent, no timer is left."""
        self.closed = True
        self._pending.clear()
        self._pending_bytes = 0
        if self._grace is not None:
            self._grace.cancel()
            self._grace = None


class _FlowProtocol(asyncio.StreamReaderProtocol):
    """A stream protocol that also tells its :class:`Conn` when the transport pauses and
    resumes writing (the stream's own ``drain()`` keeps working as before)."""

    conn: Conn | None = None
    #: Called once the transport is gone, before the read loop may notice (it may be
    #: waiting on a handler): the server lets go of the connection at once.
    gone: Callable[[], None] | None = None

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if self.conn is not None:
            self.conn.lost()
        if self.gone is not None:
            self.gone()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.conn is not None:
            self.conn.pause_writing()

    def resume_writing(self) -> None:
        super().resume_writing()
        if self.conn is not None:
            self.conn.resume_writing()


Handler = Callable[[Conn, Any], Awaitable[None] | None]


def close_over_budget(conn: Conn, why: str) -> None:
    """Close ``conn``, whose half-sent frame does not fit the frame budget: it is told why
    (error ``overloaded``) and dropped (its pending read fails; its requests are cancelled)."""
    log.warning("conn=%d closed: %s", conn.cid, why)
    conn.send(P.Error(code="overloaded", message=f"{why}; closing"))
    conn.flush()
    conn.abort()


def frame_budget(total: int, per_uid: int) -> FrameBudget[Conn]:
    """The budget the client and status sockets of one daemon share."""
    return FrameBudget(total, per_uid, close_over_budget)


class FrameServer:
    """A stream Unix-socket server that decodes frames with ``decoder`` and calls ``handle``.

    A frame that fails to decode is answered with an ``error`` event and the
    connection stays open (frame boundaries are intact); a frame over the size
    limit is answered with ``frame_too_large`` and the connection is closed
    (its body cannot be skipped safely).
    """

    def __init__(
        self,
        name: str,
        path: str,
        decoder: Any,
        handle: Handler,
        *,
        on_close: Callable[[Conn], None] | None = None,
        max_frame: int = P.DEFAULT_MAX_FRAME,
        max_buffer: int = 8 * P.DEFAULT_MAX_FRAME,
        mode: int = 0o660,
        group: str = "",
        allowed_uids: list[int] | None = None,
        backlog: int = 4096,
        frame_timeout: float = 10.0,
        budget: FrameBudget[Conn] | None = None,
    ) -> None:
        self.name = name
        # ``sclsctl top`` opens a status connection per frame: log those at debug level.
        self.conn_log_level = logging.DEBUG if name == "status" else logging.INFO
        self.path = path
        self.decoder = decoder
        self.handle = handle
        self.on_close = on_close
        self.max_frame = max_frame
        self.max_buffer = max_buffer
        self.mode = mode
        self.group = group
        self.allowed_uids = set(allowed_uids or [])
        self.backlog = backlog
        self.frame_timeout = frame_timeout
        #: Bytes held in half-sent frames (shared with the daemon's other socket).
        self.budget = budget if budget is not None else frame_budget(64 * max_frame, 16 * max_frame)
        self.conns: set[Conn] = set()
        self._listener: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._accept_paused = False
        self._next_cid = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._inode: int | None = None

    async def start(self) -> None:
        p = Path(self.path)
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.exists() or p.is_symlink():
            if not stat.S_ISSOCK(p.lstat().st_mode):
                raise StartupError(f"{self.name} socket path {p} exists and is not a socket")
            live, pid = listener_pid(str(p))
            if live:
                raise StartupError(f"{self.name} socket {p} is in use by another process "
                                   f"(pid {pid if pid is not None else '?'})")
            p.unlink()  # stale socket of a previous run: nobody answers on it
        # We accept ourselves instead of asyncio.start_unix_server: under load uvloop's
        # server accepts about one connection per loop turn, so thousands of clients
        # connecting to a busy daemon waited seconds for their first byte to be read.
        # A deep backlog: thousands of clients connecting at once must not see EAGAIN.
        lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            lsock.bind(str(p))
            lsock.listen(self.backlog)
            lsock.setblocking(False)
        except OSError:
            lsock.close()
            raise
        self._listener = lsock
        self._inode = os.stat(p).st_ino
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(lsock.fileno(), self._on_acceptable)
        os.chmod(p, self.mode)
        if self.group:
            os.chown(p, -1, grp.getgrnam(self.group).gr_gid)
        log.info("%s listening on %s (mode %o, group %s)", self.name, p, self.mode,
                 grp.getgrgid(p.stat().st_gid).gr_name if _has_group(p.stat().st_gid) else p.stat().st_gid)

    async def stop(self, flush_timeout: float = 2.0) -> None:
        """Stop listening and close every connection, first flushing what is buffered
        for it (terminal events must reach clients) for at most ``flush_timeout``."""
        self._close_listener()
        conns = list(self.conns)
        for c in conns:
            c.close()
        if conns:
            waits = [c.writer.wait_closed() for c in conns]
            try:
                await asyncio.wait_for(asyncio.gather(*waits, return_exceptions=True), flush_timeout)
            except asyncio.TimeoutError:
                log.warning("%s: %d connections did not take their last events in %.0fs",
                            self.name, sum(not c.writer.transport.is_closing() for c in conns),
                            flush_timeout)
            for c in conns:
                c.writer.transport.abort()
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=2.0)
        try:
            # Only our own socket: never one another process bound at the same path.
            if self._inode is not None and os.stat(self.path).st_ino == self._inode:
                os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _close_listener(self) -> None:
        if self._listener is not None:
            if self._loop is not None and not self._accept_paused:
                self._loop.remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None

    def _on_acceptable(self) -> None:
        """The listening socket is readable: accept everything pending (bounded)."""
        assert self._listener is not None and self._loop is not None
        for _ in range(self.backlog):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                # Out of descriptors (EMFILE/ENFILE) or an aborted connection: the socket
                # stays readable, so pause accepting briefly instead of spinning.
                log.warning("%s: accept failed (%s); pausing accepts for 0.5s", self.name, exc)
                self._loop.remove_reader(self._listener.fileno())
                self._accept_paused = True
                self._loop.call_later(0.5, self._resume_accept)
                return
            sock.setblocking(False)
            task = self._loop.create_task(self._connect(sock))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _resume_accept(self) -> None:
        self._accept_paused = False
        if self._listener is not None and self._loop is not None:
            self._loop.add_reader(self._listener.fileno(), self._on_acceptable)

    async def _connect(self, sock: socket.socket) -> None:
        """Wrap an accepted socket in a stream (what asyncio.start_unix_server does)."""
        assert self._loop is not None
        reader = asyncio.StreamReader(limit=1 << 16)

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await self._serve(reader, writer, protocol)

        protocol = _FlowProtocol(reader, serve)
        try:
            await self._loop.connect_accepted_socket(lambda: protocol, sock)
        except OSError as exc:
            log.info("%s: connection lost before it started: %s", self.name, exc)
            sock.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     protocol: _FlowProtocol) -> None:
        self._next_cid += 1
        peer = peer_cred(writer.get_extra_info("socket"))
        conn = Conn(writer, self._next_cid, self.max_buffer, peer)
        # The transport pauses us past max_buffer unread bytes (the low-water mark is a
        # quarter of it, as asyncio's default ratio).
        writer.transport.set_write_buffer_limits(high=self.max_buffer)
        protocol.conn = conn
        if peer:
            log.log(self.conn_log_level, "%s conn=%d open pid=%d uid=%d gid=%d", self.name, conn.cid,
                    peer.pid, peer.uid, peer.gid)
        else:
            log.log(self.conn_log_level, "%s conn=%d open (no peer credentials)", self.name, conn.cid)
        if self.allowed_uids and (peer is None or peer.uid not in self.allowed_uids):
            log.warning("%s conn=%d refused: uid %s not in the allow-list", self.name, conn.cid,
                        peer and peer.uid)
            conn.send(P.Error(code="forbidden", message="this uid may not use the socket"))
            await self._flush_and_close(conn)
            return
        self.conns.add(conn)
        protocol.gone = lambda: self._release(conn)
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        why = "closed by peer"
        try:
            await self._read_loop(reader, conn)
            why = "closed"
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except asyncio.CancelledError:
            why = "closed on shutdown"
        except Exception:
            # A bug in a handler: log it loudly with the connection, drop only this
            # connection (its requests are cancelled below), keep serving the others.
            log.exception("%s conn=%d handler failed; closing the connection", self.name, conn.cid)
            conn.send(P.Error(code="internal", message="internal error; connection closed"))
            why = "closed after an internal error"
        finally:
            if task is not None:
                self._tasks.discard(task)
            self._release(conn)
            log.log(self.conn_log_level, "%s conn=%d %s", self.name, conn.cid, why)

    def _release(self, conn: Conn) -> None:
        """The connection is over (its read loop ended, or its transport is gone, whichever
        comes first): it is closed and ``on_close`` runs, once, whatever raises on the way,
        so a disconnect always cancels its requests."""
        if conn.released:
            return
        conn.released = True
        self.conns.discard(conn)
        try:
            conn.close()
        except Exception:  # noqa: BLE001 - a transport already gone must not keep its requests
            log.debug("%s conn=%d close failed", self.name, conn.cid, exc_info=True)
        if self.on_close is not None:
            try:
                self.on_close(conn)
            except Exception:
                log.exception("%s conn=%d letting go of its requests failed", self.name, conn.cid)

    async def _read_loop(self, reader: asyncio.StreamReader, conn: Conn) -> None:
        while not conn.closed:
            # An idle connection may wait as long as it likes for its next frame; once a
            # frame's first byte arrived, the rest must follow within frame_timeout, so a
            # peer cannot hold a half-sent frame (and its buffer) open forever.
            first = await reader.readexactly(1)
            timer = asyncio.get_running_loop().call_later(self.frame_timeout, self._frame_expired, conn)
            try:
                header = first + await reader.readexactly(P.FRAME_HEADER.size - 1)
                (size,) = P.FRAME_HEADER.unpack(header)
                if size > self.max_frame:
                    conn.send(P.Error(code="frame_too_large",
                                      message=f"frame of {size} bytes exceeds the limit of {self.max_frame}"))
                    log.warning("%s conn=%d frame of %d bytes refused", self.name, conn.cid, size)
                    await self._flush_and_close(conn)
                    return
                body = await self._read_body(reader, conn, size)
            finally:
                timer.cancel()
                self.budget.release(conn)
            if body is None:
                return  # over the frame budget: closed
            try:
                msg = self.decoder.decode(body)
            except P.DecodeError as exc:
                code, message = P.classify_decode_error(exc)
                conn.send(P.Error(code=code, message=message))
                continue
            result = self.handle(conn, msg)
            if result is not None:
                await result

    async def _read_body(self, reader: asyncio.StreamReader, conn: Conn, size: int) -> bytes | None:
        """A frame's ``size``-byte body, taken as it arrives; what it holds while incomplete is
        charged to the budget. None: the charge did not fit and ``conn`` is closed."""
        chunk = await reader.read(size)
        if len(chunk) == size:
            return chunk  # the whole frame was there: nothing was held
        parts = [chunk]
        got = len(chunk)
        uid = conn.peer.uid if conn.peer is not None else NO_UID
        while True:
            if not chunk:
                raise asyncio.IncompleteReadError(b"".join(parts), size)
            why = self.budget.charge(conn, uid, len(chunk))
            if why is not None:
                close_over_budget(conn, why)
                return None
            chunk = await reader.read(size - got)
            parts.append(chunk)
            got += len(chunk)
            if got == size and chunk:
                return b"".join(parts)

    def _frame_expired(self, conn: Conn) -> None:
        """A frame's rest did not arrive within ``frame_timeout``: tell the peer, drop it
        (the pending read then fails and the connection's requests are cancelled)."""
        log.warning("%s conn=%d frame incomplete %.1fs after its first byte; closing", self.name,
                    conn.cid, self.frame_timeout)
        conn.send(P.Error(code="bad_frame", message=f"frame not complete within "
                          f"{self.frame_timeout:g}s of its first byte; closing"))
        conn.flush()
        conn.abort()

    async def _flush_and_close(self, conn: Conn) -> None:
        conn.flush()
        try:
            await asyncio.wait_for(conn.writer.drain(), 1.0)
        except (asyncio.TimeoutError, ConnectionError):
            pass
        conn.close()
