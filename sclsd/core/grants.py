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
small (not where the free rows are fewer than the requests in line: they
wait for a row then, and a shorter grant only adds returns); and a request
that brings its context to a busy worker (new, or moved) must leave room
there for the next grants of the requests expected back before one finishes
and frees its KV, so that returning requests resume rather than park.
Nothing of this relaxes the bound above: reservations stay within the
budget, so there is still no preemption and no overflow.

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

from .estimator import Estimator
from .grant_books import GrantRules
from .grant_fleet import Grant, WorkerBook, pages
from .grant_place import GrantPlacement, Placement
from .grant_queue import Group, Pending

__all__ = ["Grant", "GrantPolicy", "GrantRules", "Placement"]


class GrantPolicy(GrantPlacement):
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
        self._stuck: set[str] = set()
        """Workers left with parked requests and no grant since the last round."""
        self.drops = 0
        """Parked KV given up because its idle worker could fit none of its parked requests."""
        self.rounds = 0
        """Calls of :meth:`schedule` that had something to decide (the others return at once)."""
        for w in workers:
            self.add_worker(w)

    # ------------------------------------------------------------------ fleet

    def add_worker(self, wid: str, rows: int = 0) -> None:
        """``wid`` joins the fleet (or comes back into rotation, if it was drained); it holds at
        most ``rows`` grants at once (0: as many as its KV budget takes)."""
        w = self._fleet.add(wid)
        w.rows = max(0, int(rows))
        self._fleet.touch(w)
        self._changed()

    def set_rows(self, wid: str, rows: int) -> None:
        """``wid`` holds at most ``rows`` grants at once from now on (0: as many as its KV
        budget takes); grants it holds beyond that run on, and it gets no more until they end."""
        w, rows = self._fleet.get(wid), max(0, int(rows))
        if w is None or w.rows == rows:
            return
        w.rows = rows
        self._fleet.touch(w)
        self._changed(w)

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
        for p in reversed(self._q.held_by(wid)):  # at the front, in their order
            self._q.remove(p)
            p.holder = None
            self._q.push_front(p)
        return lost

    # ------------------------------------------------------------------ events

    def arrive(self, rid: str, context: int, remaining: int, *, first: bool = False,
               group: tuple[str, ...] = (), prefix: tuple[str, int] | None = None) -> None:
        """A new request: ``context`` tokens of context, at most ``remaining`` to generate, of
        ``group`` (a path: its turns in line are fair between groups at every level,
        :class:`~.grant_queue.GrantQueue`).

        ``first``: it goes ahead of the line (a request whose worker was lost; its group stays).
        ``prefix``: a worker likely to hold a cached prefix of its prompt, and its tokens (the
        prefill it saves there weighs in its placement).
        """
        if remaining > 0:
            p = Pending(rid, context, remaining, None, prefix)
            if first:
                self._q.push_front(p)
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
                self._q.push_front(Pending(rid, context, remaining, None))
        else:
            self._q.leave(rid)
        self._changed(w)
        self._check_stuck(w)
        return g

    def forget(self, rid: str) -> bool:
        """``rid`` ended outside a grant's end (cancelled, timed out, failed): drop what the
        policy holds for it (a grant, a parked KV, a queue place); False if nothing."""
        found = self._fleet.ungrant(rid)
        p = self._q.find(rid)
        self._q.leave(rid)
        if found is not None:
            self._evict.append((found[0].wid, rid))  # the engine may keep it after the grant
            self._changed(found[0])
            self._check_stuck(found[0])
            return True
        if p is not None and p.holder is not None:
            self._drop_holder(p, requeue=False)
            return True
        if p is not None:
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
        self._q.remove(p)
        holder = p.holder
        w = self._fleet.get(holder)
        self._fleet.unpark(w, p.rid)
        if w is not None:
            self._changed(w)
        if holder is not None:
            self._evict.append((holder, p.rid))
        p.holder = None
        if requeue:
            self._q.push_front(p)

    # ------------------------------------------------------------------ decisions

    def schedule(self) -> list[Grant]:
        """Grant what fits, groups in their turns (:class:`~.grant_queue.GrantQueue`), each
        group's returning requests first (largest first), then its others, first come, first
        served; requests that lost their worker or KV go before the others.

        Where workers' rows are unbounded (their KV budget alone bounds them), returning
        requests go first, every group's before any newcomer: their KV is reserved already
        and waiting wastes it. Where workers bound their rows, a free row is what requests
        wait for, and it goes to the next group in turn, returning or new (else a burst of
        long requests, coming back slice after slice, would hold every row until it ends).

        A returning request that does not fit on the worker holding its KV, and
        that no less loaded worker with room takes, is *parked* there: its KV
        stays reserved until that worker's grants end. With rows unbounded a worker
        with parked requests takes no other new grant (they go first there); with rows
        bounded, only one whose parked request found a free row but not its KV room.
        A worker left with no grant and parked requests that cannot fit drops the
        largest one's KV (it queues again, to re-prefill wherever it goes) until one
        fits. A request holding no KV that fits nowhere stops the line (its turn comes
        first); a returning one that waits lets its group's next request try.

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
        q, fleet = self._q, self._fleet
        rows = fleet.rows_bounded()
        if not rows:
            self._turns(out, due, every, held=True, new=False)
        dropped = self._unblock(out)
        stuck = False
        while q.front and not stuck:
            p = q.front[0]
            g = self._place(p)
            if g is None:
                stuck = True  # head of the line: nobody behind it goes first
            else:
                q.take(p)
                out.append(g)
        self._turns(out, due, every, held=rows, new=not stuck)
        # A grant or a drop can free room for a request that was already passed over.
        self._dirty = bool(out) or dropped
        return out

    def _turns(self, out: list[Grant], due: set[str], every: bool, *, held: bool, new: bool) -> None:
        """Grant in the groups' turns: each group's returning requests (``held``), then its
        others (``new``), until nothing more fits."""
        q, fleet = self._q, self._fleet
        done: set[int] = set()
        pos: dict[int, int] = {}
        blocked = not new
        while fleet.any_row() and (group := q.next_group(done)) is not None:
            p, g, blocked = self._next_of(group, pos, due, every, held, blocked)
            if p is None or g is None:
                done.add(id(group))
            else:
                q.take(p)
                out.append(g)

    def _next_of(self, group: Group, pos: dict[int, int], due: set[str], every: bool, held: bool,
                 blocked: bool) -> tuple[Pending | None, Grant | None, bool]:
        """The next grant of ``group`` this round: (its request, the grant, whether the line is
        blocked now); (None, None, blocked) when none of its requests can have one.
        ``pos``: how far into each group's returning requests this round got."""
        back, k = group.back, pos.get(id(group), len(group.back) if not held else 0)
        while k < len(back):
            p = back[k]
            k += 1
            if not every and p.holder not in due:
                continue  # nothing changed for it since it was parked, or last passed over
            g = self._place(p)
            if g is not None:  # it leaves the list: the next one takes its place
                pos[id(group)] = k - 1
                return p, g, blocked
            # else parked: it waits where its KV is (reserved there since its end)
        pos[id(group)] = k
        if blocked or not group.waiting:
            return None, None, blocked
        p = group.waiting[0]
        g = self._place(p)
        return (p, g, blocked) if g is not None else (None, None, True)

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
                        self._q.take(p)
                        out.append(g)
                        granted = True
                if granted or not w.parked:
                    continue
                self._drop_holder(max(mine, key=lambda p: p.context))
                self.drops += 1
                dropped = True
        return dropped
