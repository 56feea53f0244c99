"""Dispatch bookkeeping: a scheduled :class:`~sclsd.core.batch.Batch` becomes a typed
``batch`` message for its worker, and is watched until its result comes back.

Nothing sent is ever lost, and no worker is dropped for being slow. A batch is
judged by progress, never by its age against an estimate (a loaded machine, a
first call that compiles, a long prefill are all slow, not faulty):

* it *arrived* when the worker acknowledges it or names it in a heartbeat
  (``Heartbeat.batches``); a worker that heartbeats without naming a batch
  more than ``daemon.batch_ack_timeout_s`` after it was sent never got it
  (``lost_batch``): the worker is dropped without a kill, registers again,
  and the batch goes back to the pool;
* it *moves* while its tokens stream in, or while the worker's heartbeats name
  it with an engine that made progress recently (``Heartbeat.stalled_s``); one
  that has not moved for ``daemon.batch_stall_timeout_s`` drops the worker as
  ``stalled`` (:meth:`DispatchBook.stalled`; a local one is killed and
  restarted).

Either way every request it held is re-queued. A send the transport refuses
does the same (the shell reports it).

Dispatch also keeps workers from holding KV nobody will use: when the
scheduler lets go of a request's retained KV (the request moved to another
worker, ended, or its batch failed), the call that did so returns it
(:mod:`sclsd.core.decisions`) and the caller hands it to :meth:`DispatchBook.apply`:
that worker is told to ``release`` it, once.

A request goes to a worker whole once; later rows of it there are deltas
(:class:`~sclsd.protocol.ContinueRow`: the budget and the context tokens the
worker lacks), as :class:`~.records.Records` knows what each worker holds, and
records the daemon no longer needs are forgotten on the worker's next batch
(``BatchMsg.forget``) or in a ``forget`` (``Effects.forget``).

A request that ends here while its batch is in flight has its row ended on the worker
(:meth:`DispatchBook.ended`: a ``cancel_rows``), so the engine stops computing it at its
next step and the grant's result comes back at once.
"""

from __future__ import annotations

import logging
from collections.abc import Container, Iterator

from ... import protocol as P
from ...config import Config
from ...core.batch import Batch
from ...core.decisions import Releases
from ...core.scheduler_api import SchedulerInterface
from .effects import Effects
from .records import Records
from .table import Entry, RequestTable

log = logging.getLogger("sclsd")

__all__ = ["DispatchBook"]


class DispatchBook:
    """Batches sent and not answered, with their deadlines (see the module docstring)."""

    def __init__(self, cfg: Config, sched: SchedulerInterface, table: RequestTable,
                 members: Container[str], records: Records) -> None:
        self.cfg = cfg
        self.sched = sched
        self.table = table
        self.members = members
        """Registered workers: only they are told anything."""
        self.records = records
        #: batch id -> (worker, time after which a heartbeat that does not name it means the
        #: worker never got it)
        self.unacked: dict[int, tuple[str, float]] = {}
        #: batch id -> (worker, the latest time the worker showed progress on it)
        self.moved: dict[int, tuple[str, float]] = {}
        #: What a grammar row's matcher is built within on the worker ([grammar]).
        self.grammar_limits = P.GrammarLimits(**cfg.grammar.limits())
        self.cancelled_rows = 0
        """Rows of batches in flight the daemon ended on their workers (``cancel_rows``)."""

    def message(self, batch: Batch, out: Effects) -> P.BatchMsg:
        """The wire form of a batch: a request new to the worker whole (its context by token
        ids, its parameters, its grammar as admission compiled it: ``Entry.grammar``, never
        compiled here), one it holds as a :class:`~sclsd.protocol.ContinueRow`; the records
        ``out`` has for its worker to forget ride on it."""
        wid = batch.worker
        assert wid is not None
        rows: list[P.BatchRequest] = []
        cont: list[P.ContinueRow] = []
        forget = out.forget.pop(wid, [])
        for r in batch.requests:
            e = self.table.get(r.rid)
            assert e is not None, f"batch {batch.bid} holds {r.rid}, which is not live"
            n = len(e.prompt_ids) + len(e.out.ids)
            known = self.records.known(wid, r.rid)
            if known is not None and known <= n:
                cont.append(P.ContinueRow(rid=r.rid, max_new_tokens=max(1, r.remaining), known=known,
                                          generated=r.num_generated, tail=_tail(e, known)))
            else:
                rows.append(self._whole(e, r.remaining, r.num_generated))
            if (elsewhere := self.records.sent(wid, r.rid, n)) is not None:
                out.forget_on(elsewhere, r.rid)
        return P.BatchMsg(batch_id=batch.bid, slice_len=batch.slice_len, requests=rows,
                          kv_reuse=self.sched.policy.kv_reuse, cont=cont, forget=forget)

    def _whole(self, e: Entry, remaining: int, generated: int) -> P.BatchRequest:
        g = e.gen
        return P.BatchRequest(
            rid=e.rid, token_ids=e.prompt_ids + e.out.ids, max_new_tokens=max(1, remaining),
            temperature=g.temperature, top_p=g.top_p, top_k=g.top_k, seed=g.seed,
            generated=generated, stop_token_ids=list(g.stop_token_ids), ignore_eos=g.ignore_eos,
            min_p=g.min_p, presence_penalty=g.presence_penalty, frequency_penalty=g.frequency_penalty,
            repetition_penalty=g.repetition_penalty, logprobs=e.wants_logprobs,
            top_logprobs=g.top_logprobs, min_tokens=g.min_tokens, logit_bias=dict(g.logit_bias),
            # Computed in the prefill of the request's first slice, so asked for there only.
            prompt_logprobs=g.prompt_logprobs if not e.prompt_logprobs_taken and generated == 0 else None,
            grammar=e.grammar, grammar_limits=None if e.grammar is None else self.grammar_limits,
        )

    def dispatch(self, batch: Batch, now: float, out: Effects) -> None:
        """Send ``batch`` to its worker and start watching it."""
        wid = batch.worker
        assert wid is not None
        self.unacked[batch.bid] = (wid, now + self.cfg.daemon.batch_ack_timeout_s)
        self.moved[batch.bid] = (wid, now)
        log.debug("batch=%d -> worker=%s n=%d L=%d est=%.3fs ids=%s", batch.bid, wid, batch.size,
                  batch.input_len, batch.est_time, ",".join(r.rid for r in batch.requests))
        # Releases went first (the round's were applied before its batches); records to
        # forget ride on the batch for this worker.
        out.tell(wid, self.message(batch, out))
        for r in batch.requests:
            e = self.table.get(r.rid)
            if e is not None:
                e.sent_at = now

    # ------------------------------------------------------------------ retained KV

    def release(self, wid: str, rids: list[str], out: Effects) -> None:
        """Tell worker ``wid`` to drop the KV it keeps for ``rids`` (and their records)."""
        for rid in rids:
            self.records.dropped(wid, rid)
        if rids and wid in self.members:
            log.debug("release worker=%s ids=%s", wid, ",".join(rids))
            out.tell(wid, P.Release(rids=rids))

    def apply(self, releases: Releases, out: Effects) -> None:
        """Send the releases a scheduler call returned."""
        for rel in releases:
            self.release(rel.worker, list(rel.rids), out)

    def ended(self, rid: str, batch_id: int | None, out: Effects) -> None:
        """``rid`` ended in the daemon (``batch_id``: the batch it was in, if any): its worker
        forgets its record, and ends its row if that batch is still in flight there."""
        if (wid := self.records.ended(rid)) is not None and wid in self.members:
            out.forget_on(wid, rid)
        batch = self.sched.batches.get(batch_id) if batch_id is not None else None
        if batch is not None and batch.worker is not None and batch.worker in self.members:
            out.cancel_row(batch.worker, batch.bid, rid)
            self.cancelled_rows += 1

    # ------------------------------------------------------------------ tracking

    def acked(self, wid: str, batch_id: int, now: float) -> None:
        """Worker ``wid`` has batch ``batch_id`` (an ack, a heartbeat, its tokens or its result
        said so)."""
        entry = self.unacked.get(batch_id)
        if entry is not None and entry[0] == wid:
            del self.unacked[batch_id]
        self.progressed(wid, batch_id, now)

    def progressed(self, wid: str, batch_id: int, since: float) -> None:
        """Worker ``wid`` showed progress on ``batch_id`` at ``since``."""
        entry = self.moved.get(batch_id)
        if entry is not None and entry[0] == wid and since > entry[1]:
            self.moved[batch_id] = (wid, since)

    def heartbeat(self, wid: str, beat: P.Heartbeat, now: float) -> list[int]:
        """Apply a heartbeat's account of the batches ``wid`` holds; returns the batches sent
        to it, past their acknowledgement time, that it does not name: it never got them."""
        named = set(beat.batches)
        moving_since = now - beat.stalled_s
        for bid in named:
            self.acked(wid, bid, moving_since)
        return sorted(bid for bid, (w, after) in self.unacked.items()
                      if w == wid and now > after and bid not in named and bid in self.sched.batches)

    def settled(self, batch_id: int) -> None:
        """The batch's result was applied (or the batch failed): stop watching it."""
        self.unacked.pop(batch_id, None)
        self.moved.pop(batch_id, None)

    def stalled(self, now: float) -> Iterator[tuple[str, str]]:
        """Workers holding a batch that has not moved for ``daemon.batch_stall_timeout_s``,
        with why (see the module docstring). Lazy: a worker the caller drops meanwhile takes
        its batches along."""
        for bid in [b for b in self.unacked if b not in self.sched.batches]:
            del self.unacked[bid]  # answered, or re-queued with its worker
        limit = self.cfg.daemon.batch_stall_timeout_s
        for bid, (wid, at) in list(self.moved.items()):
            if bid not in self.sched.batches:
                self.moved.pop(bid, None)
            elif now - at > limit:
                self.moved.pop(bid, None)
                yield wid, (f"batch={bid} made no progress for {now - at:.0f}s "
                            f"(daemon.batch_stall_timeout_s = {limit:g})")


def _tail(e: Entry, known: int) -> list[int]:
    """The context tokens of ``e`` from ``known`` on (without building the whole context)."""
    p = len(e.prompt_ids)
    return e.out.ids[known - p:] if known >= p else e.prompt_ids[known:] + e.out.ids
