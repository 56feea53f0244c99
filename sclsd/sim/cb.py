"""Slice grants on continuous-batching workers (``scls-cb``) on the shared cost and memory model.

Core's :class:`~sclsd.core.grants.GrantPolicy` decides; this loop plays the
workers. Each worker runs continuous batching as in :mod:`sclsd.sim.ils` (one
iteration: admit what was granted to it, one ragged prefill of the admitted
requests that need one, one decode step of the whole running set), but it
admits only the policy's grants: a request runs at most S iterations per
grant, then returns to the policy, which re-grants it where it is (its KV
kept: it joins the next iteration with no prefill) or on another worker
(where it re-prefills prompt plus generated tokens), or queues it when no
worker has room (its KV then dropped). The grant round trip costs no time
here; the next iteration of its worker already runs the new grant.

Counters beside the usual metrics: ``preemptions`` (none by construction),
``oom_events`` (decode steps whose cached tokens exceed M_ava / Δ; none),
``migrations`` (grants that moved a request away from its KV), ``kv_drops``
(parked KV the policy gave up because its idle worker could fit none of its
parked requests: they re-prefill elsewhere), ``max_reserved_frac`` (the
largest Σ reservations / budget seen on any worker at any step; at most 1),
``grants``, the time-averaged shares of the budget that running rows use
(``kv_used_frac``), that is reserved (``kv_reserved_frac``) and that parked
requests keep (``kv_parked_frac``), and ``cost_s``, the model seconds by term
of the cost model (see :meth:`~sclsd.sim.cbsim.CBSimBase.counters`).
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

from ..core.grants import Grant, GrantPolicy, GrantRules
from ..core.request import Request, State
from .cbsim import ARRIVAL, STEP_DONE, CBSimBase, StepClock
from .common import SimConfig, SimResult, progress_bar, record_of
from .workers import finish_reason, target_len
from .workload import Workload

_ARRIVAL, _DONE = ARRIVAL, STEP_DONE


@dataclass(slots=True, eq=False)
class _Running:
    """A granted request in a worker's running set since iteration ``t0`` with ``c0`` tokens cached."""

    req: Request
    t0: int
    c0: int
    g0: int
    end: int
    """Iteration at which its grant ends (granted tokens or its true length)."""
    reserve: int
    first: float | None = None
    """When the prefill of its first iteration ended, if the grant began with one."""


@dataclass(slots=True, eq=False)
class CBWorker:
    wid: str
    pending: list[tuple[Request, Grant]] = field(default_factory=list)
    running: dict[str, _Running] = field(default_factory=dict)
    it: int = 0
    ctx_base: int = 0
    """Σ (c0 - t0) over the running set, so Σ contexts = ctx_base + n · it."""
    reserved: int = 0
    ends: list[tuple[int, int, str]] = field(default_factory=list)
    busy: bool = False
    new: list[_Running] = field(default_factory=list)
    first_at: float = 0.0
    last_completion: float | None = None
    busy_time: float = 0.0
    clock: StepClock = field(default_factory=StepClock)
    """When each iteration ended: the times its running requests' tokens were streamed."""


class CBSimulation(CBSimBase):
    """``scls-cb``: see the module docstring."""

    def __init__(self, cfg: SimConfig, workload: Workload, rules: GrantRules | None = None) -> None:
        """``rules``: the grant policy's (default :class:`~sclsd.core.grants.GrantRules`)."""
        if cfg.policy != "scls-cb":
            raise ValueError(f"not a slice-grant policy: {cfg.policy!r}")
        super().__init__(cfg, workload)
        self.workers = {f"w{k}": CBWorker(f"w{k}") for k in range(cfg.workers)}
        self.policy = GrantPolicy(self.est, cfg.slice_len, self.budget, self.workers, rules=rules)
        self.by_rid = {r.rid: r for r in self.requests}
        self.grants = 0
        self.max_reserved_frac = 0.0
        self.kv_reserved_s = 0.0
        self.kv_parked_s = 0.0
        self.round_s: list[float] | None = None
        """Set to a list to collect the wall seconds of every grant round (the policy's
        schedule() calls that had something to decide)."""

    def run(self) -> SimResult:
        t_wall = time.perf_counter()
        for r in self.requests:
            self._push(r.arrival, _ARRIVAL, r)
        bar = progress_bar(len(self.requests), self.cfg.progress, self.cfg.policy)
        events = 0
        heap = self._heap
        while heap:
            now, _, kind, obj = heapq.heappop(heap)
            events += 1
            if kind == _ARRIVAL:
                r = obj
                self.policy.arrive(r.rid, r.input_len, r.max_tokens - r.num_generated)
                self._dispatch(now)
            else:
                before = self._done
                self._end_step(obj, now)
                bar.update(self._done - before)
                self._dispatch(now)
                if not obj.busy:
                    self._step(obj, now)
        bar.close()
        left = [r.rid for r in self.requests if not r.state.terminal]
        if left:
            raise RuntimeError(f"simulation ended with {len(left)} unfinished requests")
        return SimResult(
            config=self.cfg,
            requests=[record_of(r) for r in self.requests],
            batches=self.stats,
            worker_completion={w.wid: w.last_completion for w in self.workers.values()},
            oom_events=self.oom_events,
            preemptions=0,
            events=events,
            wall_s=time.perf_counter() - t_wall,
            extra={
                "busy_s": {w.wid: w.busy_time for w in self.workers.values()},
                "prefill_share": self.prefill_s / self.model_s if self.model_s else 0.0,
                "migrations": self.policy.migrations,
                "grants": self.grants,
                "kv_drops": self.policy.drops,
                "max_reserved_frac": self.max_reserved_frac,
                **self.counters(),
                "kv_reserved_frac": self.kv_frac(self.kv_reserved_s),
                "kv_parked_frac": self.kv_frac(self.kv_parked_s),
            },
        )

    # ------------------------------------------------------------------ grants

    def _dispatch(self, now: float) -> None:
        """Apply the policy's grants; start the idle workers that got some."""
        if self.round_s is None:
            grants = self.policy.schedule()
        else:
            rounds, t0 = self.policy.rounds, time.perf_counter()
            grants = self.policy.schedule()
            if self.policy.rounds > rounds:
                self.round_s.append(time.perf_counter() - t0)
        self.policy.take_evictions()  # KV outside the running set is not modelled
        for g in grants:
            r = self.by_rid[g.rid]
            self.workers[g.worker].pending.append((r, g))
            r.state = State.SCHEDULED
            r.worker = g.worker
            r.slices += 1
            if r.first_dispatch is None:
                r.first_dispatch = now
        self.grants += len(grants)
        for wid in {g.worker for g in grants}:
            w = self.workers[wid]
            if not w.busy:
                self._step(w, now)

    # ------------------------------------------------------------------ iterations

    def _step(self, w: CBWorker, now: float) -> None:
        k, len_sum = 0, 0
        for r, g in w.pending:
            gen = r.num_generated
            run = _Running(r, w.it, g.context, gen, w.it + min(g.tokens, target_len(r) - gen), g.reserve)
            w.running[r.rid] = run
            w.ctx_base += g.context - w.it
            w.reserved += g.reserve
            heapq.heappush(w.ends, (run.end, next(self._seq), r.rid))
            if g.prefill:
                w.new.append(run)
                k += 1
                len_sum += g.prefill
        w.pending.clear()
        if not w.running:
            w.busy = False
            return
        booked = max(w.reserved, self.policy.reserved(w.wid))  # the policy adds parked KV
        self.max_reserved_frac = max(self.max_reserved_frac, booked / self.budget)
        t = self._time_step(w, now, k, len_sum)
        self.kv_reserved_s += booked * t
        self.kv_parked_s += self.policy.parked(w.wid) * t

    def _end_step(self, w: CBWorker, now: float) -> None:
        w.busy = False
        w.it += 1
        w.clock.ended(now)
        w.last_completion = now
        for fresh in w.new:
            fresh.first = w.first_at
            fresh.req.payload.count_prefill(fresh.c0)
            if fresh.req.first_token is None:
                fresh.req.first_token = w.first_at
        w.new.clear()
        while w.ends and w.ends[0][0] <= w.it:
            _, _, rid = heapq.heappop(w.ends)
            run = w.running.pop(rid)
            r = run.req
            r.num_generated = run.g0 + (w.it - run.t0)
            w.clock.received(r.payload, run.t0, run.first)
            w.ctx_base -= run.c0 - run.t0
            w.reserved -= run.reserve
            reason = finish_reason(r, r.num_generated)
            if reason is not None:
                if r.state.terminal:
                    raise RuntimeError(f"{rid} finished twice")
                r.state = State.FINISHED
                r.finish_reason = reason
                r.finished_at = now
                self._done += 1
                self.policy.end(rid, r.input_len, 0)
            else:
                r.state = State.QUEUED
                self.policy.end(rid, r.input_len, r.max_tokens - r.num_generated)
