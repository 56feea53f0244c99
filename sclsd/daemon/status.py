"""The status socket and the one place the daemon's state is summed up.

:meth:`StatusView.snapshot` builds the typed
:class:`~sclsd.protocol.StatusSnapshot`; the status socket sends it,
``sclsctl status/top`` render it and the Prometheus gauges read it. Nothing
on the status socket changes the daemon's state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .. import __version__
from .. import protocol as P
from ..config import Config
from ..core.scheduler_api import SchedulerInterface
from .admission import Admission
from .cost import DaemonCost
from .fleet import Fleet
from .metrics import Metrics
from .requests import LiveRequests
from .sockets import Conn, FrameServer


class StatusView:
    """Reads the daemon's parts (given explicitly) into a :class:`~sclsd.protocol.StatusSnapshot`."""

    def __init__(self, cfg: Config, sched: SchedulerInterface, live: LiveRequests, admission: Admission | None,
                 fleet: Fleet | None, cost: DaemonCost, api: FrameServer, clock: Callable[[], float],
                 started: float, extra: Callable[[], dict[str, Any]]) -> None:
        self.cfg = cfg
        self.sched = sched
        self.live = live
        #: None while the daemon starts (the server sets both once it is wired).
        self.admission = admission
        self.fleet = fleet
        self.cost = cost
        self.api = api
        self.clock = clock
        self.started = started
        #: ``draining``, ``metrics_http``, ``serving``, ``why``, ``starting``, ``loading`` and
        #: extra counters, from the server.
        self.extra = extra

    def snapshot(self) -> P.StatusSnapshot:
        s = self.sched
        now = self.clock()
        workers = []
        for wid, ws in sorted(s.workers.items()):
            info = self.fleet.workers.get(wid) if self.fleet is not None else None
            if info is None:
                continue
            reg = info.reg
            workers.append(P.WorkerStatus(
                id=wid, engine=reg.engine, model=reg.model, device=reg.device, pid=reg.pid,
                state=self.fleet.state(wid), load_s=round(ws.load, 4), batches_inflight=len(ws.batches),
                queued_batches=info.queued_batches, busy=info.busy, batches_done=ws.batches_done,
                tokens_done=ws.tokens_done, heartbeat_age_s=round(now - info.last_seen, 3),
            ))
        recent = list(s.recent)
        err = [m - e for e, m in recent]
        x = self.extra()
        d = self.cfg.daemon
        return P.StatusSnapshot(
            version=__version__,
            protocol=P.PROTOCOL_VERSION,
            uptime_s=round(now - self.started, 3),
            draining=x["draining"],
            model=self.cfg.model.name,
            policy=s.policy.name,
            slice_len=s.policy.slice_len,
            interval_s=s.interval,
            pool_size=len(s.pool),
            live_requests=len(s.live),
            running_requests=len(s.live) - len(s.pool),
            admitting=self.admission.admitting if self.admission is not None else 0,
            queued_tokens=self.live.queued_tokens,
            limits=P.Limits(max_queued_requests=d.max_queued_requests, max_queued_tokens=d.max_queued_tokens),
            connections=len(self.api.conns),
            metrics_http=x["metrics_http"],
            workers=workers,
            estimator=self.cost.estimator.to_dict(),
            estimator_error=P.EstimatorError(
                batches=len(recent),
                mean_error_s=sum(err) / len(err) if err else None,
                mean_abs_error_s=sum(abs(v) for v in err) / len(err) if err else None,
                last=[P.EstimatedVsMeasured(est_s=round(e, 4), measured_s=round(m, 4)) for e, m in recent[-8:]],
            ),
            counters={**s.stats().as_counters(), **x["counters"]},
            serving=x["serving"],
            why=x["why"],
            starting=x.get("starting", False),
            loading=x.get("loading", []),
        )


class StatusHandler:
    """Answers :class:`~sclsd.protocol.StatusRequest` and :class:`~sclsd.protocol.MetricsRequest`."""

    def __init__(self, view: StatusView, metrics: Metrics) -> None:
        self.view = view
        self.metrics = metrics

    def handle(self, conn: Conn, msg: Any) -> None:
        if isinstance(msg, P.StatusRequest):
            conn.send(P.StatusReply(status=self.view.snapshot()))
        elif isinstance(msg, P.MetricsRequest):
            conn.send(P.MetricsReply(text=self.metrics.exposition()))
