"""Prometheus metrics of the daemon, named after vLLM's (``sclsd:`` prefix).

Counters and histograms are updated as events happen; gauges are read from the
scheduler at scrape time by a custom collector.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

if TYPE_CHECKING:
    from .daemon import Daemon, ReqCtx
    from .protocol import Result, Timings

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)


class _Gauges:
    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Any:
        s = self.d.sched
        yield GaugeMetricFamily("sclsd:num_requests_waiting", "Requests in the pool", len(s.pool))
        yield GaugeMetricFamily("sclsd:num_requests_running", "Requests in batches on workers",
                                len(s.live) - len(s.pool))
        yield GaugeMetricFamily("sclsd:num_queued_tokens", "Prompt tokens of live requests",
                                self.d.queued_tokens)
        yield GaugeMetricFamily("sclsd:schedule_interval_seconds", "Current scheduling interval T",
                                s.interval)
        yield GaugeMetricFamily("sclsd:num_workers", "Registered workers", len(s.workers))
        load = GaugeMetricFamily("sclsd:worker_load_seconds", "Estimated queued work per worker",
                                 labels=["worker"])
        inflight = GaugeMetricFamily("sclsd:worker_batches_inflight", "Batches sent and not answered",
                                     labels=["worker"])
        for wid, ws in sorted(s.workers.items()):
            load.add_metric([wid], ws.load)
            inflight.add_metric([wid], len(ws.batches))
        yield load
        yield inflight


class Metrics:
    def __init__(self, daemon: Daemon) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("sclsd:request_success", "Finished requests by reason",
                                ["finished_reason"], registry=r)
        self.refusals = Counter("sclsd:request_refused", "Requests refused by error code",
                                ["code"], registry=r)
        self.prompt_tokens = Counter("sclsd:prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.gen_tokens = Counter("sclsd:generation_tokens", "Generated tokens", registry=r)
        self.batches = Counter("sclsd:batches", "Batches dispatched", registry=r)
        self.ttft = Histogram("sclsd:time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("sclsd:e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("sclsd:request_queue_time_seconds", "Time before the first dispatch",
                               buckets=_LATENCY_BUCKETS, registry=r)
        self.slices = Histogram("sclsd:request_slices", "Slices per finished request",
                                buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32), registry=r)
        self.batch_size = Histogram("sclsd:batch_size", "Requests per batch",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.batch_time = Histogram("sclsd:batch_serve_seconds", "Measured serving time per batch",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        r.register(_Gauges(daemon))  # type: ignore[arg-type]

    def refused(self, code: str) -> None:
        self.refusals.labels(code).inc()

    def dispatched(self, batch: Any) -> None:
        self.batches.inc()
        self.batch_size.observe(batch.size)

    def batch_done(self, res: Result) -> None:
        self.batch_time.observe(res.stats.prefill_s + res.stats.decode_s)

    def finished(self, c: ReqCtx, reason: str, t: Timings) -> None:
        self.requests.labels(reason).inc()
        self.prompt_tokens.inc(len(c.prompt_ids))
        self.gen_tokens.inc(len(c.out_ids))
        self.e2e.observe(t.e2e_s)
        self.queue.observe(t.queued_s)
        self.slices.observe(t.slices)
        if t.ttft_s is not None:
            self.ttft.observe(t.ttft_s)

    def exposition(self) -> str:
        return generate_latest(self.registry).decode()
