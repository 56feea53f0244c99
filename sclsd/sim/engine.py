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
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from ..bench.metrics import SLO, BatchStats, RequestRecord, summarize
from ..core.policy import DEFAULT_GAMMA, POLICIES, Policy, make_policy
from ..core.profiles import Profile
from ..core.request import Request
from ..core.scheduler import Batch, BatchOutcome, Scheduler
from .oracle import make_oracle_policy
from .workers import Noise, Served, SimPayload, SimWorker, serve_ragged, serve_static
from .workload import Workload

#: Continuous-batching baselines (sclsd.sim.ils) and the oracle, beside core's policies.
BASELINES = ("ils-conservative", "ils-paged", "oracle")
ALL_POLICIES = POLICIES + BASELINES

_ARRIVAL, _DONE, _TICK = 0, 1, 2


@dataclass
class SimConfig:
    """Everything a run needs besides the workload."""

    policy: str
    profile: Profile
    workers: int = 8
    slice_len: int = 128
    max_gen: int = 1024
    max_input: int = 1024
    """Input cap of the workload (bounds the totals of a rule table)."""
    batch_size: int = 16
    gamma: float | None = None
    """Minimal scheduling interval Γ; None takes the profile's ``gamma_s`` (else core's default)."""
    lam: float = 0.5
    zeta: float = 0.9
    noise: float = 0.0
    seed: int = 0
    block_size: int = 16
    """ils-paged: tokens per KV block."""
    watermark: float = 0.01
    """ils-paged: fraction of blocks kept free when admitting (vLLM's default)."""
    progress: bool = False

    def __post_init__(self) -> None:
        if self.policy not in ALL_POLICIES:
            raise ValueError(
                f"unknown policy {self.policy!r}; choose one of {', '.join(ALL_POLICIES)}"
            )
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")

    @property
    def gamma_s(self) -> float:
        if self.gamma is not None:
            return self.gamma
        return self.profile.gamma_s if self.profile.gamma_s is not None else DEFAULT_GAMMA

    @property
    def kv_token_budget(self) -> float:
        """KV tokens a worker may fill: the continuous engines' and the oracle's budget.

        ζ · M_ava / Δ under the KV model. A profile with a rule table (DeepSpeed)
        says instead how many padded rows fit at each total length; the budget
        is then the most tokens the table lets one batch hold (for the paper's
        table, 12 rows × 2048 = 24,576), since M_ava / Δ overstates what that
        engine can use (the paper: eq. 8 fails for DS whatever ζ).
        """
        rules = self.profile.rules
        if rules is not None:
            return float(rules_token_budget(rules.rules, self.max_input + self.max_gen))
        return self.zeta * self.profile.mem_available / self.profile.kv_bytes_per_token

    @property
    def kv_token_capacity(self) -> float:
        """KV tokens that physically fit; above it a worker runs out of memory.

        M_ava / Δ (no safety factor) under the KV model; the table's budget for a rule table.
        """
        if self.profile.rules is not None:
            return self.kv_token_budget
        return self.profile.mem_available / self.profile.kv_bytes_per_token


def rules_token_budget(rules: tuple[tuple[int, int], ...], max_total: int) -> int:
    """Most tokens one batch may hold under a rule table ``((min_total_len, max_batch), ...)``.

    Rule k covers totals in (min_k, upper_k], upper_k being the next rule's
    threshold (``max_total`` for the top one); it allows max_batch_k · upper_k tokens.
    """
    best, upper = 0, max_total
    for min_len, limit in sorted(rules, reverse=True):
        if min_len < upper:
            best = max(best, limit * upper)
            upper = min_len
    return best


@dataclass
class SimResult:
    """Per-request records and per-run counters of one simulation."""

    config: SimConfig
    requests: list[RequestRecord]
    batches: BatchStats
    worker_completion: dict[str, float | None]
    oom_events: int = 0
    preemptions: int = 0
    events: int = 0
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self, slo: SLO | None = None) -> dict[str, Any]:
        """The shared metrics (:func:`sclsd.bench.metrics.summarize`) plus run counters."""
        out: dict[str, Any] = summarize(
            self.requests,
            self.batches,
            worker_completion=self.worker_completion,
            oom_events=self.oom_events,
            slo=slo,
        )
        out["preemptions"] = self.preemptions
        out["events"] = self.events
        out["wall_s"] = self.wall_s
        out.update(self.extra)
        return out


def make_requests(workload: Workload, max_gen: int) -> list[Request]:
    """One scheduler request per workload entry; the true length hides in the payload."""
    return [
        Request(
            rid=f"r{i}",
            prompt_len=int(L),
            max_tokens=max_gen,
            arrival=float(t),
            payload=SimPayload(true_len=int(out)),
        )
        for i, (t, L, out) in enumerate(
            zip(
                workload.arrival.tolist(),
                workload.input_len.tolist(),
                workload.output_len.tolist(),
                strict=True,
            )
        )
    ]


def record_of(r: Request) -> RequestRecord:
    p: SimPayload = r.payload
    return RequestRecord(
        rid=r.rid,
        arrival=r.arrival,
        prompt_len=r.prompt_len,
        output_len=r.num_generated,
        first_token=r.first_token,
        finished=r.finished_at,
        finish_reason=r.finish_reason,
        slices=r.slices,
        pad_tokens=p.pad_tokens,
        invalid_tokens=p.invalid_tokens,
        preemptions=p.preemptions,
    )


def progress_bar(total: int, enabled: bool, desc: str) -> Any:
    """A tqdm bar over completed requests, or a no-op stand-in."""
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="req", desc=desc, mininterval=0.5, leave=False)


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


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
