"""What one scheduling round batches: the paper's round and the two switches past it.

- The paper's round (section 4): the batcher over the whole pool, one estimate
  per batch, every active worker a target.
- KV reuse (:mod:`sclsd.core.kvreuse`): the pool batched by the worker holding
  each request's KV, requests without KV admitted while the fleet can keep
  their KV, estimates per KV holder.
- Work-conserving rounds (:mod:`sclsd.core.spread`), when some active worker
  is idle: the idle workers are the only targets, and each starts one batch
  (:func:`one_each`). Batches are split so the idle workers finish the round's
  work soonest; requests whose KV is on a busy worker wait for it. A worker
  starts the batch whose requests have waited longest in the pool, except
  that with KV reuse, when newcomers and other work land on the same worker,
  the newcomers go first with a short first slice (``Policy.first_slice_len``):
  they give their first tokens and join the worker's next batch, holding the
  other work up for S/8 iterations rather than a whole slice.

With the gap bound on (``Policy.max_slice_gap_s``), rounds place requests already
streaming before requests that have not started, and a streaming request at its
bound goes first (:func:`one_each`, :func:`streaming_first`; the scheduler places
what is left of them on busy workers' queues).

Whatever a work-conserving round does not start stays in the pool: the next
round comes as soon as a worker goes idle (at every slice end, since no
worker has a second batch queued) and sees newer requests too. When no
worker goes idle for a whole interval (saturation) the interval rule's round
is the paper's, exactly: every batch placed, busy workers' queues included.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import kvreuse
from .batch import Batch
from .request import Request
from .spread import Estimate, spread

if TYPE_CHECKING:
    from .interfaces import CostModel
    from .policy import Policy

__all__ = ["Planned", "one_each", "plan_round", "streaming_first"]


@dataclass(slots=True)
class Planned:
    """One batch-to-be: its requests, slice length and estimates (anywhere, per KV holder)."""

    requests: list[Request]
    slice_len: int
    est_time: float
    est_on: dict[str, float]
    short: tuple[int, float, dict[str, float]] | None = None
    """Newcomers under KV reuse: the same batch run for a short first slice (its length
    and estimates), taken when the worker it lands on has other work waiting."""


def _fresh(group: Sequence[Request]) -> bool:
    """No request of the group has had a token yet."""
    return all(r.first_token is None for r in group)


def plan_round(
    policy: Policy,
    cost: CostModel,
    pool: Sequence[Request],
    live: Iterable[Request],
    active: Sequence[str],
    idle_loads: Mapping[str, float] | None,
    due: Collection[str] = (),
) -> list[Planned]:
    """The round's batches-to-be; ``idle_loads``: the idle workers' loads in a work-conserving
    round (None: the interval rule's round over every active worker); ``due``: streaming
    requests at their gap bound, which go to an idle worker rather than wait for the busy
    one holding their KV."""
    S = policy.slice_len
    groups, estimate = kvreuse.round_groups(
        pool, live, active, policy.batcher, cost, S, kv_reuse=policy.kv_reuse
    )
    if idle_loads is None:
        return [Planned(g, S, *estimate(g, S)) for g in groups]
    # These two follow the switch alone: the KV is on the worker whatever the cost model
    # (partitions and cached prices also need a CachedCost, see kvreuse.round_groups).
    reuse = policy.kv_reuse
    first = policy.first_slice_len if reuse and policy.first_slice_len < S else 0

    def est(g: list[Request]) -> Estimate:
        return estimate(g, S)

    # Requests whose KV is on a busy (active) worker wait for it; the rest go to the idle ones.
    busy = set(active) - set(idle_loads) if reuse else set()
    mine = [g for g in groups if g[0].kv_worker not in busy or any(r.rid in due for r in g)]
    mine = spread(mine, idle_loads, est)
    return [
        Planned(g, S, *est(g), short=(first, *estimate(g, first)) if first and _fresh(g) else None)
        for g in mine
    ]


def one_each(
    placed: Sequence[tuple[Batch, str, Planned]],
    due: Collection[str] = (),
    streaming_first: bool = False,
) -> list[tuple[Batch, str]]:
    """One batch per worker: the batch whose request has waited longest in the pool (so
    nothing starves), except that newcomers go first when their worker has other work
    waiting, for a short first slice (``Planned.short``) that holds that work up briefly.

    With the gap bound on (:attr:`~sclsd.core.policy.Policy.max_slice_gap_s`): a batch
    holding a request of ``due`` (streaming requests at their bound) goes first, and
    ``streaming_first`` puts batches of requests already streaming before batches of
    requests that have not started, newcomers' short first slices included: once more
    requests are in progress than the workers' batches hold, every newcomer started
    ahead of a stream makes some stream wait out a whole slice (measured in the
    simulator: with short first slices first, the bound barely moved the gaps)."""
    mine: dict[str, list[tuple[Batch, str, Planned]]] = {}
    for item in placed:
        mine.setdefault(item[1], []).append(item)

    def waited(b: Batch) -> float:
        return min(r.pooled_at if r.pooled_at is not None else r.arrival for r in b.requests)

    def order(b: Batch) -> tuple[bool, float]:
        return (streaming_first and _fresh(b.requests), waited(b))

    chosen: set[int] = set()
    for items in mine.values():
        dues = [it[0] for it in items if due and any(r.rid in due for r in it[0].requests)]
        shorts = [it for it in items if it[2].short is not None]
        if dues:
            b = min(dues, key=waited)
        elif shorts and len(items) > 1 and not streaming_first:
            b, w, p = min(shorts, key=lambda it: waited(it[0]))
            assert p.short is not None
            b.slice_len, b.est_time, b.est_on = p.short
        else:
            b = min((it[0] for it in items), key=order)
        chosen.add(id(b))
    return [(b, w) for b, w, _ in placed if id(b) in chosen]


def streaming_first(placed: list[tuple[Batch, str]]) -> list[tuple[Batch, str]]:
    """``placed`` with batches of requests already streaming before batches of requests that
    have not started, each kind in its order: the order a worker's queue serves them."""
    return sorted(placed, key=lambda bw: _fresh(bw[0].requests))
