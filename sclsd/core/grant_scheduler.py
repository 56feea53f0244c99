"""The slice-grant scheduler (policy ``scls-cb``): :class:`~sclsd.core.grants.GrantPolicy`
driven as a scheduler.

:class:`SliceGrantScheduler` keeps requests and workers as the slice
scheduler does (:class:`~sclsd.core.mechanism.SchedulerMechanism`: the pool,
live requests, deadlines, cancellation, worker loss, outcomes) and decides its
rounds with the grant policy: each grant is a one-request
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

from collections.abc import Iterable
from typing import TYPE_CHECKING

from .batch import Batch, BatchOutcome
from .decisions import Releases, Round, releases_of
from .grants import GrantPolicy
from .mechanism import SchedulerMechanism
from .request import Request
from .scheduler_api import GrantStats

if TYPE_CHECKING:
    from .interfaces import GrantCost
    from .policy import Policy

__all__ = ["SliceGrantScheduler"]


class SliceGrantScheduler(SchedulerMechanism[GrantStats]):
    """A scheduler whose rounds hand out slice grants (see the module docstring).

    A worker's grants reserve at most ``cost.device_kv_bytes / cost.kv_bytes_per_token``
    KV tokens (ζ · M_ava / Δ), in whole pages of ``cost.kv_page_tokens``.
    """

    def __init__(self, policy: Policy, cost: GrantCost, *, max_failures: int = 3,
                 history: int = 64, max_worker_losses: int = 0) -> None:
        super().__init__(policy, max_failures=max_failures, history=history, stats=GrantStats(),
                         max_worker_losses=max_worker_losses)
        self.cost = cost
        self.grants = GrantPolicy(cost.estimator, policy.slice_len, self.token_budget())
        #: KV to release that the policy did not decide (a failed grant's): (worker, rid).
        self._release: list[tuple[str, str]] = []
        self.next_at = float("inf")  # rounds run on changes only (see due)

    def token_budget(self) -> int:
        """KV tokens one worker's grants may reserve: ζ · M_ava / Δ of the tightest worker."""
        delta = int(self.cost.kv_bytes_per_token)
        return int(self.cost.device_kv_bytes // max(1, delta))

    # ------------------------------------------------------------------ scheduling

    def due(self, now: float) -> bool:
        """A round runs whenever something changed and requests wait (no interval)."""
        return bool(self.pool) and self._changed and bool(self.active_workers())

    def schedule(self, now: float) -> Round:
        """Grant what fits; each grant becomes a one-request batch on its worker."""
        if not self.pool or not self.active_workers():
            return Round(releases=self._released())
        self._changed = False
        self.grants.est = self.cost.estimator  # a worker's profile or memory may have changed
        self.grants.budget = self.token_budget()
        self.grants.page = self.cost.kv_page_tokens
        moved = self.grants.migrations
        out: list[Batch] = []
        for g in self.grants.schedule():
            r = self.pool[g.rid]
            batch = Batch(0, [r], g.tokens, r.input_len, est_time=g.cost)
            self._start(batch, g.worker, now)
            out.append(batch)
        self._stats.grants += len(out)
        self._stats.migrations += self.grants.migrations - moved
        self.next_at = float("inf")  # no interval: the next round waits for a change
        return Round(tuple(out), self._released())

    # ------------------------------------------------------------------ retained KV

    def kv_evicted(self, wid: str, rids: Iterable[str]) -> None:
        """An engine dropped kept KV by itself: the estimate of a later grant there is off by
        its prefill, nothing worse (the engine re-prefills what it does not hold)."""
        self._changed = True

    def _released(self) -> Releases:
        """KV the policy stopped counting on during this call, by worker (the policy's
        evictions first, then failed grants'), on workers still registered."""
        pairs = self.grants.take_evictions() + self._release
        self._release = []
        return releases_of((w, rid) for w, rid in pairs if w in self.workers)

    # ------------------------------------------------------------------ hooks

    def _on_worker_added(self, wid: str) -> None:
        self.grants.add_worker(wid)

    def _on_active(self, wid: str, active: bool) -> None:
        self.grants.set_active(wid, active)

    def _on_worker_removed(self, wid: str, back: list[Request]) -> None:
        """Its grants' requests queue again, first, to re-prefill elsewhere."""
        self.grants.remove_worker(wid)
        self._release = [(w, rid) for w, rid in self._release if w != wid]
        for r in reversed(back):
            self.grants.arrive(r.rid, r.input_len, r.remaining, first=True)

    def _on_added(self, req: Request) -> None:
        self.grants.arrive(req.rid, req.input_len, req.remaining, group=req.group)

    def _on_cancelled(self, req: Request) -> None:
        """Outside a grant the policy forgets it at once; a grant still running holds its
        reservation until its result (or its worker's loss)."""
        if req.batch_id is None:
            self.grants.forget(req.rid)

    def _on_outcome(self, batch: Batch, outcome: BatchOutcome, done: list[Request]) -> None:
        """Tell the policy how each of the grant's requests ended."""
        rows = {row.rid: row for row in outcome.rows} if outcome.ok else {}
        finished = {r.rid for r in done}
        for r in batch.requests:
            if r.rid in finished:
                self.grants.end(r.rid, r.input_len, 0)
            elif r.state.terminal or self.live.get(r.rid) is not r:
                self.grants.forget(r.rid)  # cancelled while its grant ran
            else:
                row = rows.get(r.rid)
                kept = row is not None and row.kv_tokens > 0
                self.grants.end(r.rid, r.input_len, r.remaining, kept=kept)
                if row is None and batch.worker is not None:
                    # A failed grant: whatever its worker kept is not known to be consistent.
                    self._release.append((batch.worker, r.rid))
