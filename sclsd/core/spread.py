"""Work-conserving rounds: spread a round's batches over idle workers (docs/design.md §8).

Algorithm 1 minimises the *summed* serving time of a round's batches. That
is the right goal when every worker is busy (the paper's setting: the work
queues up anyway), but with workers idle it can leave them so: one batch of
twenty requests on one worker while seven others wait. A work-conserving
round minimises instead when the round's work is done: the largest
estimated finish time over the workers that receive a batch, given their
current loads, with batches placed the max-min way (longest first, each to
the worker where it finishes first).

:func:`spread` gets there greedily from the batcher's groups: split one of
the largest groups in two (contiguous in input length, at the point that
balances the halves' estimates) while that lowers the round's finish time;
at most one split per active worker. Splitting costs a batch's fixed part
(one more prefill and decode overhead), which the finish time weighs.

The scheduler calls it only when an active worker is idle, so under
saturation rounds are exactly the paper's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from .request import Request

__all__ = ["Estimate", "finish_time", "spread"]

#: A group's estimated serving time anywhere, and where it differs (KV holders).
Estimate = tuple[float, dict[str, float]]

#: Groups tried per split (the largest ones): the finish time is set by the largest.
_CANDIDATES = 2


def _size(e: Estimate) -> float:
    est, on = e
    return min(est, *on.values()) if on else est


def finish_time(items: Sequence[Estimate], loads: Mapping[str, float]) -> float:
    """When the round's work is done: max over receiving workers of load + what they got.

    Items are placed longest first, each to the worker where it finishes first
    (ties to the name that sorts first), as :class:`~sclsd.core.offloader.MaxMin` does.
    """
    local = dict(loads)
    got: set[str] = set()
    for est, on in sorted(items, key=lambda e: -_size(e)):
        w = min(local, key=lambda w: (local[w] + on.get(w, est), w))
        local[w] += on.get(w, est)
        got.add(w)
    return max((local[w] for w in got), default=0.0)


def _halves(
    group: list[Request], estimate: Callable[[list[Request]], Estimate]
) -> tuple[list[Request], list[Request]]:
    """``group`` split in input-length order where the larger half's estimate is least.

    The left half's estimate grows with the cut and the right's shrinks, so a
    bisection finds the crossing in O(log n) estimates.
    """
    ordered = sorted(group, key=lambda r: (r.input_len, r.arrival, r.rid))
    lo, hi = 1, len(ordered) - 1  # cut positions: left = ordered[:cut]
    while lo < hi:
        mid = (lo + hi) // 2
        if _size(estimate(ordered[:mid])) < _size(estimate(ordered[mid:])):
            lo = mid + 1
        else:
            hi = mid
    best = lo
    if lo > 1:  # the crossing may sit one to the left
        def worst(c: int) -> float:
            return max(_size(estimate(ordered[:c])), _size(estimate(ordered[c:])))

        if worst(lo - 1) < worst(lo):
            best = lo - 1
    return ordered[:best], ordered[best:]


def spread(
    groups: list[list[Request]],
    loads: Mapping[str, float],
    estimate: Callable[[list[Request]], Estimate],
) -> list[list[Request]]:
    """Split ``groups`` while that lowers :func:`finish_time` (see the module docstring)."""
    groups = [g for g in groups if g]
    if not groups or not loads:
        return groups
    items = [estimate(g) for g in groups]
    best = finish_time(items, loads)
    for _ in range(len(loads) - 1):
        order = sorted(
            (k for k in range(len(groups)) if len(groups[k]) >= 2), key=lambda k: -_size(items[k])
        )
        for k in order[:_CANDIDATES]:
            left, right = _halves(groups[k], estimate)
            trial = [*items[:k], *items[k + 1 :], estimate(left), estimate(right)]
            t = finish_time(trial, loads)
            if t < best * (1 - 1e-9):
                groups = [*groups[:k], *groups[k + 1 :], left, right]
                items, best = trial, t
                break
        else:
            break
    return groups
