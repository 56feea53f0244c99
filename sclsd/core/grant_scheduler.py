"""The slice-grant scheduler (policy ``scls-cb``): :class:`~sclsd.core.grants.GrantPolicy`
driven as a scheduler.

:class:`SliceGrantScheduler` keeps requests and workers in the books every
scheduler keeps (a :class:`~sclsd.core.mechanism.SchedulerMechanism`, used as
it is: the pool, live requests, deadlines, cancellation, worker loss,
outcomes), tells its grant policy what each call did, one call after the
other (no hooks), and decides its rounds with the grant policy: each grant is a one-request
:class:`~sclsd.core.batch.Batch` of ``slice_len`` = the granted tokens, so
dispatch, acknowledgement, streaming and re-queueing work unchanged. There is
no scheduling interval: a round runs whenever something changed (an arrival,
a grant's end, a worker) and grants whatever fits.

The grant policy owns the KV bookkeeping here: it knows which worker keeps an
unfinished request's KV after its grant (the engine reports it per row, as
``kv_tokens``), prices staying against moving, and says which kept KV to
release (returned by the entry point that gave it up, as the slice scheduler's
are: :mod:`sclsd.core.decisions`); requests' ``kv_worker`` stays None.

Pure, like the rest of the core: time arrives as an argument.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from .batch import Batch, BatchOutcome
from .decisions import Applied, Cancelled, Expired, Releases, Removed, Round, releases_of
from .grants import GrantPolicy
from .mechanism import SchedulerMechanism
from .request import FinishReason, Request
from .scheduler_api import GrantStats, WorkerState

if TYPE_CHECKING:
    from .interfaces import GrantCost
    from .policy import Policy

__all__ = ["SliceGrantScheduler"]


class SliceGrantScheduler:
    """A scheduler whose rounds hand out slice grants (see the module docstring).

    A worker's grants reserve at most ``cost.device_kv_bytes / cost.kv_bytes_per_token``
    KV tokens (ζ · M_ava / Δ), in whole pages of ``cost.kv_page_tokens``.
    """

    def __init__(self, policy: Policy, cost: GrantCost, *, max_failures: int = 3,
                 history: int = 64, max_worker_losses: int = 0) -> None:
        self.policy = policy
        self.cost = cost
        # history=0: a grant's time is weighed against its worker's steps here (on_result).
        self.books: SchedulerMechanism[GrantStats] = SchedulerMechanism(
            policy, max_failures=max_failures, history=0, stats=GrantStats(),
            max_worker_losses=max_worker_losses)
        """Requests, workers, batches and counts, as every scheduler keeps them."""
        # Called for every streamed token: the books' own method, not a call that forwards.
        self.generated: Callable[[str, int, float], None] = self.books.generated
        self.grants = GrantPolicy(cost.estimator, policy.slice_len, self.token_budget())
        #: KV to release that the policy did not decide (a failed grant's): (worker, rid).
        self._release: list[tuple[str, str]] = []
        self.interval = self.books.interval  # no interval rule: rounds run on changes
        self.next_at = float("inf")  # rounds run on changes only (see due)
        self.recent: deque[tuple[float, float]] = deque(maxlen=history)
        """(estimated, measured) wall time of the latest grants: their iterations at the cost of
        their worker's steps (the grants beside them), and what the engine measured."""

    def token_budget(self) -> int:
        """KV tokens one worker's grants may reserve: ζ · M_ava / Δ of the tightest worker."""
        delta = int(self.cost.kv_bytes_per_token)
        return int(self.cost.device_kv_bytes // max(1, delta))

    # ------------------------------------------------------------------ the books, read

    @property
    def pool(self) -> dict[str, Request]:
        """Requests waiting for a grant."""
        return self.books.pool

    @property
    def live(self) -> dict[str, Request]:
        """Requests not ended yet."""
        return self.books.live

    @property
    def batches(self) -> dict[int, Batch]:
        """Grants running, as one-request batches, by id."""
        return self.books.batches

    @property
    def workers(self) -> dict[str, WorkerState]:
        return self.books.workers

    @property
    def max_failures(self) -> int:
        return self.books.max_failures

    @property
    def max_worker_losses(self) -> int:
        return self.books.max_worker_losses

    def stats(self) -> GrantStats:
        """A copy of the event counts."""
        return self.books.stats()

    def get(self, rid: str) -> Request | None:
        return self.books.get(rid)

    def active_workers(self) -> list[str]:
        return self.books.active_workers()

    def idle_workers(self) -> list[str]:
        return self.books.idle_workers()

    def loads(self) -> dict[str, float]:
        return self.books.loads()

    def next_deadline(self) -> float | None:
        return self.books.next_deadline()

    # ------------------------------------------------------------------ workers

    def add_worker(self, wid: str, rows: int = 0) -> None:
        """A worker (re)joined: no load, no KV, no grant; it holds at most ``rows`` grants at
        once (0: as many as its KV budget takes)."""
        self.books.add_worker(wid)
        self.grants.add_worker(wid, rows)

    def set_rows(self, wid: str, rows: int) -> None:
        """The most grants ``wid`` may hold at once, from now on (its engine's room changed)."""
        self.grants.set_rows(wid, rows)
        self.books.changed = True

    def set_active(self, wid: str, active: bool) -> Releases:
        """Drain a worker or put it back; a drained worker's kept KV waiting for grants there
        is given up (returned)."""
        self.books.set_active(wid, active)
        self.grants.set_active(wid, active)
        return self._released()

    def remove_worker(self, wid: str, now: float, charged: bool = False) -> Removed:
        """A worker is gone: its grants' requests queue again, first, to re-prefill elsewhere;
        those that end instead (``charged``: ``max_worker_losses``) leave the policy."""
        if wid not in self.books.workers:
            return Removed(releases=self._released())
        gone = self.books.remove_worker(wid, now, charged)
        for r in gone.ended:
            self.grants.forget(r.rid)
        self.grants.remove_worker(wid)
        self._release = [(w, rid) for w, rid in self._release if w != wid]
        for r in reversed(gone.requeued):
            self.grants.arrive(r.rid, r.input_len, r.remaining, first=True)
        return Removed(gone.requeued, gone.ended, self._released())

    # ------------------------------------------------------------------ requests

    def add(self, req: Request, now: float) -> None:
        """Accept a request: into the pool and in line for a grant."""
        self.books.add(req, now)
        prefix = (req.prefix_worker, req.prefix_tokens) if req.prefix_worker is not None else None
        self.grants.arrive(req.rid, req.input_len, req.remaining, group=req.group, prefix=prefix)

    def cancel(self, rid: str, now: float, reason: FinishReason = "cancelled") -> Cancelled | None:
        """End a live request now (None: not live); see :meth:`_forget`."""
        c = self.books.cancel(rid, now, reason)
        if c is None:
            return None
        self._forget(c.request)
        return Cancelled(c.request, self._released())

    def expire(self, now: float) -> Expired:
        """Cancel (``timeout``) the live requests whose deadline has passed."""
        e = self.books.expire(now)
        for r in e.requests:
            self._forget(r)
        return Expired(e.requests, self._released())

    def _forget(self, req: Request) -> None:
        """``req`` ended outside a result: outside a grant the policy forgets it at once; a
        grant still running holds its reservation until its result (or its worker's loss)."""
        if req.batch_id is None:
            self.grants.forget(req.rid)

    # ------------------------------------------------------------------ scheduling

    def due(self, now: float) -> bool:
        """A round runs whenever something changed and requests wait (no interval)."""
        return bool(self.books.pool) and self.books.changed and bool(self.books.active_workers())

    def schedule(self, now: float) -> Round:
        """Grant what fits; each grant becomes a one-request batch on its worker."""
        books = self.books
        if not books.pool or not books.active_workers():
            return Round(releases=self._released())
        books.changed = False
        self.grants.est = self.cost.estimator  # a worker's profile or memory may have changed
        self.grants.budget = self.token_budget()
        self.grants.page = self.cost.kv_page_tokens
        moved = self.grants.migrations
        out: list[Batch] = []
        for g in self.grants.schedule():
            r = books.pool[g.rid]
            batch = Batch(0, [r], g.tokens, r.input_len, est_time=g.cost)
            books.start(batch, g.worker, now)
            out.append(batch)
        books.counts.grants += len(out)
        books.counts.migrations += self.grants.migrations - moved
        self.next_at = float("inf")  # no interval: the next round waits for a change
        return Round(tuple(out), self._released())

    def on_result(self, outcome: BatchOutcome, now: float) -> Applied:
        """Apply a grant's outcome to the books, then tell the policy how its request ended."""
        batch = self.books.batches.get(outcome.batch_id)
        if batch is not None and outcome.ok and outcome.elapsed is not None and batch.worker in self.workers:
            # A grant's wall time is its iterations on a worker that runs others beside it: it
            # is weighed against those steps as the cost model prices them (its own share of
            # them, the grant's estimate, is what loads add up, not what a clock sees).
            steps = max((row.new_tokens for row in outcome.rows), default=0)
            mine = self.grants.grants_on(batch.worker)
            pre = sum(self.grants.prefill_cost(mine[r.rid].prefill) for r in batch.requests if r.rid in mine)
            self.recent.append((steps * self.grants.step_cost(batch.worker) + pre, outcome.elapsed))
        applied = self.books.on_result(outcome, now)
        if batch is not None:
            self._ended(batch, outcome, applied.ended)
        return Applied(applied.ended, applied.requeued, self._released())

    def _ended(self, batch: Batch, outcome: BatchOutcome, done: Iterable[Request]) -> None:
        """Tell the policy how each of the grant's requests ended (``done``: those the
        outcome ended)."""
        rows = {row.rid: row for row in outcome.rows} if outcome.ok else {}
        finished = {r.rid for r in done}
        for r in batch.requests:
            row = rows.get(r.rid)
            if r.rid in finished:
                self.grants.end(r.rid, r.input_len, 0)
            elif r.state.terminal or self.books.live.get(r.rid) is not r:
                self.grants.forget(r.rid)  # cancelled while its grant ran
                continue
            else:
                kept = row is not None and row.kv_tokens > 0
                self.grants.end(r.rid, r.input_len, r.remaining, kept=kept)
            if row is None and batch.worker is not None:
                # A failed grant: whatever its worker kept is not known to be consistent, and
                # of no use to a request it ended (failed for good) either.
                self._release.append((batch.worker, r.rid))

    # ------------------------------------------------------------------ retained KV

    def kv_evicted(self, wid: str, rids: Iterable[str]) -> None:
        """An engine dropped kept KV by itself: the estimate of a later grant there is off by
        its prefill, nothing worse (the engine re-prefills what it does not hold)."""
        self.books.changed = True

    def _released(self) -> Releases:
        """KV the policy stopped counting on during this call, by worker (the policy's
        evictions first, then failed grants'), on workers still registered."""
        pairs = self.grants.take_evictions() + self._release
        self._release = []
        return releases_of((w, rid) for w, rid in pairs if w in self.books.workers)
