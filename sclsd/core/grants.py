"""Slice grants on continuous-batching workers (policy ``scls-cb``).

Workers run continuous batching; the policy hands out *grants*: request r may
generate up to S more tokens on worker w. Memory is reserved per grant:

    reserved(w) = Σ over w's grants of (context at grant + granted tokens)
                + Σ over requests back from a grant on w of their context (KV kept)

in KV tokens, and a grant is admitted only while ``reserved(w)`` stays within
the worker's budget ζ · M_ava / Δ. A granted request never needs more KV than
its reservation, so no worker ever preempts or runs out of memory, while only
S tokens per request are reserved ahead instead of its whole ``max_tokens``.

When a grant ends (S tokens or EOS) the request comes back. The policy places
it again with max-min over the workers' estimated loads plus the KV-affinity
term: it stays on the worker holding its KV (no re-prefill) unless another
worker with room finishes its work sooner by more than the re-prefill the KV
saves *and* the stall that re-prefill causes to every request running on
that worker. Staying where there is no room yet, it gets what room there is
(a shorter grant) or waits there (parked, its KV reserved) until grants there
end; see :meth:`GrantPolicy.schedule`. Returning requests go before new ones;
new requests are granted, FCFS, as soon as some worker has room (no
scheduling interval).

Reservations follow use (:class:`GrantRules`): while requests wait for room
grants shrink to S/4 tokens, so that what is reserved ahead of use stays
small; and a request that brings its context to a busy worker (new, or moved)
must leave room there for the next grants of the requests expected back
before one finishes and frees its KV, so that returning requests resume
rather than park. Nothing of this relaxes the bound above: reservations stay
within the budget, so there is still no preemption and no overflow.

A worker's load is the estimated time to finish its granted slices under the
continuous-batching cost model: an iteration of N requests with contexts l_i
costs d1 · Σ l_i + d2 · N + d4, so a grant of s tokens from context c adds
d1 · (c·s + s(s+1)/2) + d2 · s (plus its prefill, eq. 3 for one row, when the
worker does not hold its KV), and a busy worker adds d4 per iteration for
S iterations, whatever the number of grants (d3 is neglected). Loads rise
when a grant is made and fall when it ends, as the paper's scheduler does
with batches.

Pure: no clock, no I/O. The driver (the simulator or the daemon) reports
arrivals and grant ends and applies the grants :meth:`GrantPolicy.schedule`
returns; :meth:`GrantPolicy.take_evictions` says which retained KV to free.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .estimator import Estimator
from .grant_books import GrantBooks, GrantRules
from .grant_fleet import Grant, WorkerBook, pages
from .grant_queue import Pending

__all__ = ["Grant", "GrantPolicy", "GrantRules", "Placement"]


@dataclass(frozen=True, slots=True)
class Placement:
    """Why a returning request went where it went (for tests and traces)."""

    rid: str
    holder: str
    worker: str
    gap: float
    """load(holder) − load(worker) when decided (0 when it stayed)."""
    reprefill_cost: float
    fits_holder: bool


class GrantPolicy(GrantBooks):
    """Grants of at most ``slice_len`` tokens under a per-worker KV budget; see the module docstring.

    Incremental: the books of every worker live in a :class:`~sclsd.core.grant_fleet.GrantFleet`
    whose index finds the worker for a grant in O(log n), and :meth:`schedule` does
    nothing unless something changed since the last round that granted nothing.
    """

    def __init__(
        self, est: Estimator, slice_len: int, token_budget: float, workers: Iterable[str] = (),
        *, rules: GrantRules | None = None,
    ) -> None:
        super().__init__(est, slice_len, token_budget, rules)
        self._evict: list[tuple[str, str]] = []
        self._stuck: set[str] = set()
        """Workers left with parked requests and no grant since the last round."""
        self._after: str | None = None
        self.migrations = 0
        """Grants that moved a request away from the worker holding its KV."""
        self.drops = 0
        """Parked KV given up because its idle worker could fit none of its parked requests."""
        self.rounds = 0
        """Calls of :meth:`schedule` that had something to decide (the others return at once)."""
        self.placements: list[Placement] = []
        self.record_placements = False
        for w in workers:
            self.add_worker(w)

    # ------------------------------------------------------------------ fleet

    def add_worker(self, wid: str) -> None:
        """``wid`` joins the fleet (or comes back into rotation, if it was drained)."""
        self._fleet.add(wid)
        self._changed()

    def set_active(self, wid: str, active: bool) -> None:
        """Take ``wid`` out of rotation (drain) or back in. Out of rotation it gets no new
        grant; requests waiting on its KV queue again (that KV is evicted), and grants
        running there keep running."""
        w = self._fleet.get(wid)
        if w is None:
            return
        self._fleet.set_active(w, active)
        self._changed()
        if not active:
            for p in self._q.held_by(wid):
                self._drop_holder(p)

    def remove_worker(self, wid: str) -> list[str]:
        """Forget ``wid``; returns the ids of the requests it held grants for (their KV is lost)."""
        w = self._fleet.remove(wid)
        self._stuck.discard(wid)
        if w is None:
            return []
        self._changed()
        lost = list(w.grants)  # the driver re-submits them with arrive()
        moved = self._q.held_by(wid)
        for p in moved:
            self._q.remove_back(p)
        for p in reversed(moved):
            p.holder = None
            self._q.waiting.appendleft(p)
        return lost

    # ------------------------------------------------------------------ events

    def arrive(self, rid: str, context: int, remaining: int, *, first: bool = False,
               group: str = "") -> None:
        """A new request: ``context`` prompt tokens, at most ``remaining`` to generate, of
        ``group`` (its turn in line is fair between groups: :class:`~.grant_queue.GrantQueue`).

        ``first``: queue it ahead of the waiting ones (a request whose worker was lost).
        """
        if remaining > 0:
            p = Pending(rid, context, remaining, None)
            if first:
                self._q.waiting.appendleft(p)
            else:
                self._q.join(p, group)
            self._dirty = True

    def end(self, rid: str, context: int, remaining: int, *, kept: bool = True) -> Grant:
        """``rid``'s grant ended with ``context`` tokens and ``remaining`` left (0: finished).

        Its reservation is freed but for the KV an unfinished request keeps on the worker
        (``kept``: the worker said it keeps it; otherwise the request queues again to
        re-prefill wherever it goes, ahead of new ones).
        """
        found = self._fleet.ungrant(rid)
        if found is None:
            raise KeyError(f"no grant for {rid!r}")
        w, g = found
        back = 1.0 if remaining > 0 else 0.0
        self.rho += (back - self.rho) / self._rules.window
        if remaining > 0:
            if kept and w.active:  # its KV stays, reserved, until placed
                self._fleet.park(w, rid, pages(context, self._page))
                p = Pending(rid, context, remaining, w.wid)
                self._q.push_back(p, self._back_key(p))
            else:
                if kept:
                    self._evict.append((w.wid, rid))
                self._q.waiting.appendleft(Pending(rid, context, remaining, None))
        self._changed(w)
        self._check_stuck(w)
        return g

    def forget(self, rid: str) -> bool:
        """``rid`` ended outside a grant's end (cancelled, timed out, failed): drop what the
        policy holds for it (a grant, a parked KV, a queue place); False if nothing."""
        found = self._fleet.ungrant(rid)
        if found is not None:
            self._evict.append((found[0].wid, rid))  # the engine may keep it after the grant
            self._changed(found[0])
            self._check_stuck(found[0])
            return True
        p = self._q.find_back(rid)
        if p is not None:
            self._drop_holder(p, requeue=False)
            return True
        if self._q.remove_waiting(rid):
            self._dirty = True  # the next in line may fit where this one did not
            return True
        return False

    def take_evictions(self) -> list[tuple[str, str]]:
        """(worker, rid) pairs whose retained KV the policy no longer counts on."""
        out, self._evict = self._evict, []
        return out

    def _check_stuck(self, w: WorkerBook) -> None:
        if w.parked and not w.grants:
            self._stuck.add(w.wid)

    def _drop_holder(self, p: Pending, *, requeue: bool = True) -> None:
        """Evict ``p``'s parked KV; with ``requeue`` it waits again, first, with no holder."""
        self._q.remove_back(p)
        holder = p.holder
        w = self._fleet.get(holder)
        self._fleet.unpark(w, p.rid)
        if w is not None:
            self._changed(w)
        if holder is not None:
            self._evict.append((holder, p.rid))
        p.holder = None
        if requeue:
            self._q.waiting.appendleft(p)

    # ------------------------------------------------------------------ decisions

    def schedule(self) -> list[Grant]:
        """Grant what fits: returning requests first (largest first), then new ones FCFS.

        A returning request that does not fit on the worker holding its KV, and
        that no less loaded worker with room takes, is *parked* there: its KV
        stays reserved and it goes first when that worker's grants end. A worker
        with parked requests takes no other new grant. A worker left with no
        grant and parked requests that cannot fit drops the largest one's KV
        (it queues again, to re-prefill wherever it goes) until one fits.

        A parked request is looked at again when the books of the worker holding
        its KV change (a grant there ends or starts, parked KV there goes) or when
        some worker falls idle or joins; a round that follows no change (no event
        since a round that granted and dropped nothing) returns at once.
        """
        if not self._dirty:
            return []
        self.rounds += 1
        due, self._due = self._due, set()
        every, self._all_due = self._all_due, False
        out: list[Grant] = []
        for p in list(self._q.back):
            if not every and p.holder not in due:
                continue  # nothing changed for it since it was parked, or last passed over
            g = self._place(p)
            if g is not None:  # else parked: it waits where its KV is (reserved there since its end)
                self._q.remove_back(p)
                out.append(g)
        dropped = self._unblock(out)
        waiting = self._q.waiting
        while waiting:
            g = self._place(waiting[0])
            if g is None:
                break  # head-of-line: in turn
            self._q.take()
            out.append(g)
        # A grant or a drop can free room for a request that was already passed over.
        self._dirty = bool(out) or dropped
        return out

    def _unblock(self, out: list[Grant]) -> bool:
        """Idle workers whose parked requests cannot fit drop KV until one does; True if any did."""
        stuck, self._stuck = self._stuck, set()
        dropped = False
        books = [self._fleet.books[wid] for wid in stuck if wid in self._fleet]
        for w in sorted(books, key=lambda b: b.order):
            while w.parked and not w.grants:
                mine = self._q.held_by(w.wid)
                if not mine:
                    break
                granted = False
                for p in mine:
                    g = self._place(p)
                    if g is not None:
                        self._q.remove_back(p)
                        out.append(g)
                        granted = True
                if granted or not w.parked:
                    continue
                self._drop_holder(max(mine, key=lambda p: p.context))
                self.drops += 1
                dropped = True
        return dropped

    def _place(self, p: Pending) -> Grant | None:
        """Grant ``p`` on the worker where it finishes first (None: wait, parked where it is).

        The holder of its KV always competes (it has room, or will when its grants
        end) and wins ties; another worker competes only with room (and the headroom
        of :class:`GrantRules`) and nothing parked, and pays the re-prefill (plus the
        stall it causes there, for a move). Ties among the others rotate so idle
        workers share lone requests. A holder short of room for the whole grant
        gives what fits, if enough (see :class:`GrantRules`).
        """
        fleet, rules = self._fleet, self._rules
        if not fleet.names:
            return None
        # A context near the budget gets a shorter grant rather than none.
        tokens = min(self._S, p.remaining, max(1, fleet.budget - p.context))
        if rules.short and self._others_wait(p):
            tokens = min(tokens, rules.tokens(rules.short, self._S))
        need = pages(p.context + tokens, self._page)
        busy = self._busy_cost()
        h = fleet.get(p.holder)
        if h is not None and not h.active:
            h = None
        limit = (h.load + busy) + 0.0 if h is not None else float("inf")
        # Another worker takes p only with room for its grant and, unless idle, the headroom.
        headroom = self._headroom(tokens)
        slot = -1
        pre = per_row = 0.0
        index = fleet.index
        # Cheap bounds first: most rounds no other worker has room, or none is ahead enough.
        if index.most_free() >= need:
            pre = self.prefill_cost(p.context)
            per_row = pre * rules.stall if h is not None else 0.0
            if index.least_key(busy, pre, per_row) < limit:
                slot, _ = index.best(need, busy, pre, start=fleet.start_after(self._after),
                                     limit=limit, per_row=per_row, extra=headroom)
        fits_holder = h is not None and fleet.fits(h, need, p.rid)
        if slot >= 0:
            w = fleet.books[fleet.names[slot]]
        elif h is not None and not fits_holder and rules.least:
            room = fleet.budget - (h.reserved - h.parked.get(p.rid, 0))
            fit = room // self._page * self._page - p.context  # the most whole pages allow
            if fit < rules.tokens(rules.least, self._S):
                return None
            tokens, w = min(tokens, fit), h
        elif fits_holder and h is not None:
            w = h
        else:
            return None
        held = w is h
        if not held and pre == 0.0:
            pre = self.prefill_cost(p.context)
        if self.record_placements and h is not None:
            self.placements.append(Placement(
                p.rid, h.wid, w.wid, 0.0 if held else (h.load + busy) - (w.load + busy),
                self.prefill_cost(p.context), fits_holder))
        hw = fleet.get(p.holder)
        fleet.unpark(hw, p.rid)
        cost = self.decode_cost(p.context, tokens) + (0.0 if held else pre)
        g = Grant(p.rid, w.wid, p.context, tokens, 0 if held else p.context, cost, self._page)
        if p.holder is not None and not held:
            self.migrations += 1
            self._evict.append((p.holder, p.rid))
        fleet.grant(w, g)
        if hw is not None:
            self._changed(hw)  # the holder's other parked requests may fit, or move, now
        if not held:
            self._after = w.wid
        return g

    def _headroom(self, tokens: int) -> int:
        """KV tokens to leave free beside a grant of ``tokens`` that brings a context in."""
        rules = self._rules
        if not rules.headroom or self.rho <= 0.0:
            return 0
        cap = int(rules.headroom_cap * self._fleet.budget)
        if self.rho >= 1.0:
            return cap
        return min(cap, int(rules.headroom * tokens * self.rho / (1.0 - self.rho)))

    def _others_wait(self, p: Pending) -> bool:
        """Requests other than ``p`` wait in line for room."""
        waiting = self._q.waiting
        return len(waiting) > (1 if waiting and waiting[0] is p else 0)

