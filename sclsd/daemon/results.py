"""Results: what a worker reports about a batch becomes deltas, finished requests and re-queues.

Two messages: ``tokens`` while a batch runs (new tokens as they are generated)
and ``result`` when it ends (authoritative: every token of the slice). Both are
checked before they count: for a batch in flight on the worker that sent it;
only rows of that batch's live requests count, each once, never past the
request's budget, so a buggy or hostile worker cannot write into another
request's output.

Streamed tokens go to the client at once (a request's first one sets its
first-token time) and join its output; the scheduler still hears of them only
at the slice's end, through the result, which then adds only what was not
streamed. A batch that ends without a result (its worker was lost, or it
failed) keeps the streamed tokens its client already saw: they count as
generated, and the request continues after them, or ends if they ended it.

Detokenizing runs in the thread pool; applying runs on the loop, strictly in
the order the messages arrived, so a request's deltas keep their order.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Executor

from .. import protocol as P
from ..core.batch import Batch, BatchOutcome, RowOutcome
from ..core.scheduler_api import SchedulerInterface
from ..tokenizer import Tokenizer
from .dispatch import Dispatcher
from .metrics import Metrics
from .requests import LiveRequests, ReqCtx

log = logging.getLogger("sclsd")

#: A result's accepted rows: the request, its output (budget-capped), tokens already streamed.
Rows = list[tuple[ReqCtx, P.RequestOutput, int]]
#: A tokens message's accepted rows: the request and its new ids and logprobs (a chunk of
#: ``c.inbound`` until applied).
Chunks = list[tuple[ReqCtx, tuple[list[int], list[P.TokenLogprobs]]]]
Decoded = asyncio.Future[list[str]]


class Results:
    """Applies :class:`~sclsd.protocol.Tokens` and :class:`~sclsd.protocol.Result` messages
    (see the module docstring)."""

    def __init__(self, sched: SchedulerInterface, live: LiveRequests, tok: Tokenizer, pool: Executor,
                 dispatcher: Dispatcher, metrics: Metrics, clock: Callable[[], float],
                 wake: Callable[[], None]) -> None:
        self.sched = sched
        self.live = live
        self.tok = tok
        self.pool = pool
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.clock = clock
        self.wake = wake
        #: Engine-side counts summed over results (pad and invalid tokens, prefill and reuse,
        #: evictions, preemptions): the status shows them beside the scheduler's.
        self.counters: dict[str, int] = {}
        #: Per worker, the latest (preemptions, KV peak tokens) its engine reported.
        self.engine_totals: dict[str, tuple[int, int]] = {}
        #: Decodes in flight with what applies them, in arrival order.
        self._order: deque[tuple[Decoded, Callable[[Decoded], None]]] = deque()
        # A lost worker's batches were re-queued: their streamed tokens become output.

    # ------------------------------------------------------------------ arrival (validation)

    def on_result(self, msg: P.Result | P.Tokens) -> None:
        """A worker's message about one of its batches."""
        if isinstance(msg, P.Tokens):
            self.on_tokens(msg)
            return
        res = msg
        batch = self._batch(res.worker_id, res.batch_id, "result")
        if batch is None:
            return
        self.dispatcher.acked(res.worker_id, res.batch_id)  # a result implies receipt
        if res.error is not None:
            log.error("worker=%s batch=%d failed: %s; ids=%s", res.worker_id, res.batch_id, res.error,
                      ",".join(r.rid for r in batch.requests))
            self._evicted(res)
            self.fail_batch(res.batch_id)
            return
        members = {r.rid: r for r in batch.requests}
        rows: Rows = []
        seen: set[str] = set()
        stray: list[str] = []
        for out in res.outputs:
            req = members.get(out.rid)
            c = self.live.get(out.rid)
            if req is None or c is None or c.req is not req or out.rid in seen:
                if out.kv_tokens and out.rid not in seen:
                    stray.append(out.rid)  # e.g. cancelled during the slice: nobody needs its KV
                continue
            seen.add(out.rid)
            budget = max(0, req.remaining)
            if len(out.token_ids) > budget:
                out = P.RequestOutput(rid=out.rid, token_ids=out.token_ids[:budget], finish_reason="length",
                                      logprobs=out.logprobs[:budget])
            k = c.streamed if c.streamed_bid == res.batch_id else 0
            context = self._context(c)
            if k and context[-k:] != out.token_ids[:k]:
                log.warning("worker=%s batch=%d id=%s: result differs from the %d tokens it streamed; "
                            "the streamed ones stand", res.worker_id, res.batch_id, out.rid, k)
            rows.append((c, out, k))
        self.dispatcher.release(res.worker_id, stray)
        work = [self._context(c) + out.token_ids[k:] for c, out, k in rows]
        self._submit(work, lambda f: self._apply(res, rows, f))

    def on_tokens(self, msg: P.Tokens) -> None:
        """Tokens of a running batch: streamed to their clients, counted at its result."""
        batch = self.sched.batches.get(msg.batch_id)
        if batch is None or batch.worker != msg.worker_id:
            return  # re-queued meanwhile (its worker lost), or not this worker's
        self.dispatcher.acked(msg.worker_id, msg.batch_id)  # it runs: it was received
        now = self.clock()
        members = {r.rid: r for r in batch.requests}
        chunks: Chunks = []
        seen: set[str] = set()
        for out in msg.outputs:
            req = members.get(out.rid)
            c = self.live.get(out.rid)
            if (req is None or c is None or c.req is not req or out.rid in seen
                    or req.batch_id != msg.batch_id):
                continue
            seen.add(out.rid)
            if c.streamed_bid != msg.batch_id:
                c.streamed_bid, c.streamed, c.streamed_reason = msg.batch_id, 0, None
            ids = out.token_ids[: max(0, req.remaining - c.streamed)]
            if not ids:
                continue
            if req.first_token is None:
                req.first_token = now
            if not c.gen.stream:
                continue  # its client hears the whole output at the end: the result brings it
            c.streamed += len(ids)
            c.streamed_reason = out.finish_reason
            chunk = (list(ids), list(out.logprobs[: len(ids)]))
            c.inbound.append(chunk)
            chunks.append((c, chunk))
        if chunks:
            work = [self._context(c) for c, _ in chunks]
            self._submit(work, lambda f: self._apply_tokens(chunks, f))

    def _batch(self, wid: str, bid: int, what: str) -> Batch | None:
        batch = self.sched.batches.get(bid)
        if batch is None:
            log.info("%s for unknown batch=%d from worker=%s ignored", what, bid, wid)
            return None
        if batch.worker != wid:
            log.warning("%s for batch=%d from worker=%s, but it was sent to worker=%s; ignored",
                        what, bid, wid, batch.worker)
            return None
        return batch

    @staticmethod
    def _context(c: ReqCtx) -> list[int]:
        """The request's output including streamed tokens still being detokenized."""
        out = list(c.out_ids)
        for ids, _ in c.inbound:
            out += ids
        return out

    # ------------------------------------------------------------------ decoding, in order

    def _submit(self, work: list[list[int]], apply: Callable[[Decoded], None]) -> None:
        fut = asyncio.get_running_loop().run_in_executor(self.pool, self._decode_all, work)
        self._order.append((fut, apply))
        fut.add_done_callback(self._drain)

    def _drain(self, _done: Decoded) -> None:
        """Apply every decoded message at the head of the arrival order."""
        while self._order and self._order[0][0].done():
            fut, apply = self._order.popleft()
            try:
                apply(fut)
            except (Exception, asyncio.CancelledError):  # noqa: BLE001 - the next ones still apply
                log.exception("applying a worker's message failed")

    def _decode_all(self, seqs: list[list[int]]) -> list[str]:
        return [self.tok.decode(s) for s in seqs]

    # ------------------------------------------------------------------ applying

    def _apply_tokens(self, chunks: Chunks, fut: Decoded) -> None:
        try:
            texts: list[str] | None = fut.result()
        except (Exception, asyncio.CancelledError):  # noqa: BLE001 - the text follows with the next
            log.warning("detokenizing streamed tokens failed; ids=%s", ",".join(c.rid for c, _ in chunks))
            texts = None
        for i, (c, chunk) in enumerate(chunks):
            if self.live.get(c.rid) is not c:
                continue
            if c.inbound and c.inbound[0] is chunk:
                c.inbound.pop(0)
                c.out_ids.extend(chunk[0])
                c.logprobs.extend(chunk[1])
            # (else its batch ended without a result meanwhile: already in out_ids)
            text = c.detok.apply(texts[i]) if texts is not None else ""
            self.live.delta(c, chunk[0], text)

    def _apply(self, res: P.Result, rows: Rows, fut: Decoded) -> None:
        try:
            texts = fut.result()
        except Exception:  # noqa: BLE001 - the batch is failed, not the daemon
            log.exception("detokenizing batch=%d failed; ids=%s", res.batch_id,
                          ",".join(c.rid for c, _, _ in rows))
            self.fail_batch(res.batch_id)
            return
        if res.batch_id not in self.sched.batches:
            return  # its worker was declared dead meanwhile: requests already re-queued
        try:
            self._apply_rows(res, rows, texts)
        except Exception:
            # A bug here must not leave requests hanging: log it with the ids, fail the
            # batch (its requests are re-queued, up to scheduler.max_failures).
            log.exception("applying batch=%d failed; ids=%s", res.batch_id,
                          ",".join(c.rid for c, _, _ in rows))
            self.fail_batch(res.batch_id)

    def fail_batch(self, batch_id: int) -> None:
        """The batch failed: its requests go back to the pool, or end after too many failures."""
        self.dispatcher.settled(batch_id)
        batch = self.sched.batches.get(batch_id)
        members = [r.rid for r in batch.requests] if batch is not None else []
        done = self.sched.on_result(BatchOutcome(batch_id, ok=False), self.clock())
        self.dispatcher.flush_released()
        self.settle_streamed(members)
        for r in done:
            c = self.live.get(r.rid)
            if c is not None:
                self.live.finish(c, "error")
        self.wake()

    def settle_streamed(self, rids: Iterable[str] | None = None) -> None:
        """Requests whose batch ended without a result keep the tokens already streamed to
        their clients: counted as generated, the request continues after them (or ends, if
        the worker said they ended it). ``rids``: those to look at (None: every live one)."""
        now = self.clock()
        ctxs = list(self.live.ctx.values()) if rids is None else [self.live.ctx.get(r) for r in rids]
        for c in ctxs:
            if c is None or not c.streamed or c.streamed_bid in self.sched.batches:
                continue
            k, reason = c.streamed, c.streamed_reason
            c.streamed, c.streamed_bid, c.streamed_reason = 0, None, None
            for ids, lps in c.inbound:
                c.out_ids.extend(ids)
                c.logprobs.extend(lps)
            c.inbound.clear()
            r = c.req
            r.num_generated += k
            if r.state.terminal:
                continue  # failed for good: its error follows
            if c.detok.stopped:
                reason = "stop"
            elif reason is None and r.remaining <= 0:
                reason = "length"
            log.info("id=%s keeps %d streamed tokens of a batch that ended without a result%s",
                     r.rid, k, f"; finished ({reason})" if reason else "")
            if reason is not None and self.sched.cancel(r.rid, now, reason) is not None:
                self.live.finish(c, reason)

    def _evicted(self, res: P.Result) -> None:
        """The worker dropped these requests' KV to make room."""
        if res.kv_evicted:
            self.sched.kv_evicted(res.worker_id, res.kv_evicted)
            counters = self.counters
            counters["kv_evicted"] = counters.get("kv_evicted", 0) + len(res.kv_evicted)

    def _apply_rows(self, res: P.Result, rows: Rows, texts: list[str]) -> None:
        now = self.clock()
        outcomes: list[RowOutcome] = []
        deltas: list[tuple[ReqCtx, list[int], str]] = []
        stray: list[str] = []
        for (c, out, k), full in zip(rows, texts, strict=True):
            if self.live.get(c.rid) is not c:
                if out.kv_tokens:
                    stray.append(c.rid)
                continue  # cancelled or timed out while we decoded: its row is ignored
            tail = out.token_ids[k:]
            base = len(c.out_ids) - k  # tokens before this slice
            c.out_ids.extend(tail)
            if out.logprobs:  # the result's are authoritative, streamed ones included
                del c.logprobs[base:]
                c.logprobs.extend(out.logprobs)
            c.streamed, c.streamed_bid, c.streamed_reason = 0, None, None
            final = out.finish_reason is not None
            new_text = c.detok.apply(full, final=final)
            reason = "stop" if c.detok.stopped else out.finish_reason
            kv = out.kv_tokens
            if kv and reason is not None:
                stray.append(c.rid)  # ended here (a stop string): the worker kept its KV for nothing
                kv = 0
            outcomes.append(RowOutcome(out.rid, k + len(tail), reason, kv_tokens=kv))
            deltas.append((c, tail, new_text))
        stats = res.stats
        self.dispatcher.settled(res.batch_id)
        done = self.sched.on_result(
            BatchOutcome(res.batch_id, outcomes, elapsed=stats.prefill_s + stats.decode_s), now
        )
        self._evicted(res)  # after the rows: a row kept early in the batch may be evicted later
        self.dispatcher.release(res.worker_id, stray)
        self.dispatcher.flush_released()
        self.metrics.batch_done(stats.prefill_s + stats.decode_s)
        # Engine-side waste and reuse, summed for status (the replay benchmark reads these).
        counters = self.counters
        for name, value in (("pad_tokens", stats.pad_tokens), ("invalid_tokens", stats.invalid_tokens),
                            ("prefill_tokens", stats.prefill_tokens),
                            ("reused_tokens", stats.reused_tokens),
                            ("batch_rows", len(res.outputs)), ("results", 1)):
            counters[name] = counters.get(name, 0) + value
        if stats.preemptions or stats.kv_peak_tokens:
            # Continuous engines report these since their start: keep each worker's latest.
            self.engine_totals[res.worker_id] = (stats.preemptions, stats.kv_peak_tokens)
            counters["preemptions"] = sum(p for p, _ in self.engine_totals.values())
            counters["kv_peak_tokens"] = max(k for _, k in self.engine_totals.values())
        for c, ids, text in deltas:
            self.live.delta(c, ids, text)
        for r in done:
            ended = self.live.get(r.rid)
            if ended is not None:
                self.live.finish(ended, r.finish_reason or "error")
        self.wake()
