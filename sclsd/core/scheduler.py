"""The slice scheduler: rounds of batches over the pool, placed on workers, at an interval.

Driven identically by the daemon (real clock) and the simulator (virtual
clock)::

    sched.add(req, now)
    if sched.due(now):
        for batch in sched.schedule(now):   # batch.worker is set
            send(batch)
    done = sched.on_result(outcome, now)    # finished requests; the rest re-queued

What to batch, where to send it and when to schedule next are decided by the
:class:`~sclsd.core.policy.Policy`; this module is only the mechanism of its
rounds (the pool, workers and outcomes are :mod:`sclsd.core.mechanism`'s).
It implements :class:`~sclsd.core.scheduler_api.SchedulerInterface`, as the
slice-grant scheduler does.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from .batch import Batch, BatchOutcome, RowOutcome
from .kvreuse import KVLedger
from .mechanism import SchedulerMechanism
from .request import Request
from .rounds import one_each, plan_round
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
    ) -> None:
        super().__init__(policy, max_failures=max_failures, history=history, stats=SchedulerStats())
        self.cost = cost
        self.kv = KVLedger()

    # ------------------------------------------------------------------ scheduling

    def due(self, now: float) -> bool:
        """True when a scheduling round should run now.

        The interval rule: ``now`` has reached ``next_at``. Work-conserving
        policies also run a round at once when an active worker is idle and
        something changed since the last round.
        """
        if not self.pool or not self.active_workers():
            return False
        if now >= self.next_at:
            return True
        return self.policy.work_conserving and self._changed and bool(self.idle_workers())

    def schedule(self, now: float) -> list[Batch]:
        """Batch the pool and assign the batches to workers (:mod:`sclsd.core.rounds`).

        The paper's round batches and places the whole pool; with workers idle and
        no more batches than idle workers, a work-conserving round starts one batch
        on each idle worker (a backlog gets the paper's round).
        """
        active = self.active_workers()
        if not self.pool or not active:
            return []
        self._changed = False
        idle = self.idle_workers() if self.policy.work_conserving else []
        loads = {w: self.workers[w].load for w in (idle or active)}
        pool = list(self.pool.values())
        planned = plan_round(self.policy, self.cost, pool, self.live.values(), active,
                             loads if idle else None)
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
        if idle:  # each idle worker starts one batch now; the rest waits for a fuller round
            placed = one_each(list(zip(batches, targets, planned, strict=True)))
        batches = [b for b, _ in placed]
        for batch, wid in placed:
            batch.est_time = batch.est_for(wid)
            self._start(batch, wid, now)
            for r in batch.requests:
                if r.kv_worker is not None and r.kv_worker != wid:
                    self._release_kv(r)  # it moved: the KV left behind is of no use
        self.interval = self.policy.interval.next(
            {w: self.workers[w].load for w in active}
        )
        self.next_at = now + self.interval
        return batches

    # ------------------------------------------------------------------ retained KV

    def kv_evicted(self, wid: str, rids: Iterable[str]) -> None:
        """Worker ``wid`` dropped these requests' KV on its own (to make room)."""
        if self.kv.evicted(wid, rids, self.live):
            self._changed = True

    def take_released(self) -> dict[str, list[str]]:
        """KV the policy no longer counts on, by worker, since the last call: tell them to drop it."""
        return self.kv.take_released()

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
