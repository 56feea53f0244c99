"""The daemon's side of the workers: ZeroMQ ROUTER, registry, heartbeats, local processes.

This module moves messages and watches liveness; what a registration or a
result means for scheduling is decided by the callbacks the daemon passes in.

Security: every message is capped by ``zmq.MAXMSGSIZE`` (a larger one drops
the peer's connection); an ``ipc://`` endpoint gets the Unix sockets' mode and
group; with ``daemon.curve_keypair_file`` (required on ``tcp://``) the ROUTER is
a CURVE server and a ZAP handler admits only the public keys listed in
``daemon.curve_authorized_keys``. Spawned local workers get a key pair made for
this run.
"""

from __future__ import annotations

import asyncio
import grp
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from . import protocol as P
from .config import Config

log = logging.getLogger("sclsd.workers")

#: Default cap on one worker message (a batch of 1024 requests × 2048 ids is ~10 MB of
#: msgpack); ``daemon.max_worker_msg_bytes`` sets it.
MAX_WORKER_MSG = 64 * 1024 * 1024
#: Seconds between two Reregister messages to the same unknown worker.
REREGISTER_EVERY_S = 1.0


@dataclass(eq=False)
class WorkerInfo:
    wid: str
    reg: P.Register
    last_seen: float
    queued_batches: int = 0
    busy: bool = False
    draining: bool = False
    registered_at: float = 0.0


class WorkerHub:
    """ROUTER socket + registry of live workers + supervisor of local worker processes."""

    def __init__(
        self,
        cfg: Config,
        *,
        on_register: Callable[[P.Register], None],
        on_result: Callable[[P.Result], None],
        on_dead: Callable[[str, str], None],
    ) -> None:
        self.cfg = cfg
        self.on_register = on_register
        self.on_result = on_result
        self.on_dead = on_dead
        self.ctx = zmq.asyncio.Context()
        self.sock: zmq.asyncio.Socket | None = None
        self.workers: dict[str, WorkerInfo] = {}
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self._unknown_asked: dict[str, float] = {}
        self.auth: Any = None
        self.authorized: set[bytes] = set()
        self.server_public: bytes | None = None
        self._key_dir: str | None = None
        self._local_keys: dict[str, str] = {}
        #: Messages refused before reaching a handler (undecodable, bad frames).
        self.bad_messages = 0

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        d = self.cfg.daemon
        sock = self.ctx.socket(zmq.ROUTER)
        # A peer whose message exceeds this is disconnected by libzmq before we see it.
        sock.setsockopt(zmq.MAXMSGSIZE, d.max_worker_msg_bytes)
        sock.setsockopt(zmq.LINGER, 0)
        # A restarted worker reuses its id: let the new connection take the identity over.
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        # Sending to a vanished worker raises instead of dropping silently.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if d.curve_keypair_file:
            self._start_curve(sock)
        ep = d.worker_endpoint
        if ep.startswith("ipc://"):
            os.makedirs(os.path.dirname(ep[len("ipc://"):]) or ".", exist_ok=True)
        sock.bind(ep)
        if ep.startswith("ipc://"):
            # Whoever can connect to the ipc socket can register as a worker: same
            # mode and group as the Unix sockets.
            path = ep[len("ipc://"):]
            os.chmod(path, d.socket_mode)
            if d.socket_group:
                os.chown(path, -1, grp.getgrnam(d.socket_group).gr_gid)
        self.sock = sock
        log.info("workers endpoint %s (%s)", ep,
                 f"CURVE, {len(self.authorized)} authorized keys" if self.auth else "no CURVE")
        self._tasks.append(asyncio.create_task(self._recv_loop(), name="workers-recv"))
        self._tasks.append(asyncio.create_task(self._monitor_loop(), name="workers-monitor"))
        for i in range(self.cfg.workers.spawn):
            self._tasks.append(asyncio.create_task(self._supervise(f"w{i}", i), name=f"supervise-w{i}"))

    def _start_curve(self, sock: zmq.asyncio.Socket) -> None:
        """Make the ROUTER a CURVE server; a ZAP handler admits the authorized keys only."""
        from zmq.auth.asyncio import AsyncioAuthenticator

        from .keys import generate_keypair, read_authorized_keys, read_keypair, write_keypair

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

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP: may the worker with this CURVE public key (Z85) connect?"""
        ok = key in self.authorized
        if not ok:
            log.warning("worker connection refused: CURVE key %s is not in %s", key.decode(errors="replace"),
                        self.cfg.daemon.curve_authorized_keys)
        return ok

    async def stop(self, timeout: float = 5.0) -> None:
        """Ask every worker to shut down, wait for local processes, close the socket."""
        self._stopping = True
        for wid in list(self.workers):
            self.send(wid, P.Shutdown())
        deadline = time.monotonic() + timeout
        for wid, proc in list(self.procs.items()):
            try:
                await asyncio.wait_for(proc.wait(), max(0.1, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                log.warning("worker=%s did not exit in time; killing", wid)
                proc.kill()
                await proc.wait()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.auth is not None:
            self.auth.stop()
        if self.sock is not None:
            self.sock.close(0)
        self.ctx.term()
        if self._key_dir is not None:
            shutil.rmtree(self._key_dir, ignore_errors=True)

    def check_tasks(self) -> None:
        """Re-raise the error of a background task that died (never swallow it)."""
        for t in self._tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise RuntimeError(f"background task {t.get_name()} failed") from t.exception()

    # ------------------------------------------------------------------ sending

    def send(self, wid: str, msg: Any) -> bool:
        """Send to a worker. False (and the worker declared dead) when it is unreachable."""
        assert self.sock is not None
        try:
            self.sock.send_multipart([wid.encode(), P.encode(msg)], flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError as exc:
            if wid in self.workers:
                self._declare_dead(wid, f"send failed: {exc}")
            return False

    def drain(self, wid: str) -> bool:
        """Tell a worker to take no new batches (it finishes those it holds)."""
        info = self.workers.get(wid)
        if info is None:
            return False
        info.draining = True
        return self.send(wid, P.Drain())

    def resume(self, wid: str) -> bool:
        """Undo :meth:`drain`."""
        info = self.workers.get(wid)
        if info is None:
            return False
        info.draining = False
        return self.send(wid, P.Resume())

    # ------------------------------------------------------------------ loops

    async def _recv_loop(self) -> None:
        assert self.sock is not None
        while True:
            frames = await self.sock.recv_multipart()
            self.handle_frames(frames)

    def handle_frames(self, frames: list[bytes]) -> None:
        """One multipart message from the ROUTER: [identity, body]."""
        if len(frames) != 2:
            self.bad_messages += 1
            log.warning("worker message with %d frames dropped", len(frames))
            return
        ident, body = frames
        wid = ident.decode(errors="replace")
        try:
            msg = P.worker_decoder.decode(body)
        except P.DecodeError as exc:
            self.bad_messages += 1
            log.warning("worker=%r sent an undecodable message (%s); dropped", wid, str(exc)[:200])
            return
        if isinstance(msg, P.Register):
            self._register(wid, msg)
        elif isinstance(msg, P.Heartbeat):
            info = self.workers.get(wid)
            if info is None:
                self._ask_reregister(wid, "heartbeat")
                return
            info.last_seen = time.monotonic()
            info.queued_batches = msg.queued_batches
            info.busy = msg.busy
        elif isinstance(msg, P.Result):
            info = self.workers.get(wid)
            if info is None:
                log.warning("worker=%s result for batch=%d from an unregistered worker dropped",
                            wid, msg.batch_id)
                self._ask_reregister(wid, "result")
                return
            if msg.worker_id != wid:
                log.warning("worker=%s sent a result as %r; dropped", wid, msg.worker_id)
                return
            info.last_seen = time.monotonic()
            self.on_result(msg)

    def _ask_reregister(self, wid: str, what: str) -> None:
        """A worker we do not know (declared dead, e.g. hung past the heartbeat timeout, but
        alive again) would otherwise heartbeat into the void forever: ask it to register."""
        now = time.monotonic()
        if now - self._unknown_asked.get(wid, -1e9) < REREGISTER_EVERY_S:
            return
        self._unknown_asked[wid] = now
        if len(self._unknown_asked) > 4096:  # bounded: identities come from peers
            self._unknown_asked.clear()
        log.info("worker=%s unknown (%s received): asking it to register again", wid, what)
        self.send_raw(wid, P.Reregister())

    def _register(self, wid: str, msg: P.Register) -> None:
        if msg.worker_id != wid:
            log.warning("worker identity %r registered as %r; refused", wid, msg.worker_id)
            return
        if msg.protocol != P.PROTOCOL_VERSION:
            log.error("worker=%s speaks protocol %d, daemon %d; refused", wid, msg.protocol, P.PROTOCOL_VERSION)
            self.send_raw(wid, P.Shutdown())
            return
        if wid in self.workers:
            # Re-registration means the worker restarted: whatever it held is gone.
            self._declare_dead(wid, "re-registered (restarted)")
        self._unknown_asked.pop(wid, None)
        now = time.monotonic()
        self.workers[wid] = WorkerInfo(wid, msg, now, registered_at=now)
        log.info("worker=%s registered engine=%s model=%s device=%s pid=%d kv_bytes_per_token=%d mem_available=%d",
                 wid, msg.engine, msg.model, msg.device, msg.pid, msg.kv_bytes_per_token, msg.mem_available)
        try:
            self.on_register(msg)
        except Exception:  # noqa: BLE001 - a peer's registration, not the daemon, is at fault
            # e.g. a profile the estimator cannot use: refuse this worker, keep serving.
            log.exception("worker=%s registration refused: the daemon cannot use it", wid)
            self.workers.pop(wid, None)
            self.send_raw(wid, P.Shutdown())
            return
        self.send(wid, P.Welcome(heartbeat_interval_s=self.cfg.daemon.heartbeat_interval_s))

    def send_raw(self, wid: str, msg: Any) -> None:
        assert self.sock is not None
        try:
            self.sock.send_multipart([wid.encode(), P.encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def _declare_dead(self, wid: str, why: str) -> None:
        if self.workers.pop(wid, None) is None:
            return
        log.warning("worker=%s lost: %s", wid, why)
        self.on_dead(wid, why)
        proc = self.procs.get(wid)
        if proc is not None and proc.returncode is None:
            proc.kill()  # a hung local worker: the supervisor restarts it

    async def _monitor_loop(self) -> None:
        d = self.cfg.daemon
        while True:
            await asyncio.sleep(d.heartbeat_interval_s)
            now = time.monotonic()
            for wid, info in list(self.workers.items()):
                if now - info.last_seen > d.heartbeat_timeout_s:
                    self._declare_dead(wid, f"no heartbeat for {now - info.last_seen:.1f}s")

    # ------------------------------------------------------------------ local processes

    def worker_command(self, wid: str, index: int) -> list[str]:
        w, d = self.cfg.workers, self.cfg.daemon
        device = w.device
        if device == "cuda":
            device = f"cuda:{index}"
        cmd = [
            sys.executable, "-m", "worker.main",
            "--connect", d.worker_endpoint,
            "--id", wid,
            "--engine", w.engine,
            "--model", self.cfg.model.name,
            "--device", device,
            "--threads", str(w.threads),
            "--mem-budget", str(w.mem_budget_bytes),
            "--heartbeat", str(d.heartbeat_interval_s),
        ]
        if self.server_public is not None and wid in self._local_keys:
            # The public key is no secret; the worker's secret key stays in a 0600 file.
            cmd += ["--curve-server-key", self.server_public.decode(),
                    "--curve-keypair", self._local_keys[wid]]
        # [workers.options] key = value becomes the worker flag --key value (e.g. decode_s -> --decode-s).
        for key, value in sorted(w.options.items()):
            cmd += [f"--{key.replace('_', '-')}", str(value)]
        return cmd

    async def _supervise(self, wid: str, index: int) -> None:
        """Run one local worker; restart it when it exits unless the daemon is stopping."""
        backoff = self.cfg.workers.restart_backoff_s
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        while not self._stopping:
            cmd = self.worker_command(wid, index)
            proc = await asyncio.create_subprocess_exec(*cmd, env=env, start_new_session=True)
            self.procs[wid] = proc
            log.info("worker=%s spawned pid=%d", wid, proc.pid)
            rc = await proc.wait()
            if self._stopping:
                break
            log.warning("worker=%s pid=%d exited rc=%s; restarting in %.1fs", wid, proc.pid, rc, backoff)
            self._declare_dead(wid, f"process exited rc={rc}")
            await asyncio.sleep(backoff)

    def kill_local(self, wid: str, sig: int = signal.SIGKILL) -> None:
        """Signal a local worker process (tests and operators)."""
        proc = self.procs.get(wid)
        if proc is not None and proc.returncode is None:
            proc.send_signal(sig)
