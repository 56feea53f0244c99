"""What the grant policy knows and reads: its settings, its books, its cost estimates.

:class:`GrantBooks` is the state side of :class:`~sclsd.core.grants.GrantPolicy`:
the slice length, the KV budget and page, the cost model, every worker's
books (a :class:`~sclsd.core.grant_fleet.Fleet`) and the requests waiting
for a grant (a :class:`~sclsd.core.grant_queue.GrantQueue`), with the read-only
queries the daemon and the simulator use. Changing a setting marks the
policy's next round as due.

Pure: no clock, no I/O.
"""

from __future__ import annotations

from .estimator import Estimator
from .grant_fleet import Fleet, Grant
from .grant_queue import GrantQueue, Pending

__all__ = ["GrantBooks"]


class GrantBooks:
    """Settings, books, queries and costs of the grant policy (see the module docstring)."""

    def __init__(self, est: Estimator, slice_len: int, token_budget: float) -> None:
        if slice_len < 1:
            raise ValueError("slice_len must be >= 1")
        self._fleet = Fleet()
        self._fleet.budget = int(token_budget)
        self._est = est
        self._S = slice_len
        self._page = 1
        self._q = GrantQueue()
        self._dirty = True
        """Something changed since the last round that granted and dropped nothing."""

    # ------------------------------------------------------------------ settings

    @property
    def est(self) -> Estimator:
        """The cost model; the driver may replace it (a worker's profile changed)."""
        return self._est

    @est.setter
    def est(self, est: Estimator) -> None:
        if est != self._est:
            self._est = est
            self._resort()

    @property
    def S(self) -> int:  # noqa: N802 - the paper's name
        """The slice length: the most tokens one grant may generate."""
        return self._S

    @S.setter
    def S(self, value: int) -> None:  # noqa: N802
        if value < 1:
            raise ValueError("slice_len must be >= 1")
        if value != self._S:
            self._S = value
            self._resort()

    @property
    def budget(self) -> int:
        """KV tokens one worker may reserve (ζ · M_ava / Δ)."""
        return self._fleet.budget

    @budget.setter
    def budget(self, value: int) -> None:
        if int(value) != self._fleet.budget:
            self._fleet.budget = int(value)
            self._fleet.rebuild()
            self._dirty = True

    @property
    def page(self) -> int:
        """KV page size in tokens (engines allocate whole pages): reservations round up to it."""
        return self._page

    @page.setter
    def page(self, value: int) -> None:
        if value != self._page:
            self._page = value
            self._dirty = True

    def _resort(self) -> None:
        """New sort keys for the returning requests (stable: ties keep their order)."""
        self._q.rekey(self._back_key)
        self._dirty = True

    # ------------------------------------------------------------------ queries

    @property
    def workers(self) -> list[str]:
        return list(self._fleet.names)

    def load(self, wid: str) -> float:
        """Estimated seconds to finish ``wid``'s granted slices (0 when it has none)."""
        w = self._fleet.books[wid]
        return w.load + self._busy_cost() if w.grants else 0.0

    def reserved(self, wid: str) -> int:
        return self._fleet.books[wid].reserved

    def parked(self, wid: str) -> int:
        """KV tokens ``wid`` keeps for requests waiting there for room (part of reserved)."""
        return sum(self._fleet.books[wid].parked.values())

    def grants_on(self, wid: str) -> dict[str, Grant]:
        return dict(self._fleet.books[wid].grants)

    @property
    def queued(self) -> int:
        return len(self._q)

    # ------------------------------------------------------------------ costs

    def decode_cost(self, context: int, tokens: int) -> float:
        e = self._est
        return e.d1 * (context * tokens + tokens * (tokens + 1) / 2.0) + e.d2 * tokens

    def prefill_cost(self, tokens: int) -> float:
        return self._est.t_prefill(1, tokens) if tokens > 0 else 0.0

    def _busy_cost(self) -> float:
        return self._est.d4 * self._S

    def _back_key(self, p: Pending) -> float:
        """Minus the decode cost of ``p``'s next grant: the largest goes first."""
        return -self.decode_cost(p.context, min(self._S, p.remaining))
