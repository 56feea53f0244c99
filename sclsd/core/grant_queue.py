"""Requests waiting for a grant: back from one and parked, or waiting in line.

:class:`GrantQueue` keeps the two lines the grant policy serves: requests back
from a grant, parked on the worker holding their KV (the largest next grant
first, then in the order they came back), and the others in line (a request
that lost its KV, or its worker, goes to the front).

The line is fair between groups (a client connection and user, or what the
client names with ``generate.group``: for sclsd-http, one HTTP request and its
``n`` choices): each newcomer gets a turn one past the later of its group's
last turn and the turn last served, and the line is kept in turn order, so 64
requests sent at once by one group take turns with a single request that
another group sends after them, instead of all going first (start-time fair
queueing, a request as the unit). With one group it is first come, first served.

Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["GrantQueue", "Pending"]


@dataclass(slots=True, eq=False)
class Pending:
    """A request waiting for its next grant."""

    rid: str
    context: int
    remaining: int
    holder: str | None
    """The worker holding its KV, if any."""
    key: float = 0.0
    """Its place among the returning requests (ascending: the largest next grant first)."""
    turn: float = -math.inf
    """Its place in line (see the module docstring); -inf: at the front."""


class GrantQueue:
    """The returning (parked) requests in order of key, and the waiting ones FCFS."""

    def __init__(self) -> None:
        self.waiting: deque[Pending] = deque()
        self.back: list[Pending] = []
        """Parked requests, ascending ``key``; equal keys in the order they came back."""
        self._keys: list[float] = []
        self._served = 0.0
        """The turn of the latest request taken from the line."""
        self._last: dict[str, float] = {}
        """Each group's latest turn."""

    def __len__(self) -> int:
        return len(self.waiting) + len(self.back)

    def join(self, p: Pending, group: str) -> None:
        """A newcomer of ``group`` takes its turn in line (see the module docstring)."""
        turn = max(self._served, self._last.get(group, -math.inf)) + 1.0
        self._last[group] = p.turn = turn
        waiting = self.waiting
        if not waiting or waiting[-1].turn <= turn:
            waiting.append(p)  # one group, or the latest turn: first come, first served
        else:
            i = len(waiting)
            while i > 0 and waiting[i - 1].turn > turn:
                i -= 1
            waiting.insert(i, p)
        if len(self._last) > 4096:  # groups come and go: forget those with nothing in line
            self._last = {g: t for g, t in self._last.items() if t > self._served}

    def take(self) -> Pending:
        """The head of the line leaves it (its grant was placed)."""
        p = self.waiting.popleft()
        if p.turn > self._served:
            self._served = p.turn
        return p

    def push_back(self, p: Pending, key: float) -> None:
        """``p`` joins the returning requests, after those of an equal or smaller key."""
        p.key = key
        k = bisect_right(self._keys, key)
        self.back.insert(k, p)
        self._keys.insert(k, key)

    def remove_back(self, p: Pending) -> bool:
        for k, q in enumerate(self.back):
            if q is p:
                del self.back[k]
                del self._keys[k]
                return True
        return False

    def rekey(self, key: Callable[[Pending], float]) -> None:
        """New keys for the returning requests; the order is sorted again, stably."""
        for p in self.back:
            p.key = key(p)
        self.back.sort(key=lambda p: p.key)
        self._keys = [p.key for p in self.back]

    def held_by(self, wid: str) -> list[Pending]:
        """The returning requests parked on ``wid``, in order."""
        return [p for p in self.back if p.holder == wid]

    def find_back(self, rid: str) -> Pending | None:
        return next((p for p in self.back if p.rid == rid), None)

    def remove_waiting(self, rid: str) -> bool:
        for p in self.waiting:
            if p.rid == rid:
                self.waiting.remove(p)
                return True
        return False
