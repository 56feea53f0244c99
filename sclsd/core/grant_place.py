"""Where one request's next grant goes, and how long it is: the placement rule of the grant
policy (:class:`~sclsd.core.grants.GrantPolicy`).

A request competes for the worker holding its KV (it has room, or will when its grants end;
it wins ties) and for every other worker with room and the headroom of
:class:`~sclsd.core.grant_books.GrantRules`, which pays the re-prefill (and the stall it
causes there, for a move): max-min over the workers' estimated loads with the KV-affinity
term. The worker index (:class:`~sclsd.core.grant_index.WorkerIndex`) finds the best other
worker without a scan. A new request with a prefix hint (a worker likely to hold a cached
prefix of its prompt) goes there where it has room and finishes the request no later than the
best other worker, its prefill there counted only past the prefix. A holder short of room for
a whole grant gives what fits, if enough; else the request parks there.

Pure: no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from .estimator import Estimator
from .grant_books import GrantBooks, GrantRules
from .grant_fleet import Grant, pages
from .grant_queue import Pending

__all__ = ["GrantPlacement", "Placement"]


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


class GrantPlacement(GrantBooks):
    """The placement rule over the policy's books (see the module docstring)."""

    def __init__(self, est: Estimator, slice_len: int, token_budget: float,
                 rules: GrantRules | None = None) -> None:
        super().__init__(est, slice_len, token_budget, rules)
        self._evict: list[tuple[str, str]] = []
        """(worker, rid): kept KV the policy stopped counting on, until taken."""
        self._after: str | None = None
        """The worker the last move went to: ties among the others rotate from there."""
        self.migrations = 0
        """Grants that moved a request away from the worker holding its KV."""
        self.placements: list[Placement] = []
        self.record_placements = False

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
        # Short grants make reservations follow use while the line waits for KV room. Where
        # the free rows cannot take everyone in line, it waits for a row instead: a shorter
        # grant frees no memory anyone waits for and only adds a return (a round trip, and
        # on an arena engine a pause and a regroup) every S/4 tokens, so it keeps its S.
        others = self._others_waiting(p)
        if rules.short and others and others < fleet.free_rows():
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
        if h is None and p.prefix is not None:
            slot = self._prefix_slot(p, slot, need, busy, headroom)
        fits_holder = h is not None and fleet.fits(h, need, p.rid)
        if slot >= 0:
            w = fleet.books[fleet.names[slot]]
        elif h is not None and not fits_holder and rules.least and fleet.has_row(h):
            room = fleet.budget - (h.reserved - h.parked.get(p.rid, 0))
            fit = room // self._page * self._page - p.context  # the most whole pages allow
            if fit < rules.tokens(rules.least, self._S):
                fleet.starve(h, p.rid)
                return None
            tokens, w = min(tokens, fit), h
        elif fits_holder and h is not None:
            w = h
        else:
            if h is not None and fleet.has_row(h):
                fleet.starve(h, p.rid)  # a row there, but not its room
            return None
        held = w is h
        if h is None and p.prefix is not None and w.wid == p.prefix[0]:
            pre = self.prefill_cost(_tail(p))  # its load there: the prompt past the prefix
        elif not held and pre == 0.0:
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

    def _prefix_slot(self, p: Pending, slot: int, need: int, busy: float, headroom: int) -> int:
        """The slot for new request ``p`` given its prefix hint: the hinted worker where it
        has room (and the headroom, where grants run) and finishes ``p`` no later than the
        best other (``slot``, -1: none), counting there only the prefill of the prompt past
        the prefix; else ``slot``. A hint is a likelihood (the worker may have dropped the
        prefix), so it weighs only what it would save, never parks or evicts anything."""
        assert p.prefix is not None
        fleet = self._fleet
        w = fleet.get(p.prefix[0])
        if w is None or w.slot == slot or not w.active or not fleet.has_row(w) or fleet.blocked(w):
            return slot
        if fleet.budget - w.reserved < (need + headroom if w.grants else need):
            return slot
        key = (w.load + busy) + self.prefill_cost(_tail(p))
        if slot >= 0:
            best = fleet.books[fleet.names[slot]]
            if key > (best.load + busy) + self.prefill_cost(p.context):
                return slot
        return w.slot

    def _headroom(self, tokens: int) -> int:
        """KV tokens to leave free beside a grant of ``tokens`` that brings a context in."""
        rules = self._rules
        if not rules.headroom or self.rho <= 0.0:
            return 0
        cap = int(rules.headroom_cap * self._fleet.budget)
        if self.rho >= 1.0:
            return cap
        return min(cap, int(rules.headroom * tokens * self.rho / (1.0 - self.rho)))

    def _others_waiting(self, p: Pending) -> int:
        """Requests other than ``p`` waiting in line for room."""
        return self._q.n_waiting - (1 if p.holder is None and p.rid in self._q else 0)


def _tail(p: Pending) -> int:
    """The prompt tokens new request ``p`` prefills on the worker of its prefix hint."""
    assert p.prefix is not None
    return max(1, p.context - min(p.prefix[1], p.context - 1))
