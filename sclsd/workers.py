"""The daemon's side of the workers: ZeroMQ ROUTER, registry, heartbeats, local processes.

This module moves messages and watches liveness; what a registration or a
result means for scheduling is decided by the callbacks the daemon passes in.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from . import protocol as P
from .config import Config

log = logging.getLogger("sclsd.workers")

#: Cap on one worker message (a batch of 1024 requests × 2048 ids is ~10 MB of msgpack).
MAX_WORKER_MSG = 64 * 1024 * 1024


@dataclass(eq=False)
class WorkerInfo:
    wid: str
    reg: P.Register
    last_seen: float
    queued_batches: int = 0
    busy: bool = False
    draining: bool = False


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

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_WORKER_MSG)
        sock.setsockopt(zmq.LINGER, 0)
        # A restarted worker reuses its id: let the new connection take the identity over.
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        # Sending to a vanished worker raises instead of dropping silently.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        ep = self.cfg.daemon.worker_endpoint
        if ep.startswith("ipc://"):
            os.makedirs(os.path.dirname(ep[len("ipc://"):]) or ".", exist_ok=True)
        sock.bind(ep)
        self.sock = sock
        log.info("workers endpoint %s", ep)
        self._tasks.append(asyncio.create_task(self._recv_loop(), name="workers-recv"))
        self._tasks.append(asyncio.create_task(self._monitor_loop(), name="workers-monitor"))
        for i in range(self.cfg.workers.spawn):
            self._tasks.append(asyncio.create_task(self._supervise(f"w{i}", i), name=f"supervise-w{i}"))

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
        if self.sock is not None:
            self.sock.close(0)
        self.ctx.term()

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
        info = self.workers.get(wid)
        if info is None:
            return False
        info.draining = True
        return self.send(wid, P.Drain())

    # ------------------------------------------------------------------ loops

    async def _recv_loop(self) -> None:
        assert self.sock is not None
        while True:
            frames = await self.sock.recv_multipart()
            if len(frames) != 2:
                log.warning("worker message with %d frames dropped", len(frames))
                continue
            ident, body = frames
            wid = ident.decode(errors="replace")
            try:
                msg = P.worker_decoder.decode(body)
            except P.DecodeError as exc:
                log.warning("worker=%s sent an undecodable message (%s); dropped", wid, exc)
                continue
            if isinstance(msg, P.Register):
                self._register(wid, msg)
            elif isinstance(msg, P.Heartbeat):
                info = self.workers.get(wid)
                if info is not None:
                    info.last_seen = time.monotonic()
                    info.queued_batches = msg.queued_batches
                    info.busy = msg.busy
            elif isinstance(msg, P.Result):
                info = self.workers.get(wid)
                if info is None:
                    log.warning("worker=%s result for batch=%d from an unregistered worker dropped",
                                wid, msg.batch_id)
                    continue
                info.last_seen = time.monotonic()
                self.on_result(msg)

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
        self.workers[wid] = WorkerInfo(wid, msg, time.monotonic())
        log.info("worker=%s registered engine=%s model=%s device=%s pid=%d kv_bytes_per_token=%d mem_available=%d",
                 wid, msg.engine, msg.model, msg.device, msg.pid, msg.kv_bytes_per_token, msg.mem_available)
        self.send(wid, P.Welcome(heartbeat_interval_s=self.cfg.daemon.heartbeat_interval_s))
        self.on_register(msg)

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
