"""The discrete-event simulator: the daemon's scheduler on a virtual clock.

Events sit in one heap ordered by (time, sequence): request arrivals,
scheduling ticks at ``sched.next_at`` and batch completions. After every
event the loop asks the scheduler ``due(now)`` and, when it is, runs
``schedule(now)`` and hands each batch to its worker's FIFO queue — exactly
what the daemon does with a real clock. A completion feeds
``on_result(outcome, now)`` and starts the worker's next batch.

The policies of the ablation ladder (sls, so, pm, ab, lb, scls) and the
oracle run here; the continuous-batching baselines have their own loop in
:mod:`sclsd.sim.ils` because they bypass the slice scheduler by definition.
The settings and the result of a run are in :mod:`sclsd.sim.common`.
"""

from __future__ import annotations

import heapq
import itertools
import time
from typing import Any

from ..core.policy import Policy, make_policy
from ..core.scheduler import Batch, BatchOutcome, Scheduler
from ..eval.metrics import BatchStats
from .common import SimConfig, SimResult, make_requests, progress_bar, record_of
from .oracle import make_oracle_policy
from .workers import Noise, Served, SimPayload, SimWorker, serve_ragged, serve_static
from .workload import Workload

_ARRIVAL, _DONE, _TICK = 0, 1, 2


class StaticSimulation:
    """Slice-level (and sequence-level) scheduling: core's Scheduler, cost-model workers."""

    def __init__(self, cfg: SimConfig, workload: Workload, policy: Policy | None = None) -> None:
        self.cfg = cfg
        prof = cfg.profile
        self.est = prof.estimator
        if policy is None:
            if cfg.policy == "oracle":
                policy = make_oracle_policy(
                    self.est,
                    token_budget=cfg.kv_token_budget,
                    max_gen=cfg.max_gen,
                    gamma=cfg.gamma_s,
                    lam=cfg.lam,
                )
            else:
                policy = make_policy(
                    cfg.policy,
                    slice_len=cfg.slice_len,
                    max_gen=cfg.max_gen,
                    batch_size=cfg.batch_size,
                    gamma=cfg.gamma_s,
                    lam=cfg.lam,
                )
        self.ragged = cfg.policy == "oracle"
        self.sched = Scheduler(policy, prof.cost(cfg.zeta))
        # The physical memory: the same predicate with no safety margin (ζ = 1).
        self.real_mem = prof.cost(zeta=1.0)
        self.workers = {f"w{k}": SimWorker(f"w{k}") for k in range(cfg.workers)}
        for wid in self.workers:
            self.sched.add_worker(wid)
        self.requests = make_requests(workload, cfg.max_gen)
        self.noise = Noise(cfg.noise, cfg.seed)
        self.stats = BatchStats()
        self.oom_events = 0
        self.model_s = 0.0  # noise-free serving seconds, all workers
        self.prefill_s = 0.0  # ... of which prefill (re-prefills of later slices included)
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = itertools.count()

    def _push(self, t: float, kind: int, obj: Any) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, obj))

    def run(self) -> SimResult:
        t0 = time.perf_counter()
        sched = self.sched
        for r in self.requests:
            self._push(r.arrival, _ARRIVAL, r)
        bar = progress_bar(len(self.requests), self.cfg.progress, self.cfg.policy)
        events = 0
        tick_at = float("-inf")
        heap = self._heap
        while heap:
            now, _, kind, obj = heapq.heappop(heap)
            events += 1
            if kind == _ARRIVAL:
                sched.add(obj, now)
            elif kind == _DONE:
                bar.update(self._complete(obj, now))
            if sched.due(now):
                for batch in sched.schedule(now):
                    self._dispatch(batch, now)
                if sched.next_at != tick_at:
                    # One pending tick per round: a round that finds the pool empty pushes none,
                    # and the next arrival then schedules at once (as the daemon does).
                    tick_at = sched.next_at
                    self._push(tick_at, _TICK, None)
        bar.close()
        if sched.live:  # every request completes, or the simulator has a bug
            raise RuntimeError(f"simulation ended with {len(sched.live)} live requests")
        return SimResult(
            config=self.cfg,
            requests=[record_of(r) for r in self.requests],
            batches=self.stats,
            worker_completion={w: s.last_completion for w, s in self.workers.items()},
            oom_events=self.oom_events,
            events=events,
            wall_s=time.perf_counter() - t0,
            extra={
                "busy_s": {w: s.busy_time for w, s in self.workers.items()},
                "prefill_share": self.prefill_s / self.model_s if self.model_s else 0.0,
            },
        )

    # ------------------------------------------------------------------ workers

    def _dispatch(self, batch: Batch, now: float) -> None:
        w = self.workers[batch.worker]  # type: ignore[index]
        w.queue.append(batch)
        if not w.busy:
            self._start(w, now)

    def _start(self, w: SimWorker, now: float) -> None:
        batch = w.queue.popleft()
        served = serve_ragged(batch, self.est) if self.ragged else serve_static(batch, self.est)
        if self._would_oom(batch, served):
            self.oom_events += 1
        self.model_s += served.time
        self.prefill_s += served.prefill
        elapsed = served.time * self.noise()
        w.busy = True
        w.busy_time += elapsed
        self._push(now + elapsed, _DONE, (w, batch, served, elapsed))

    def _would_oom(self, batch: Batch, served: Served) -> bool:
        if self.ragged:
            return served.kv_tokens > self.cfg.kv_token_capacity
        return self.real_mem.oom(batch.size, batch.input_len, served.iterations)

    def _complete(self, item: tuple[SimWorker, Batch, Served, float], now: float) -> int:
        w, batch, served, elapsed = item
        w.busy = False
        w.last_completion = now
        for r, pad, inv in zip(batch.requests, served.pad, served.invalid, strict=True):
            p: SimPayload = r.payload
            p.pad_tokens += pad
            p.invalid_tokens += inv
        self.stats.add(batch.size, served.early_return)
        done = self.sched.on_result(BatchOutcome(batch.bid, served.rows, elapsed=elapsed), now)
        if w.queue:
            self._start(w, now)
        return len(done)


def simulate(cfg: SimConfig, workload: Workload) -> SimResult:
    """Run one simulation of ``cfg.policy`` on ``workload`` until every request completes."""
    if cfg.policy.startswith("ils-"):
        from .ils import ILSSimulation

        return ILSSimulation(cfg, workload).run()
    return StaticSimulation(cfg, workload).run()
