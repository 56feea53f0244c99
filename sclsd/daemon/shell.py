"""The shell around the serving core: what happens goes in, what the core says goes out.

The serving core (:mod:`sclsd.daemon.serving`) decides everything about
requests and workers and returns :class:`~sclsd.daemon.serving.effects.Effects`;
the shell feeds it and delivers them (:meth:`Shell.deliver`). A request's path::

    client socket (sockets) ─▶ frontend ─▶ admission ─▶ core.submit
    core.step (the scheduling loop here) ─▶ batch message ─▶ transport ─▶ worker
    worker ─▶ transport ─▶ fleet (peer → worker id) ─▶ core.worker_message
        ─▶ text to detokenize (here: small jobs at once, others in the thread pool)
        ─▶ core.decoded
        ─▶ delta / done to the client's connection

Delivering is the only place the daemon's I/O meets its decisions: events to
client connections, messages to workers through the fleet (a send the
transport refuses is fed back as the worker's loss), local processes of lost
workers killed (a spawned worker restarts), detokenizing in the thread pool
(handed back in the order asked, so a request's deltas keep theirs), metrics.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import Any, cast

from .. import protocol as P
from ..config import Config
from .fleet import Fleet
from .frontend import Frontend
from .metrics import Metrics
from .serving.core import ServingCore
from .serving.effects import DecodeJob, Effects
from .sockets import Conn
from .supervisor import Supervisor

log = logging.getLogger("sclsd")


INLINE_DECODE_TOKENS = 4096
"""Token ids a detokenizing job may have to be decoded on the loop rather than in the pool:
a streamed message's windows (a few tokens a request; about 100 us for 64 requests with a
Rust tokenizer) cost less than the pool's round trip and its GIL hand-over; a whole long
output (a result's rows, a window held back by a lagging stream) still goes to the pool."""


class Shell:
    """Feeds the serving core and delivers its effects (see the module docstring)."""

    def __init__(self, cfg: Config, core: ServingCore, frontend: Frontend, fleet: Fleet,
                 supervisor: Supervisor, metrics: Metrics, pool: Executor, idle: asyncio.Event,
                 clock: Callable[[], float]) -> None:
        self.cfg = cfg
        self.core = core
        self.frontend = frontend
        self.fleet = fleet
        self.supervisor = supervisor
        self.metrics = metrics
        self.pool = pool
        self.idle = idle
        """Set while no request is live (the drain waits for it)."""
        self.clock = clock
        self.wake = asyncio.Event()
        """Set when something changed that the scheduling loop should look at."""
        self._decoding: deque[tuple[asyncio.Future[Any], DecodeJob]] = deque()

    # ------------------------------------------------------------------ inputs: clients

    def on_client(self, conn: Conn, msg: Any) -> Awaitable[None] | None:
        """A decoded client message (an awaitable when admission must tokenize first)."""
        handled = self.frontend.handle(conn, msg)
        if isinstance(handled, Effects):
            self.deliver(handled)
            return None
        return self._deliver_later(handled)

    async def _deliver_later(self, handled: Awaitable[Effects]) -> None:
        self.deliver(await handled)

    def on_client_close(self, conn: Conn) -> None:
        self.deliver(self.frontend.on_close(conn))

    # ------------------------------------------------------------------ inputs: workers

    def on_message(self, peer: bytes, msg: P.WorkerMsg) -> None:
        """A decoded worker message with its transport peer."""
        now = self.clock()
        if isinstance(msg, P.Register):
            self._register(peer, msg, now)
            return
        wid = self.fleet.member(peer, msg)
        if wid is not None:
            self.deliver(self.core.worker_message(wid, msg, now))

    def _register(self, peer: bytes, reg: P.Register, now: float) -> None:
        """Authenticated and fit, a worker joins; else it is refused. A member registering
        again on its own connection (our Welcome was late) is welcomed again; one that comes
        on a new connection replaces its old self (restarted, or reconnected), whose batches
        go back to the pool. Neither is killed: it lives and serves."""
        core = self.core
        wid = reg.worker_id
        if self.fleet.stopping:
            self.fleet.turn_away(peer, reg)
            return
        why = self.fleet.authenticate(reg) or core.join_refusal(reg)
        if why is not None:
            self.fleet.refuse(peer, reg, why)
            return
        old = self.fleet.by_peer.get(peer)
        if old == wid and wid in core.members:
            self.deliver(core.worker_rejoined(wid, now))
            return
        if old is not None and old != wid:
            self.deliver(core.worker_lost(old, f"its connection registered as {wid}", "replaced", now))
        member = core.members.workers.get(wid)
        if member is not None:
            same = member.reg.pid == reg.pid
            self.deliver(core.worker_lost(
                wid, f"registered again on a new connection ({'same' if same else 'new'} process, "
                f"pid {reg.pid})", "reconnected" if same else "restarted", now))
        joined = core.worker_joined(reg, now)
        if joined.refused is not None:
            self.fleet.refuse(peer, reg, joined.refused)
        else:
            self.fleet.bind(peer, wid)
        self.deliver(joined)

    def worker_exited(self, wid: str, why: str) -> None:
        """A local worker's process ended (the supervisor restarts it)."""
        self.deliver(self.core.worker_lost(wid, why, "exited", self.clock()))

    # ------------------------------------------------------------------ effects

    def deliver(self, eff: Effects) -> None:
        """Do what the core said (see the module docstring), then wake the scheduling loop
        if it asked."""
        for lost in eff.lost:
            self.fleet.unbind(lost.wid)
            self.metrics.worker_lost(lost.reason)
            if lost.kill:
                self.supervisor.kill(lost.wid)  # a spawned one restarts
        for client, event in eff.to_clients:
            cast(Conn, client).send(event)  # the core's clients are the connections we gave it
        unreachable: dict[str, str] = {}  # worker -> why
        for wid, msg in eff.worker_messages():
            if wid in unreachable:
                continue
            if isinstance(msg, P.BatchMsg):
                self.metrics.dispatched(len(msg.requests))
            if self.fleet.send(wid, msg) is False:
                unreachable[wid] = f"unreachable: sending {type(msg).__name__} failed"
        for ended in eff.ended:
            self.metrics.ended(ended)
        for seconds in eff.batch_seconds:
            self.metrics.batch_done(seconds)
        for job in eff.decode:
            self._decode(job)
        if eff.wake:
            self.wake.set()
        if len(self.core.table):
            self.idle.clear()
        else:
            self.idle.set()
        for wid, why in unreachable.items():  # its batches go back to the pool
            self.deliver(self.core.worker_lost(wid, why, "unreachable", self.clock()))

    def _decode(self, job: DecodeJob) -> None:
        """Detokenize ``job``: at once when it is small and nothing is in the pool (the texts
        must come back in the order asked), else in the pool."""
        if not self._decoding and job.size() <= INLINE_DECODE_TOKENS:
            texts: Any
            try:
                texts = job.run(self.core.tok)
            except Exception as exc:  # noqa: BLE001 - the core decides
                texts = exc
            self.deliver(self.core.decoded(job, texts, self.clock()))
            return
        fut = asyncio.get_running_loop().run_in_executor(self.pool, job.run, self.core.tok)
        self._decoding.append((fut, job))
        fut.add_done_callback(self._decoded)

    def _decoded(self, _done: asyncio.Future[Any]) -> None:
        """Hand every detokenized job at the head of the order to the core."""
        while self._decoding and self._decoding[0][0].done():
            fut, job = self._decoding.popleft()
            texts: Any
            try:
                texts = fut.result()
            except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001 - the core decides
                texts = exc
            try:
                self.deliver(self.core.decoded(job, texts, self.clock()))
            except Exception:  # noqa: BLE001 - the next ones still apply; logged loudly
                log.exception("applying a worker's message failed")

    # ------------------------------------------------------------------ time

    async def schedule(self) -> None:
        """The scheduling loop: a core step whenever something changed or a timer is due."""
        loop = asyncio.get_running_loop()
        while True:
            self.wake.clear()
            eff, wait = self.core.step(self.clock())
            self.deliver(eff)
            if wait > 0:
                # A timer sets the same event a change would (not asyncio.wait_for, whose
                # timeout racing a cancellation can swallow the cancel on Python 3.11).
                timer = loop.call_later(wait, self.wake.set)
                try:
                    await self.wake.wait()
                finally:
                    timer.cancel()
            else:
                await asyncio.sleep(0)

    async def monitor(self) -> None:
        """Every heartbeat interval: keepalives, silent workers, stalled batches. A tick that
        wakes late (the loop itself was held up) judges no worker (``ServingCore.tick``)."""
        interval = self.cfg.daemon.heartbeat_interval_s
        loop = asyncio.get_running_loop()
        while True:
            expected = loop.time() + interval
            await asyncio.sleep(interval)
            late = loop.time() - expected
            if late > interval:
                log.warning("the daemon's loop was held up %.1fs: no worker judged this tick", late)
            self.deliver(self.core.tick(self.clock(), judge=late <= interval))

    def fail_all(self, code: P.ErrorCode, message: str) -> list[str]:
        """End every live request with ``error``; returns their ids."""
        eff = self.core.fail_all(code, message, self.clock())
        self.deliver(eff)
        return [e.rid for e in eff.ended]
