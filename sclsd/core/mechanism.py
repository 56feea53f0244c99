"""The mechanism every scheduler shares: the pool, live requests, deadlines, workers, outcomes.

Both schedulers (:class:`~sclsd.core.scheduler.Scheduler`, slice rounds, and
:class:`~sclsd.core.grant_scheduler.SliceGrantScheduler`, slice grants) keep
requests and workers the same way and apply a batch's outcome the same way;
they differ in how a round is decided and in who keeps track of the KV a
worker holds after a slice. This class does the former. The slice scheduler
extends it and keeps the KV through a few ``_on_*`` hooks (each a no-op
here); the slice-grant scheduler owns one as it is, its books, and tells its
grant policy what each call did.

Each entry point returns what it decided (:mod:`sclsd.core.decisions`), the KV
it released included: the subclass gathers releases while a call runs and
:meth:`SchedulerMechanism._released` hands them over as the call returns, so
none is left for a later call.

Pure, like the rest of the core: time arrives as an argument.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import TYPE_CHECKING, Generic, TypeVar

from .batch import Batch, BatchOutcome, RowOutcome
from .decisions import Applied, Cancelled, Expired, Releases, Removed
from .request import FinishReason, Request, State
from .scheduler_api import SchedulerStats, WorkerState

if TYPE_CHECKING:
    from .policy import Policy

__all__ = ["SchedulerMechanism"]

StatsT = TypeVar("StatsT", bound=SchedulerStats)


class SchedulerMechanism(Generic[StatsT]):
    """Requests and workers as both schedulers keep them (see the module docstring).
    Subclasses implement ``due``, ``schedule``, ``kv_evicted`` (``SchedulerInterface``) and
    :meth:`_released`, and may override the hooks."""

    def __init__(self, policy: Policy, *, max_failures: int, history: int,
                 stats: StatsT, max_worker_losses: int = 0) -> None:
        self.policy = policy
        self.max_failures = max_failures
        self.max_worker_losses = max_worker_losses
        """A request in flight on this many workers that died ends with an error (it may be
        what kills them: poison stops); 0: never."""
        self.pool: dict[str, Request] = {}
        """Requests waiting for a slice (or a grant)."""
        self.live: dict[str, Request] = {}
        """Every request not ended yet: in the pool or in a batch."""
        self.batches: dict[int, Batch] = {}
        """Batches on workers, by id, until their outcome."""
        self.workers: dict[str, WorkerState] = {}
        self.interval = policy.interval.initial
        self.next_at = float("-inf")
        self.recent: deque[tuple[float, float]] = deque(maxlen=history)
        """(estimated, measured) serving time of the latest batches."""
        #: Something changed since the last round: a work-conserving round is worth running.
        self.changed = True
        self._bids = itertools.count(1)
        self._deadlines: list[tuple[float, str]] = []
        self.counts = stats
        """The event counts (:meth:`stats` hands out copies)."""

    def stats(self) -> StatsT:
        """A copy of the event counts."""
        return self.counts.copy()

    # ------------------------------------------------------------------ workers

    def add_worker(self, wid: str, rows: int = 0) -> None:
        """A worker (re)joined: it starts with no load and holds no KV (``rows``: see
        :meth:`SchedulerInterface.add_worker <sclsd.core.scheduler_api.SchedulerInterface.add_worker>`)."""
        self.workers[wid] = WorkerState(wid)
        self.changed = True
        self._on_worker_added(wid)

    def set_rows(self, wid: str, rows: int) -> None:
        """Slice rounds ignore a worker's rows (their interval bounds what a worker queues)."""

    def set_active(self, wid: str, active: bool) -> Releases:
        """Take a worker in or out of rotation (drain) without touching its batches; returns
        the KV that no longer counts (a drained worker's kept KV the policy gives up)."""
        self.workers[wid].active = active
        self.changed = True
        self._on_active(wid, active)
        return self._released()

    def remove_worker(self, wid: str, now: float, charged: bool = False) -> Removed:
        """A worker is gone: its batches' requests go back to the pool. ``charged`` (the
        worker died: exited, hung): the loss counts against each of them, and one that has
        now been on ``max_worker_losses`` workers that died ends instead (state ``FAILED``,
        in ``Removed.ended``: the caller tells its client).

        Tokens its unfinished slices streamed count already (:meth:`generated`): each request
        continues after them, its context and budget as its client saw them.
        """
        ws = self.workers.pop(wid, None)
        if ws is None:
            return Removed(releases=self._released())
        self.changed = True
        back: list[Request] = []
        ended: list[Request] = []
        for bid in sorted(ws.batches):
            batch = self.batches.pop(bid, None)
            if batch is None:
                continue
            for r in batch.requests:
                if r.state.terminal:
                    continue
                r.worker_losses += charged
                if charged and 0 < self.max_worker_losses <= r.worker_losses:
                    r.batch_id = None
                    self._on_cancelled(r)  # the policy forgets it, as for a cancel
                    ended.append(self._finish(r, now, "error", State.FAILED))
                else:
                    self._requeue(r, now)
                    back.append(r)
        self._on_worker_removed(wid, back)
        return Removed(tuple(back), tuple(ended), self._released())

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
        self.counts.accepted += 1
        self.changed = True
        if req.deadline is not None:
            heapq.heappush(self._deadlines, (req.deadline, req.rid))
        self._on_added(req)

    def get(self, rid: str) -> Request | None:
        return self.live.get(rid)

    def generated(self, rid: str, k: int, now: float) -> None:
        """``k`` tokens of ``rid``'s running slice were streamed at ``now``: they count at once, so
        a slice that ends without a result leaves the request right for its next one."""
        r = self.live.get(rid)
        if r is not None and k > 0:  # _count, inlined: this runs for every streamed token
            r.num_generated += k
            if r.first_token is None:
                r.first_token = now

    @staticmethod
    def _count(r: Request, k: int, now: float) -> None:
        """Where a request's progress grows (and in :meth:`generated`): ``k`` more tokens."""
        if k > 0:
            r.num_generated += k
            if r.first_token is None:
                r.first_token = now

    def cancel(self, rid: str, now: float, reason: FinishReason = "cancelled") -> Cancelled | None:
        """End a live request now (None: it is not live). A batch holding it still runs; its
        row is ignored."""
        req = self._cancel(rid, now, reason)
        return None if req is None else Cancelled(req, self._released())

    def _cancel(self, rid: str, now: float, reason: FinishReason) -> Request | None:
        req = self.live.pop(rid, None)
        if req is None:
            return None
        self.pool.pop(rid, None)
        req.state = State.CANCELLED
        req.finish_reason = reason
        req.finished_at = now
        self.counts.ended(reason)
        self._on_cancelled(req)
        return req

    def next_deadline(self) -> float | None:
        """The earliest deadline of a live request (None: none has one)."""
        while self._deadlines and self._deadlines[0][1] not in self.live:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    def expire(self, now: float) -> Expired:
        """Cancel (reason ``timeout``) every live request whose deadline has passed."""
        out: list[Request] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, rid = heapq.heappop(self._deadlines)
            req = self._cancel(rid, now, "timeout")
            if req is not None:
                out.append(req)
        return Expired(tuple(out), self._released())

    # ------------------------------------------------------------------ batches

    def start(self, batch: Batch, wid: str, now: float) -> None:
        """Put ``batch`` on worker ``wid``: a fresh id, the worker's load, its requests out
        of the pool (a round's placement)."""
        batch.bid = next(self._bids)
        batch.worker = wid
        ws = self.workers[wid]
        ws.load += batch.est_time
        ws.batches.add(batch.bid)
        self.batches[batch.bid] = batch
        for r in batch.requests:
            del self.pool[r.rid]
            r.state = State.SCHEDULED
            r.worker = wid
            r.batch_id = batch.bid
            r.slice_start = r.num_generated
            if r.first_dispatch is None:
                r.first_dispatch = now
        self.counts.batches += 1

    def on_result(self, outcome: BatchOutcome, now: float) -> Applied:
        """Apply a worker's result: the requests that reached a terminal state, those back in
        the pool (with their new context length), the KV released.
        """
        batch = self.batches.pop(outcome.batch_id, None)
        if batch is None:
            # A batch of a worker already declared dead: its requests were re-queued.
            return Applied(releases=self._released())
        ws = self.workers.get(batch.worker or "")
        if ws is not None:
            # Subtract the estimate, not the measurement, so errors don't accumulate (paper 4.5).
            ws.load = max(0.0, ws.load - batch.est_time)
            ws.batches.discard(batch.bid)
            ws.batches_done += 1
            ws.last_completion = now
        if outcome.ok and outcome.elapsed is not None:
            self.recent.append((batch.est_time, outcome.elapsed))
        self.changed = True
        rows = {row.rid: row for row in outcome.rows}
        done: list[Request] = []
        back: list[Request] = []
        early = outcome.ok and bool(rows)
        for r in batch.requests:
            if r.state.terminal or self.live.get(r.rid) is not r:
                continue  # cancelled or timed out while its batch ran
            row = rows.get(r.rid)
            if not outcome.ok or row is None:
                self._on_row_failed(r, batch)
                r.failures += 1 if outcome.charged or outcome.ok else 0
                if r.failures > self.max_failures:
                    done.append(self._finish(r, now, "error", State.FAILED))
                else:
                    self._requeue(r, now)
                    back.append(r)
                early = False
                continue
            if not self._apply_row(r, row, batch, ws, now, done):
                back.append(r)
                early = False
        # Early return: every row finished before the slice's last iteration (paper 4.2).
        if early and max((row.new_tokens for row in outcome.rows), default=0) < batch.slice_len:
            self.counts.early_returns += 1
        self._on_outcome(batch, outcome, done)
        return Applied(tuple(done), tuple(back), self._released())

    def _apply_row(self, r: Request, row: RowOutcome, batch: Batch, ws: WorkerState | None,
                   now: float, done: list[Request]) -> bool:
        """One row of a served batch; True when it finished the request (or failed it: the
        engine could not serve the row, which no other worker would do better), False when
        it went back to the pool."""
        r.slices += 1
        self.counts.slices += 1
        if row.failed:
            r.kv_worker, r.kv_tokens = None, 0
            done.append(self._finish(r, now, "error", State.FAILED))
            return True
        self._count(r, row.new_tokens - r.slice_tokens, now)  # those streamed counted already
        if ws is not None:
            ws.tokens_done += row.new_tokens
        reason: FinishReason | None = row.finish_reason
        if reason is None and r.remaining <= 0:
            reason = "length"
        if reason is not None:
            r.kv_worker, r.kv_tokens = None, 0  # a finished row's KV is not kept
            done.append(self._finish(r, now, reason, State.FINISHED))
            return True
        self._on_row_continues(r, row, batch)
        self._requeue(r, now)
        return False

    def _requeue(self, r: Request, now: float) -> None:
        r.state = State.QUEUED
        r.pooled_at = now
        r.batch_id = None
        self.pool[r.rid] = r
        self.counts.requeued += 1

    def _finish(self, r: Request, now: float, reason: FinishReason, state: State) -> Request:
        r.state, r.finish_reason, r.finished_at = state, reason, now
        self.live.pop(r.rid, None)
        self.counts.ended(reason, failed=state is State.FAILED)
        return r

    # ------------------------------------------------------------------ releases

    def _released(self) -> Releases:
        """KV given up during this call, on registered workers, returned as it ends (none here)."""
        return ()

    # ------------------------------------------------------------------ hooks (KV, policy state)

    def _on_worker_added(self, wid: str) -> None:
        """A worker joined (or rejoined: it keeps nothing)."""

    def _on_active(self, wid: str, active: bool) -> None:
        """A worker went out of rotation or back in."""

    def _on_worker_removed(self, wid: str, back: list[Request]) -> None:
        """A worker died; ``back``: its requests, already back in the pool, oldest batch first."""

    def _on_added(self, req: Request) -> None:
        """A request joined the pool."""

    def _on_cancelled(self, req: Request) -> None:
        """A live request ended outside a result (cancelled, timed out)."""

    def _on_row_failed(self, r: Request, batch: Batch) -> None:
        """``r``'s batch failed or left its row out: whatever its worker kept is suspect."""

    def _on_row_continues(self, r: Request, row: RowOutcome, batch: Batch) -> None:
        """``r`` got its slice and goes back to the pool (``row.kv_tokens``: KV kept)."""

    def _on_outcome(self, batch: Batch, outcome: BatchOutcome, done: list[Request]) -> None:
        """A batch's outcome was applied; ``done``: the requests it ended."""
