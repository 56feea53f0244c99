"""The scheduler: request pool, batching, offloading, interval, results.

Driven identically by the daemon (real clock) and the simulator (virtual
clock)::

    sched.add(req, now)
    if sched.due(now):
        for batch in sched.schedule(now):   # batch.worker is set
            send(batch)
    done = sched.on_result(outcome, now)    # finished requests; the rest re-queued

What to batch, where to send it and when to schedule next are decided by the
:class:`~sclsd.core.policy.Policy`; this module is only the mechanism.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .batch import Batch, BatchOutcome, RowOutcome
from .kvreuse import KVLedger
from .request import FinishReason, Request, State
from .rounds import one_each, plan_round

if TYPE_CHECKING:
    from .interfaces import CostModel
    from .policy import Policy

# Batch and its outcomes are defined in .batch; they are part of this module's API too.
__all__ = ["Batch", "BatchOutcome", "RowOutcome", "Scheduler", "WorkerState"]


@dataclass(slots=True)
class WorkerState:
    """The scheduler's view of one worker: rotation, estimated load, counters."""

    wid: str
    active: bool = True
    load: float = 0.0
    """Estimated seconds of work queued on the worker (paper eq. 11)."""
    batches: set[int] = field(default_factory=set)
    batches_done: int = 0
    tokens_done: int = 0
    last_completion: float | None = None


#: A work-conserving round whose batcher answers with more than this many batches per
#: idle worker places them all (the paper's round): one DP places the backlog instead of
#: one DP per slice end starting a batch each (thousands of requests, zero-time workers).
BACKLOG_BATCHES_PER_IDLE = 8


class Scheduler:
    """Slice-level scheduler over a pool of requests and a set of workers."""

    def __init__(
        self,
        policy: Policy,
        cost: CostModel,
        *,
        max_failures: int = 3,
        history: int = 64,
    ) -> None:
        self.policy = policy
        self.cost = cost
        self.max_failures = max_failures
        self.pool: dict[str, Request] = {}
        self.live: dict[str, Request] = {}
        self.batches: dict[int, Batch] = {}
        self.workers: dict[str, WorkerState] = {}
        self.interval = policy.interval.initial
        self.next_at = float("-inf")
        #: Something changed since the last round (a request, a result, a worker): a
        #: work-conserving round is worth running; cleared by each round.
        self._changed = True
        self.kv = KVLedger()
        self._bids = itertools.count(1)
        self._deadlines: list[tuple[float, str]] = []
        #: (estimated, measured) serving time of the latest batches.
        self.recent: deque[tuple[float, float]] = deque(maxlen=history)
        self.counters: dict[str, int] = {
            "accepted": 0,
            "finished": 0,
            "cancelled": 0,
            "timed_out": 0,
            "failed": 0,
            "batches": 0,
            "slices": 0,
            "requeued": 0,
            "early_returns": 0,
        }

    # ------------------------------------------------------------------ workers

    def add_worker(self, wid: str) -> None:
        """A worker (re)joined: it starts with no load and holds no KV."""
        self.kv.forget(wid, self.live.values())
        self.workers[wid] = WorkerState(wid)
        self._changed = True

    def set_active(self, wid: str, active: bool) -> None:
        """Take a worker in or out of rotation (drain) without touching its batches."""
        self.workers[wid].active = active
        self._changed = True

    def remove_worker(self, wid: str, now: float) -> list[Request]:
        """A worker died: its batches' requests go back to the pool.

        Tokens of the unfinished slice never reached us, so each request
        continues from its last completed slice and output stays consistent.
        """
        ws = self.workers.pop(wid, None)
        if ws is None:
            return []
        self._changed = True
        self.kv.forget(wid, self.live.values())
        back: list[Request] = []
        for bid in sorted(ws.batches):
            batch = self.batches.pop(bid, None)
            if batch is None:
                continue
            for r in batch.requests:
                if not r.state.terminal:
                    self._requeue(r, now)
                    back.append(r)
        return back

    def active_workers(self) -> list[str]:
        return [w for w, s in self.workers.items() if s.active]

    def idle_workers(self) -> list[str]:
        """Active workers with no batch in flight."""
        return [w for w, s in self.workers.items() if s.active and not s.batches]

    def loads(self) -> dict[str, float]:
        return {w: s.load for w, s in self.workers.items()}

    # ------------------------------------------------------------------ requests

    def add(self, req: Request, now: float) -> None:
        """Accept a request into the pool."""
        req.state = State.QUEUED
        req.pooled_at = now
        self.pool[req.rid] = req
        self.live[req.rid] = req
        self.counters["accepted"] += 1
        self._changed = True
        if req.deadline is not None:
            heapq.heappush(self._deadlines, (req.deadline, req.rid))

    def get(self, rid: str) -> Request | None:
        return self.live.get(rid)

    def cancel(
        self, rid: str, now: float, reason: FinishReason = "cancelled"
    ) -> Request | None:
        """End a live request now. A batch holding it still runs; its row is ignored."""
        req = self.live.pop(rid, None)
        if req is None:
            return None
        self.pool.pop(rid, None)
        self._release_kv(req)
        req.state = State.CANCELLED
        req.finish_reason = reason
        req.finished_at = now
        self.counters["timed_out" if reason == "timeout" else "cancelled"] += 1
        return req

    def next_deadline(self) -> float | None:
        while self._deadlines and self._deadlines[0][1] not in self.live:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    def expire(self, now: float) -> list[Request]:
        """Cancel (reason ``timeout``) every live request whose deadline has passed."""
        out: list[Request] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, rid = heapq.heappop(self._deadlines)
            req = self.cancel(rid, now, "timeout")
            if req is not None:
                out.append(req)
        return out

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
            batch.bid = next(self._bids)
            batch.est_time = batch.est_for(wid)
            ws = self.workers[wid]
            ws.load += batch.est_time
            ws.batches.add(batch.bid)
            batch.worker = wid
            self.batches[batch.bid] = batch
            for r in batch.requests:
                del self.pool[r.rid]
                r.state = State.SCHEDULED
                r.worker = wid
                r.batch_id = batch.bid
                if r.kv_worker is not None and r.kv_worker != wid:
                    self._release_kv(r)  # it moved: the KV left behind is of no use
                if r.first_dispatch is None:
                    r.first_dispatch = now
        self.counters["batches"] += len(batches)
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

    def on_result(self, outcome: BatchOutcome, now: float) -> list[Request]:
        """Apply a worker's result. Returns the requests that reached a terminal state.

        Unfinished requests go back to the pool with their new context length.
        """
        batch = self.batches.pop(outcome.batch_id, None)
        if batch is None:
            return []  # batch of a worker already declared dead: its requests were re-queued
        ws = self.workers.get(batch.worker or "")
        if ws is not None:
            # Subtract the estimate, not the measurement, so errors don't accumulate (paper 4.5).
            ws.load = max(0.0, ws.load - batch.est_time)
            ws.batches.discard(batch.bid)
            ws.batches_done += 1
            ws.last_completion = now
        if outcome.ok and outcome.elapsed is not None:
            self.recent.append((batch.est_time, outcome.elapsed))
        self._changed = True
        rows = {row.rid: row for row in outcome.rows}
        done: list[Request] = []
        early = outcome.ok and bool(rows)
        for r in batch.requests:
            if r.state.terminal or self.live.get(r.rid) is not r:
                continue  # cancelled or timed out while its batch ran
            row = rows.get(r.rid)
            if not outcome.ok or row is None:
                self._release_kv(r)  # whatever the worker kept is not known to be consistent
                r.failures += 1
                if r.failures > self.max_failures:
                    done.append(self._finish(r, now, "error", State.FAILED))
                else:
                    self._requeue(r, now)
                early = False
                continue
            r.slices += 1
            self.counters["slices"] += 1
            if row.new_tokens:
                r.num_generated += row.new_tokens
                if r.first_token is None:
                    r.first_token = now
                if ws is not None:
                    ws.tokens_done += row.new_tokens
            reason: FinishReason | None = row.finish_reason
            if reason is None and r.remaining <= 0:
                reason = "length"
            if reason is not None:
                r.kv_worker, r.kv_tokens = None, 0  # a finished row's KV is not kept
                done.append(self._finish(r, now, reason, State.FINISHED))
            else:
                early = False
                if row.kv_tokens > 0 and batch.worker in self.workers:
                    r.kv_worker, r.kv_tokens = batch.worker, min(row.kv_tokens, r.input_len - 1)
                else:
                    self._release_kv(r)
                self._requeue(r, now)
        # Early return: every row finished before the slice's last iteration (paper 4.2).
        if early and max((row.new_tokens for row in outcome.rows), default=0) < batch.slice_len:
            self.counters["early_returns"] += 1
        return done

    # ------------------------------------------------------------------ internals

    def _requeue(self, r: Request, now: float) -> None:
        r.state = State.QUEUED
        r.pooled_at = now
        r.batch_id = None
        self.pool[r.rid] = r
        self.counters["requeued"] += 1

    def _finish(self, r: Request, now: float, reason: FinishReason, state: State) -> Request:
        r.state = state
        r.finish_reason = reason
        r.finished_at = now
        self.live.pop(r.rid, None)
        self.counters["failed" if state is State.FAILED else "finished"] += 1
        return r
