"""Streamed tokens: a running batch's ``tokens`` messages become deltas at once.

A ``tokens`` message counts only for a batch in flight on the worker that
sent it, only for rows of that batch's live requests, each once, in order (a
row's part starts where its previous one ended: ``RequestOutput.start``), never
past the request's budget: a buggy or hostile worker cannot write into another
request's output. A request's first streamed token sets its first-token time;
a streaming request's tokens are detokenized (off the loop: a
:class:`TokensJob`) and sent as a ``delta``, and join its output (see
:mod:`~sclsd.daemon.serving.output`). The scheduler decides nothing on them until
the slice's end, through the result, which brings only the tokens no ``tokens``
message did.

Streamed tokens count in the request's progress as they are taken
(:meth:`~sclsd.core.scheduler_api.SchedulerInterface.generated`: ``Request.num_generated``,
the one record of it), so a batch that ends without a result (its worker lost, or it
failed) leaves each request with the context and budget its client saw: it continues after
them (:meth:`Streaming.settle`), or ends if they ended it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from ... import protocol as P
from ...core.scheduler_api import SchedulerInterface
from .dispatch import DispatchBook
from .effects import Effects, TextJob
from .output import Chunk
from .replies import Replies
from .table import Entry, RequestTable

log = logging.getLogger("sclsd")

__all__ = ["Streaming", "TokensJob"]


@dataclass(eq=False, slots=True)
class TokensJob(TextJob):
    """Streamed chunks to detokenize: for ``k`` chunks, ``seqs[i]`` is the window of
    ``chunks[i]``'s request's output to decode and ``seqs[k + i]`` its left context alone
    (:meth:`~sclsd.tokenizer.Detokenizer.window`, offsets in ``snaps[i]``): the cost of a
    message does not grow with the output."""

    chunks: list[tuple[Entry, Chunk]]
    seqs: list[list[int]]
    keep_special: list[bool]
    snaps: list[tuple[int, int, int, int]]


class Streaming:
    """Applies ``tokens`` messages (see the module docstring)."""

    def __init__(self, sched: SchedulerInterface, table: RequestTable, replies: Replies,
                 dispatch: DispatchBook) -> None:
        self.sched = sched
        self.table = table
        self.replies = replies
        self.dispatch = dispatch

    def on_tokens(self, msg: P.Tokens, now: float, out: Effects) -> None:
        """Tokens of a worker's running batches: streamed to their clients (one detokenizing
        job for the whole message), counted at each batch's result."""
        chunks: list[tuple[Entry, Chunk]] = []
        for part in msg.batches:
            self._batch_tokens(msg.worker_id, part, now, chunks, out)
        if chunks:
            wins = [e.out.window() for e, _ in chunks]
            keep = [not e.gen.skip_special_tokens for e, _ in chunks]
            out.decode.append(TokensJob(chunks, [w[0] for w in wins] + [w[1] for w in wins], keep + keep,
                                        [w[2] for w in wins]))

    def _batch_tokens(self, wid: str, part: P.BatchTokens, now: float,
                      chunks: list[tuple[Entry, Chunk]], eff: Effects) -> None:
        bid = part.batch_id
        batch = self.sched.batches.get(bid)
        if batch is None or batch.worker != wid:
            return  # re-queued meanwhile (its worker lost), or not this worker's
        self.dispatch.acked(wid, bid, now)  # it runs: it moves
        reqs = batch.requests
        # Under scls-cb every grant is a one-row batch: no lookup table for one row.
        members = None if len(reqs) == 1 else {r.rid: r for r in reqs}
        seen: set[str] = set()
        get = self.table.get
        generated = self.sched.generated
        for row in part.outputs:
            rid = row.rid
            req = (reqs[0] if reqs[0].rid == rid else None) if members is None else members.get(rid)
            if req is None or rid in seen or req.batch_id != bid:
                continue
            e = get(rid)
            if e is None or e.req is not req:
                continue
            seen.add(rid)
            out = e.out
            ids = row.token_ids
            if row.start != req.slice_tokens:
                # Not where its previous part ended (a part we did not take): the rest of the
                # slice waits for the result, which then fails the batch (results.py).
                continue
            if row.prompt_logprobs and e.takes_prompt_logprobs(row.prompt_logprobs):
                # Named off the loop, before this message's tokens (whose delta carries them).
                eff.decode.append(self.replies.events.prompt_names(e, row.prompt_logprobs))
            if len(ids) > req.remaining:
                ids = ids[:req.remaining]
            if not ids:
                continue
            generated(rid, len(ids), now)  # the request's progress, counted once
            e.tokens_at(now, len(ids))
            if e.streams:
                chunks.append((e, out.stream(ids, row.logprobs, row.finish_reason)))
            else:  # its client hears the whole output at the end
                out.take(ids, row.logprobs, row.finish_reason)

    def apply(self, job: TokensJob, texts: list[str] | None, now: float, out: Effects) -> None:
        """The chunks were detokenized (``texts`` None: that failed; their text follows with
        the next): each lands in its output and goes to its client. A request whose stop
        string just appeared ends now (``stop``), its row on the worker with it."""
        k = len(job.chunks)
        holds = self.table.holds
        delta = self.replies.delta_of_live
        for i, (e, chunk) in enumerate(job.chunks):
            if not holds(e):
                continue
            e.out.land(chunk)
            text = e.out.detok.apply_window(job.snaps[i], texts[i], texts[k + i]) if texts is not None else ""
            delta(e, chunk.ids, text, out)
            if e.out.detok.stopped:
                cancelled = self.sched.cancel(e.rid, now, "stop")
                if cancelled is not None:
                    self.dispatch.apply(cancelled.releases, out)
                    self.replies.finish(e, "stop", now, out)

    def settle(self, rids: Iterable[str] | None, now: float, out: Effects) -> None:
        """Requests whose batch ended without a result keep the tokens already streamed to
        their clients (they counted as they came): their outputs take in what is still being
        detokenized, and a request ends if the worker said they ended it, or its budget is
        spent. ``rids``: those to look at (None: every live one)."""
        entries = list(self.table) if rids is None else [self.table.get(r) for r in rids]
        for e in entries:
            if e is None or e.req.batch_id in self.sched.batches or not e.out.unsettled:
                continue
            reason = e.out.settle()
            r = e.req
            if r.state.terminal:
                continue  # failed for good: its error follows
            if e.out.detok.stopped:
                reason = "stop"
            elif reason is None and r.remaining <= 0:
                reason = "length"
            log.info("id=%s keeps the %d streamed tokens of a batch that ended without a result%s",
                     r.rid, r.slice_tokens, f"; finished ({reason})" if reason else "")
            cancelled = None if reason is None else self.sched.cancel(r.rid, now, reason)
            if cancelled is not None:
                assert reason is not None
                self.dispatch.apply(cancelled.releases, out)
                self.replies.finish(e, reason, now, out)
