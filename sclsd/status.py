"""The status socket: read-only snapshots of the daemon and Prometheus metrics.

The snapshot's keys are stable (docs/operations.md lists them); ``sclsctl
status`` and ``sclsctl top`` render it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from . import protocol as P

if TYPE_CHECKING:
    from .api import Conn
    from .daemon import Daemon


class StatusHandler:
    """Answers :class:`~sclsd.protocol.StatusRequest` and :class:`~sclsd.protocol.MetricsRequest`.

    Nothing on this socket changes the daemon's state.
    """

    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon

    def handle(self, conn: Conn, msg: Any) -> None:
        if isinstance(msg, P.StatusRequest):
            conn.send(P.StatusReply(status=self.snapshot()))
        elif isinstance(msg, P.MetricsRequest):
            conn.send(P.MetricsReply(text=self.d.metrics.exposition()))

    def snapshot(self) -> dict[str, Any]:
        d = self.d
        s = d.sched
        now = time.monotonic()
        workers = []
        for wid, ws in sorted(s.workers.items()):
            info = d.hub.workers.get(wid)
            reg = info.reg if info else None
            workers.append({
                "id": wid,
                "engine": reg.engine if reg else None,
                "model": reg.model if reg else None,
                "device": reg.device if reg else None,
                "pid": reg.pid if reg else None,
                "state": d.worker_state(wid),
                "load_s": round(ws.load, 4),
                "batches_inflight": len(ws.batches),
                "queued_batches": info.queued_batches if info else None,
                "busy": info.busy if info else None,
                "batches_done": ws.batches_done,
                "tokens_done": ws.tokens_done,
                "heartbeat_age_s": round(now - info.last_seen, 3) if info else None,
            })
        recent = list(s.recent)
        err = [m - e for e, m in recent]
        est = d.cost.estimator
        return {
            "version": __import__("sclsd").__version__,
            "protocol": P.PROTOCOL_VERSION,
            "uptime_s": round(now - d.started, 3),
            "draining": d.draining,
            "model": d.cfg.model.name,
            "policy": s.policy.name,
            "slice_len": s.policy.slice_len,
            "interval_s": s.interval,
            "pool_size": len(s.pool),
            "live_requests": len(s.live),
            "running_requests": len(s.live) - len(s.pool),
            "admitting": d.admitting,
            "queued_tokens": d.queued_tokens,
            "limits": {"max_queued_requests": d.cfg.daemon.max_queued_requests,
                       "max_queued_tokens": d.cfg.daemon.max_queued_tokens},
            "connections": len(d.api.conns),
            "metrics_http": d.metrics_http_address,
            "workers": workers,
            "estimator": est.to_dict() if hasattr(est, "to_dict") else repr(est),
            "estimator_error": {
                "batches": len(recent),
                "mean_error_s": sum(err) / len(err) if err else None,
                "mean_abs_error_s": sum(abs(x) for x in err) / len(err) if err else None,
                "last": [{"est_s": round(e, 4), "measured_s": round(m, 4)} for e, m in recent[-8:]],
            },
            "counters": {**s.counters, "refused": d.metrics.refused_total,
                         "bad_worker_messages": d.hub.bad_messages},
        }
