"""Requests waiting for a grant: back from one and parked, or waiting in line.

:class:`GrantQueue` keeps the two lines the grant policy serves: requests back
from a grant, parked on the worker holding their KV (the largest next grant
first, then in the order they came back), and the others, first come first
served (a request that lost its KV, or its worker, goes to the front).

Pure: no clock, no I/O.
"""

from __future__ import annotations

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


class GrantQueue:
    """The returning (parked) requests in order of key, and the waiting ones FCFS."""

    def __init__(self) -> None:
        self.waiting: deque[Pending] = deque()
        self.back: list[Pending] = []
        """Parked requests, ascending ``key``; equal keys in the order they came back."""
        self._keys: list[float] = []

    def __len__(self) -> int:
        return len(self.waiting) + len(self.back)

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
