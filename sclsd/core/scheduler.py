"""The slice scheduler: rounds of batches over the pool, placed on workers, at an interval.

Driven identically by the daemon (real clock) and the simulator (virtual
clock)::

    sched.add(req, now)
    if sched.due(now):
        round = sched.schedule(now)         # a Round: batches (worker set) and releases
        release(round.releases)             # KV left behind by requests that moved
        for batch in round.batches:
            send(batch)
    applied = sched.on_result(outcome, now) # ended requests, re-queued ones, releases
    release(applied.releases)

What to batch, where to send it and when to schedule next are decided by the
:class:`~sclsd.core.policy.Policy`; this module is only the mechanism of its
rounds (the pool, workers and outcomes are :mod:`sclsd.core.mechanism`'s).
It implements :class:`~sclsd.core.scheduler_api.SchedulerInterface`, as the
slice-grant scheduler does.

**No stalls** (``Policy.max_slice_gap_s``, off by default in the core, so the
paper's rounds reproduce): a request that has had a slice is streaming, and its
client sees nothing between the end of one slice and the first token of the
next. With the bound ``B`` on, rounds place streaming requests before requests
that have not started, and a streaming request is *due* once the wait for its
next slice would exceed ``B``: when ``pooled_at + B`` falls before the least
loaded active worker could take it (``now + min load``). A due request goes
into the next dispatch: the paper's rounds run at that time whatever the interval
(placing the pool on the workers' queues, streaming requests ahead);
work-conserving rounds, which come at every slice end, start due requests
first, on an idle worker even when a busy one holds their KV. Placing due
requests alone on busy workers' queues was tried and left out: batched
apart from the rest of the pool they made smaller batches and cost 15-30 %
of throughput in the simulator.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable
from typing import TYPE_CHECKING

from .batch import Batch, BatchOutcome, RowOutcome
from .decisions import Releases, Round, releases_of
from .kvreuse import KVLedger
from .mechanism import SchedulerMechanism
from .request import Request
from .rounds import one_each, plan_round, streaming_first
from .scheduler_api import SchedulerStats, WorkerState

if TYPE_CHECKING:
    from .interfaces import CostModel
    from .policy import Policy

# Batch and its outcomes are defined in .batch, WorkerState in .stats; they are part of
# this module's API too.
__all__ = ["Batch", "BatchOutcome", "RowOutcome", "Scheduler", "WorkerState"]


#: A work-conserving round whose batcher answers with more than this many batches per
#: idle worker places them all (the paper's round): one DP places the backlog instead of
#: one DP per slice end starting a batch each (thousands of requests, zero-time workers).
BACKLOG_BATCHES_PER_IDLE = 8


class Scheduler(SchedulerMechanism[SchedulerStats]):
    """Slice-level scheduler over a pool of requests and a set of workers."""

    def __init__(
        self,
        policy: Policy,
        cost: CostModel,
        *,
        max_failures: int = 3,
        history: int = 64,
        max_worker_losses: int = 0,
    ) -> None:
        super().__init__(policy, max_failures=max_failures, history=history, stats=SchedulerStats(),
                         max_worker_losses=max_worker_losses)
        self.cost = cost
        self.kv = KVLedger()
        #: Streaming requests in the pool by when their gap bound runs out:
        #: (pooled_at + bound, seq, rid, pooled_at); an entry whose request left the pool
        #: or came back later is stale and skipped.
        self._gaps: list[tuple[float, int, str, float]] = []
        self._gap_seq = itertools.count()
        #: Streaming requests whose bound ran out and that are still in the pool.
        self._overdue: dict[str, float] = {}

    # ------------------------------------------------------------------ the gap bound

    @property
    def next_at(self) -> float:
        """When a round is next needed: the interval rule's time, or earlier when a streaming
        request becomes due (the gap bound)."""
        at = self._interval_at
        if self.policy.gap_bound is not None and self._gap_round_helps():
            at = min(at, self._gap_due_at())
        return at


    @next_at.setter
    def next_at(self, value: float) -> None:
        self._interval_at = value

    def _gap_round_helps(self) -> bool:
        """A round for a due request can start it: always for the paper's rounds (they place
        on queues); for work-conserving ones only with a worker idle (the others' slice ends
        bring a round anyway)."""
        return not self.policy.work_conserving or bool(self.idle_workers())

    def _horizon(self) -> float:
        """How long a request put in the pool now would wait for a worker at the least: the
        least estimated queued time over the active workers (0 with one idle)."""
        return min((s.load for s in self.workers.values() if s.active), default=0.0)

    def _gap_top(self) -> tuple[float, int, str, float] | None:
        """The earliest live entry of the gap heap (stale ones dropped)."""
        gaps = self._gaps
        while gaps:
            _, _, rid, pooled = gaps[0]
            r = self.pool.get(rid)
            if r is not None and r.pooled_at == pooled:
                return gaps[0]
            heapq.heappop(gaps)
        return None

    def _gap_due_at(self) -> float:
        top = self._gap_top()
        return float("inf") if top is None else top[0] - self._horizon()

    def _arm(self, r: Request, at: float) -> None:
        assert r.pooled_at is not None
        heapq.heappush(self._gaps, (at, next(self._gap_seq), r.rid, r.pooled_at))

    def _take_due(self, now: float) -> set[str]:
        """The streaming requests in the pool that are due now (ids), those due at earlier
        rounds and still waiting included."""
        horizon = self._horizon()
        while (top := self._gap_top()) is not None and top[0] - horizon <= now:
            heapq.heappop(self._gaps)
            self._overdue[top[2]] = top[3]
        for rid, pooled in list(self._overdue.items()):
            r = self.pool.get(rid)
            if r is None or r.pooled_at != pooled:
                del self._overdue[rid]
        return set(self._overdue)

    def _requeue(self, r: Request, now: float) -> None:
        super()._requeue(r, now)
        bound = self.policy.gap_bound
        if bound is not None and r.first_token is not None:
            self._arm(r, now + bound)

    # ------------------------------------------------------------------ scheduling

    def due(self, now: float) -> bool:
        """True when a scheduling round should run now.

        The interval rule: ``now`` has reached the interval's time. Work-conserving
        policies also run a round at once when an active worker is idle and
        something changed since the last round; with the gap bound on, a round
        also runs when a streaming request is due.
        """
        if not self.pool or not self.active_workers():
            return False
        if now >= self._interval_at:
            return True
        if (self.policy.gap_bound is not None and self._gap_due_at() <= now
                and self._gap_round_helps()):
            return True
        return self.policy.work_conserving and self.changed and bool(self.idle_workers())

    def schedule(self, now: float) -> Round:
        """Batch the pool and assign the batches to workers (:mod:`sclsd.core.rounds`).

        The paper's round batches and places the whole pool; with workers idle and
        no more batches than idle workers, a work-conserving round starts one batch
        on each idle worker (a backlog gets the paper's round). With the gap bound
        on, streaming requests go first (due ones before the rest), and due ones
        may leave the worker holding their KV for an idle one (else they wait for it).
        """
        active = self.active_workers()
        if not self.pool or not active:
            return Round(releases=self._released())
        due = self._take_due(now) if self.policy.gap_bound is not None else set()
        idle = self.idle_workers() if self.policy.work_conserving else []
        return Round(tuple(self._round(now, active, idle, due)), self._released())

    def _round(self, now: float, active: list[str], idle: list[str], due: set[str]) -> list[Batch]:
        """The round of the interval rule or of work conservation; ``due``: the streaming
        requests due now (gap bound), started first."""
        self.changed = False
        loads = {w: self.workers[w].load for w in (idle or active)}
        pool = list(self.pool.values())
        planned = plan_round(self.policy, self.cost, pool, self.live.values(), active,
                             loads if idle else None, due)
        if idle and len(planned) > BACKLOG_BATCHES_PER_IDLE * len(idle):
            # A deep backlog (many more batches than idle workers): place the whole pool
            # as the paper's round does, rather than one batch per idle worker and a fresh
            # DP over the same backlog at every slice end.
            idle = []
            loads = {w: self.workers[w].load for w in active}
            planned = plan_round(self.policy, self.cost, pool, self.live.values(), active, None)
        batches = [
            Batch(0, p.requests, p.slice_len, max(r.input_len for r in p.requests),
                  est_time=p.est_time, est_on=p.est_on)
            for p in planned
        ]
        targets = self.policy.offloader.assign(batches, loads)
        placed = list(zip(batches, targets, strict=True))
        gap_on = self.policy.gap_bound is not None
        if idle:  # each idle worker starts one batch now; the rest waits for a fuller round
            placed = one_each(list(zip(batches, targets, planned, strict=True)), due, gap_on)
        elif gap_on:
            placed = streaming_first(placed)  # each worker's queue serves them first
        self._place(placed, now)
        self.interval = self.policy.interval.next(
            {w: self.workers[w].load for w in active}
        )
        self.next_at = now + self.interval
        return [b for b, _ in placed]

    def _place(self, placed: list[tuple[Batch, str]], now: float) -> None:
        for batch, wid in placed:
            batch.est_time = batch.est_for(wid)
            self.start(batch, wid, now)
            for r in batch.requests:
                if r.kv_worker is not None and r.kv_worker != wid:
                    self._release_kv(r)  # it moved: the KV left behind is of no use

    # ------------------------------------------------------------------ retained KV

    def kv_evicted(self, wid: str, rids: Iterable[str]) -> None:
        """Worker ``wid`` dropped these requests' KV on its own (to make room)."""
        if self.kv.evicted(wid, rids, self.live):
            self.changed = True

    def _released(self) -> Releases:
        """KV the policy stopped counting on during this call, by worker."""
        return releases_of(self.kv.take())

    def _release_kv(self, r: Request) -> None:
        self.kv.drop(r, self.workers)

    # ------------------------------------------------------------------ hooks

    def _on_worker_added(self, wid: str) -> None:
        self.kv.forget(wid, self.live.values())

    def _on_worker_removed(self, wid: str, back: list[Request]) -> None:
        self.kv.forget(wid, self.live.values())

    def _on_cancelled(self, req: Request) -> None:
        self._release_kv(req)

    def _on_row_failed(self, r: Request, batch: Batch) -> None:
        self._release_kv(r)  # whatever the worker kept is not known to be consistent

    def _on_row_continues(self, r: Request, row: RowOutcome, batch: Batch) -> None:
        if row.kv_tokens > 0 and batch.worker in self.workers:
            r.kv_worker, r.kv_tokens = batch.worker, min(row.kv_tokens, r.input_len - 1)
        else:
            self._release_kv(r)
