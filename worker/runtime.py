"""The worker's two threads: receive (owns the ZeroMQ DEALER) and serve (runs the engine).

Layout (paper section 4.1, DESIGN section 2)::

    daemon ROUTER <──DEALER── receive thread ──local queue──▶ serve thread ── engine.serve
                                   ▲                                 │
                                   └──────── inproc PAIR ◀───────────┘ (encoded Result)

ZeroMQ sockets are not thread-safe, so each socket has one owner: the DEALER
and the receiving end of the PAIR belong to the receive thread (the caller of
:meth:`WorkerRuntime.run`), the sending end of the PAIR to the serve thread.
The PAIR wakes the receive thread's poll the moment a result is ready, so a
result is never delayed by a poll timeout.

The DEALER uses ``ZMQ_IMMEDIATE``: nothing is queued while the daemon is
unreachable, so re-sent Registers do not pile up and replay later. ZeroMQ
reconnects by itself; a socket monitor tells us when the connection drops, and
we register again on the next one, since a restarted daemon has forgotten us.
Register is also re-sent when no Welcome follows within ``register_retry_s``.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from sclsd import protocol as P
from worker.engines.base import Engine

log = logging.getLogger("worker")

#: Cap on one message from the daemon (same order as the daemon's own cap).
MAX_MSG_BYTES = 64 * 1024 * 1024
#: Longest engine error text sent back to the daemon.
MAX_ERROR_CHARS = 2000


@dataclass
class RuntimeOptions:
    """How a worker talks to its daemon."""

    endpoint: str
    worker_id: str
    heartbeat_s: float = 1.0
    """Heartbeat interval until the daemon's Welcome says otherwise."""
    register_retry_s: float = 3.0
    """Re-send Register when no Welcome arrived within this many seconds."""
    shutdown_timeout_s: float = 30.0
    """After a shutdown request, abandon the running batch after this long."""
    poll_ms: int = 100
    """Longest sleep of the receive loop (signals and timers are checked in between)."""
    profile: dict[str, Any] | None = None
    curve_server_key: bytes | None = None
    """Daemon's public CURVE key (Z85) for ``tcp://``; enables encryption when set."""
    curve_keypair: tuple[bytes, bytes] | None = None
    """This worker's (public, secret) CURVE keys; generated when absent."""


@dataclass
class _State:
    connected: bool = False
    welcomed: bool = False
    registered: bool = False
    """A Register went out on the current connection."""
    draining: bool = False
    stopping: bool = False
    stop_deadline: float = 0.0
    busy: bool = False
    outbox: deque[bytes] = field(default_factory=deque)


class WorkerRuntime:
    """Runs one engine behind a DEALER socket until shutdown (see the module docstring)."""

    def __init__(self, engine: Engine, opts: RuntimeOptions) -> None:
        self.engine = engine
        self.opts = opts
        self.state = _State()
        self.ctx = zmq.Context()
        self.batches: queue.Queue[tuple[P.BatchMsg, float] | None] = queue.Queue()
        self._inproc = f"inproc://results-{id(self)}"
        self._stop_requested = threading.Event()
        self._abandon = threading.Event()
        self._stop_reason = ""
        self._heartbeat_s = opts.heartbeat_s

    # ------------------------------------------------------------------ control

    def request_stop(self, reason: str, abandon: bool = False) -> None:
        """Ask the worker to exit after the running batch, or at once with ``abandon``.

        Safe to call from a signal handler or another thread.
        """
        self._stop_reason = reason
        self._stop_requested.set()
        if abandon:
            self._abandon.set()

    # ------------------------------------------------------------------ sockets

    def _dealer(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.opts.worker_id.encode())
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MSG_BYTES)
        # Long enough for the last Result to leave on shutdown, bounded so exit never hangs.
        sock.setsockopt(zmq.LINGER, 2000)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        if self.opts.curve_server_key:
            public, secret = self.opts.curve_keypair or zmq.curve_keypair()
            sock.setsockopt(zmq.CURVE_SERVERKEY, self.opts.curve_server_key)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        return sock

    def _send(self, sock: zmq.Socket, msg: Any, *, keep: bool = False) -> bool:
        """Send without blocking. ``keep``: on failure, queue it for a later retry."""
        body = P.encode(msg)
        try:
            sock.send(body, flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            if keep:
                self.state.outbox.append(body)
            return False

    def _flush(self, sock: zmq.Socket) -> None:
        out = self.state.outbox
        while out:
            try:
                sock.send(out[0], flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            out.popleft()

    def _register(self, sock: zmq.Socket) -> bool:
        info = self.engine.info()
        reg = P.Register(
            worker_id=self.opts.worker_id,
            engine=info.engine,
            model=info.model,
            device=info.device,
            kv_bytes_per_token=info.kv_bytes_per_token,
            mem_available=info.mem_available,
            pid=os.getpid(),
            eos_token_ids=list(info.eos_token_ids),
            profile=self.opts.profile or self.engine.profile(),
        )
        sent = self._send(sock, reg)
        if sent:
            self.state.registered = True
            log.info(
                "register sent: engine=%s model=%s device=%s kv_bytes_per_token=%d mem_available=%d",
                info.engine,
                info.model,
                info.device,
                info.kv_bytes_per_token,
                info.mem_available,
            )
        return sent

    # ------------------------------------------------------------------ serve thread

    def _serve_loop(self) -> None:
        pair = self.ctx.socket(zmq.PAIR)
        pair.setsockopt(zmq.LINGER, 0)
        pair.connect(self._inproc)
        if getattr(self.engine, "continuous", False):
            self._serve_continuous(pair)
            return
        try:
            while True:
                item = self.batches.get()
                if item is None:
                    return
                batch, queued_at = item
                self.state.busy = True
                try:
                    res = self._serve_one(batch, time.monotonic() - queued_at)
                finally:
                    self.state.busy = False
                pair.send(P.encode(res))
        finally:
            pair.close()

    def _serve_continuous(self, pair: zmq.Socket) -> None:
        """Continuous engines (hf-cb) admit new batches while earlier ones still generate."""
        from worker.engines.hf_cb import queue_take

        wid = self.opts.worker_id

        def emit(batch: P.BatchMsg, outputs: Any, stats: Any, error: str | None) -> None:
            if error is not None:
                log.warning("batch=%d refused: %s", batch.batch_id, error)
                res = P.Result(worker_id=wid, batch_id=batch.batch_id, error=error[:MAX_ERROR_CHARS])
            else:
                res = P.Result(worker_id=wid, batch_id=batch.batch_id, outputs=outputs, stats=stats)
            pair.send(P.encode(res))

        self.state.busy = True
        try:
            self.engine.run_continuous(queue_take(self.batches), emit)  # type: ignore[attr-defined]
        except Exception:
            # Admitted requests cannot be answered any more: exit, and the daemon re-queues
            # them when it sees the process (or its heartbeats) gone.
            log.exception("continuous engine failed; exiting")
            os._exit(1)
        finally:
            self.state.busy = False
            pair.close()

    def _serve_one(self, batch: P.BatchMsg, waited: float) -> P.Result:
        wid = self.opts.worker_id
        try:
            outputs, stats = self.engine.serve(batch)
        except Exception as exc:  # the worker outlives a failing batch
            log.exception("batch=%d failed", batch.batch_id)
            text = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
            return P.Result(worker_id=wid, batch_id=batch.batch_id, error=text)
        stats = msgspec.structs.replace(stats, queue_wait_s=waited)
        log.debug(
            "batch=%d done: n=%d L=%d iterations=%d prefill=%.3fs decode=%.3fs",
            batch.batch_id,
            stats.batch_size,
            stats.input_len,
            stats.iterations,
            stats.prefill_s,
            stats.decode_s,
        )
        return P.Result(worker_id=wid, batch_id=batch.batch_id, outputs=outputs, stats=stats)

    # ------------------------------------------------------------------ receive thread

    def _refuse(self, sock: zmq.Socket, batch: P.BatchMsg, why: str) -> None:
        """Answer a batch we will not serve with an error, so its requests go back to the pool."""
        log.warning("batch=%d refused: %s", batch.batch_id, why)
        res = P.Result(worker_id=self.opts.worker_id, batch_id=batch.batch_id, error=why)
        self._send(sock, res, keep=True)

    def _begin_stop(self, sock: zmq.Socket, why: str) -> None:
        st = self.state
        if st.stopping:
            return
        st.stopping = True
        st.stop_deadline = time.monotonic() + self.opts.shutdown_timeout_s
        log.info("stopping (%s): finishing the running batch", why)
        # Batches not started are handed back rather than silently dropped.
        while True:
            try:
                item = self.batches.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                self._refuse(sock, item[0], "worker shutting down")
        self.batches.put(None)

    def _on_message(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        st = self.state
        try:
            msg = P.to_worker_decoder.decode(frames[-1])
        except P.DecodeError as exc:
            log.warning("undecodable message from the daemon dropped: %s", exc)
            return
        if isinstance(msg, P.Welcome):
            if not st.welcomed:
                log.info("welcomed (heartbeat every %.2fs)", msg.heartbeat_interval_s)
            st.welcomed = True
            if msg.heartbeat_interval_s > 0:
                self._heartbeat_s = msg.heartbeat_interval_s
        elif isinstance(msg, P.BatchMsg):
            if st.stopping:
                self._refuse(sock, msg, "worker shutting down")
            elif st.draining:
                self._refuse(sock, msg, "worker draining")
            else:
                self.batches.put((msg, time.monotonic()))
        elif isinstance(msg, P.Drain):
            if not st.draining:
                log.info(
                    "draining: finishing %d queued batches, taking no more", self.batches.qsize()
                )
            st.draining = True
        elif isinstance(msg, P.Resume):
            if st.draining:
                log.info("resumed: taking batches again")
            st.draining = False
        elif isinstance(msg, P.Reregister):
            # The daemon declared us dead (e.g. we hung past its heartbeat timeout) and
            # already gave our batches back to the pool: drop the queued ones, register again.
            dropped = 0
            while True:
                try:
                    item = self.batches.get_nowait()
                except queue.Empty:
                    break
                if item is None:  # a stop marker stays
                    self.batches.put(None)
                    break
                dropped += 1
            log.warning("daemon asks us to register again (dropped %d queued batches)", dropped)
            st.welcomed = st.registered = False
        elif isinstance(msg, P.Shutdown):
            self._begin_stop(sock, "shutdown from the daemon")

    def run(self) -> int:
        """Run until shutdown; returns the process exit code (0 on a clean stop)."""
        opts, st = self.opts, self.state
        results = self.ctx.socket(zmq.PAIR)
        results.setsockopt(zmq.LINGER, 0)
        results.bind(self._inproc)  # bind before the serve thread connects
        sock = self._dealer()
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sock.connect(opts.endpoint)
        log.info("connecting to %s", opts.endpoint)
        server = threading.Thread(target=self._serve_loop, name="serve", daemon=True)
        server.start()

        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(results, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        last_register = -1e9
        next_beat = time.monotonic()
        abandoned = False
        try:
            while True:
                now = time.monotonic()
                if self._stop_requested.is_set() and not st.stopping:
                    self._begin_stop(sock, self._stop_reason)
                if st.stopping:
                    if not server.is_alive() and (not st.outbox or now > st.stop_deadline):
                        break
                    if now > st.stop_deadline or self._abandon.is_set():
                        log.warning("running batch abandoned")
                        abandoned = True
                        break
                if not st.welcomed and (
                    not st.registered or now - last_register >= opts.register_retry_s
                ):
                    # Until a Register gets onto a connection, try every loop; after
                    # that, re-send only when no Welcome came (the daemon may have lost it).
                    if self._register(sock):
                        last_register = now
                if st.welcomed and now >= next_beat:
                    beat = P.Heartbeat(
                        worker_id=opts.worker_id,
                        queued_batches=self.batches.qsize(),
                        busy=st.busy,
                    )
                    self._send(sock, beat)
                    next_beat = now + self._heartbeat_s
                self._flush(sock)

                timeout = opts.poll_ms
                if (st.stopping and server.is_alive()) or (st.connected and not st.registered):
                    # Short naps while a batch winds down or the handshake completes.
                    timeout = min(timeout, 20)
                if st.welcomed:
                    timeout = max(0, min(timeout, int((next_beat - now) * 1000) + 1))
                for s, _ in poller.poll(timeout):
                    if s is sock:
                        while True:
                            try:
                                frames = sock.recv_multipart(flags=zmq.NOBLOCK)
                            except zmq.Again:
                                break
                            self._on_message(sock, frames)
                    elif s is results:
                        while True:
                            try:
                                body = results.recv(flags=zmq.NOBLOCK)
                            except zmq.Again:
                                break
                            st.outbox.append(body)
                        self._flush(sock)
                    elif s is monitor:
                        event = recv_monitor_message(monitor)["event"]
                        if event == zmq.EVENT_CONNECTED:
                            log.info("connected to %s", opts.endpoint)
                            st.connected = True
                        elif event == zmq.EVENT_DISCONNECTED:
                            log.warning("daemon disconnected; will register again on reconnect")
                            st.connected = st.welcomed = st.registered = False
        finally:
            if st.outbox:
                log.warning("%d messages could not be delivered", len(st.outbox))
            sock.disable_monitor()
            monitor.close(0)
            results.close(0)
            # An abandoned serve thread may still hold its PAIR: do not wait for it.
            sock.close(0 if abandoned else None)
            if not abandoned:
                self.ctx.term()
        log.info("exiting")
        return 0
