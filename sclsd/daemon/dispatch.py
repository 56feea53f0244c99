"""Dispatch: a scheduled :class:`~sclsd.core.scheduler.Batch` becomes a typed ``batch``
message on its way to a worker, and is watched until its result comes back.

Nothing sent is ever lost: a send the transport refuses declares the worker
dead (its batches go back to the pool); a batch the worker does not
acknowledge within ``daemon.batch_ack_timeout_s``, or that stays in flight
longer than ``max(daemon.batch_overdue_min_s, daemon.batch_overdue_factor ×``
the worker's estimated queue at dispatch``)``, does the same: the worker is
dropped (a local one is restarted) and every request it held is re-queued.

Dispatch also keeps workers from holding KV nobody will use: when the
scheduler lets go of a request's retained KV (the request moved to another
worker, ended, or its batch failed), that worker is told to ``release`` it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from .. import protocol as P
from ..config import Config
from ..core.batch import Batch
from ..core.scheduler_api import SchedulerInterface
from .fleet import Fleet
from .metrics import Metrics
from .requests import LiveRequests

log = logging.getLogger("sclsd")


class Dispatcher:
    """Sends batches and tracks their acknowledgement and deadline."""

    def __init__(self, cfg: Config, sched: SchedulerInterface, live: LiveRequests, fleet: Fleet, metrics: Metrics,
                 clock: Callable[[], float]) -> None:
        self.cfg = cfg
        self.sched = sched
        self.live = live
        self.fleet = fleet
        self.metrics = metrics
        self.clock = clock
        #: batch id -> (worker, time by which its acknowledgement must arrive)
        self.unacked: dict[int, tuple[str, float]] = {}
        #: batch id -> (worker, time after which it is overdue)
        self.due: dict[int, tuple[str, float]] = {}

    def message(self, batch: Batch) -> P.BatchMsg:
        """The wire form of a batch: each request's whole context by token ids."""
        rows = []
        for r in batch.requests:
            c = self.live.ctx[r.rid]
            g = c.gen
            rows.append(P.BatchRequest(
                rid=r.rid, token_ids=c.prompt_ids + c.out_ids, max_new_tokens=max(1, r.remaining),
                temperature=g.temperature, top_p=g.top_p, top_k=g.top_k, seed=g.seed,
                generated=r.num_generated, stop_token_ids=list(g.stop_token_ids), ignore_eos=g.ignore_eos,
                min_p=g.min_p, presence_penalty=g.presence_penalty, frequency_penalty=g.frequency_penalty,
                repetition_penalty=g.repetition_penalty, logprobs=g.logprobs or g.top_logprobs > 0,
                top_logprobs=g.top_logprobs,
            ))
        return P.BatchMsg(batch_id=batch.bid, slice_len=batch.slice_len, requests=rows,
                          kv_reuse=self.sched.policy.kv_reuse)

    def dispatch(self, batch: Batch) -> None:
        wid = batch.worker
        assert wid is not None
        d = self.cfg.daemon
        now = self.clock()
        ws = self.sched.workers.get(wid)
        ahead = ws.load if ws is not None else batch.est_time  # includes this batch
        self.unacked[batch.bid] = (wid, now + d.batch_ack_timeout_s)
        self.due[batch.bid] = (wid, now + max(d.batch_overdue_min_s, d.batch_overdue_factor * ahead))
        log.debug("batch=%d -> worker=%s n=%d L=%d est=%.3fs ids=%s", batch.bid, wid, batch.size,
                  batch.input_len, batch.est_time, ",".join(r.rid for r in batch.requests))
        self.flush_released()  # the round may have moved requests away from their KV
        self.metrics.dispatched(batch.size)
        # A refused send declares the worker dead, which re-queues this batch too.
        self.fleet.send(wid, self.message(batch))

    # ------------------------------------------------------------------ retained KV

    def release(self, wid: str, rids: list[str]) -> None:
        """Tell worker ``wid`` to drop the KV it keeps for ``rids``."""
        if rids and wid in self.fleet.workers:
            log.debug("release worker=%s ids=%s", wid, ",".join(rids))
            self.fleet.send(wid, P.Release(rids=rids))

    def flush_released(self) -> None:
        """Send the releases the scheduler decided since the last call."""
        for wid, rids in self.sched.take_released().items():
            self.release(wid, rids)

    # ------------------------------------------------------------------ tracking

    def acked(self, wid: str, batch_id: int) -> None:
        entry = self.unacked.get(batch_id)
        if entry is not None and entry[0] == wid:
            del self.unacked[batch_id]

    def settled(self, batch_id: int) -> None:
        """The batch's result was applied (or the batch failed): stop watching it."""
        self.unacked.pop(batch_id, None)
        self.due.pop(batch_id, None)

    def check(self, now: float) -> None:
        """Drop workers that left a batch unacknowledged or overdue (see the module docstring)."""
        for table, what in ((self.unacked, "not acknowledged"), (self.due, "overdue")):
            for bid, (wid, deadline) in list(table.items()):
                if bid not in self.sched.batches:
                    table.pop(bid, None)  # answered, or re-queued with its worker
                elif now > deadline:
                    table.pop(bid, None)
                    self.fleet.declare_dead(wid, f"batch={bid} {what} in time")
