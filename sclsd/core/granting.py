"""The scheduler mechanism for slice grants (policy ``scls-cb``).

:class:`GrantScheduler` keeps everything :class:`~sclsd.core.scheduler.Scheduler`
does for the daemon (the pool, live requests, deadlines, cancellation, worker
loss, results, counters) and replaces its rounds with
:class:`~sclsd.core.grants.GrantPolicy`: each grant is a one-request
:class:`~sclsd.core.batch.Batch` of ``slice_len`` = the granted tokens, so
dispatch, acknowledgement, streaming and re-queueing work unchanged. There is
no scheduling interval: a round runs whenever something changed (an arrival,
a grant's end, a worker) and grants whatever fits.

The grant policy owns the KV bookkeeping here: it knows which worker keeps an
unfinished request's KV after its grant (the engine reports it per row, as
``kv_tokens``), prices staying against moving, and says which kept KV to
release (:meth:`take_released`). The :class:`~sclsd.core.kvreuse.KVLedger` of
the slice rounds stays empty.

Pure, like the rest of the core: time arrives as an argument.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from .batch import Batch, BatchOutcome
from .grants import GrantPolicy
from .request import FinishReason, Request, State
from .scheduler import Scheduler

if TYPE_CHECKING:
    from .estimator import Estimator
    from .interfaces import CostModel
    from .policy import Policy

__all__ = ["GrantScheduler"]


class GrantScheduler(Scheduler):
    """A :class:`Scheduler` whose rounds hand out slice grants (see the module docstring).

    ``cost`` must also give the estimator (``cost.estimator``) and, as
    :class:`~sclsd.core.interfaces.CachedCost` does, Δ (``kv_bytes_per_token``)
    and the KV a worker may hold (``device_kv_bytes``, ζ · M_ava): a worker's
    grants reserve at most ``device_kv_bytes / kv_bytes_per_token`` tokens.
    """

    def __init__(self, policy: Policy, cost: CostModel, *, max_failures: int = 3,
                 history: int = 64) -> None:
        super().__init__(policy, cost, max_failures=max_failures, history=history)
        self.grants = GrantPolicy(self._estimator(), policy.slice_len, self.token_budget())
        #: KV to release that the policy did not decide (a failed grant's), by worker.
        self._release: dict[str, list[str]] = {}
        self.counters["grants"] = 0
        self.counters["migrations"] = 0
        self.next_at = float("inf")  # rounds run on changes only (see due)

    # ------------------------------------------------------------------ cost facts

    def _estimator(self) -> Estimator:
        return self.cost.estimator  # type: ignore[attr-defined]

    def token_budget(self) -> int:
        """KV tokens one worker's grants may reserve: ζ · M_ava / Δ of the tightest worker."""
        delta = int(self.cost.kv_bytes_per_token)  # type: ignore[attr-defined]
        return int(self.cost.device_kv_bytes // max(1, delta))  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ workers

    def add_worker(self, wid: str) -> None:
        super().add_worker(wid)
        self.grants.add_worker(wid)

    def set_active(self, wid: str, active: bool) -> None:
        super().set_active(wid, active)
        self.grants.set_active(wid, active)

    def remove_worker(self, wid: str, now: float) -> list[Request]:
        """A worker died: its grants' requests queue again, first, to re-prefill elsewhere."""
        self.grants.remove_worker(wid)
        self._release.pop(wid, None)
        back = super().remove_worker(wid, now)
        for r in reversed(back):
            self.grants.arrive(r.rid, r.input_len, r.remaining, first=True)
        return back

    # ------------------------------------------------------------------ requests

    def add(self, req: Request, now: float) -> None:
        super().add(req, now)
        self.grants.arrive(req.rid, req.input_len, req.remaining)

    def cancel(self, rid: str, now: float, reason: FinishReason = "cancelled") -> Request | None:
        """End a live request now. Outside a grant the policy forgets it at once; a grant
        still running holds its reservation until its result (or its worker's loss)."""
        req = super().cancel(rid, now, reason)
        if req is not None and req.batch_id is None:
            self.grants.forget(rid)
        return req

    # ------------------------------------------------------------------ scheduling

    def due(self, now: float) -> bool:
        """A round runs whenever something changed and requests wait (no interval)."""
        return bool(self.pool) and self._changed and bool(self.active_workers())

    def schedule(self, now: float) -> list[Batch]:
        """Grant what fits; each grant becomes a one-request batch on its worker."""
        if not self.pool or not self.active_workers():
            return []
        self._changed = False
        self.grants.est = self._estimator()  # a worker's profile or memory may have changed
        self.grants.budget = self.token_budget()
        self.grants.page = int(getattr(self.cost, "kv_page_tokens", 1))
        moved = self.grants.migrations
        out: list[Batch] = []
        for g in self.grants.schedule():
            r = self.pool.pop(g.rid)
            ws = self.workers[g.worker]
            batch = Batch(next(self._bids), [r], g.tokens, r.input_len, est_time=g.cost,
                          worker=g.worker)
            ws.load += g.cost
            ws.batches.add(batch.bid)
            self.batches[batch.bid] = batch
            r.state = State.SCHEDULED
            r.worker = g.worker
            r.batch_id = batch.bid
            if r.first_dispatch is None:
                r.first_dispatch = now
            out.append(batch)
        self.counters["batches"] += len(out)
        self.counters["grants"] += len(out)
        self.counters["migrations"] += self.grants.migrations - moved
        self.next_at = float("inf")  # no interval: the next round waits for a change
        return out

    # ------------------------------------------------------------------ retained KV

    def kv_evicted(self, wid: str, rids: Iterable[str]) -> None:
        """An engine dropped kept KV by itself: the estimate of a later grant there is off by
        its prefill, nothing worse (the engine re-prefills what it does not hold)."""
        self._changed = True

    def take_released(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for wid, rid in self.grants.take_evictions():
            out.setdefault(wid, []).append(rid)
        for wid, rids in self._release.items():
            out.setdefault(wid, []).extend(rids)
        self._release = {}
        return {w: rids for w, rids in out.items() if w in self.workers}

    # ------------------------------------------------------------------ results

    def on_result(self, outcome: BatchOutcome, now: float) -> list[Request]:
        """Apply a grant's result, then tell the policy how each of its requests ended."""
        batch = self.batches.get(outcome.batch_id)
        done = super().on_result(outcome, now)
        if batch is None:
            return done
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
                    self._release.setdefault(batch.worker, []).append(r.rid)
                r.kv_worker, r.kv_tokens = None, 0  # the policy tracks kept KV, not the ledger
        return done
