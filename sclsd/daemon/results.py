"""Results: a worker's answer for a batch becomes deltas, finished requests and re-queues.

A result is checked before it counts: it must be for a batch in flight on the
worker that sent it; only rows of that batch's live requests count, each once,
never past the request's budget, so a buggy or hostile worker cannot write into
another request's output. Detokenizing runs in the thread pool; applying runs
on the loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Executor

from .. import protocol as P
from ..core.scheduler import BatchOutcome, RowOutcome, Scheduler
from ..tokenizer import Tokenizer
from .dispatch import Dispatcher
from .metrics import Metrics
from .requests import LiveRequests, ReqCtx

log = logging.getLogger("sclsd")

Rows = list[tuple[ReqCtx, P.RequestOutput]]


class Results:
    """Applies :class:`~sclsd.protocol.Result` messages (see the module docstring)."""

    def __init__(self, sched: Scheduler, live: LiveRequests, tok: Tokenizer, pool: Executor,
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

    def on_result(self, res: P.Result) -> None:
        batch = self.sched.batches.get(res.batch_id)
        if batch is None:
            log.info("result for unknown batch=%d from worker=%s ignored", res.batch_id, res.worker_id)
            return
        if batch.worker != res.worker_id:
            log.warning("result for batch=%d from worker=%s, but it was sent to worker=%s; ignored",
                        res.batch_id, res.worker_id, batch.worker)
            return
        self.dispatcher.acked(res.worker_id, res.batch_id)  # a result implies receipt
        if res.error is not None:
            log.error("worker=%s batch=%d failed: %s; ids=%s", res.worker_id, res.batch_id, res.error,
                      ",".join(r.rid for r in batch.requests))
            self.fail_batch(res.batch_id)
            return
        members = {r.rid: r for r in batch.requests}
        rows: Rows = []
        seen: set[str] = set()
        for out in res.outputs:
            req = members.get(out.rid)
            c = self.live.get(out.rid)
            if req is None or c is None or c.req is not req or out.rid in seen:
                continue
            seen.add(out.rid)
            budget = max(0, req.remaining)
            if len(out.token_ids) > budget:
                out = P.RequestOutput(rid=out.rid, token_ids=out.token_ids[:budget], finish_reason="length")
            rows.append((c, out))
        work = [c.out_ids + out.token_ids for c, out in rows]
        fut = asyncio.get_running_loop().run_in_executor(self.pool, self._decode_all, work)
        fut.add_done_callback(lambda f: self._apply(res, rows, f))

    def _decode_all(self, seqs: list[list[int]]) -> list[str]:
        return [self.tok.decode(s) for s in seqs]

    def _apply(self, res: P.Result, rows: Rows, fut: asyncio.Future[list[str]]) -> None:
        try:
            texts = fut.result()
        except Exception:  # noqa: BLE001 - the batch is failed, not the daemon
            log.exception("detokenizing batch=%d failed; ids=%s", res.batch_id,
                          ",".join(c.rid for c, _ in rows))
            self.fail_batch(res.batch_id)
            return
        if res.batch_id not in self.sched.batches:
            return  # its worker was declared dead meanwhile: requests already re-queued
        try:
            self._apply_rows(res, rows, texts)
        except Exception:
            # A bug here must not leave requests hanging: log it with the ids, fail the
            # batch (its requests are re-queued, up to scheduler.max_failures).
            log.exception("applying batch=%d failed; ids=%s", res.batch_id, ",".join(c.rid for c, _ in rows))
            self.fail_batch(res.batch_id)

    def fail_batch(self, batch_id: int) -> None:
        """The batch failed: its requests go back to the pool, or end after too many failures."""
        self.dispatcher.settled(batch_id)
        for r in self.sched.on_result(BatchOutcome(batch_id, ok=False), self.clock()):
            c = self.live.get(r.rid)
            if c is not None:
                self.live.finish(c, "error")
        self.wake()

    def _apply_rows(self, res: P.Result, rows: Rows, texts: list[str]) -> None:
        now = self.clock()
        outcomes: list[RowOutcome] = []
        deltas: list[tuple[ReqCtx, list[int], str]] = []
        for (c, out), full in zip(rows, texts, strict=True):
            if self.live.get(c.rid) is not c:
                continue  # cancelled or timed out while we decoded: its row is ignored
            c.out_ids.extend(out.token_ids)
            final = out.finish_reason is not None
            new_text = c.detok.apply(full, final=final)
            reason = "stop" if c.detok.stopped else out.finish_reason
            outcomes.append(RowOutcome(out.rid, len(out.token_ids), reason))
            deltas.append((c, out.token_ids, new_text))
        stats = res.stats
        self.dispatcher.settled(res.batch_id)
        done = self.sched.on_result(
            BatchOutcome(res.batch_id, outcomes, elapsed=stats.prefill_s + stats.decode_s), now
        )
        self.metrics.batch_done(stats.prefill_s + stats.decode_s)
        # Engine-side waste, summed for status (the replay benchmark reads these counters).
        counters = self.sched.counters
        counters["pad_tokens"] = counters.get("pad_tokens", 0) + stats.pad_tokens
        counters["invalid_tokens"] = counters.get("invalid_tokens", 0) + stats.invalid_tokens
        counters["batch_rows"] = counters.get("batch_rows", 0) + len(res.outputs)
        counters["results"] = counters.get("results", 0) + 1
        for c, ids, text in deltas:
            self.live.delta(c, ids, text)
        for r in done:
            c = self.live.get(r.rid)
            if c is not None:
                self.live.finish(c, r.finish_reason or "error")
        self.wake()
