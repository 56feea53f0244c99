"""The daemon's wiring and lifecycle: build the parts, start, serve, drain, stop.

A request's path through the parts (one module each)::

    sockets ─▶ frontend ─▶ admission ─▶ requests (live table) ─▶ rounds ─▶ dispatch
        ─▶ transport (ZeroMQ hub) ─▶ worker ─▶ fleet ─▶ results ─▶ requests: done/error

Start-up: the sockets listen first; until the tokenizer is loaded (and the model
downloaded, where ``model.allow_download`` lets it) ``generate`` is answered with
error ``starting``, ``ping`` with ``pong``, and the status shows ``starting``
with the workers that are loading. The worker transport starts and the local
workers are spawned before the tokenizer loads, so both load at once; what the
workers send before the parts are wired waits in :class:`EarlySink`.

Guarantees (docs/operations.md): every accepted request ends with exactly one
``done`` or ``error``; SIGTERM drains (``draining`` for new requests,
``daemon.drain_timeout_s`` for those in flight, ``error: shutdown`` for what is
left, exit 0) and a second SIGTERM/SIGINT ends the drain at once; a background
task that fails stops the daemon loudly, after every live request got its
terminal event.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .. import models
from .. import protocol as P
from .. import tokenizer as tokenizers
from ..config import Config
from ..core.grant_scheduler import SliceGrantScheduler
from ..core.policy import GRANT_POLICIES, make_policy
from ..core.scheduler import Scheduler
from ..core.scheduler_api import SchedulerInterface
from ..sdnotify import Notifier
from ..tokenizer import Tokenizer
from .admission import Admission
from .cost import DaemonCost
from .dispatch import Dispatcher
from .drain import Drain
from .errors import StartupError
from .fleet import Fleet
from .frontend import Frontend
from .lock import DaemonLock
from .metrics import HttpServer, Metrics
from .requests import LiveRequests
from .results import Results
from .rounds import Rounds
from .secret import worker_secret
from .sockets import FrameServer
from .startup import EarlySink, in_thread
from .status import StatusHandler, StatusView
from .supervisor import Supervisor
from .transport.base import WorkerTransport

log = logging.getLogger("sclsd")


def make_scheduler(cfg: Config, cost: DaemonCost) -> SchedulerInterface:
    """The core scheduler for ``cfg``; Γ is ``scheduler.gamma_s``, else the profile's, else
    the core's default."""
    s = cfg.scheduler
    gamma = s.effective_gamma(cost.profile.gamma_s)
    policy = make_policy(s.policy, slice_len=s.slice_len, max_gen=cfg.model.max_gen,
                         batch_size=s.batch_size, gamma=gamma, lam=s.lam,
                         work_conserving=s.work_conserving, kv_reuse=s.kv_reuse)
    if s.policy in GRANT_POLICIES:
        return SliceGrantScheduler(policy, cost, max_failures=s.max_failures)
    return Scheduler(policy, cost, max_failures=s.max_failures)


class Server:
    """One daemon: its parts, wired (see the module docstring for the path they form)."""

    def __init__(self, cfg: Config, *, transport: WorkerTransport | None = None,
                 tokenizer: Tokenizer | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.clock = clock
        self.started = clock()
        self.tok = tokenizer
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="sclsd-tok")
        if transport is None:
            from .transport.zmq_hub import ZmqTransport  # zmq only for the real hub

            transport = ZmqTransport(cfg)
        self.transport = transport
        self.metrics = Metrics()
        self.cost = DaemonCost.initial(cfg)
        self.sched = make_scheduler(cfg, self.cost)
        self.live = LiveRequests(self.sched, self.metrics, clock)
        self.wake = asyncio.Event()
        """Set when something changed that the scheduling loop should look at."""
        self.notifier = Notifier.from_env()
        self.drain = Drain(self.live, cfg.daemon.drain_timeout_s, self.notifier.stopping)
        self.run_dir = tempfile.mkdtemp(prefix="sclsd-run-")
        self._tasks: list[asyncio.Task[None]] = []
        self._metrics_http: HttpServer | None = None
        self.lock = DaemonLock(cfg.daemon.lock_path)
        #: What the daemon does before it can serve (shown in its status); None once wired.
        self.starting: str | None = "starting"
        self.frontend: Frontend | None = None
        self.sink = EarlySink()
        self._make_sockets()

    def _make_sockets(self) -> None:
        """The two socket servers and the status view, usable before the parts are wired."""
        cfg = self.cfg
        d = cfg.daemon
        common: dict[str, Any] = dict(max_frame=d.max_frame_bytes, max_buffer=d.max_conn_buffer_bytes,
                                      mode=d.socket_mode, group=d.socket_group, backlog=d.listen_backlog,
                                      frame_timeout=d.frame_timeout_s)
        self.api = FrameServer("api", d.socket, P.client_decoder, self._on_client,
                               on_close=self._on_client_close, allowed_uids=d.allowed_uids, **common)
        self.view = StatusView(cfg, self.sched, self.live, None, None, self.cost, self.api,
                               self.clock, self.started, self._status_extra)
        self.metrics.watch(self.view.snapshot)
        status = StatusHandler(self.view, self.metrics)
        self.status_server = FrameServer("status", d.status_socket, P.status_decoder, status.handle,
                                         allowed_uids=d.status_allowed_uids, **common)

    def _on_client(self, conn: Any, msg: Any) -> Any:
        """A client message: to the front end once wired; before, ``pong`` or ``starting``."""
        if self.frontend is not None:
            return self.frontend.handle(conn, msg)
        if isinstance(msg, P.Ping):
            conn.send(P.Pong(nonce=msg.nonce))
        else:
            conn.send(P.Error(code="starting", id=getattr(msg, "id", None),
                              message=f"sclsd is starting ({self.starting}): retry shortly, or wait "
                                      "for it with `sclsctl wait-ready`"))
        return None

    def _on_client_close(self, conn: Any) -> None:
        if self.frontend is not None:
            self.frontend.on_close(conn)

    # ------------------------------------------------------------------ wiring

    def wire(self, tok: Tokenizer) -> None:
        """Build the parts that need the tokenizer, and connect them."""
        cfg, clock = self.cfg, self.clock
        self.tok = tok
        wake = self.wake.set
        self.fleet = Fleet(cfg, self.transport, self.sched, self.cost, tok, clock, wake, self.secret)
        self.dispatcher = Dispatcher(cfg, self.sched, self.live, self.fleet, self.metrics, clock)
        self.rounds = Rounds(self.sched, self.live, self.dispatcher, clock, self.wake)
        self.results = Results(self.sched, self.live, tok, self.pool, self.dispatcher, self.metrics, clock,
                               wake)
        self.fleet.on_result = self.results.on_result
        self.fleet.on_ack = self.dispatcher.acked
        # A worker lost: kill its process (a spawned one restarts), settle what it streamed.
        self.fleet.on_dead.append(lambda wid, why: self.supervisor.kill(wid))
        self.fleet.on_dead.append(lambda wid, why: self.results.settle_streamed())
        # A request ended: tell workers holding its KV to drop it.
        self.live.on_end.append(lambda c: self.dispatcher.flush_released())
        self.admission = Admission(cfg, self.live, tok, self.pool, self.metrics, clock, wake,
                                   is_draining=lambda: self.drain.draining, not_serving=self.not_serving,
                                   fleet_caps=lambda: [w.reg.caps for w in self.fleet.workers.values()])
        self.view.admission, self.view.fleet = self.admission, self.fleet
        # Last: from here on the sockets hand client messages to the front end, and what
        # workers sent meanwhile reaches the fleet.
        self.frontend = Frontend(cfg, self.admission, self.live, self.fleet)
        self.starting = None
        self.sink.attach(self.fleet)

    def _worker_exited(self, wid: str, why: str) -> None:
        if self.frontend is not None:  # wired: before, no worker can have registered
            self.fleet.declare_dead(wid, why)

    def not_serving(self) -> str | None:
        """Why no request can be served now (starting; every local worker given up, none registered)."""
        if self.starting is not None:
            return f"starting: {self.starting}"
        if self.fleet.workers or self.supervisor.serving:
            return None
        return "no workers: " + "; ".join(self.supervisor.gave_up.values())

    def _gave_up(self, why: str) -> None:
        why_now = self.not_serving()
        if why_now is not None:
            # Nothing can serve what is queued: end it now rather than let it wait forever.
            left = self.live.fail_all("no_workers", why_now)
            if left:
                log.error("%d queued requests ended: %s", len(left), why_now)

    def _status_extra(self) -> dict[str, Any]:
        why = self.not_serving()
        wired = self.frontend is not None
        supervisor = getattr(self, "supervisor", None)
        loading = [] if supervisor is None else [
            P.LoadingWorker(id=w.id, pid=w.pid, age_s=w.age_s, step=w.step)
            for w in supervisor.loading(self.fleet.workers if wired else {})]
        if not wired:
            return {"draining": False, "metrics_http": self._metrics_address(), "serving": False,
                    "why": why, "starting": True, "loading": loading,
                    "counters": {"refused": self.metrics.refused_total,
                                 "bad_worker_messages": self.transport.bad_messages,
                                 "workers_refused": 0,
                                 "worker_restarts": supervisor.restarts if supervisor else 0}}
        return {
            "loading": loading,
            "draining": self.drain.draining,
            "metrics_http": self._metrics_address(),
            "serving": why is None,
            "why": why,
            "counters": {**self.results.counters,
                         "refused": self.metrics.refused_total,
                         "bad_worker_messages": self.transport.bad_messages,
                         "workers_refused": self.fleet.refused,
                         "worker_restarts": self.supervisor.restarts},
        }

    def _metrics_address(self) -> str | None:
        return self._metrics_http.address if self._metrics_http is not None else None

    # ------------------------------------------------------------------ lifecycle

    async def start(self, *, sockets: bool = True, spawn: bool = True) -> None:
        """Listen (``sockets``; ``generate`` is answered ``starting`` meanwhile), fetch the model
        where allowed, start the transport and the local workers (``spawn``), load the
        tokenizer (off the loop) while they load, and wire; unit tests start neither sockets
        nor workers."""
        cfg = self.cfg
        if sockets:
            await self.api.start()
            await self.status_server.start()
            if cfg.daemon.metrics_http:
                self._metrics_http = self.metrics.serve_http(cfg.daemon.metrics_http,
                                                             asyncio.get_running_loop())
        if cfg.model.allow_download and cfg.model.name != "fake":
            await self._fetch_model()  # first: workers load offline, from the local cache
        self.secret, secret_file = worker_secret(cfg, self.run_dir, self.transport.authenticated)
        await self.transport.start(self.sink)
        self.supervisor = Supervisor(cfg, self.run_dir, secret_file, self.transport.spawn_args,
                                     on_exit=self._worker_exited, on_give_up=self._gave_up)
        if spawn:
            self.supervisor.start()
        tok = self.tok if self.tok is not None else await self._load_tokenizer()
        self.wire(tok)
        self._tasks = [asyncio.create_task(self.rounds.run(), name="scheduler"),
                       asyncio.create_task(self._monitor(), name="monitor")]

    async def _fetch_model(self) -> None:
        """Download the model if it is a hub id missing from the local cache (in the pool)."""
        name = self.cfg.model.name
        self.starting = f"downloading {name}"
        try:
            await in_thread(models.fetch, name)
        except (ValueError, OSError) as exc:
            raise StartupError(f"cannot download model {name!r}: {exc}") from exc

    async def _load_tokenizer(self) -> Tokenizer:
        """The model's tokenizer (from the model cache where it has one), loaded off the loop."""
        m = self.cfg.model
        self.starting = f"loading the tokenizer of {m.name}"
        t0 = time.monotonic()
        load = functools.partial(tokenizers.load, m.name, cache_dir=m.cache_dir or None)
        try:
            tok = await in_thread(load)
        except Exception as exc:  # noqa: BLE001 - any loading failure is a start-up error
            raise StartupError(f"cannot load the tokenizer of model {m.name!r}: {exc}") from exc
        log.info("tokenizer for %s loaded in %.1fs", m.name, time.monotonic() - t0)
        return tok

    async def _monitor(self) -> None:
        """Every heartbeat interval: keepalives, silent workers, unacknowledged or overdue batches."""
        while True:
            await asyncio.sleep(self.cfg.daemon.heartbeat_interval_s)
            now = self.clock()
            self.fleet.tick(now)
            self.dispatcher.check(now)

    async def run(self) -> int:
        """Serve until drained or stopped; the process's main coroutine."""
        cfg = self.cfg
        log.info("sclsd starting: config=%s model=%s policy=%s slice_len=%d workers=%d engine=%s",
                 cfg.source, cfg.model.name, cfg.scheduler.policy, cfg.scheduler.slice_len,
                 cfg.workers.spawn, cfg.workers.engine)
        loop = asyncio.get_running_loop()
        starting = asyncio.create_task(self._acquire_and_start(), name="start")
        stopped_by: list[int] = []

        def on_signal(sig: int) -> None:
            if starting.done():
                self.drain.begin(sig)
            else:  # nothing to drain yet: abandon the start (the sockets already listen)
                stopped_by.append(sig)
                starting.cancel()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
        try:
            await starting
        except BaseException as exc:
            await self.stop()  # what did start: workers, sockets, the run directory, the lock
            if isinstance(exc, asyncio.CancelledError) and stopped_by:
                log.info("stopped by %s during start-up", signal.Signals(stopped_by[0]).name)
                return 0
            raise
        # systemd's ExecReload convention is SIGHUP, whose default action would kill us.
        loop.add_signal_handler(signal.SIGHUP, lambda: log.warning(
            "SIGHUP ignored: configuration changes take effect on restart"))
        self.notifier.ready(f"serving on {cfg.daemon.socket}")
        self._tasks.append(asyncio.create_task(self.notifier.watchdog_loop(), name="watchdog"))
        try:
            await self._run_until_stopped()
        finally:
            # Even when a background task failed: every live request still gets its
            # terminal event before the connections close.
            self.live.fail_all("internal", "the daemon failed; see its log")
            self.notifier.stopping()
            await self.stop()
        return 0

    async def _acquire_and_start(self) -> None:
        self.lock.acquire()
        await self.start()

    def check(self) -> None:
        """Raise the error of any background task that died (never swallow it)."""
        self.transport.check()
        self.supervisor.check()
        self.drain.check()
        for t in self._tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise RuntimeError(f"background task {t.get_name()} failed") from t.exception()

    async def _run_until_stopped(self) -> None:
        stop = asyncio.create_task(self.drain.stopped.wait())
        while not stop.done():
            await asyncio.wait([stop, *[t for t in self._tasks if not t.done()]], timeout=1.0,
                               return_when=asyncio.FIRST_COMPLETED)
            self.check()

    # ------------------------------------------------------------------ stop

    async def stop(self) -> None:
        """Close the sockets, stop the workers and the transport, release the lock."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.api.stop()
        await self.status_server.stop()
        wired = self.frontend is not None
        if wired:
            self.fleet.shutdown_all()
        if hasattr(self, "supervisor"):
            # Workers that never registered were told nothing: a failed start kills them now.
            await self.supervisor.stop(timeout=5.0 if wired else 0.0)
        await self.transport.stop()
        if self._metrics_http is not None:
            # shutdown() waits for the server thread's poll: not on the loop.
            await asyncio.get_running_loop().run_in_executor(None, self._metrics_http.shutdown)
        self.pool.shutdown(wait=False, cancel_futures=True)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self.notifier.close()
        self.lock.release()
        log.info("sclsd stopped")
