"""What the continuous-batching simulations share (``ils-*`` and ``scls-cb``): the event
heap, the noise, the counters, and the timing of one iteration of a worker's batch."""

from __future__ import annotations

import heapq
import itertools
from bisect import bisect_left
from typing import Any, Protocol

from ..eval.metrics import BatchStats
from .common import SimConfig, make_requests
from .workers import Noise, SimPayload
from .workload import Workload

#: Event kinds on the heap.
ARRIVAL, STEP_DONE = 0, 1


class StepClock:
    """When each iteration of one worker ended, and the longest interval between two
    consecutive ends over any range that reaches the latest iteration, in O(log n).

    A request's run of tokens on a continuous-batching worker (from its admission or
    grant to its end, preemption or grant end) gets one token per iteration, so the
    longest gap inside the run is the longest interval between consecutive iteration
    ends over the run, and a run always ends at the latest iteration. A stack of the
    intervals that no later interval is as long as answers that in a binary search
    (each interval enters and leaves it once).
    """

    __slots__ = ("ends", "_idx", "_gap")

    def __init__(self) -> None:
        self.ends: list[float] = []
        """``ends[i]``: when iteration i ended."""
        self._idx: list[int] = []
        self._gap: list[float] = []

    def ended(self, t: float) -> None:
        """The next iteration ended at ``t``."""
        i = len(self.ends)
        if i:
            g = t - self.ends[-1]
            while self._gap and self._gap[-1] <= g:
                self._gap.pop()
                self._idx.pop()
            self._idx.append(i)
            self._gap.append(g)
        self.ends.append(t)

    def longest_since(self, a: int) -> float | None:
        """max of ``ends[i] - ends[i-1]`` over i in [a, latest] (None: an empty range)."""
        k = bisect_left(self._idx, max(a, 1))
        return self._gap[k] if k < len(self._idx) else None

    def received(self, p: SimPayload, t0: int, first: float | None) -> None:
        """A run of one token per iteration from iteration ``t0`` to the latest reached the
        client (``p.received``). ``first``: when the prefill of iteration ``t0`` ended, if
        the run began with one (its first token comes then, the next at the end of
        iteration ``t0 + 1``); otherwise each token comes at its iteration's end."""
        it = len(self.ends)
        if it <= t0:
            return  # preempted before its first iteration ran
        if first is None:
            p.received(self.ends[t0], self.ends[it - 1], self.longest_since(t0 + 1))
        elif it == t0 + 1:
            p.received(first, first, None)
        else:
            rest = self.longest_since(t0 + 2)
            into = self.ends[t0 + 1] - first
            p.received(first, self.ends[it - 1], into if rest is None else max(into, rest))


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
