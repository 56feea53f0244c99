"""The daemon process: its parts, start-up, serving, drain and stop.

The serving core (:mod:`sclsd.daemon.serving`) decides; the shell
(:mod:`sclsd.daemon.shell`) feeds it and delivers what it says; this module
builds them and runs the process around them (see the shell for a request's
path through the parts).

Start-up: the sockets listen first; until the tokenizer is loaded (and the model
downloaded, where ``model.allow_download`` lets it) ``generate`` is answered with
error ``starting``, ``ping`` with ``pong``, and the status shows ``starting``
with the workers that are loading. The worker transport starts and the local
workers are spawned before the tokenizer loads, so both load at once; what the
workers send before the core exists waits in :class:`~.startup.EarlyMessages`.
The core needs the tokenizer: it and the shell are built once it is loaded
(``Server.shell`` is None until then), everything else at construction.

Guarantees (docs/operations.md): every accepted request ends with exactly one
``done`` or ``error``; SIGTERM drains (``draining`` for new requests,
``daemon.drain_timeout_s`` for those in flight, ``error: shutdown`` for what is
left, exit 0) and a second SIGTERM/SIGINT ends the drain at once; a background
task that fails stops the daemon loudly, after every live request got its
terminal event. The signal handlers that were there before are restored on
the way out.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import shutil
import signal
import tempfile
import time
from collections.abc import Awaitable, Callable
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
from .drain import DrainControl
from .errors import StartupError
from .fleet import Fleet
from .frontend import Frontend
from .lock import EndpointLocks
from .metrics import HttpServer, Metrics, model_label
from .secret import WorkerSecret
from .serving.core import ServingCore
from .shell import Shell
from .signals import captured_signals
from .sockets import Conn, FrameServer, frame_budget
from .startup import EarlyMessages, in_thread
from .status import DaemonState, StatusHandler, StatusView
from .supervisor import Supervisor
from .transport.base import WorkerTransport

#: Seconds stopped workers have to exit before they are killed.
WORKER_EXIT_S = 30.0

log = logging.getLogger("sclsd")


def make_scheduler(cfg: Config, cost: DaemonCost) -> SchedulerInterface:
    """The core scheduler for ``cfg``; Γ is ``scheduler.gamma_s``, else the profile's, else
    the core's default."""
    s = cfg.scheduler
    gamma = s.effective_gamma(cost.profile.gamma_s)
    policy = make_policy(s.policy, slice_len=s.slice_len, max_gen=cfg.model.max_gen,
                         batch_size=s.batch_size, gamma=gamma, lam=s.lam,
                         work_conserving=s.work_conserving, kv_reuse=s.kv_reuse,
                         max_slice_gap_s=s.max_slice_gap_s)
    if s.policy in GRANT_POLICIES:
        return SliceGrantScheduler(policy, cost, max_failures=s.max_failures,
                                   max_worker_losses=s.max_worker_losses)
    return Scheduler(policy, cost, max_failures=s.max_failures, max_worker_losses=s.max_worker_losses)


GC_THRESHOLDS = (10_000, 50, 1000)
"""The collector's thresholds once serving (Python's are 700, 10, 10): a streamed token
allocates a few short-lived objects, and with the defaults the collector ran every few
hundred tokens and scanned every live request's output; at 12,800 streamed tokens/s this
and :func:`gc.freeze` took the daemon's CPU per token from about 27 to 22 us
(docs/benchmarks.md, "The daemon at GPU token rates"). Cycles are rare here (reference
counting frees nearly everything), so little waits longer to be freed."""


def quiet_collector() -> None:
    """Everything made during start-up lives as long as the process: out of the collector's
    sight (:func:`gc.freeze`), and collections rarer (:data:`GC_THRESHOLDS`)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


class Server:
    """One daemon (see the module docstring)."""

    def __init__(self, cfg: Config, *, transport: WorkerTransport | None = None,
                 tokenizer: Tokenizer | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.clock = clock
        self.started = clock()
        self.tok = tokenizer
        # Two pools: what streams tokens to clients (detokenizing) never waits behind what
        # admits new requests (tokenizing prompts, checking grammars), however large or slow
        # a client makes those.
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="sclsd-detok")
        self.admit_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="sclsd-admit")
        if transport is None:
            from .transport.zmq_router import ZmqTransport  # zmq only for the real transport

            transport = ZmqTransport(cfg)
        self.transport = transport
        self.metrics = Metrics(model_label(cfg))
        self.cost = DaemonCost.initial(cfg)
        self.sched = make_scheduler(cfg, self.cost)
        self.notifier = Notifier.from_env()
        self.run_dir = tempfile.mkdtemp(prefix="sclsd-run-")
        try:  # written at start, once the lock is ours
            self.worker_secret = WorkerSecret.for_config(cfg, self.run_dir, transport.authenticated)
        except BaseException:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            raise
        self.lock = EndpointLocks(cfg.daemon.endpoints())
        self.fleet = Fleet(transport, self.worker_secret.value, clock)
        self.supervisor = Supervisor(cfg, self.run_dir, self.worker_secret.path, transport.spawn_args,
                                     on_exit=self._worker_exited, on_give_up=self._gave_up)
        self.drain = DrainControl(self, cfg.daemon.drain_timeout_s, self.notifier)
        self.idle = asyncio.Event()
        """Set while no request is live (the drain waits for it)."""
        self.idle.set()
        #: What the daemon does before it can serve (shown in its status); None once it can.
        self.starting: str | None = "starting"
        self.admission: Admission | None = None
        self.shell: Shell | None = None
        """The serving core and its shell, once the tokenizer is loaded."""
        self.early = EarlyMessages()
        self._tasks: list[asyncio.Task[None]] = []
        self._metrics_http: HttpServer | None = None
        d = cfg.daemon
        # One budget for the half-sent frames of both sockets.
        self.frame_budget = frame_budget(d.max_partial_frame_bytes, d.max_partial_frame_bytes_per_uid)
        common: dict[str, Any] = dict(max_frame=d.max_frame_bytes, max_buffer=d.max_conn_buffer_bytes,
                                      mode=d.client_socket_mode, group=d.socket_group, backlog=d.listen_backlog,
                                      frame_timeout=d.frame_timeout_s, budget=self.frame_budget)
        self.api = FrameServer("api", d.socket, P.client_decoder, self.on_client,
                               on_close=self.on_client_close, allowed_uids=d.allowed_uids, **common)
        self.view = StatusView(cfg, self.sched, self.cost, self.api, clock, self.started)
        self.metrics.watch(self.snapshot)
        self.status_server = FrameServer("status", d.status_socket, P.status_decoder,
                                         StatusHandler(self.snapshot, self.metrics).handle,
                                         allowed_uids=d.status_allowed_uids, **common)

    @property
    def secret(self) -> str | None:
        """What workers present at ``register`` (None: CURVE authenticates them)."""
        return self.worker_secret.value

    @property
    def core(self) -> ServingCore | None:
        """The serving core (None until the tokenizer is loaded)."""
        return self.shell.core if self.shell is not None else None

    # ------------------------------------------------------------------ inputs before the core

    def on_client(self, conn: Conn, msg: Any) -> Awaitable[None] | None:
        """A client message: to the shell once it exists; before, ``pong`` or ``starting``."""
        if self.shell is not None:
            return self.shell.on_client(conn, msg)
        if isinstance(msg, P.Ping):
            conn.send(P.Pong(nonce=msg.nonce, features=list(P.GENERATE_FEATURES)))
        else:
            if isinstance(msg, P.Generate):
                self.metrics.refused("starting", "starting")
            conn.send(P.Error(code="starting", id=getattr(msg, "id", None),
                              message=f"sclsd is starting ({self.starting}): retry shortly, or "
                                      "wait for it with `sclsctl wait-ready`"))
        return None

    def on_client_close(self, conn: Conn) -> None:
        if self.shell is not None:
            self.shell.on_client_close(conn)

    def on_message(self, peer: bytes, msg: P.WorkerMsg) -> None:
        """The transport's sink: to the shell once it exists; before, held."""
        if self.shell is not None:
            self.shell.on_message(peer, msg)
        else:
            self.early.hold(peer, msg)

    def _worker_exited(self, wid: str, why: str) -> None:
        if self.shell is not None:  # before, no worker can have registered
            self.shell.worker_exited(wid, why)

    # ------------------------------------------------------------------ the drain's view

    def live_count(self) -> int:
        core = self.core
        return len(core.table) if core is not None else 0

    def fail_all(self, code: P.ErrorCode, message: str) -> list[str]:
        """End every live request with ``error``; returns their ids."""
        return self.shell.fail_all(code, message) if self.shell is not None else []

    # ------------------------------------------------------------------ status

    def not_serving(self) -> str | None:
        """Why no request can be served now (starting; every local worker given up, none registered)."""
        if self.starting is not None:
            return f"starting: {self.starting}"
        if self.fleet.peers or self.supervisor.serving:
            return None
        return "no workers: " + "; ".join(self.supervisor.gave_up.values())

    def _gave_up(self, why: str) -> None:
        why_now = self.not_serving()
        if why_now is not None:
            # Nothing can serve what is queued: end it now rather than let it wait forever.
            left = self.fail_all("no_workers", why_now)
            if left:
                log.error("%d queued requests ended: %s", len(left), why_now)

    def snapshot(self) -> P.StatusSnapshot:
        """The daemon's typed status (the status socket, ``sclsctl`` and the gauges read it)."""
        why = self.not_serving()
        loading = [P.LoadingWorker(id=w.id, pid=w.pid, age_s=w.age_s, step=w.step, state=w.state)
                   for w in self.supervisor.loading(self.fleet.peers)]
        state = DaemonState(
            draining=self.drain.draining, serving=why is None, why=why, starting=self.core is None,
            metrics_http=self._metrics_http.address if self._metrics_http is not None else None,
            loading=loading, admitting=self.admission.pending if self.admission is not None else 0,
            counters={"refused": self.metrics.refused_total, "bad_worker_messages": self.transport.bad_messages,
                      "workers_refused": self.fleet.refused, "worker_restarts": self.supervisor.restarts,
                      "partial_frame_closed": self.frame_budget.closed},
            tokenizer=getattr(self.tok, "directory", None))
        return self.view.snapshot(self.core, state)

    # ------------------------------------------------------------------ lifecycle

    async def start(self, *, sockets: bool = True, spawn: bool = True) -> None:
        """Listen (``sockets``; ``generate`` is answered ``starting`` meanwhile), fetch the model
        where allowed, start the transport and the local workers (``spawn``), load the
        tokenizer (off the loop) while they load, and serve; unit tests start neither sockets
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
        self.worker_secret.write()
        await self.transport.start(self)
        if spawn:
            self.supervisor.start()
        tok = self.tok if self.tok is not None else await self._load_tokenizer()
        shell = self._serve_with(tok)
        self._tasks = [asyncio.create_task(shell.schedule(), name="scheduler"),
                       asyncio.create_task(shell.monitor(), name="monitor")]

    def _serve_with(self, tok: Tokenizer) -> Shell:
        """The tokenizer is here: the core, admission and the shell exist, client messages
        reach them, and what workers sent meanwhile reaches the core."""
        cfg = self.cfg
        self.tok = tok
        core = ServingCore(cfg, self.sched, self.cost, tok)
        self.admission = Admission(cfg, core, tok, self.admit_pool, self.metrics, self.clock,
                                   is_draining=lambda: self.drain.draining, not_serving=self.not_serving)
        frontend = Frontend(cfg, self.admission, core, self.clock)
        self.shell = shell = Shell(cfg, core, frontend, self.fleet, self.supervisor, self.metrics,
                                   self.pool, self.idle, self.clock)
        # A request admitted after its grammar's check is answered from admission's own task.
        self.admission.deliver = shell.deliver
        self.starting = None
        for peer, msg in self.early.take():
            shell.on_message(peer, msg)
        return shell

    async def _fetch_model(self) -> None:
        """Download the model if it is a hub id missing from the local cache (in a thread)."""
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
            tok: Tokenizer = await in_thread(load)
        except Exception as exc:  # noqa: BLE001 - any loading failure is a start-up error
            raise StartupError(f"cannot load the tokenizer of model {m.name!r}: {exc}") from exc
        log.info("tokenizer for %s loaded in %.1fs", m.name, time.monotonic() - t0)
        return tok

    async def run(self) -> int:
        """Serve until drained or stopped; the process's main coroutine."""
        cfg = self.cfg
        log.info("sclsd starting: config=%s model=%s policy=%s slice_len=%d workers=%d engine=%s",
                 cfg.source, cfg.model.name, cfg.scheduler.policy, cfg.scheduler.slice_len,
                 cfg.workers.spawn, cfg.engine)
        loop = asyncio.get_running_loop()
        starting = asyncio.create_task(self._acquire_and_start(), name="start")
        stopped_by: list[int] = []

        def on_signal(sig: int) -> None:
            if starting.done():
                self.drain.begin(sig)
            else:  # nothing to drain yet: abandon the start (the sockets already listen)
                stopped_by.append(sig)
                starting.cancel()

        with captured_signals(loop, {signal.SIGTERM: on_signal, signal.SIGINT: on_signal}):
            try:
                await starting
            except BaseException as exc:
                await self.stop()  # what did start: workers, sockets, the run directory, the lock
                if isinstance(exc, asyncio.CancelledError) and stopped_by:
                    log.info("stopped by %s during start-up", signal.Signals(stopped_by[0]).name)
                    return 0
                raise
            # systemd's ExecReload convention is SIGHUP, whose default action would kill us.
            with captured_signals(loop, {signal.SIGHUP: lambda sig: log.warning(
                    "SIGHUP ignored: configuration changes take effect on restart")}):
                self.notifier.ready(f"serving on {cfg.daemon.socket}")
                quiet_collector()
                self._tasks.append(asyncio.create_task(self.notifier.watchdog_loop(), name="watchdog"))
                try:
                    await self._run_until_stopped()
                finally:
                    # Even when a background task failed: every live request still gets its
                    # terminal event before the connections close.
                    self.fail_all("internal", "the daemon failed; see its log")
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

    async def stop(self) -> None:
        """Close the sockets, stop the workers and the transport, release the lock."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.api.stop()
        await self.status_server.stop()
        if self.admission is not None:
            self.admission.close()  # grammar checks nobody can hear any more
        serving = self.core is not None
        self.fleet.shutdown_all()
        # Workers that have not registered (loading, or restarted after a loss) were told
        # nothing over the socket: a signal tells them, so they are not left to the kill below.
        self.supervisor.terminate(self.fleet.peers)
        # A worker closes its engine and exits in about a second once told to; on a busy
        # machine in several: it is given WORKER_EXIT_S before it is killed (TimeoutStopSec
        # in systemd/sclsd.service leaves room for it after the drain). A failed start
        # (nothing served) kills them at once.
        await self.supervisor.stop(timeout=WORKER_EXIT_S if serving else 0.0)
        await self.transport.stop()
        if self._metrics_http is not None:
            # shutdown() waits for the server thread's poll: not on the loop.
            await asyncio.get_running_loop().run_in_executor(None, self._metrics_http.shutdown)
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.admit_pool.shutdown(wait=False, cancel_futures=True)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self.notifier.close()
        self.lock.release()
        log.info("sclsd stopped")
