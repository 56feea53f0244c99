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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .batch import Batch, BatchOutcome, RowOutcome
from .request import FinishReason, Request, State

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
        """A worker (re)joined: it starts with no load."""
        self.workers[wid] = WorkerState(wid)

    def set_active(self, wid: str, active: bool) -> None:
        """Take a worker in or out of rotation (drain) without touching its batches."""
        self.workers[wid].active = active

    def remove_worker(self, wid: str, now: float) -> list[Request]:
        """A worker died: its batches' requests go back to the pool.

        Tokens of the unfinished slice never reached us, so each request
        continues from its last completed slice and output stays consistent.
        """
        ws = self.workers.pop(wid, None)
        if ws is None:
            return []
        back: list[Request] = []
        for bid in sorted(ws.batches):
            batch = self.batches.pop(bid, None)
            if batch is None:
                continue
            for r in batch.requests:
                if not r.state.terminal:
                    self._requeue(r)
                    back.append(r)
        return back

    def active_workers(self) -> list[str]:
        return [w for w, s in self.workers.items() if s.active]

    def loads(self) -> dict[str, float]:
        return {w: s.load for w, s in self.workers.items()}

    # ------------------------------------------------------------------ requests

    def add(self, req: Request, now: float) -> None:
        """Accept a request into the pool."""
        req.state = State.QUEUED
        self.pool[req.rid] = req
        self.live[req.rid] = req
        self.counters["accepted"] += 1
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
        """True when a scheduling round should run now."""
        return bool(self.pool) and now >= self.next_at and bool(self.active_workers())

    def schedule(self, now: float) -> list[Batch]:
        """Batch the whole pool and assign every batch to a worker."""
        active = self.active_workers()
        if not self.pool or not active:
            return []
        reqs = list(self.pool.values())
        groups = self.policy.batcher(reqs, self.policy.slice_len, self.cost)
        batches: list[Batch] = []
        for group in groups:
            if not group:
                continue
            L = max(r.input_len for r in group)
            S = self.policy.slice_len
            batches.append(
                Batch(
                    bid=next(self._bids),
                    requests=group,
                    slice_len=S,
                    input_len=L,
                    est_time=self.cost.t_serve(len(group), L, S),
                )
            )
        loads = {w: self.workers[w].load for w in active}
        targets = self.policy.offloader.assign(batches, loads)
        for batch, wid in zip(batches, targets, strict=True):
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
                if r.first_dispatch is None:
                    r.first_dispatch = now
        self.counters["batches"] += len(batches)
        self.interval = self.policy.interval.next(
            {w: self.workers[w].load for w in active}
        )
        self.next_at = now + self.interval
        return batches

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
        rows = {row.rid: row for row in outcome.rows}
        done: list[Request] = []
        early = outcome.ok and bool(rows)
        for r in batch.requests:
            if r.state.terminal or self.live.get(r.rid) is not r:
                continue  # cancelled or timed out while its batch ran
            row = rows.get(r.rid)
            if not outcome.ok or row is None:
                r.failures += 1
                if r.failures > self.max_failures:
                    done.append(self._finish(r, now, "error", State.FAILED))
                else:
                    self._requeue(r)
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
                done.append(self._finish(r, now, reason, State.FINISHED))
            else:
                early = False
                self._requeue(r)
        # Early return: every row finished before the slice's last iteration (paper 4.2).
        if early and max((row.new_tokens for row in outcome.rows), default=0) < batch.slice_len:
            self.counters["early_returns"] += 1
        return done

    # ------------------------------------------------------------------ internals

    def _requeue(self, r: Request) -> None:
        r.state = State.QUEUED
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
