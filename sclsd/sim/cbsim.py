"""What the continuous-batching simulations share (``ils-*`` and ``scls-cb``): the event
heap, the noise, the counters, and the timing of one iteration of a worker's batch."""

from __future__ import annotations

import heapq
import itertools
from typing import Any, Protocol

from ..eval.metrics import BatchStats
from .common import SimConfig, make_requests
from .workers import Noise
from .workload import Workload

#: Event kinds on the heap.
ARRIVAL, STEP_DONE = 0, 1


class StepWorker(Protocol):
    """The fields of a worker that one iteration's timing reads and sets."""

    running: Any
    ctx_base: int
    it: int
    first_at: float
    busy: bool
    busy_time: float


class CBSimBase:
    """Event loop state and iteration timing for workers that run continuous batching."""

    def __init__(self, cfg: SimConfig, workload: Workload) -> None:
        self.cfg = cfg
        self.est = cfg.profile.estimator
        self.budget = int(cfg.kv_token_budget)
        self.capacity = cfg.kv_token_capacity
        self.requests = make_requests(workload, cfg.max_gen)
        self.noise = Noise(cfg.noise, cfg.seed)
        self.stats = BatchStats()
        self.oom_events = 0
        self.model_s = 0.0  # noise-free serving seconds, all workers
        self.prefill_s = 0.0  # ... of which prefill
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = itertools.count()
        self._done = 0
        # Time-weighted KV counters: Σ over iterations of (tokens × the iteration's seconds).
        self.step_s = 0.0
        self.kv_used_s = 0.0
        #: Noise-free seconds by term of the cost model, all workers: what a policy spends on.
        self.cost_s = {"decode_kv": 0.0, "decode_rows": 0.0, "decode_fixed": 0.0,
                       "prefill_tokens": 0.0, "prefill_fixed": 0.0}

    def kv_frac(self, token_s: float) -> float:
        """Σ (KV tokens × seconds) over busy iterations as a time-average share of the budget."""
        return token_s / (self.step_s * self.budget) if self.step_s and self.budget else 0.0

    def counters(self) -> dict[str, Any]:
        """What a run spent its memory and time on: ``kv_used_frac`` (KV of the running rows,
        averaged over busy iterations, as a share of the budget) and ``cost_s`` (model
        seconds by term of the cost model, all workers, noise left out)."""
        return {"kv_used_frac": self.kv_frac(self.kv_used_s), "cost_s": dict(self.cost_s)}

    def _push(self, t: float, kind: int, obj: Any) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, obj))

    def _time_step(self, w: StepWorker, now: float, k: int, len_sum: int) -> float:
        """Start one iteration of ``w``'s batch: one decode step for its running requests,
        plus a ragged prefill of the ``k`` newcomers (``len_sum`` tokens in all); returns its seconds."""
        n = len(w.running)
        ctx = w.ctx_base + n * w.it  # Σ contexts before this step's token
        if ctx + n > self.capacity:
            self.oom_events += 1
        t = self.est.tau_decode(ctx / n + 1, n)
        e, c = self.est, self.cost_s
        c["decode_kv"] += (e.d1 * n + e.d3) * (ctx / n + 1)
        c["decode_rows"] += e.d2 * n
        c["decode_fixed"] += e.d4
        pre = 0.0
        if k:
            pre = self.est.t_prefill(k, len_sum / k)
            c["prefill_tokens"] += e.p1 * len_sum + e.p3 * len_sum / k
            c["prefill_fixed"] += e.p2 * k + e.p4
            t += pre
            self.prefill_s += pre
        self.model_s += t
        factor = self.noise()
        t *= factor
        w.first_at = now + pre * factor
        self.stats.add(n)
        w.busy = True
        w.busy_time += t
        self._push(now + t, STEP_DONE, w)
        self.step_s += t
        self.kv_used_s += (ctx + n) * t  # the KV this step's decode holds
        return t
