"""Prometheus metrics of the daemon, named after vLLM's (``sclsd:`` prefix).

Counters and histograms are updated as events happen; gauges (and the
per-worker series) are read at scrape time from the status snapshot
(:class:`~sclsd.protocol.StatusSnapshot`, built in :mod:`.status`; the
collector is :mod:`.gauges`), so the status socket, ``sclsctl`` and Prometheus
show the same numbers. Every series carries ``model_name``, the name clients
ask for (``[http] model_name``, else ``[model] name``). The exposition is served
on the status socket (``metrics`` message) and, when ``daemon.metrics_http`` is
set, over HTTP by prometheus_client's own server, whose thread hands every
scrape to the event loop so the daemon's state is only ever read on the loop.

How requests end is counted apart: ``request_success`` (stop, length),
``request_cancelled`` (cancelled by the client or a disconnect, timed out),
``request_failed`` (an error); refusals at admission by error code and the
check that refused (``request_refused``). The per-request latency and size
histograms observe completed requests; time to first token every request that
got one; queue time every request a worker started, from acceptance to the
start of its first slice (the batch's dispatch plus the time it waited in the
worker's queue).

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
from typing import Any, get_args

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from ..config import Config
from ..protocol import LossReason, StatusSnapshot
from .gauges import SnapshotGauges
from .grammar import CAUSES, OUTCOMES
from .serving.effects import Ended

log = logging.getLogger("sclsd.metrics")

# vLLM's latency buckets, from a millisecond (a zero-time engine) to minutes (a CPU model).
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                 2.5, 5.0)
#: A stream's longest freeze: decode steps (tens of ms) up to whole slices queued behind others.
_GAP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
#: Finish reasons of a completed request (its output is whole); cancelled ones are counted apart.
_COMPLETED = ("stop", "length")
_CANCELLED = ("cancelled", "timeout")
#: Why requests fail: ``error`` (a ``done`` after too many failed batches), or the error code.
_FAILED = ("error", "shutdown", "no_workers", "internal")


def model_label(cfg: Config) -> str:
    """The ``model_name`` label: the name clients ask for (``[http] model_name``, else the
    daemon's model), as sclsd-http serves it from the same config."""
    return cfg.http.model_name or cfg.model.name


class _Hist:
    """A histogram updated on the event loop only (no lock)."""

    __slots__ = ("name", "doc", "bounds", "counts", "sum")

    def __init__(self, name: str, doc: str, buckets: Iterable[float]) -> None:
        self.name = name
        self.doc = doc
        self.bounds = tuple(float(b) for b in buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        """``count`` observations of ``value``."""
        # Prometheus buckets are "less than or equal": the first bound >= value.
        self.counts[bisect_left(self.bounds, value)] += count
        self.sum += value * count

    def family(self, model: str) -> HistogramMetricFamily:
        cum = 0
        buckets = []
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            cum += n
            buckets.append((floatToGoString(bound), cum))
        fam = HistogramMetricFamily(self.name, self.doc, labels=["model_name"])
        fam.add_metric([model], buckets, sum_value=self.sum)
        return fam


class _Counter:
    """A counter with fixed label names, updated on the event loop only. ``preset`` label
    values are exposed at 0 from the start, so a rate over them exists before the first event."""

    __slots__ = ("name", "doc", "labels", "values")

    def __init__(self, name: str, doc: str, *labels: str, preset: Iterable[str] = ()) -> None:
        self.name = name
        self.doc = doc
        self.labels = labels
        self.values: dict[tuple[str, ...], float] = {(v,): 0.0 for v in preset}

    def inc(self, amount: float = 1.0, *values: str) -> None:
        self.values[values] = self.values.get(values, 0.0) + amount

    def family(self, model: str) -> CounterMetricFamily:
        fam = CounterMetricFamily(self.name, self.doc, labels=["model_name", *self.labels])
        if not self.labels:
            fam.add_metric([model], self.values.get((), 0.0))
        for k, v in sorted(self.values.items()):
            if k:
                fam.add_metric([model, *k], v)
        return fam


class _Events:
    """Collector of the event-time series."""

    def __init__(self, series: list[_Hist | _Counter], model: str) -> None:
        self.series = series
        self.model = model

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Metric]:
        for s in self.series:
            yield s.family(self.model)


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

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        # process_cpu_seconds_total, RSS, open fds: kept last (see watch()), so that the
        # exposition (``sclsctl metrics | head``) starts with sclsd's own.
        self._process = ProcessCollector(registry=self.registry)
        self.refused_total = 0
        self.success = _Counter("sclsd:request_success", "Completed requests by finish reason (stop, "
                                "length)", "finished_reason", preset=_COMPLETED)
        self.cancelled = _Counter("sclsd:request_cancelled", "Requests ended before completion by "
                                  "their client (cancel, disconnect) or their timeout", "reason",
                                  preset=_CANCELLED)
        self.failed = _Counter("sclsd:request_failed", "Requests ended with an error, by reason "
                               "(error: its batch failed too often; else the error code)", "reason",
                               preset=_FAILED)
        self.refusals = _Counter("sclsd:request_refused", "Requests refused at admission, by error code "
                                 "and the check that refused", "code", "reason")
        self.prompt_tokens = _Counter("sclsd:prompt_tokens", "Prompt tokens of ended requests")
        self.gen_tokens = _Counter("sclsd:generation_tokens", "Tokens generated for ended requests")
        self.batches = _Counter("sclsd:batches", "Batches dispatched")
        self.worker_losses = _Counter("sclsd:worker_restarts", "Workers dropped, by reason (a spawned "
                                      "worker whose process ended or was killed restarts)", "reason",
                                      preset=get_args(LossReason))
        self.grammar_refusals = _Counter("sclsd:grammar_refusals", "Structured-output grammars refused "
                                         "at admission, by cause (timeout, memory, crash, invalid, limit)",
                                         "cause", preset=CAUSES)
        self.grammar_checks = _Counter("sclsd:grammar_checks", "Structured-output grammars at admission, by "
                                       "how they were answered: checked (a check ran for the request), "
                                       "cached, shared (it waited for another request's check); and checks "
                                       "retried (past grammar.quick_s) or stopped (nobody waited any more)",
                                       "outcome", preset=OUTCOMES)
        self.ttft = _Hist("sclsd:time_to_first_token_seconds", "Acceptance to the first token",
                          _LATENCY_BUCKETS)
        self.tpot = _Hist("sclsd:time_per_output_token_seconds", "Time per output token after the "
                          "first, per completed request", _TPOT_BUCKETS)
        self.gap = _Hist("sclsd:request_max_inter_token_gap_seconds", "Longest wait between two "
                         "consecutive deltas of a completed request (a stream's longest freeze)",
                         _GAP_BUCKETS)
        self.itl = _Hist("sclsd:inter_token_latency_seconds", "Time between two consecutive output "
                         "tokens reaching the daemon, per token (tokens that arrive together share "
                         "their wait)", _TPOT_BUCKETS)
        self.prefill_time = _Hist("sclsd:request_prefill_time_seconds", "Start of the first slice on a "
                                  "worker to the first token, per completed request", _LATENCY_BUCKETS)
        self.decode_time = _Hist("sclsd:request_decode_time_seconds", "First token to the last, per "
                                 "completed request", _LATENCY_BUCKETS)
        self.e2e = _Hist("sclsd:e2e_request_latency_seconds", "Acceptance to the end, per completed "
                         "request", _LATENCY_BUCKETS)
        self.queue = _Hist("sclsd:request_queue_time_seconds", "Acceptance to the start of the first "
                           "slice on a worker (dispatch plus the worker's queue)", _LATENCY_BUCKETS)
        self.req_prompt = _Hist("sclsd:request_prompt_tokens", "Prompt tokens per completed request",
                                _TOKEN_BUCKETS)
        self.req_gen = _Hist("sclsd:request_generation_tokens", "Generated tokens per completed request",
                             _TOKEN_BUCKETS)
        self.slices = _Hist("sclsd:request_slices", "Slices per completed request",
                            (1, 2, 3, 4, 6, 8, 12, 16, 32))
        self.batch_size = _Hist("sclsd:batch_size", "Requests per batch",
                                (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024))
        self.batch_time = _Hist("sclsd:batch_serve_seconds", "Measured serving time per batch",
                                _LATENCY_BUCKETS)
        self.registry.register(_Events([
            self.success, self.cancelled, self.failed, self.refusals, self.prompt_tokens,
            self.gen_tokens, self.batches, self.worker_losses, self.grammar_refusals,
            self.grammar_checks, self.ttft, self.tpot, self.itl, self.gap,
            self.prefill_time, self.decode_time, self.e2e, self.queue, self.req_prompt,
            self.req_gen, self.slices, self.batch_size, self.batch_time], model_name))

    def watch(self, snapshot: Callable[[], StatusSnapshot]) -> None:
        """Serve the gauges from ``snapshot`` (the status view), read at each scrape."""
        self.registry.register(SnapshotGauges(snapshot, self.model_name))
        self.registry.unregister(self._process)
        self.registry.register(self._process)

    def refused(self, code: str, reason: str) -> None:
        """A request refused with error ``code`` by the check ``reason`` (a bound, a field)."""
        self.refused_total += 1
        self.refusals.inc(1, code, reason)

    def grammar_refused(self, cause: str) -> None:
        """A request's grammar was refused for ``cause`` (:data:`.grammar.CAUSES`)."""
        self.grammar_refusals.inc(1, cause)

    def grammar_checked(self, outcome: str) -> None:
        """How a request's grammar was answered, or what became of a check (:data:`.grammar.OUTCOMES`)."""
        self.grammar_checks.inc(1, outcome)

    def dispatched(self, size: int) -> None:
        self.batches.inc()
        self.batch_size.observe(size)

    def worker_lost(self, reason: LossReason) -> None:
        """A worker was dropped for ``reason``."""
        self.worker_losses.inc(1, reason)

    def batch_done(self, seconds: float) -> None:
        self.batch_time.observe(seconds)

    def ended(self, e: Ended) -> None:
        """A request got its terminal event."""
        t = e.timings
        self.prompt_tokens.inc(e.prompt_tokens)
        self.gen_tokens.inc(e.completion_tokens)
        if e.started:
            self.queue.observe(t.queued_s)
        if t.ttft_s is not None:
            self.ttft.observe(t.ttft_s)
        for gap, n in e.token_gaps:
            self.itl.observe(gap / max(1, n), max(1, n))
        if e.reason in _CANCELLED:
            self.cancelled.inc(1, e.reason)
            return
        if e.reason not in _COMPLETED:
            self.failed.inc(1, e.code or "error")
            return
        self.success.inc(1, e.reason)
        self.req_prompt.observe(e.prompt_tokens)
        self.req_gen.observe(e.completion_tokens)
        self.e2e.observe(t.e2e_s)
        self.slices.observe(t.slices)
        if t.ttft_s is not None:
            self.prefill_time.observe(max(0.0, t.ttft_s - t.queued_s) if e.started else t.ttft_s)
            self.decode_time.observe(max(0.0, t.e2e_s - t.ttft_s))
        if t.ttft_s is not None and e.completion_tokens > 1:
            self.tpot.observe((t.e2e_s - t.ttft_s) / (e.completion_tokens - 1))
        if t.max_gap_s is not None:
            self.gap.observe(t.max_gap_s)

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
