"""What the box holds now, as a gateway reads it: requests waiting and running, KV in use.

The Gateway API Inference Extension's model-server protocol asks each server
for TotalQueuedRequests, TotalRunningRequests and KVCacheUtilization; here is
what they mean for a box that serves requests in slices (docs/operations.md,
Metrics):

- **waiting**: live requests no worker has started yet, in the pool or in a
  batch still waiting in a worker's local queue. A request is waiting for
  exactly its queue time (``request_queue_time_seconds``).
- **running**: live requests a worker has started, being served now or
  between two slices (their KV usually kept for the next). ``waiting +
  running`` is every live request.
- **KV usage per worker** (0 to 1):

  - static batches (``scls`` and the other slice policies): the batch the
    worker serves now, its oldest in flight (a static worker serves its queue
    in order), takes ``(L + S) · n · Δ`` (eq. 5: padding and finished rows
    included, as the batcher counts it), and the KV it keeps for requests
    between slices ``kv_tokens · Δ`` each; over the worker's ``M_ava`` (its
    report at register, else the profile's). Batches queued behind hold no KV.
  - slice grants (``scls-cb``): what the grant policy reserves on the worker
    (each grant in flight its context plus its granted tokens, in whole pages;
    each request waiting for its next grant there the KV it keeps) over the
    budget it grants against, ``ζ · M_ava / Δ`` tokens of the tightest worker.

  Kept KV beyond the device's room spills to host memory: usage stops at 1.
- **KV usage overall**: used over capacity summed over the workers.

Reads the scheduler, the request table, the members and the cost model; changes
nothing.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

from ..core.grant_scheduler import SliceGrantScheduler
from ..core.scheduler_api import SchedulerInterface
from .cost import DaemonCost
from .serving.membership import Membership
from .serving.table import RequestTable

__all__ = ["Occupancy", "occupancy"]


@dataclass(frozen=True)
class Occupancy:
    """Requests waiting and running, and KV usage per worker and overall (0 to 1)."""

    waiting: int
    running: int
    kv_usage: dict[str, float]
    """Per registered worker."""
    kv_usage_total: float


def occupancy(sched: SchedulerInterface, table: RequestTable, members: Membership,
              cost: DaemonCost) -> Occupancy:
    """The box's occupancy now (see the module docstring)."""
    serving = _serving_batches(sched, members)
    waiting = running = 0
    for e in table:
        r = e.req
        if e.started_at is not None or r.first_token is not None or r.batch_id in serving:
            running += 1
        else:
            waiting += 1
    if isinstance(sched, SliceGrantScheduler):
        kv = _grant_kv(sched, members.workers)
    else:
        kv = _static_kv(sched, members.workers, serving, cost)
    used = sum(min(u, c) for u, c in kv.values())
    cap = sum(c for _, c in kv.values())
    return Occupancy(waiting, running, {w: _ratio(u, c) for w, (u, c) in kv.items()}, _ratio(used, cap))


def _ratio(used: float, cap: float) -> float:
    return min(1.0, used / cap) if cap > 0 else 0.0


def _serving_batches(sched: SchedulerInterface, members: Membership) -> set[int]:
    """Ids of the batches workers serve now: a static worker's oldest in flight, every grant
    in flight on a continuous worker (its engine admits them all at once)."""
    out: set[int] = set()
    for wid, info in members.workers.items():
        ws = sched.workers.get(wid)
        if ws is None or not ws.batches:
            continue
        if info.reg.caps.batching == "continuous":
            out |= ws.batches
        else:
            out.add(min(ws.batches))
    return out


def _memory(cost: DaemonCost, wid: str) -> tuple[int, float]:
    """(Δ, M_ava) of worker ``wid``: its report, else the profile's."""
    reported = cost.memory.get(wid)
    if reported is not None:
        return reported
    return cost.profile.kv_bytes_per_token, cost.profile.mem_available


def _static_kv(sched: SchedulerInterface, workers: Collection[str], serving: set[int],
               cost: DaemonCost) -> dict[str, tuple[float, float]]:
    """(used, M_ava) bytes per worker under static batches."""
    kept: dict[str, int] = {}
    for r in sched.live.values():
        # A row of the batch being served counts in that batch's footprint.
        if r.kv_worker is not None and r.batch_id not in serving:
            kept[r.kv_worker] = kept.get(r.kv_worker, 0) + r.kv_tokens
    out: dict[str, tuple[float, float]] = {}
    for wid in workers:
        ws = sched.workers.get(wid)
        if ws is None:
            continue
        delta, m_ava = _memory(cost, wid)
        if not math.isfinite(m_ava) or m_ava <= 0:
            continue  # no memory figure: no usage to report
        tokens = kept.get(wid, 0)
        for bid in ws.batches & serving:
            b = sched.batches[bid]
            tokens += (b.input_len + b.slice_len) * b.size
        out[wid] = (float(tokens * delta), float(m_ava))
    return out


def _grant_kv(sched: SliceGrantScheduler, workers: Collection[str]) -> dict[str, tuple[float, float]]:
    """(reserved, budget) KV tokens per worker under slice grants."""
    g = sched.grants
    known = set(g.workers)
    budget = float(g.budget)
    if budget <= 0:
        return {}
    return {wid: (float(g.reserved(wid)), budget) for wid in workers if wid in known}
