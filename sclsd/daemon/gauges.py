"""The daemon's scrape-time series: gauges (and per-worker counters) read from the status
snapshot at each scrape, so the status socket, ``sclsctl`` and Prometheus show the same
numbers. Every series carries the ``model_name`` label (see :mod:`.metrics`).

The three a gateway balances on (the Gateway API Inference Extension's
model-server protocol; meanings in :mod:`.occupancy`):

- ``sclsd:num_requests_waiting``: TotalQueuedRequests, live requests no worker
  has started yet;
- ``sclsd:num_requests_running``: TotalRunningRequests, live requests a worker
  has started and that have not ended;
- ``sclsd:kv_cache_usage_perc``: KVCacheUtilization, 0 to 1 over all workers
  (``sclsd:worker_kv_cache_usage_perc{worker}`` per worker).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..protocol import StatusSnapshot

__all__ = ["SnapshotGauges"]

_STATES = ("active", "draining", "drained")


class _Labelled:
    """Builds families whose samples all carry ``model_name`` first."""

    def __init__(self, model_name: str) -> None:
        self.model = model_name

    def gauge(self, name: str, doc: str, value: float | None = None,
              labels: Sequence[str] = ()) -> GaugeMetricFamily:
        fam = GaugeMetricFamily(name, doc, labels=["model_name", *labels])
        if value is not None:
            fam.add_metric([self.model], value)
        return fam

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> CounterMetricFamily:
        return CounterMetricFamily(name, doc, labels=["model_name", *labels])

    def add(self, fam: GaugeMetricFamily | CounterMetricFamily, values: Sequence[str],
            value: float) -> None:
        fam.add_metric([self.model, *values], value)


class SnapshotGauges:
    """Collector of the scrape-time series, from ``snapshot()`` (the status view)."""

    def __init__(self, snapshot: Callable[[], StatusSnapshot], model_name: str) -> None:
        self.snapshot = snapshot
        self.f = _Labelled(model_name)

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Metric]:
        st = self.snapshot()
        yield from self._requests(st)
        yield from self._daemon(st)
        yield from self._workers(st)

    def _requests(self, st: StatusSnapshot) -> Iterator[Metric]:
        g = self.f.gauge
        yield g("sclsd:num_requests_waiting", "Live requests no worker has started yet (the "
                "gateway's TotalQueuedRequests)", st.waiting_requests)
        yield g("sclsd:num_requests_running", "Live requests a worker has started, served now "
                "or between slices (the gateway's TotalRunningRequests)", st.started_requests)
        yield g("sclsd:num_requests_pooled", "Requests in the scheduler's pool, waiting for a "
                "slice (not started, or between slices)", st.pool_size)
        yield g("sclsd:num_requests_in_batches", "Requests in batches sent to workers (served "
                "now, or queued on the worker)", st.running_requests)
        yield g("sclsd:num_requests_admitting", "Requests between their frame and admission "
                "(tokenizing, or waiting for their grammar's check)", st.admitting)
        yield g("sclsd:kv_cache_usage_perc", "KV cache in use over all workers, 0 to 1 (the "
                "gateway's KVCacheUtilization)", st.kv_cache_usage)
        yield g("sclsd:num_queued_tokens", "Prompt tokens of live requests", st.queued_tokens)

    def _daemon(self, st: StatusSnapshot) -> Iterator[Metric]:
        g = self.f.gauge
        yield g("sclsd:schedule_interval_seconds", "Current scheduling interval T", st.interval_s)
        yield g("sclsd:num_workers", "Registered workers", len(st.workers))
        yield g("sclsd:num_connections", "Open client API connections", st.connections)
        yield g("sclsd:partial_frame_bytes", "Bytes held in half-sent frames on the client and status "
                "sockets", st.partial_frame_bytes)
        yield g("sclsd:draining", "1 while the daemon drains (SIGTERM)", int(st.draining))
        yield g("sclsd:serving", "1 while the daemon can serve (0: no workers left)", int(st.serving))
        err = st.estimator_error
        yield g("sclsd:estimator_abs_error_seconds", "Mean |measured - estimated| batch time over "
                "recent batches", err.mean_abs_error_s or 0.0)
        yield g("sclsd:estimator_error_seconds", "Mean (measured - estimated) batch time over "
                "recent batches", err.mean_error_s or 0.0)
        c = st.counters
        # vLLM's names for what operators alert on: preemptions and prefix-cache hits (here:
        # prompt and context tokens taken from KV a worker kept, instead of prefilled).
        for name, doc, value in (
                ("sclsd:num_preemptions", "Requests the engines preempted to make room", c.get("preemptions", 0)),
                ("sclsd:prefix_cache_queries", "Context tokens of slices started (prefilled or taken "
                 "from kept KV)", c.get("prefill_tokens", 0) + c.get("reused_tokens", 0)),
                ("sclsd:prefix_cache_hits", "Context tokens taken from KV a worker kept",
                 c.get("reused_tokens", 0))):
            fam = self.f.counter(name, doc)
            self.f.add(fam, [], value)
            yield fam
        events = self.f.counter("sclsd:scheduler_events", "Scheduler counters (status counters)",
                                ["event"])
        for k, v in sorted(st.counters.items()):
            self.f.add(events, [k], v)
        yield events

    def _workers(self, st: StatusSnapshot) -> Iterator[Metric]:
        f = self.f
        w = ["worker"]
        kv = f.gauge("sclsd:worker_kv_cache_usage_perc", "KV cache in use on the worker, 0 to 1",
                     labels=w)
        load = f.gauge("sclsd:worker_load_seconds", "Estimated queued work per worker", labels=w)
        inflight = f.gauge("sclsd:worker_batches_inflight", "Batches sent and not answered", labels=w)
        queue = f.gauge("sclsd:worker_queue_depth", "Batches in the worker's local queue (last "
                        "heartbeat)", labels=w)
        age = f.gauge("sclsd:worker_heartbeat_age_seconds", "Seconds since the worker was last "
                      "heard from", labels=w)
        state = f.gauge("sclsd:worker_state", "1 for the worker's state", labels=["worker", "state"])
        batches = f.counter("sclsd:worker_batches", "Batches served by the worker since it "
                            "registered", w)
        tokens = f.counter("sclsd:worker_generation_tokens", "Tokens generated by the worker since "
                           "it registered", w)
        for ws in st.workers:
            f.add(kv, [ws.id], ws.kv_cache_usage)
            f.add(load, [ws.id], ws.load_s)
            f.add(inflight, [ws.id], ws.batches_inflight)
            f.add(queue, [ws.id], ws.queued_batches)
            f.add(age, [ws.id], ws.heartbeat_age_s)
            for name in _STATES:
                f.add(state, [ws.id, name], int(name == ws.state))
            f.add(batches, [ws.id], ws.batches_done)
            f.add(tokens, [ws.id], ws.tokens_done)
        yield from (kv, load, inflight, queue, age, state, batches, tokens)
