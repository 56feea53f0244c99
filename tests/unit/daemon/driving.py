"""The serving core driven synchronously: :class:`TimedDriver` is
:class:`~.test_core.Driver` plus what measuring durations on the fake clock takes;
:class:`WorkerDriver` (at the end) is :class:`~.test_core.Driver` plus what the streaming
and KV-reuse tests need of a worker (held results, releases and evictions reaching the
engine, any engine).

- A worker's queue: a batch waits from its arrival until the test serves it, and its
  result reports that wait as ``queue_wait_s`` (as a real worker does, and as the
  in-process transport does on the real clock).
- An engine that takes time: ``serve(..., run_s=...)`` starts the batches at ``now``
  (their streamed tokens reach the daemon then) and delivers their results ``run_s``
  later, the clock moved on to then.
- The metrics: every :class:`~sclsd.daemon.serving.effects.Effects` the driver runs goes
  to a real :class:`~sclsd.daemon.metrics.Metrics`, as the shell's ``deliver`` does, so a
  test reads the exported histograms (:func:`exported`).

Durations are differences of fake-clock readings: a test that moves the clock by binary
fractions (0.125, 0.25, ...) asserts them exactly, not as lower bounds.
"""

from __future__ import annotations

from collections.abc import Hashable
from pathlib import Path
from typing import Any

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from sclsd import protocol as P
from sclsd.daemon.metrics import Metrics, model_label
from sclsd.daemon.serving.effects import Effects, Ended

from .scrape import Samples
from .test_core import Driver


class TimedDriver(Driver):
    """A :class:`Driver` whose workers hold their batches until served, whose engines may
    take time, and whose effects reach a :class:`Metrics` (see the module docstring)."""

    def __init__(self, tmp: Path, **sections: dict[str, Any]) -> None:
        self.arrived: dict[int, float] = {}
        """Batch id -> when it reached its worker (fake clock), until a result reports it."""
        self.ended: list[Ended] = []
        """Every request's end as the core reported it to the metrics, in order."""
        self._started_at: float | None = None
        self._run_s = 0.0
        super().__init__(tmp, **sections)
        self.metrics = Metrics(model_label(self.core.cfg))

    def run(self, eff: Effects) -> Effects:
        """As :meth:`Driver.run`, noting when batches arrive and feeding the metrics what
        the shell would (the decoding's own effects come through here too, once each)."""
        for _, msg in eff.worker_messages():
            if isinstance(msg, P.BatchMsg):
                self.arrived.setdefault(msg.batch_id, self.now)
                self.metrics.dispatched(len(msg.requests))
        super().run(eff)
        for lost in eff.lost:
            self.metrics.worker_lost(lost.reason)
        for ended in eff.ended:
            self.ended.append(ended)
            self.metrics.ended(ended)
        for seconds in eff.batch_seconds:
            self.metrics.batch_done(seconds)
        return eff

    def serve(self, wid: str, *, stream: bool = False, result: bool = True,
              run_s: float = 0.0) -> list[P.BatchMsg]:
        """Serve ``wid``'s pending batches, started at ``now``: each one waited in the
        worker's queue since it arrived; their streamed tokens arrive at ``now``, their
        results ``run_s`` later (the clock is moved there)."""
        self._started_at, self._run_s = self.now, run_s
        try:
            return super().serve(wid, stream=stream, result=result)
        finally:
            self._started_at = None

    def message(self, wid: str, msg: P.WorkerMsg) -> Effects:
        if isinstance(msg, P.Result) and self._started_at is not None and msg.batch_id in self.arrived:
            waited = self._started_at - self.arrived.pop(msg.batch_id)
            msg = msgspec.structs.replace(msg, stats=msgspec.structs.replace(msg.stats, queue_wait_s=waited))
            self.now = self._started_at + self._run_s
        return super().message(wid, msg)


def exported(metrics: Metrics) -> Samples:
    """Every sample of ``metrics``' exposition, read back as Prometheus would: (name,
    labels) -> value (:func:`.scrape.value` picks one)."""
    out: Samples = {}
    for fam in text_string_to_metric_families(metrics.exposition()):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


class WorkerDriver(Driver):
    """A :class:`Driver` whose workers do what the in-process transport's workers do
    beyond serving, for the streaming and KV-reuse tests:

    - a worker's engine may be any :class:`FakeEngine` (``join(wid, engine=...)``);
    - ``release`` reaches the engine (its kept KV dropped), and a result reports the KV
      its engine evicted (``kv_evicted``), as a worker's does;
    - ``serve(..., hold=True)`` streams a batch's tokens and keeps its result until
      :meth:`finish`, as if the slice were still running;
    - :attr:`taken` keeps every batch as its worker's engine took it (rows whole);
    - ``submit(..., prompt_ids=[...])`` submits token ids rather than a prompt's text;
    - :meth:`until_done` serves one worker or several;
    - :meth:`counters` are the status's counters (scheduler and engines).
    """

    def __init__(self, tmp: Path, **sections: dict[str, Any]) -> None:
        self.held_results: dict[str, list[P.Result]] = {}
        """Per worker, the results ``serve(..., hold=True)`` kept back, in order."""
        self.taken: dict[str, list[P.BatchMsg]] = {}
        """Per worker, every batch its engine served, as it took it (rows whole), in order."""
        self._holding = False
        super().__init__(tmp, **sections)

    def submit(self, client: Hashable, rid: str, prompt: str = "hello", *,
               prompt_ids: list[int] | None = None, **fields: Any) -> Effects:
        """As :meth:`Driver.submit`; with ``prompt_ids`` the request is those token ids."""
        if prompt_ids is None:
            return super().submit(client, rid, prompt, **fields)
        fields.setdefault("max_tokens", 16)
        fields.setdefault("stream", False)
        gen = P.Generate(id=rid, prompt_ids=prompt_ids, temperature=0.0, **fields)
        return self.run(self.core.submit(client, 1000, gen, rid, list(prompt_ids), self.now))

    def run(self, eff: Effects) -> Effects:
        """As :meth:`Driver.run`; a ``release`` also drops the KV its worker's engine kept."""
        for wid, msg in eff.worker_messages():
            if isinstance(msg, P.Release) and wid in self.engines:
                self.engines[wid].release(msg.rids)
        return super().run(eff)

    def serve(self, wid: str, *, stream: bool = False, result: bool = True,
              hold: bool = False) -> list[P.BatchMsg]:
        """As :meth:`Driver.serve`; with ``hold`` the tokens stream and the results wait in
        :attr:`held_results` for :meth:`finish`."""
        self._holding = hold
        for b in self.batches(wid):
            whole = self.whole.get(b.batch_id)
            if isinstance(whole, P.BatchMsg):
                self.taken.setdefault(wid, []).append(whole)
        try:
            return super().serve(wid, stream=stream or hold, result=result)
        finally:
            self._holding = False

    def message(self, wid: str, msg: P.WorkerMsg) -> Effects:
        if isinstance(msg, P.Result) and wid in self.engines and not msg.kv_evicted:
            evicted = self.engines[wid].take_evicted()
            if evicted:
                msg = msgspec.structs.replace(msg, kv_evicted=evicted)
        if isinstance(msg, P.Result) and self._holding:
            self.held_results.setdefault(wid, []).append(msg)
            return Effects()
        return super().message(wid, msg)

    def finish(self, wid: str, n: int | None = None) -> int:
        """Deliver up to ``n`` of ``wid``'s held results (all by default); returns how many."""
        held = self.held_results.get(wid, [])
        take = held[: n if n is not None else len(held)]
        del held[: len(take)]
        for res in take:
            self.message(wid, res)
        return len(take)

    def until_done(self, client: Hashable, *rids: str, wid: str | tuple[str, ...] = "w0",
                   rounds: int = 50, stream: bool = False) -> None:
        """As :meth:`Driver.until_done`, serving the worker ``wid`` (or each of several, in
        order, every round), streaming its tokens with ``stream``."""
        wids = (wid,) if isinstance(wid, str) else wid
        for _ in range(rounds):
            if all(self.terminal(client, r) for r in rids):
                return
            self.now += 1.0
            self.step()
            for w in wids:
                self.serve(w, stream=stream)
        raise AssertionError(f"not done after {rounds} rounds: {rids}")

    def counters(self) -> dict[str, int]:
        """The daemon's counters as its status shows them (scheduler and engines)."""
        return {**self.core.sched.stats().as_counters(), **self.core.results.engines.as_counters()}
