"""Prometheus metrics of the daemon, named after vLLM's (``sclsd:`` prefix).

Counters and histograms are updated as events happen; gauges (and the
per-worker series) are read at scrape time from the status snapshot
(:class:`~sclsd.protocol.StatusSnapshot`, built in :mod:`.status`), so the
status socket, ``sclsctl`` and Prometheus show the same numbers. The exposition is served on the status socket (``metrics``
message) and, when ``daemon.metrics_http`` is set, over HTTP by
prometheus_client's own server, whose thread hands every scrape to the event
loop so the daemon's state is only ever read on the loop.

Because everything is read and written on the loop, the event-time series are
plain counters and bucket arrays (:class:`_Hist`, :class:`_Counter`), not
prometheus_client's locked ones: a finished request costs a few increments,
which matters at thousands of requests per second.
"""

from __future__ import annotations

import asyncio
import logging
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from ..protocol import StatusSnapshot, Timings

log = logging.getLogger("sclsd.metrics")

# vLLM's latency buckets, from a millisecond (a zero-time engine) to minutes (a CPU model).
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                 2.5, 5.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
_STATES = ("active", "draining", "drained")


class _Hist:
    """A histogram updated on the event loop only (no lock)."""

    __slots__ = ("name", "doc", "bounds", "counts", "sum")

    def __init__(self, name: str, doc: str, buckets: Iterable[float]) -> None:
        self.name = name
        self.doc = doc
        self.bounds = tuple(float(b) for b in buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # Prometheus buckets are "less than or equal": the first bound >= value.
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def family(self) -> HistogramMetricFamily:
        cum = 0
        buckets = []
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            cum += n
            buckets.append((floatToGoString(bound), cum))
        return HistogramMetricFamily(self.name, self.doc, buckets=buckets, sum_value=self.sum)


class _Counter:
    """A counter (optionally with one label) updated on the event loop only."""

    __slots__ = ("name", "doc", "label", "values")

    def __init__(self, name: str, doc: str, label: str | None = None) -> None:
        self.name = name
        self.doc = doc
        self.label = label
        self.values: dict[str, float] = {}

    def inc(self, amount: float = 1.0, label: str = "") -> None:
        self.values[label] = self.values.get(label, 0.0) + amount

    def family(self) -> CounterMetricFamily:
        if self.label is None:
            return CounterMetricFamily(self.name, self.doc, value=self.values.get("", 0.0))
        fam = CounterMetricFamily(self.name, self.doc, labels=[self.label])
        for k, v in sorted(self.values.items()):
            fam.add_metric([k], v)
        return fam


class _Events:
    """Collector of the event-time series."""

    def __init__(self, series: list[_Hist | _Counter]) -> None:
        self.series = series

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Metric]:
        for s in self.series:
            yield s.family()


class _Gauges:
    """Scrape-time view of the pool, the scheduler and the workers, from the snapshot."""

    def __init__(self, snapshot: Callable[[], StatusSnapshot]) -> None:
        self.snapshot = snapshot

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Metric]:
        st = self.snapshot()
        yield GaugeMetricFamily("sclsd:num_requests_waiting", "Requests in the pool, waiting for a slice",
                                st.pool_size)
        yield GaugeMetricFamily("sclsd:num_requests_running", "Requests in batches on workers",
                                st.running_requests)
        yield GaugeMetricFamily("sclsd:num_queued_tokens", "Prompt tokens of live requests", st.queued_tokens)
        yield GaugeMetricFamily("sclsd:schedule_interval_seconds", "Current scheduling interval T",
                                st.interval_s)
        yield GaugeMetricFamily("sclsd:num_workers", "Registered workers", len(st.workers))
        yield GaugeMetricFamily("sclsd:num_connections", "Open client API connections", st.connections)
        yield GaugeMetricFamily("sclsd:partial_frame_bytes", "Bytes held in half-sent frames on the "
                                "client and status sockets", st.partial_frame_bytes)
        yield GaugeMetricFamily("sclsd:draining", "1 while the daemon drains (SIGTERM)", int(st.draining))
        yield GaugeMetricFamily("sclsd:serving", "1 while the daemon can serve (0: no workers left)",
                                int(st.serving))
        err = st.estimator_error
        yield GaugeMetricFamily("sclsd:estimator_abs_error_seconds",
                                "Mean |measured - estimated| batch time over recent batches",
                                err.mean_abs_error_s or 0.0)
        yield GaugeMetricFamily("sclsd:estimator_error_seconds",
                                "Mean (measured - estimated) batch time over recent batches",
                                err.mean_error_s or 0.0)
        events = CounterMetricFamily("sclsd:scheduler_events", "Scheduler counters (status counters)",
                                     labels=["event"])
        for k, v in sorted(st.counters.items()):
            events.add_metric([k], v)
        yield events
        load = GaugeMetricFamily("sclsd:worker_load_seconds", "Estimated queued work per worker",
                                 labels=["worker"])
        inflight = GaugeMetricFamily("sclsd:worker_batches_inflight", "Batches sent and not answered",
                                     labels=["worker"])
        queue = GaugeMetricFamily("sclsd:worker_queue_depth", "Batches in the worker's local queue "
                                  "(last heartbeat)", labels=["worker"])
        age = GaugeMetricFamily("sclsd:worker_heartbeat_age_seconds", "Seconds since the worker was "
                                "last heard from", labels=["worker"])
        state = GaugeMetricFamily("sclsd:worker_state", "1 for the worker's state", labels=["worker", "state"])
        batches = CounterMetricFamily("sclsd:worker_batches", "Batches served by the worker since it "
                                      "registered", labels=["worker"])
        tokens = CounterMetricFamily("sclsd:worker_generation_tokens", "Tokens generated by the worker "
                                     "since it registered", labels=["worker"])
        for w in st.workers:
            load.add_metric([w.id], w.load_s)
            inflight.add_metric([w.id], w.batches_inflight)
            queue.add_metric([w.id], w.queued_batches)
            age.add_metric([w.id], w.heartbeat_age_s)
            for name in _STATES:
                state.add_metric([w.id, name], int(name == w.state))
            batches.add_metric([w.id], w.batches_done)
            tokens.add_metric([w.id], w.tokens_done)
        yield from (load, inflight, queue, age, state, batches, tokens)


class _OnLoop:
    """A registry stand-in for the HTTP server's thread: each scrape runs on the loop."""

    def __init__(self, registry: CollectorRegistry, loop: asyncio.AbstractEventLoop) -> None:
        self.registry = registry
        self.loop = loop

    async def _collect(self) -> list[Metric]:
        return list(self.registry.collect())

    def collect(self) -> list[Metric]:
        # A stuck loop makes scrapes time out: the right signal for a monitor.
        return asyncio.run_coroutine_threadsafe(self._collect(), self.loop).result(timeout=10)

    def restricted_registry(self, names: list[str]) -> _OnLoop:
        return _Restricted(self, set(names))


class _Restricted(_OnLoop):
    def __init__(self, parent: _OnLoop, names: set[str]) -> None:
        super().__init__(parent.registry, parent.loop)
        self.names = names

    def collect(self) -> list[Metric]:
        out = []
        for m in super().collect():
            samples = [s for s in m.samples if s.name in self.names]
            if samples:
                m.samples = samples
                out.append(m)
        return out


class HttpServer:
    """prometheus_client's HTTP server thread, stoppable."""

    def __init__(self, server: Any, thread: Any, address: str) -> None:
        self.server = server
        self.thread = thread
        self.address = address

    def shutdown(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


class Metrics:
    """The daemon's Prometheus registry; the daemon calls the event methods below."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.refused_total = 0
        self.requests = _Counter("sclsd:request_success", "Finished requests by reason", "finished_reason")
        self.refusals = _Counter("sclsd:request_refused", "Requests refused by error code", "code")
        self.prompt_tokens = _Counter("sclsd:prompt_tokens", "Prompt tokens of finished requests")
        self.gen_tokens = _Counter("sclsd:generation_tokens", "Generated tokens")
        self.batches = _Counter("sclsd:batches", "Batches dispatched")
        self.ttft = _Hist("sclsd:time_to_first_token_seconds", "Time to first token", _LATENCY_BUCKETS)
        self.tpot = _Hist("sclsd:time_per_output_token_seconds", "Time per output token after the first",
                          _TPOT_BUCKETS)
        self.e2e = _Hist("sclsd:e2e_request_latency_seconds", "End-to-end request latency", _LATENCY_BUCKETS)
        self.queue = _Hist("sclsd:request_queue_time_seconds", "Time before the first dispatch",
                           _LATENCY_BUCKETS)
        self.req_prompt = _Hist("sclsd:request_prompt_tokens", "Prompt tokens per finished request",
                                _TOKEN_BUCKETS)
        self.req_gen = _Hist("sclsd:request_generation_tokens", "Generated tokens per finished request",
                             _TOKEN_BUCKETS)
        self.slices = _Hist("sclsd:request_slices", "Slices per finished request",
                            (1, 2, 3, 4, 6, 8, 12, 16, 32))
        self.batch_size = _Hist("sclsd:batch_size", "Requests per batch",
                                (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024))
        self.batch_time = _Hist("sclsd:batch_serve_seconds", "Measured serving time per batch",
                                _LATENCY_BUCKETS)
        self.registry.register(_Events([
            self.requests, self.refusals, self.prompt_tokens, self.gen_tokens, self.batches, self.ttft,
            self.tpot, self.e2e, self.queue, self.req_prompt, self.req_gen, self.slices, self.batch_size,
            self.batch_time]))

    def watch(self, snapshot: Callable[[], StatusSnapshot]) -> None:
        """Serve the gauges from ``snapshot`` (the status view), read at each scrape."""
        self.registry.register(_Gauges(snapshot))

    def refused(self, code: str) -> None:
        self.refused_total += 1
        self.refusals.inc(1, code)

    def dispatched(self, size: int) -> None:
        self.batches.inc()
        self.batch_size.observe(size)

    def batch_done(self, seconds: float) -> None:
        self.batch_time.observe(seconds)

    def finished(self, reason: str, prompt: int, out: int, t: Timings) -> None:
        self.requests.inc(1, reason)
        self.prompt_tokens.inc(prompt)
        self.gen_tokens.inc(out)
        self.req_prompt.observe(prompt)
        self.req_gen.observe(out)
        self.e2e.observe(t.e2e_s)
        self.queue.observe(t.queued_s)
        self.slices.observe(t.slices)
        if t.ttft_s is not None:
            self.ttft.observe(t.ttft_s)
            if out > 1:
                self.tpot.observe((t.e2e_s - t.ttft_s) / (out - 1))

    def exposition(self) -> str:
        return generate_latest(self.registry).decode()

    def serve_http(self, address: str, loop: asyncio.AbstractEventLoop) -> HttpServer:
        """Serve ``/metrics`` over HTTP on ``host:port`` (prometheus_client's server)."""
        from prometheus_client import start_http_server

        from ..config import parse_host_port

        host, port = parse_host_port(address)
        server, thread = start_http_server(port, addr=host, registry=_OnLoop(self.registry, loop))
        log.info("metrics over HTTP on http://%s:%d/metrics", host, server.server_port)
        return HttpServer(server, thread, f"{host}:{server.server_port}")
