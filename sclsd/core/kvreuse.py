"""KV reuse in a round: whom to batch together, what a batch costs where, whom to admit.

A worker keeps the KV of each unfinished request after its slice
(``Request.kv_worker`` / ``kv_tokens``). A batch there then prefills only the
uncached tail of each row. This module is the policy side of that
(docs/design.md §8), pure like the rest of :mod:`sclsd.core`:

- **Partition.** A round splits the pool by the worker holding each request's
  KV and runs the batcher on each part alone, so a batch's rows share one KV
  worker. Mixing a cached row with an uncached one would make the whole batch
  prefill the uncached row's length (the layout below), throwing the saving away.
- **Layout and estimate.** The worker lays a batch out as ``past`` positions
  (the longest held prefix, others left-padded) then ``new`` positions (the
  longest uncached tail) and prefills only ``new``
  (:class:`~sclsd.core.interfaces.CachedCost`). When that layout would not fit
  in memory it prefills in full instead, as the worker does. Retained KV that
  could not stay on the device beside the running batch comes back from host
  memory first: ``copy_s`` of the expected bytes.
- **Admission.** Every request in progress keeps KV somewhere, so requests
  without KV join a round (oldest first) only while the fleet can hold the KV
  of everything in progress, ``Σ (L + S) · Δ <= Σ_w retain_bytes``. Without
  this bound a saturated pool keeps thousands of requests in progress and
  every worker evicts what it kept long before the request comes back.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from .interfaces import CachedCost, CostModel, LinearCost
from .memory import UNBOUNDED
from .request import Request, State
from .spread import Estimate

if TYPE_CHECKING:
    from .interfaces import Batcher

__all__ = [
    "HeldView",
    "KVLedger",
    "ReuseCost",
    "admit",
    "committed_bytes",
    "estimate_on",
    "estimates",
    "layout",
    "partition",
    "plan",
    "retained_bytes",
    "round_groups",
]


class ReuseCost(CostModel, CachedCost, Protocol):
    """A cost model with the KV reuse part (what :func:`plan` needs)."""


def partition(reqs: Iterable[Request], workers: Collection[str]) -> dict[str | None, list[Request]]:
    """Requests by the worker holding their KV (None: held by no worker in ``workers``)."""
    out: dict[str | None, list[Request]] = {}
    for r in reqs:
        w = r.kv_worker if r.kv_worker in workers else None
        out.setdefault(w, []).append(r)
    return out


def layout(group: Sequence[Request], worker: str, cost: ReuseCost, S: int) -> tuple[int, int]:
    """``(past, new)`` positions of ``group`` run on ``worker`` (``past = 0``: a full prefill)."""
    n = len(group)
    past = max((r.kv_tokens for r in group if r.kv_worker == worker), default=0)
    L = max(r.input_len for r in group)
    if past == 0:
        return 0, L
    new = max(r.input_len - r.kv_tokens if r.kv_worker == worker else r.input_len for r in group)
    new = max(new, 1)
    if cost.oom(n, past + new, S):
        return 0, L  # the re-assembled cache would not fit: the worker prefills in full
    return past, new


def estimate_on(
    group: Sequence[Request], worker: str, cost: ReuseCost, S: int, retained: float
) -> float:
    """Estimated seconds of ``group`` on ``worker``, which retains ``retained`` bytes of KV.

    The expected host copy assumes the batch's held KV is spread like the rest
    of what the worker keeps: the share that does not fit on the device beside
    the running batch, ``1 - room / retained``, comes back over the host link.
    """
    n = len(group)
    past, new = layout(group, worker, cost, S)
    t = cost.t_serve_cached(n, past, new, S)
    if past:
        delta = cost.kv_bytes_per_token
        held = sum(r.kv_tokens for r in group if r.kv_worker == worker) * delta
        room = max(0.0, cost.device_kv_bytes - (past + new + S) * n * delta)
        spill = max(0.0, 1.0 - room / retained) if retained > 0 else 0.0
        t += cost.copy_s(held * spill)
    return t


def retained_bytes(live: Iterable[Request], delta: int) -> dict[str, float]:
    """KV bytes the policy believes each worker keeps."""
    out: dict[str, float] = {}
    for r in live:
        if r.kv_worker is not None:
            out[r.kv_worker] = out.get(r.kv_worker, 0.0) + r.kv_tokens * delta
    return out


def committed_bytes(live: Iterable[Request], S: int, delta: int) -> float:
    """KV the requests in progress may hold after their next slice: ``Σ (L + S) · Δ``.

    In progress: in a batch (scheduled), or waiting with KV kept somewhere.
    """
    total = 0
    for r in live:
        if r.state is State.SCHEDULED or (r.state is State.QUEUED and r.kv_worker is not None):
            total += r.input_len + min(S, r.remaining)
    return float(total * delta)


def admit(
    fresh: Sequence[Request], committed: float, capacity: float, S: int, delta: int
) -> tuple[list[Request], list[Request]]:
    """Requests without KV, oldest first, while everything in progress fits ``capacity``.

    Returns ``(admitted, waiting)``. When nothing is in progress the oldest is
    admitted whatever its size, so the pool always drains.
    """
    ordered = sorted(fresh, key=lambda r: (r.arrival, r.rid))
    used = committed
    for k, r in enumerate(ordered):
        need = (r.input_len + min(S, r.remaining)) * delta
        if used + need > capacity and used > 0:
            return ordered[:k], ordered[k:]
        used += need
    return ordered, []


@dataclass(frozen=True)
class HeldView:
    """One partition's batches on the worker holding their KV, as the batcher sees them.

    Every row holds all but its last ``tail`` tokens at most (``tail``: the
    partition's longest uncached tail), so a batch padded to input length
    ``L`` holds ``L - tail`` positions and prefills ``tail``: an upper bound
    on :func:`layout`'s, exact when the rows' tails are equal (after a slice
    each is one token, the last one sampled). A
    :class:`~sclsd.core.interfaces.CostModel` with the batcher's linear fast path.
    """

    cost: ReuseCost
    tail: int

    def _split(self, L: int) -> tuple[int, int]:
        new = min(self.tail, L) if L > 0 else self.tail
        return L - new, new

    def t_serve(self, n: int, input_len: int, slice_len: int) -> float:
        past, new = self._split(input_len)
        return self.cost.t_serve_cached(n, past, new, slice_len)

    def oom(self, n: int, input_len: int, slice_len: int) -> bool:
        return self.cost.oom(n, input_len, slice_len)

    def linear_terms(self, L: np.ndarray, S: int) -> tuple[np.ndarray, np.ndarray]:
        L = np.asarray(L, dtype=np.float64)
        new = np.minimum(float(self.tail), L)
        return self.cost.linear_terms_cached(L - new, new, S)

    def max_batch(self, L: np.ndarray, S: int) -> np.ndarray:
        L = np.asarray(L, dtype=np.int64)
        if isinstance(self.cost, LinearCost):
            return np.asarray(self.cost.max_batch(L, S), dtype=np.int64)
        return np.fromiter((_max_fit(self.cost, int(x), S) for x in L), np.int64, L.size)


def _max_fit(cost: CostModel, L: int, S: int) -> int:
    """Largest n with ``not oom(n, L, S)`` by doubling and bisection (oom is monotone in n)."""
    if cost.oom(1, L, S):
        return 0
    lo, hi = 1, 2
    while hi < UNBOUNDED and not cost.oom(hi, L, S):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if not cost.oom(mid, L, S) else (lo, mid)
    return lo


def plan(
    pool: Sequence[Request],
    live: Iterable[Request],
    active: Sequence[str],
    batcher: Batcher,
    cost: ReuseCost,
    S: int,
) -> tuple[list[list[Request]], list[Request]]:
    """A round's groups under KV reuse, and the requests left waiting for room.

    Each KV worker's requests are batched alone (priced by :class:`HeldView`);
    requests without KV are admitted by :func:`admit` and batched together.
    """
    live = list(live)
    delta = cost.kv_bytes_per_token
    parts = partition(pool, set(active))
    fresh = parts.pop(None, [])
    capacity = cost.retain_bytes * len(active)
    admitted, waiting = admit(fresh, committed_bytes(live, S, delta), capacity, S, delta)
    groups: list[list[Request]] = []
    for _, part in sorted((w, p) for w, p in parts.items() if w is not None):
        tail = max(r.uncached_tail for r in part)
        groups.extend(batcher(part, S, HeldView(cost, tail)))
    if admitted:
        groups.extend(batcher(admitted, S, cost))
    return [g for g in groups if g], waiting


def estimates(
    group: Sequence[Request],
    cost: ReuseCost,
    S: int,
    retained: Mapping[str, float],
    active: Collection[str],
) -> tuple[float, dict[str, float]]:
    """``(estimate anywhere, {KV worker: estimate there})`` of one group."""
    n = len(group)
    L = max(r.input_len for r in group)
    anywhere = cost.t_serve(n, L, S)
    holders = {r.kv_worker for r in group if r.kv_worker is not None and r.kv_worker in active}
    on = {w: estimate_on(group, w, cost, S, retained.get(w, 0.0)) for w in holders}
    return anywhere, on


def round_groups(
    pool: Sequence[Request],
    live: Iterable[Request],
    active: Sequence[str],
    batcher: Batcher,
    cost: CostModel,
    S: int,
    *,
    kv_reuse: bool,
) -> tuple[list[list[Request]], Callable[[list[Request], int], Estimate]]:
    """A round's groups and how to estimate one at a slice length (anywhere, and on
    its KV holders).

    Without ``kv_reuse`` (or a cost model without :class:`CachedCost`) this is
    the paper's round: the batcher over the whole pool, one estimate per group.
    """
    if kv_reuse and isinstance(cost, CachedCost):
        rc: ReuseCost = cost  # a CostModel that is also a CachedCost
        live = list(live)
        groups, _waiting = plan(pool, live, active, batcher, rc, S)
        held = retained_bytes(live, rc.kv_bytes_per_token)
        names = set(active)

        def estimate(g: list[Request], s: int) -> Estimate:
            return estimates(g, rc, s, held, names)

        return groups, estimate

    def plain(g: list[Request], s: int) -> Estimate:
        return cost.t_serve(len(g), max(r.input_len for r in g), s), {}

    return [g for g in batcher(pool, S, cost) if g], plain


class KVLedger:
    """Which worker holds each request's KV as the scheduler counts it, and what it gave up.

    The fields themselves live on the requests (``kv_worker``, ``kv_tokens``);
    this keeps the KV the scheduler stopped counting on (its request moved to
    another worker, ended, or failed) until the scheduler's call returns it
    (:meth:`take`), and applies what workers report they evicted.
    """

    def __init__(self) -> None:
        self._released: list[tuple[str, str]] = []

    def drop(self, r: Request, workers: Collection[str]) -> None:
        """Stop counting on ``r``'s KV; its worker, if still there, is to be told."""
        if r.kv_worker is not None:
            if r.kv_worker in workers:
                self._released.append((r.kv_worker, r.rid))
            r.kv_worker, r.kv_tokens = None, 0

    def forget(self, wid: str, live: Iterable[Request]) -> None:
        """Worker ``wid`` (re)started or died: whatever it kept is gone."""
        self._released = [(w, rid) for w, rid in self._released if w != wid]
        for r in live:
            if r.kv_worker == wid:
                r.kv_worker, r.kv_tokens = None, 0

    def evicted(self, wid: str, rids: Iterable[str], live: Mapping[str, Request]) -> bool:
        """Worker ``wid`` evicted these requests' KV; True when the scheduler counted on any."""
        changed = False
        for rid in rids:
            r = live.get(rid)
            if r is not None and r.kv_worker == wid:
                r.kv_worker, r.kv_tokens = None, 0
                changed = True
        return changed

    def take(self) -> list[tuple[str, str]]:
        """The KV given up since the last call, as (worker, request id) pairs in order."""
        out, self._released = self._released, []
        return out
