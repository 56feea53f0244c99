"""Which worker a grant should go to, without scanning every worker: a tournament tree.

:class:`WorkerIndex` keeps, for each worker slot, what a placement compares
(its free KV tokens, its load, its running grants) and, for each subtree of
slots, the best of each (most free tokens, least load, fewest grants). A
placement asks for the slot minimising

    key(w) = (load(w) + base) + add + per_row · rows(w)

among the slots with ``free(w) ≥ need`` (``need + extra`` where ``rows(w) > 0``), ties going to
the slot that comes first in rotation order (slots ``start, …, n−1, 0, …,
start−1``), and only below a ``limit``. The subtree aggregates bound every key
and every free count inside them from the right side, so a branch-and-bound
descent skips whole subtrees that cannot hold a better slot: a query visits
O(log n) nodes when the least loaded worker with room is found early, and an
update of one slot touches O(log n) nodes.

The key is computed in the order the scan over workers computes it, so the
same floating-point value comes out and ties fall where the scan puts them
(float addition and multiplication are monotone, which makes the bounds valid
for the rounded values too).

Pure: integers and floats only.
"""

from __future__ import annotations

__all__ = ["WorkerIndex"]

_NONE_FREE = -(1 << 62)
"""Free tokens of a slot that takes nothing (empty, or out of the running)."""
_NO_LOAD = float("inf")
_NO_ROWS = 1 << 62


class WorkerIndex:
    """Per-slot (free, load, rows) with subtree maxima and minima; see the module docstring."""

    __slots__ = ("n", "_size", "_free", "_load", "_rows")

    def __init__(self, n: int) -> None:
        self.n = n
        size = 1
        while size < max(1, n):
            size *= 2
        self._size = size
        self._free = [_NONE_FREE] * (2 * size)
        self._load = [_NO_LOAD] * (2 * size)
        self._rows = [_NO_ROWS] * (2 * size)

    def set(self, slot: int, free: int, load: float, rows: int) -> None:
        """Slot ``slot`` takes grants: it has ``free`` KV tokens, ``load`` and ``rows`` grants."""
        self._put(slot, free, load, rows)

    def clear(self, slot: int) -> None:
        """Slot ``slot`` takes no grant (out of rotation, or waiting for parked requests)."""
        self._put(slot, _NONE_FREE, _NO_LOAD, _NO_ROWS)

    def _put(self, slot: int, free: int, load: float, rows: int) -> None:
        i = slot + self._size
        fr, ld, rw = self._free, self._load, self._rows
        fr[i], ld[i], rw[i] = free, load, rows
        i >>= 1
        while i:
            a, b = 2 * i, 2 * i + 1
            f = fr[a] if fr[a] >= fr[b] else fr[b]
            lo = ld[a] if ld[a] <= ld[b] else ld[b]
            r = rw[a] if rw[a] <= rw[b] else rw[b]
            if fr[i] == f and ld[i] == lo and rw[i] == r:
                return  # the ancestors' aggregates cannot change either
            fr[i], ld[i], rw[i] = f, lo, r
            i >>= 1

    def most_free(self) -> int:
        """The most free tokens of a slot that takes grants."""
        return self._free[1]

    def least_key(self, base: float, add: float, per_row: float = 0.0) -> float:
        """A lower bound of the key over the slots that take grants (inf when none does)."""
        key = (self._load[1] + base) + add
        if per_row and self._rows[1] < _NO_ROWS:
            key += per_row * self._rows[1]
        return key

    def best(
        self,
        need: int,
        base: float,
        add: float,
        *,
        start: int = 0,
        limit: float = float("inf"),
        per_row: float = 0.0,
        extra: int = 0,
    ) -> tuple[int, float]:
        """The slot of least key below ``limit`` with room for ``need`` (and ``extra`` more
        where grants run); (-1, limit) if none.

        Ties go to the slot first in rotation order from ``start``.
        """
        fr, ld, rw = self._free, self._load, self._rows
        size = self._size
        best_slot, best_key = -1, limit
        for lo, hi in ((start, self.n), (0, start)):
            if lo >= hi:
                continue
            stack = [(1, 0, size)]
            while stack:
                node, nlo, nhi = stack.pop()
                if nhi <= lo or nlo >= hi:
                    continue
                rows = rw[node]
                # An idle slot below needs no extra: the least rows bound the room asked for.
                if fr[node] < (need + extra if rows else need):
                    continue  # no slot below has room (or takes grants at all)
                key = (ld[node] + base) + add
                if per_row:
                    key += per_row * rows
                # Visiting in rotation order, a later slot with an equal key loses the tie.
                if key >= best_key:
                    continue
                if nhi - nlo == 1:
                    best_slot, best_key = nlo, key
                    continue
                mid = (nlo + nhi) >> 1
                stack.append((2 * node + 1, mid, nhi))
                stack.append((2 * node, nlo, mid))
        return best_slot, best_key
