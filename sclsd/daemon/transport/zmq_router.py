"""The ZeroMQ ROUTER that workers connect to: bind, authenticate, frame, send, receive.

This module only moves messages; what they mean is decided by the sink (the
daemon's server and the serving core behind it). Peers are the ROUTER's routing ids, assigned by ZeroMQ per connection:
a worker does not choose its own, so connecting alone cannot take over a
registered worker's traffic.

Security: every message is capped by ``zmq.MAXMSGSIZE`` (a larger one drops
the peer's connection); an ``ipc://`` endpoint gets ``daemon.worker_socket_mode``
(0600 by default: the daemon's user only) and ``daemon.socket_group``; with
``daemon.curve_keypair_file`` (required on ``tcp://``) the ROUTER is a CURVE
server and a ZAP handler admits only the public keys listed in
``daemon.curve_authorized_keys``; spawned local workers then get a key pair
made for this run.

Sends never block: a message the ROUTER cannot take (peer gone, queue full) is
reported to the caller, which puts the work back (docs/operations.md).
"""

from __future__ import annotations

import asyncio
import grp
import logging
import os
import shutil
import tempfile
from typing import Any, cast

import zmq
import zmq.asyncio

from ... import protocol as P
from ...config import Config
from .base import WorkerSink

log = logging.getLogger("sclsd.workers")

DRAIN_BATCH = 64
"""Worker messages read per wake-up of the receive loop beyond the one awaited."""


class ZmqTransport:
    """ROUTER socket bound at ``daemon.worker_endpoint`` (see the module docstring)."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.ctx = zmq.asyncio.Context()
        self.sock: zmq.asyncio.Socket | None = None
        self._sync: zmq.Socket[bytes] | None = None
        """The same socket without the asyncio wrapper: what is already queued is read
        without a Future per message."""
        self.sink: WorkerSink | None = None
        self.bad_messages = 0
        #: CURVE authenticates peers (known from the config: the server starts with it).
        self.authenticated = bool(cfg.daemon.curve_keypair_file)
        self.auth: Any = None
        self.authorized: set[bytes] = set()
        self.server_public: bytes | None = None
        self._key_dir: str | None = None
        self._local_keys: dict[str, str] = {}
        self._task: asyncio.Task[None] | None = None

    async def start(self, sink: WorkerSink) -> None:
        d = self.cfg.daemon
        self.sink = sink
        sock = self.ctx.socket(zmq.ROUTER)
        # A peer whose message exceeds this is disconnected by libzmq before we see it.
        sock.setsockopt(zmq.MAXMSGSIZE, d.max_worker_msg_bytes)
        sock.setsockopt(zmq.LINGER, 0)
        # Sending to a vanished peer raises instead of dropping silently.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # No high-water mark on either side: admission bounds what can be in flight
        # (daemon.max_queued_*), and a full pipe would otherwise refuse batches.
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        if d.curve_keypair_file:
            self._start_curve(sock)
        ep = d.worker_endpoint
        path = ep[len("ipc://"):] if ep.startswith("ipc://") else None
        if path is not None:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        # Restrict the ipc file before anyone can connect: bind under a tight umask.
        old = os.umask(0o177) if path is not None else None
        try:
            sock.bind(ep)
        finally:
            if old is not None:
                os.umask(old)
        if path is not None:
            # The worker endpoint is not a client interface: its own mode (0600 by default).
            os.chmod(path, d.worker_socket_mode)
            if d.socket_group:
                os.chown(path, -1, grp.getgrnam(d.socket_group).gr_gid)
        self.sock = sock
        self._sync = zmq.Socket.shadow(sock.underlying)
        log.info("workers endpoint %s (%s)", ep,
                 f"CURVE, {len(self.authorized)} authorized keys" if self.auth else "secret")
        self._task = asyncio.create_task(self._recv_loop(), name="workers-recv")

    def _start_curve(self, sock: zmq.asyncio.Socket) -> None:
        """Make the ROUTER a CURVE server; a ZAP handler admits the authorized keys only."""
        from zmq.auth.asyncio import AsyncioAuthenticator

        from ...keys import generate_keypair, read_authorized_keys, read_keypair, write_keypair

        d = self.cfg.daemon
        public, secret = read_keypair(d.curve_keypair_file)
        self.authorized = read_authorized_keys(d.curve_authorized_keys)
        if self.cfg.workers.spawn:
            # Spawned workers get a key pair of their own for this run only.
            self._key_dir = tempfile.mkdtemp(prefix="sclsd-keys-")
            for i in range(self.cfg.workers.spawn):
                wpub, wsec = generate_keypair()
                path = os.path.join(self._key_dir, f"w{i}.keypair")
                write_keypair(path, wpub, wsec)
                self._local_keys[f"w{i}"] = path
                self.authorized.add(wpub.encode())
        self.server_public = public
        self.auth = AsyncioAuthenticator(self.ctx, log=logging.getLogger("sclsd.workers.zap"))
        self.auth.start()
        self.auth.configure_curve_callback("*", credentials_provider=self)
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        self.authenticated = True

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP: may the worker with this CURVE public key (Z85) connect?"""
        ok = key in self.authorized
        if not ok:
            log.warning("worker connection refused: CURVE key %s is not in %s", key.decode(errors="replace"),
                        self.cfg.daemon.curve_authorized_keys)
        return ok

    def spawn_args(self, wid: str) -> list[str]:
        if self.server_public is not None and wid in self._local_keys:
            # The public key is no secret; the worker's secret key stays in a 0600 file. One
            # argument with "=": a Z85 key may start with "-", which argparse would take for a flag.
            return [f"--curve-server-key={self.server_public.decode()}",
                    "--curve-keypair", self._local_keys[wid]]
        return []

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.auth is not None:
            self.auth.stop()
        if self.sock is not None:
            self.sock.close(0)
        self.ctx.term()
        if self._key_dir is not None:
            shutil.rmtree(self._key_dir, ignore_errors=True)

    def check(self) -> None:
        t = self._task
        if t is not None and t.done() and not t.cancelled() and t.exception() is not None:
            raise RuntimeError("background task workers-recv failed") from t.exception()

    def send(self, peer: bytes, msg: P.DaemonToWorkerMsg) -> bool:
        assert self.sock is not None
        # With NOBLOCK, pyzmq's asyncio socket tries the send at once and completes the
        # future before returning: read it now, or a refusal would go unnoticed.
        # (pyzmq types it as an Awaitable; on an asyncio socket it is an asyncio Future.)
        fut = cast("asyncio.Future[Any]", self.sock.send_multipart([peer, P.encode(msg)], flags=zmq.NOBLOCK))
        exc = fut.exception() if fut.done() else None
        if not fut.done():  # pragma: no cover - only with sends already pending
            fut.add_done_callback(self._late_send)
            return True
        if exc is not None:
            log.warning("send of %s to peer %s failed: %s", type(msg).__name__, peer.hex(), exc)
            return False
        return True

    @staticmethod
    def _late_send(fut: asyncio.Future[Any]) -> None:  # pragma: no cover - see send()
        if not fut.cancelled() and fut.exception() is not None:
            log.error("a queued send to a worker failed: %s", fut.exception())

    async def _recv_loop(self) -> None:
        assert self.sock is not None and self._sync is not None
        sync = self._sync
        while True:
            self.handle_frames(await self.sock.recv_multipart())
            # Then whatever else is queued, without awaiting each (at rates of a box of GPUs
            # the asyncio machinery per message cost more than the message), a bounded
            # number at a time so that the loop's other work keeps its turns.
            for _ in range(DRAIN_BATCH):
                try:
                    frames = sync.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self.handle_frames(frames)

    def handle_frames(self, frames: list[bytes]) -> None:
        """One multipart message from the ROUTER: [routing id, body]."""
        if len(frames) != 2:
            self.bad_messages += 1
            log.warning("worker message with %d frames dropped", len(frames))
            return
        peer, body = frames
        try:
            msg = P.worker_decoder.decode(body)
        except P.DecodeError as exc:
            self.bad_messages += 1
            log.warning("peer %s sent an undecodable message (%s); dropped", peer.hex(), str(exc)[:200])
            return
        assert self.sink is not None
        self.sink.on_message(peer, msg)
