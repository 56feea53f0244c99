"""Fair turns between groups for work that waits for a few slots (grammar checks).

:class:`Turns` is a line where each item belongs to the group that asked for it (a
request's group: its connection and ``user``, or what it names with
``generate.group``): a newcomer gets a turn one past the later of its group's last turn
and the turn last served, and items leave in turn order (start-time fair queueing with
an item as the unit, as the scheduler's line does for requests, :mod:`sclsd.core.grant_queue`).
So 64 items that one group queues at once take turns with a single item another group
queues after them, instead of all going first; with one group it is first come, first
served. An item a second group also asks for (the same grammar) moves up to that
group's turn where it is earlier, so no group waits behind another's turns for work it
shares.

Pure: no clock, no I/O.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Hashable
from typing import Generic, TypeVar

__all__ = ["Turns"]

T = TypeVar("T", bound=Hashable)


class Turns(Generic[T]):
    """Items in fair turns between their groups (see the module docstring)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, T]] = []
        self._turn: dict[T, tuple[float, int]] = {}
        """Each queued item's place (its turn, then the order it came); the heap may also hold
        stale places of items that left or moved, skipped when they reach its top."""
        self._seq = itertools.count()
        self._served = 0.0
        """The turn of the latest item taken."""
        self._last: dict[str, float] = {}
        """Each group's latest turn."""

    def __len__(self) -> int:
        return len(self._turn)

    def __contains__(self, item: T) -> bool:
        return item in self._turn

    def _next_turn(self, group: str) -> float:
        return max(self._served, self._last.get(group, -math.inf)) + 1.0

    def join(self, item: T, group: str) -> float:
        """``item`` of ``group`` takes its turn in line (it must not be in line); the turn."""
        assert item not in self._turn, "already in line"
        turn = self._last[group] = self._next_turn(group)
        self._place(item, turn)
        if len(self._last) > 4096:  # groups come and go: forget those with nothing left in line
            self._last = {g: t for g, t in self._last.items() if t > self._served}
        return turn

    def share(self, item: T, group: str) -> bool:
        """``group`` asks for ``item`` too (it is in line): it moves up to ``group``'s next
        turn where that is earlier, which ``group`` then spends. Whether it moved."""
        turn = self._next_turn(group)
        if turn >= self._turn[item][0]:
            return False
        self._last[group] = turn
        self._place(item, turn)
        return True

    def remove(self, item: T) -> bool:
        """``item`` leaves the line without its turn (nobody waits for it); whether it was in line."""
        return self._turn.pop(item, None) is not None

    def take(self) -> T | None:
        """The item whose turn is next leaves the line (None when the line is empty)."""
        heap = self._heap
        while heap:
            turn, seq, item = heapq.heappop(heap)
            if self._turn.get(item) == (turn, seq):
                del self._turn[item]
                self._served = max(self._served, turn)
                return item
        return None

    def _place(self, item: T, turn: float) -> None:
        place = (turn, next(self._seq))
        self._turn[item] = place
        heapq.heappush(self._heap, (*place, item))
        if len(self._heap) > 2 * len(self._turn) + 64:  # stale places: rebuild
            self._heap = [(t, s, i) for i, (t, s) in self._turn.items()]
            heapq.heapify(self._heap)
