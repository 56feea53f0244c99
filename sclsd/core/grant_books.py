"""What the grant policy knows and reads: its settings, its books, its cost estimates.

:class:`GrantBooks` is the state side of :class:`~sclsd.core.grants.GrantPolicy`:
the slice length, the KV budget and page, the cost model, every worker's
books (a :class:`~sclsd.core.grant_fleet.GrantFleet`) and the requests waiting
for a grant (a :class:`~sclsd.core.grant_queue.GrantQueue`), with the read-only
queries the daemon and the simulator use. Changing a setting marks the
policy's next round as due.

Pure: no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from .estimator import Estimator
from .grant_fleet import Grant, GrantFleet, WorkerBook
from .grant_queue import GrantQueue, Pending

__all__ = ["GrantBooks", "GrantRules"]


@dataclass(frozen=True)
class GrantRules:
    """How the grant policy sizes grants and prices moves; sizes are fractions of S.

    The defaults keep KV reservations close to what grants use and moves rare
    where they stall much; :meth:`basic` gives the plain rules (a grant of S
    tokens where S tokens fit, moves priced by one re-prefill).
    """

    stall: float = 1.0
    """A move re-prefills the request on its target, stalling every request running there
    meanwhile: it moves only when the holder's finish exceeds the target's by more than
    (1 + stall · grants running there) re-prefills. 0: by one re-prefill."""
    headroom: float = 5.0
    """A grant that brings a request's context to a busy worker (a new request, a move)
    must leave free the next grants of the requests expected back there before one of
    them finishes and frees its KV: headroom × (grant length) × ρ / (1 − ρ) tokens, ρ the
    share of recent grant ends that came back for more (the count of returns between two
    finishes is about geometric, so 5 leaves e^-5 of the cases short), at most
    ``headroom_cap`` of the budget. Then returning requests resume instead of parking.
    0: no headroom."""
    headroom_cap: float = 0.25
    short: float = 0.25
    """While requests wait for room, a grant is at most ⌈short · S⌉ tokens (and at least
    ``floor``), so that reservations follow use closely where room is short; not where
    the workers' free rows are fewer than the requests in line (they wait for a row then,
    not for KV). 0: always up to S."""
    least: float = 0.125
    """A returning request without room for a full grant on its holder gets what room is
    there, if at least ⌈least · S⌉ tokens (and ``floor``), instead of parking. 0: it parks."""
    window: int = 128
    """Grant ends that ρ averages over (an exponential moving average)."""
    floor: int = 16
    """No rule shortens a grant below this many tokens (S, if less): every grant costs
    the daemon a round trip to its worker."""

    def __post_init__(self) -> None:
        if (min(self.stall, self.headroom, self.headroom_cap, self.short, self.least) < 0
                or self.window < 1 or self.floor < 1):
            raise ValueError(f"bad grant rules: {self}")

    def tokens(self, frac: float, S: int) -> int:  # noqa: N803 - the paper's name
        """⌈frac · S⌉ tokens, but not below ``floor`` (nor above S)."""
        return min(S, max(self.floor, -int(-frac * S // 1)))

    @classmethod
    def basic(cls) -> GrantRules:
        """Full grants only, no headroom, moves priced by their re-prefill alone."""
        return cls(stall=0.0, headroom=0.0, short=0.0, least=0.0)


class GrantBooks:
    """Settings, books, queries and costs of the grant policy (see the module docstring)."""

    def __init__(
        self, est: Estimator, slice_len: int, token_budget: float, rules: GrantRules | None = None
    ) -> None:
        if slice_len < 1:
            raise ValueError("slice_len must be >= 1")
        self._rules = rules if rules is not None else GrantRules()
        self._fleet = GrantFleet()
        self._fleet.budget = int(token_budget)
        self._est = est
        self._S = slice_len
        self._page = 1
        self._q = GrantQueue()
        self._dirty = True
        """Something changed since the last round that granted and dropped nothing."""
        self._due: set[str] = set()
        """Workers whose parked requests the next round looks at again (their books changed)."""
        self._all_due = True
        """The next round looks at every parked request (a worker fell idle, or came)."""
        self.rho = 1.0
        """Share of recent grant ends that came back for another grant (see GrantRules)."""

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
    def rules(self) -> GrantRules:
        """How grants are sized and moves priced (:class:`GrantRules`)."""
        return self._rules

    @rules.setter
    def rules(self, rules: GrantRules) -> None:
        if rules != self._rules:
            self._rules = rules
            self._changed()

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
            self._changed()

    @property
    def page(self) -> int:
        """KV page size in tokens (engines allocate whole pages): reservations round up to it."""
        return self._page

    @page.setter
    def page(self, value: int) -> None:
        if value != self._page:
            self._page = value
            self._changed()

    def _resort(self) -> None:
        """New sort keys for the returning requests (stable: ties keep their order)."""
        self._q.rekey(self._back_key)
        self._changed()

    def _changed(self, w: WorkerBook | None = None) -> None:
        """A round is due; it looks again at the requests parked on ``w`` (None: on every
        worker). A worker left with nothing to run or keep may take any parked request."""
        self._dirty = True
        if w is None or (not w.grants and not w.parked):
            self._all_due = True
        else:
            self._due.add(w.wid)

    # ------------------------------------------------------------------ queries

    @property
    def workers(self) -> list[str]:
        """Every worker's id, sorted."""
        return list(self._fleet.names)

    def load(self, wid: str) -> float:
        """Estimated seconds to finish ``wid``'s granted slices (0 when it has none)."""
        w = self._fleet.books[wid]
        return w.load + self._busy_cost() if w.grants else 0.0

    def reserved(self, wid: str) -> int:
        """KV tokens ``wid``'s grants and parked requests reserve."""
        return self._fleet.books[wid].reserved

    def parked(self, wid: str) -> int:
        """KV tokens ``wid`` keeps for requests waiting there for room (part of reserved)."""
        return sum(self._fleet.books[wid].parked.values())

    def grants_on(self, wid: str) -> dict[str, Grant]:
        """The grants running on ``wid``, by request id (a copy)."""
        return dict(self._fleet.books[wid].grants)

    @property
    def queued(self) -> int:
        """Requests waiting for a grant: parked where their KV is, or in line."""
        return len(self._q)

    # ------------------------------------------------------------------ costs

    def decode_cost(self, context: int, tokens: int) -> float:
        """Load a grant of ``tokens`` from ``context`` adds (its rows' share of the steps)."""
        e = self._est
        return e.d1 * (context * tokens + tokens * (tokens + 1) / 2.0) + e.d2 * tokens

    def prefill_cost(self, tokens: int) -> float:
        """Seconds to prefill a context of ``tokens`` (eq. 3, one row)."""
        return self._est.t_prefill(1, tokens) if tokens > 0 else 0.0

    def step_cost(self, wid: str) -> float:
        """Estimated seconds of one iteration of ``wid`` with the grants it runs now (halfway
        through them): the cost model's step, d1 · Σ contexts + d2 · rows + d4."""
        e = self._est
        grants = self._fleet.books[wid].grants.values() if wid in self._fleet else ()
        return e.d4 + sum(e.d1 * (g.context + g.tokens / 2.0) + e.d2 for g in grants)

    def _busy_cost(self) -> float:
        return self._est.d4 * self._S

    def _back_key(self, p: Pending) -> float:
        """Minus the decode cost of ``p``'s next grant: the largest goes first."""
        return -self.decode_cost(p.context, min(self._S, p.remaining))
