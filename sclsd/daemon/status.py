"""The status socket and the one place the daemon's state is summed up.

:meth:`StatusView.snapshot` builds the typed
:class:`~sclsd.protocol.StatusSnapshot`; the status socket sends it,
``sclsctl status/top`` render it and the Prometheus gauges read it. Nothing
on the status socket changes the daemon's state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import __version__
from .. import protocol as P
from ..config import Config
from ..core.scheduler_api import SchedulerInterface
from .cost import DaemonCost
from .metrics import Metrics
from .occupancy import Occupancy, occupancy
from .serving.core import ServingCore
from .sockets import Conn, FrameServer


@dataclass(frozen=True)
class DaemonState:
    """What the server knows beyond the serving core: its lifecycle and its own counts."""

    draining: bool
    serving: bool
    why: str | None
    """Why it cannot serve (starting, no workers), when it cannot."""
    starting: bool
    metrics_http: str | None
    loading: list[P.LoadingWorker] = field(default_factory=list)
    admitting: int = 0
    counters: dict[str, int] = field(default_factory=dict)
    """Refusals, bad worker messages, refused registrations, restarts."""
    tokenizer: str | None = None
    """Where the model's tokenizer files are (``StatusSnapshot.tokenizer``)."""


class StatusView:
    """Reads the scheduler, the cost model and the serving core (once there is one) into a
    :class:`~sclsd.protocol.StatusSnapshot`."""

    def __init__(self, cfg: Config, sched: SchedulerInterface, cost: DaemonCost, api: FrameServer,
                 clock: Callable[[], float], started: float) -> None:
        self.cfg = cfg
        self.sched = sched
        self.cost = cost
        self.api = api
        self.clock = clock
        self.started = started

    def snapshot(self, core: ServingCore | None, state: DaemonState) -> P.StatusSnapshot:
        s = self.sched
        now = self.clock()
        workers = []
        members = core.members if core is not None else None
        occ = (occupancy(s, core.table, core.members, self.cost) if core is not None
               else Occupancy(0, 0, {}, 0.0))
        for wid, ws in sorted(s.workers.items()):
            info = members.workers.get(wid) if members is not None else None
            if members is None or info is None:
                continue
            reg = info.reg
            workers.append(P.WorkerStatus(
                id=wid, engine=reg.engine, model=reg.model, device=reg.device, pid=reg.pid,
                state=members.state(wid), load_s=round(ws.load, 4), batches_inflight=len(ws.batches),
                queued_batches=info.queued_batches, busy=info.busy, batches_done=ws.batches_done,
                tokens_done=ws.tokens_done, heartbeat_age_s=round(now - info.last_seen, 3),
                kv_cache_usage=occ.kv_usage.get(wid, 0.0),
            ))
        recent = list(s.recent)
        err = [m - e for e, m in recent]
        d = self.cfg.daemon
        engines = core.results.engines.as_counters() if core is not None else {}
        if core is not None:
            engines["cancels_sent"] = core.dispatch.cancelled_rows
            engines["prefix_hints"] = core.routes.hints  # requests sent where their prefix likely is
        return P.StatusSnapshot(
            version=__version__,
            protocol=P.PROTOCOL_VERSION,
            uptime_s=round(now - self.started, 3),
            draining=state.draining,
            model=self.cfg.model.name,
            policy=s.policy.name,
            slice_len=s.policy.slice_len,
            interval_s=s.interval,
            pool_size=len(s.pool),
            live_requests=len(s.live),
            running_requests=len(s.live) - len(s.pool),
            admitting=state.admitting,
            queued_tokens=core.table.queued_tokens if core is not None else 0,
            limits=P.Limits(max_queued_requests=d.max_queued_requests, max_queued_tokens=d.max_queued_tokens,
                            max_partial_frame_bytes=d.max_partial_frame_bytes,
                            max_partial_frame_bytes_per_uid=d.max_partial_frame_bytes_per_uid,
                            max_input=self.cfg.model.max_input),
            connections=len(self.api.conns),
            metrics_http=state.metrics_http,
            workers=workers,
            estimator=self.cost.estimator.to_dict(),
            estimator_error=P.EstimatorError(
                batches=len(recent),
                mean_error_s=sum(err) / len(err) if err else None,
                mean_abs_error_s=sum(abs(v) for v in err) / len(err) if err else None,
                last=[P.EstimatedVsMeasured(est_s=round(e, 4), measured_s=round(m, 4)) for e, m in recent[-8:]],
            ),
            counters={**s.stats().as_counters(), **engines, **state.counters},
            serving=state.serving,
            why=state.why,
            starting=state.starting,
            loading=state.loading,
            waiting_requests=occ.waiting,
            started_requests=occ.running,
            kv_cache_usage=occ.kv_usage_total,
            partial_frame_bytes=self.api.budget.held,
            expected_workers=self.cfg.workers.spawn,
            tokenizer=state.tokenizer,
            worker_losses=[] if core is None else [
                P.WorkerLosses(id=wid, count=r.count, by_reason=dict(r.by_reason), last_reason=r.last_reason,
                               last_why=r.last_why, last_age_s=round(now - r.last_at, 1))
                for wid, r in sorted(core.members.losses.items())],
        )


class StatusHandler:
    """Answers :class:`~sclsd.protocol.StatusRequest` and :class:`~sclsd.protocol.MetricsRequest`."""

    def __init__(self, snapshot: Callable[[], P.StatusSnapshot], metrics: Metrics) -> None:
        self.snapshot = snapshot
        self.metrics = metrics

    def handle(self, conn: Conn, msg: Any) -> None:
        if isinstance(msg, P.StatusRequest):
            conn.send(P.StatusReply(status=self.snapshot()))
        elif isinstance(msg, P.MetricsRequest):
            conn.send(P.MetricsReply(text=self.metrics.exposition()))
