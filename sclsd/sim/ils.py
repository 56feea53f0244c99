"""Iteration-level scheduling (continuous batching) baselines on the same cost and memory model.

Both baselines dispatch each arriving request to a worker round-robin (as
DeepSpeed-FastGen's and the paper's ILS do) and let every worker run
continuous batching over its own FCFS waiting queue. One *iteration* of a
worker:

1. **Admission**, FCFS with head-of-line blocking: waiting requests join the
   running set while memory allows (see below).
2. **Prefill** of the requests admitted in this iteration, as one ragged
   forward: ``T_prefill(k, mean L)`` for k newcomers (no padding: the same
   token count as their own prompts; a preempted request re-prefills its
   prompt plus what it had generated).
3. **Decode step** of the whole running set of n requests, newcomers
   included: ``tau_decode(mean l + 1, n)`` where l are the context lengths
   (no padding in paged / continuous engines). Every running request gets
   one token; the ones reaching their true length (EOS) or max_tokens leave.

The first token of a request comes when the prefill of its admission
iteration ends (tokens are streamed). Memory:

- ``ils-conservative`` (DeepSpeed-FastGen's conservative management, as the
  paper describes it): admit only when the KV of prompt + the whole
  remaining generation budget of every running request fits in the budget
  ζ · M_ava / Δ tokens. Nothing is ever preempted.
- ``ils-paged`` (vLLM): KV in blocks of ``block_size`` tokens allocated on
  demand; admit while the prompt's blocks fit with ``watermark`` of all
  blocks left free; when a decode step needs more blocks than are free,
  preempt the newest running request (recompute: free its blocks, put it back
  at the head of the queue with its generated tokens kept) until it fits.

An ``oom_event`` is a decode step whose cached tokens exceed the physical
capacity M_ava / Δ; by construction neither baseline has any.

Between events nothing but arithmetic happens, so each iteration is O(1):
the context sum and the paged block demand are kept incrementally.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from dataclasses import dataclass, field

from ..core.request import Request, State
from .cbsim import ARRIVAL, STEP_DONE, CBSimBase, StepClock
from .common import SimConfig, SimResult, progress_bar, record_of
from .workers import finish_reason, target_len
from .workload import Workload

_ARRIVAL, _DONE = ARRIVAL, STEP_DONE


@dataclass(slots=True, eq=False)
class _Running:
    """A request in a worker's running set since iteration ``t0``, with ``c0`` tokens cached then."""

    req: Request
    t0: int
    c0: int
    g0: int
    """Tokens generated before this admission."""
    first: float | None = None
    """When the prefill of its admission iteration ended (its first token of this run)."""


@dataclass(slots=True, eq=False)
class ILSWorker:
    """One continuous-batching worker."""

    wid: str
    waiting: deque[Request] = field(default_factory=deque)
    running: dict[str, _Running] = field(default_factory=dict)
    """Insertion order = admission order: the last one is the newest (preempted first)."""
    it: int = 0
    """Iterations run so far; a running request's context is c0 + (it - t0)."""
    ctx_base: int = 0
    """Σ (c0 - t0) over the running set, so Σ contexts = ctx_base + n · it."""
    reserved: int = 0
    """ils-conservative: tokens reserved for prompt + remaining budget of the running set."""
    used_blocks: int = 0
    phase: list[int] = field(default_factory=list)
    """ils-paged: running requests by (c0 - t0) mod block size; they need a block at step
    ``it`` when their context ``c0 + it - t0`` is a multiple of the block size."""
    finish: list[tuple[int, int, str]] = field(default_factory=list)
    """Heap of (iteration at which it finishes, seq, rid); stale entries skipped."""
    busy: bool = False
    new: list[_Running] = field(default_factory=list)
    """Admitted in the iteration under way (their first token comes when its prefill ends)."""
    first_at: float = 0.0
    """When the prefill of the iteration under way ends."""
    last_completion: float | None = None
    busy_time: float = 0.0
    clock: StepClock = field(default_factory=StepClock)
    """When each iteration ended: the times its running requests' tokens were streamed."""


class ILSSimulation(CBSimBase):
    """Continuous batching per worker, round-robin dispatch; see the module docstring."""

    def __init__(self, cfg: SimConfig, workload: Workload) -> None:
        if cfg.policy not in ("ils-conservative", "ils-paged"):
            raise ValueError(f"not a continuous-batching baseline: {cfg.policy!r}")
        super().__init__(cfg, workload)  # prefill_s includes recomputation after preemption
        self.paged = cfg.policy == "ils-paged"
        self.B = cfg.block_size
        self.total_blocks = self.budget // self.B
        self.watermark_blocks = int(cfg.watermark * self.total_blocks)
        self.workers = [ILSWorker(f"w{k}", phase=[0] * self.B) for k in range(cfg.workers)]
        self.preemptions = 0

    def run(self) -> SimResult:
        t_wall = time.perf_counter()
        for k, r in enumerate(self.requests):
            self._push(r.arrival, _ARRIVAL, (self.workers[k % len(self.workers)], r))
        bar = progress_bar(len(self.requests), self.cfg.progress, self.cfg.policy)
        events = 0
        heap = self._heap
        while heap:
            now, _, kind, obj = heapq.heappop(heap)
            events += 1
            if kind == _ARRIVAL:
                w, r = obj
                w.waiting.append(r)
                if not w.busy:
                    self._step(w, now)
            else:
                before = self._done
                self._end_step(obj, now)
                bar.update(self._done - before)
                self._step(obj, now)
        bar.close()
        left = [r.rid for r in self.requests if not r.state.terminal]
        if left:
            raise RuntimeError(f"simulation ended with {len(left)} unfinished requests")
        return SimResult(
            config=self.cfg,
            requests=[record_of(r) for r in self.requests],
            batches=self.stats,
            worker_completion={w.wid: w.last_completion for w in self.workers},
            oom_events=self.oom_events,
            preemptions=self.preemptions,
            events=events,
            wall_s=time.perf_counter() - t_wall,
            extra={
                "busy_s": {w.wid: w.busy_time for w in self.workers},
                "prefill_share": self.prefill_s / self.model_s if self.model_s else 0.0,
            },
        )

    # ------------------------------------------------------------------ memory

    def _reservation(self, r: Request) -> int:
        return r.input_len + (r.max_tokens - r.num_generated)

    def _fits(self, w: ILSWorker, r: Request) -> bool:
        if self.paged:
            need = -(-r.input_len // self.B)
            if not w.running:  # an idle worker always takes one request if it can hold it at all
                return need <= self.total_blocks
            return w.used_blocks + need + self.watermark_blocks <= self.total_blocks
        if not w.running:
            return True
        return w.reserved + self._reservation(r) <= self.budget

    def _admit(self, w: ILSWorker, r: Request, now: float) -> None:
        c0 = r.input_len
        run = _Running(r, w.it, c0, r.num_generated)
        w.running[r.rid] = run
        w.new.append(run)
        w.ctx_base += c0 - w.it
        if self.paged:
            w.used_blocks += -(-c0 // self.B)
            w.phase[(c0 - w.it) % self.B] += 1
        else:
            w.reserved += self._reservation(r)
        heapq.heappush(w.finish, (w.it + target_len(r) - r.num_generated, next(self._seq), r.rid))
        r.state = State.SCHEDULED
        r.worker = w.wid
        r.slices = 1  # no slices: a request's whole generation counts as one
        if r.first_dispatch is None:
            r.first_dispatch = now

    def _release(self, w: ILSWorker, run: _Running) -> None:
        """Take ``run`` out of the running set, freeing its memory; its tokens so far are kept."""
        r = run.req
        del w.running[r.rid]
        r.num_generated = run.g0 + (w.it - run.t0)
        w.clock.received(r.payload, run.t0, run.first)
        w.ctx_base -= run.c0 - run.t0
        if self.paged:
            w.used_blocks -= -(-(run.c0 + w.it - run.t0) // self.B)
            w.phase[(run.c0 - run.t0) % self.B] -= 1
        else:
            w.reserved -= run.c0 + (r.max_tokens - run.g0)

    # ------------------------------------------------------------------ iterations

    def _step(self, w: ILSWorker, now: float) -> None:
        """Start one iteration of ``w`` at ``now`` (or leave it idle when it has nothing to do)."""
        k, len_sum = 0, 0
        while w.waiting and self._fits(w, w.waiting[0]):
            r = w.waiting.popleft()
            self._admit(w, r, now)
            k += 1
            len_sum += r.input_len
        if not w.running:
            w.busy = False
            return
        if self.paged:
            self._ensure_blocks(w)
        self._time_step(w, now, k, len_sum)

    def _ensure_blocks(self, w: ILSWorker) -> None:
        """Find blocks for this decode step, preempting the newest requests if needed."""
        while True:
            need = w.phase[(-w.it) % self.B]
            if w.used_blocks + need <= self.total_blocks or len(w.running) <= 1:
                w.used_blocks += need
                return
            victim = w.running[next(reversed(w.running))]
            self._release(w, victim)
            if victim in w.new:
                w.new.remove(victim)
            victim.req.state = State.QUEUED
            victim.req.payload.preemptions += 1
            self.preemptions += 1
            w.waiting.appendleft(victim.req)

    def _end_step(self, w: ILSWorker, now: float) -> None:
        w.it += 1
        w.clock.ended(now)
        w.last_completion = now
        for fresh in w.new:
            fresh.first = w.first_at
            # Its prefill ran (after a preemption, a recompute of prompt + generated).
            fresh.req.payload.count_prefill(fresh.c0)
            if fresh.req.first_token is None:
                fresh.req.first_token = w.first_at
        w.new.clear()
        while w.finish and w.finish[0][0] <= w.it:
            _, _, rid = heapq.heappop(w.finish)
            run = w.running.get(rid)
            if run is None or run.t0 + target_len(run.req) - run.g0 != w.it:
                continue  # preempted since this entry was pushed
            self._release(w, run)
            r = run.req
            r.state = State.FINISHED
            r.finish_reason = finish_reason(r, r.num_generated)
            r.finished_at = now
            self._done += 1
