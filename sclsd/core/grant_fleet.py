"""The grant policy's books on the workers: grants, reservations, loads and parked KV.

:class:`GrantFleet` holds one :class:`WorkerBook` per worker and keeps a
:class:`~sclsd.core.grant_index.WorkerIndex` in step with them: every change
of a worker's reservation, load, grants or parked requests updates its slot,
so the policy finds the worker for a grant with a descent of the index
instead of a scan of the fleet. Slots follow the workers' names in sorted
order, which is the order ties rotate in.

Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Iterator
from dataclasses import dataclass, field

from .grant_index import WorkerIndex

__all__ = ["Grant", "WorkerBook", "GrantFleet", "pages"]


def pages(tokens: int, page: int) -> int:
    """``tokens`` rounded up to whole pages of ``page`` tokens."""
    return -(-tokens // page) * page


@dataclass(frozen=True, slots=True)
class Grant:
    """Request ``rid`` may generate up to ``tokens`` more tokens on ``worker``."""

    rid: str
    worker: str
    context: int
    """Tokens of context when the grant starts (prompt plus tokens generated so far)."""
    tokens: int
    prefill: int
    """Tokens the worker must prefill first: 0 when it holds the request's KV."""
    cost: float
    """The estimate added to the worker's load."""
    page: int = 1
    """The worker's KV page in tokens: a grant reserves whole pages."""

    @property
    def reserve(self) -> int:
        """KV tokens reserved for this grant: context plus granted tokens, in whole pages."""
        return pages(self.context + self.tokens, self.page)


@dataclass(slots=True)
class WorkerBook:
    """What the policy counts on one worker."""

    wid: str
    reserved: int = 0
    """KV tokens reserved: its grants' reservations plus its parked requests' KV."""
    load: float = 0.0
    grants: dict[str, Grant] = field(default_factory=dict)
    parked: dict[str, int] = field(default_factory=dict)
    """Returning requests waiting here for room, by the KV tokens they keep reserved."""
    rows: int = 0
    """The most grants it holds at once: the rows its engine runs plus a lookahead (0: as many
    as its KV budget takes)."""
    starved: set[str] = field(default_factory=set)
    """With ``rows``: returning requests here that found a free row but not their KV room;
    until they are placed no other request takes its room."""
    active: bool = True
    slot: int = 0
    """Its place in sorted name order (the index's slot)."""
    order: int = 0
    """When it was added, relative to the others (the order idle workers are unblocked in)."""


class GrantFleet:
    """Every worker's :class:`WorkerBook` and the index over them (see the module docstring)."""

    def __init__(self) -> None:
        self.budget = 0
        self.books: dict[str, WorkerBook] = {}
        """In the order the workers were added (the order idle workers are unblocked in)."""
        self.names: list[str] = []
        """Sorted: slot k is names[k]."""
        self.index = WorkerIndex(0)
        self._where: dict[str, str] = {}
        """rid -> the worker it holds a grant on."""
        self._added = 0

    # ------------------------------------------------------------------ membership

    def __contains__(self, wid: object) -> bool:
        return wid in self.books

    def __iter__(self) -> Iterator[WorkerBook]:
        return iter(self.books.values())

    def __len__(self) -> int:
        return len(self.books)

    def get(self, wid: str | None) -> WorkerBook | None:
        return self.books.get(wid) if wid is not None else None

    def add(self, wid: str) -> WorkerBook:
        """``wid`` in rotation (added if new)."""
        w = self.books.get(wid)
        if w is None:
            w = self.books[wid] = WorkerBook(wid, order=self._added)
            self._added += 1
            self.names.append(wid)
            self.names.sort()
            self.rebuild()
        elif not w.active:
            w.active = True
            self.touch(w)
        return w

    def remove(self, wid: str) -> WorkerBook | None:
        w = self.books.pop(wid, None)
        if w is not None:
            self.names.remove(wid)
            for rid in w.grants:
                self._where.pop(rid, None)
            self.rebuild()
        return w

    def set_active(self, w: WorkerBook, active: bool) -> None:
        w.active = active
        self.touch(w)

    def rebuild(self) -> None:
        """Slots again from the sorted names (after a worker came or went, or the budget changed)."""
        self.index = WorkerIndex(len(self.names))
        for k, wid in enumerate(self.names):
            w = self.books[wid]
            w.slot = k
            self.touch(w)

    def start_after(self, name: str | None) -> int:
        """The first slot whose name sorts after ``name`` (0 if none): where rotation resumes."""
        if name is None:
            return 0
        k = bisect_right(self.names, name)
        return k if k < len(self.names) else 0

    # ------------------------------------------------------------------ books

    def touch(self, w: WorkerBook) -> None:
        """Bring ``w``'s slot in the index up to date with its book."""
        if w.active and self.has_row(w) and not self.blocked(w):
            self.index.set(w.slot, self.budget - w.reserved, w.load, len(w.grants))
        else:
            self.index.clear(w.slot)

    @staticmethod
    def has_row(w: WorkerBook) -> bool:
        """Whether ``w`` may hold another grant (``rows`` not reached)."""
        return not w.rows or len(w.grants) < w.rows

    @staticmethod
    def blocked(w: WorkerBook) -> bool:
        """Whether ``w`` keeps its room for requests parked on it: any of them, where its rows
        are unbounded (they go first there); with ``rows``, those short of KV room (fair turns
        decide who gets a free row)."""
        return bool(w.starved) if w.rows else bool(w.parked)

    def rows_bounded(self) -> bool:
        """Whether some worker bounds the grants it holds (``rows``)."""
        return any(w.rows for w in self.books.values())

    def free_rows(self) -> float:
        """Grants the workers in rotation may still take before their rows are all held
        (infinite where one of them has no bound)."""
        free = 0
        for w in self.books.values():
            if not w.rows:
                return math.inf
            if w.active:
                free += max(0, w.rows - len(w.grants))
        return free

    def any_row(self) -> bool:
        """Whether some worker in rotation may hold another grant."""
        return any(w.active and self.has_row(w) for w in self.books.values())

    def starve(self, w: WorkerBook, rid: str) -> None:
        """``rid``, parked on ``w``, found a free row there but not its KV room."""
        if w.rows and rid in w.parked and rid not in w.starved:
            w.starved.add(rid)
            self.touch(w)

    def holder_of(self, rid: str) -> str | None:
        """The worker ``rid`` holds a grant on, if any."""
        return self._where.get(rid)

    def grant(self, w: WorkerBook, g: Grant) -> None:
        w.grants[g.rid] = g
        w.reserved += g.reserve
        w.load += g.cost
        self._where[g.rid] = w.wid
        self.touch(w)

    def ungrant(self, rid: str) -> tuple[WorkerBook, Grant] | None:
        """Take ``rid``'s grant off its worker: its reservation and load freed."""
        wid = self._where.pop(rid, None)
        if wid is None:
            return None
        w = self.books[wid]
        g = w.grants.pop(rid)
        w.reserved -= g.reserve
        w.load = w.load - g.cost if w.grants else 0.0  # no drift: idle means no load
        self.touch(w)
        return w, g

    def park(self, w: WorkerBook, rid: str, tokens: int) -> None:
        w.parked[rid] = tokens
        w.reserved += tokens
        self.touch(w)

    def unpark(self, w: WorkerBook | None, rid: str) -> None:
        if w is not None and rid in w.parked:
            w.reserved -= w.parked.pop(rid)
            w.starved.discard(rid)
            self.touch(w)

    def fits(self, w: WorkerBook, need: int, rid: str) -> bool:
        """``need`` more tokens fit on ``w`` beside what it reserves (but ``rid``'s own parked
        KV), and it has a row for them."""
        return self.has_row(w) and w.reserved - w.parked.get(rid, 0) + need <= self.budget
