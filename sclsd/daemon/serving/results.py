"""Results: a worker's ``result`` for a batch becomes deltas, finished requests and re-queues.

A result ends a slice: it brings the tokens of each row that no ``tokens``
message did (those streamed are in the output already, see
:mod:`~sclsd.daemon.serving.streaming`), each row's ``start`` saying how many
went before. It is checked before it counts, as streamed tokens are: for a
batch in flight on the worker that sent it; only rows of that batch's live
requests, each once, never past the request's budget; a row whose tokens do
not follow those the daemon took from the stream fails the batch (the
worker's stream lost a part: what the client saw stands, the request goes
on after it). Its rows are detokenized off the loop (a
:class:`ResultJob`), then applied: the outputs grow, the scheduler gets the
batch's outcome (finished requests, the rest back in the pool, the KV the
worker keeps), clients get their deltas and terminal events. A result with an
error fails the batch: its requests go back to the pool, or end after
``scheduler.max_failures`` failures. A row with an error (``RequestOutput.error``:
the engine could not serve that row, its grammar) ends its request alone with
``bad_request`` and the worker's message: never retried, the worker not at fault.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

from ... import protocol as P
from ...core.batch import Batch, BatchOutcome, RowOutcome
from ...core.scheduler_api import SchedulerInterface
from .dispatch import DispatchBook
from .effects import Effects, TextJob
from .engine_stats import EngineStats
from .prefixes import PrefixRoutes
from .replies import Replies
from .streaming import Streaming
from .table import Entry, RequestTable

log = logging.getLogger("sclsd")

#: Most characters of a worker's row error its client hears.
MAX_ROW_ERROR = 2000

__all__ = ["ResultJob", "Results", "Row"]


@dataclass(frozen=True, slots=True)
class Row:
    """An accepted row of a result: its request, its output (budget-capped), and how many of
    its tokens were streamed already."""

    entry: Entry
    output: P.RequestOutput
    streamed: int


@dataclass(eq=False, slots=True)
class ResultJob(TextJob):
    """A result's rows to detokenize: for ``k`` rows, ``seqs[i]`` is the window of row
    ``i``'s output with the slice and ``seqs[k + i]`` its left context alone
    (:meth:`~sclsd.tokenizer.Detokenizer.window`, offsets in ``snaps[i]``)."""

    result: P.Result
    rows: list[Row]
    seqs: list[list[int]]
    keep_special: list[bool]
    snaps: list[tuple[int, int, int, int]]
    stray: list[str]
    """Rows whose requests ended before the result came (a cancel mid-slice) but whose KV the
    worker kept: released when the result is applied, unless the scheduler releases them."""


def is_out_of_memory(error: str) -> bool:
    """Whether a worker's error text says the device ran out of memory (torch's
    ``OutOfMemoryError``, CUDA's "out of memory")."""
    return "OutOfMemoryError" in error or "out of memory" in error.lower()


class WorkerMemory(Protocol):
    """The cost model's side of a failed batch (the daemon's ``DaemonCost``)."""

    def on_oom(self, wid: str) -> None:
        """Worker ``wid`` ran out of memory: count on less of it from now on."""
        ...


class Results:
    """Applies ``result`` messages (see the module docstring)."""

    def __init__(self, sched: SchedulerInterface, table: RequestTable, replies: Replies,
                 dispatch: DispatchBook, streaming: Streaming, memory: WorkerMemory,
                 routes: PrefixRoutes) -> None:
        self.sched = sched
        self.routes = routes
        """Where finished contexts may be cached (:mod:`.prefixes`): noted as rows finish."""
        self.table = table
        self.replies = replies
        self.dispatch = dispatch
        self.streaming = streaming
        self.memory = memory
        self.engines = EngineStats()

    # ------------------------------------------------------------------ arrival (validation)

    def on_result(self, res: P.Result, now: float, out: Effects) -> None:
        """A worker's result for one of its batches."""
        batch = self._batch(res.worker_id, res.batch_id)
        if batch is None:
            return
        self.dispatch.acked(res.worker_id, res.batch_id, now)  # a result implies receipt
        if res.error is not None:
            log.error("worker=%s batch=%d failed: %s; ids=%s", res.worker_id, res.batch_id, res.error,
                      ",".join(r.rid for r in batch.requests))
            self._evicted(res)
            # Out of memory with several rows: the worker holds less than it said. Its memory
            # shrinks, the rows go back uncharged, and smaller batches follow. One row alone
            # out of memory is that request's failure.
            oom = is_out_of_memory(res.error) and batch.size > 1
            if oom:
                self.memory.on_oom(res.worker_id)
            # Rows it held no record of are the daemon's mistake, not the requests'.
            self.fail_batch(res.batch_id, now, out, why=f"worker {res.worker_id}: {res.error}",
                            charged=not oom and not res.unknown)
            return
        members = {r.rid: r for r in batch.requests}
        rows: list[Row] = []
        seen: set[str] = set()
        stray: list[str] = []
        gaps: list[str] = []
        for o in res.outputs:
            req = members.get(o.rid)
            e = self.table.get(o.rid)
            if req is None or e is None or e.req is not req or o.rid in seen:
                if o.kv_tokens and o.rid not in seen:
                    stray.append(o.rid)  # e.g. cancelled during the slice: nobody needs its KV
                continue
            seen.add(o.rid)
            k = req.slice_tokens  # streamed, and counted, already
            if o.finish_reason == "cancelled":
                gaps.append(f"{o.rid}: the worker ended it as cancelled, and it was not")
                continue
            if o.error is None and o.start != k:
                gaps.append(f"{o.rid}: its result starts at token {o.start}, {k} were streamed")
                continue
            if e.takes_prompt_logprobs(o.prompt_logprobs):  # named off the loop, before the rows
                out.decode.append(self.replies.events.prompt_names(e, o.prompt_logprobs))
            budget = max(0, req.remaining)
            if len(o.token_ids) > budget:
                o = P.RequestOutput(rid=o.rid, token_ids=o.token_ids[:budget], start=k, finish_reason="length",
                                    logprobs=o.logprobs[:budget])
            e.cached_tokens = max(e.cached_tokens, min(o.reused_tokens, len(e.prompt_ids)))
            rows.append(Row(e, o, k))
        if gaps:
            log.warning("worker=%s batch=%d: its result does not follow what it streamed: %s",
                        res.worker_id, res.batch_id, "; ".join(gaps))
            self.dispatch.release(res.worker_id, stray, out)
            self.fail_batch(res.batch_id, now, out, why=f"worker {res.worker_id}: its result does not "
                            f"follow what it streamed ({gaps[0]})")
            return
        wins = [r.entry.out.detok.window(r.entry.out.context() + list(r.output.token_ids)) for r in rows]
        keep = [not r.entry.gen.skip_special_tokens for r in rows]
        out.decode.append(ResultJob(res, rows, [w[0] for w in wins] + [w[1] for w in wins], keep + keep,
                                    [w[2] for w in wins], stray))

    def _batch(self, wid: str, bid: int) -> Batch | None:
        batch = self.sched.batches.get(bid)
        if batch is None:
            log.info("result for unknown batch=%d from worker=%s ignored", bid, wid)
            return None
        if batch.worker != wid:
            log.warning("result for batch=%d from worker=%s, but it was sent to worker=%s; ignored",
                        bid, wid, batch.worker)
            return None
        return batch

    # ------------------------------------------------------------------ applying

    def apply(self, job: ResultJob, texts: list[str] | BaseException, now: float,
              out: Effects) -> None:
        """The rows were detokenized (or that failed: the batch fails); apply them."""
        res = job.result
        ids = ",".join(r.entry.rid for r in job.rows)
        if isinstance(texts, BaseException):
            log.error("detokenizing batch=%d failed: %r; ids=%s", res.batch_id, texts, ids,
                      exc_info=texts)
            self.dispatch.release(res.worker_id, job.stray, out)
            self.fail_batch(res.batch_id, now, out)
            return
        if res.batch_id not in self.sched.batches:
            return  # its worker was declared dead meanwhile: requests already re-queued
        try:
            k = len(job.rows)
            pairs = [(snap, texts[i], texts[k + i]) for i, snap in enumerate(job.snaps)]
            self._apply_rows(res, job.rows, pairs, job.stray, now, out)
        except Exception:
            # A bug here must not leave requests hanging: log it with the ids, fail the
            # batch (its requests are re-queued, up to scheduler.max_failures).
            log.exception("applying batch=%d failed; ids=%s", res.batch_id, ids)
            self.fail_batch(res.batch_id, now, out)

    def fail_batch(self, batch_id: int, now: float, out: Effects, why: str | None = None,
                   charged: bool = True) -> None:
        """The batch failed (``why``): its requests go back to the pool, or end with an
        ``engine_error`` after too many failures (not ``charged``: this one does not count)."""
        self.dispatch.settled(batch_id)
        batch = self.sched.batches.get(batch_id)
        members = [r.rid for r in batch.requests] if batch is not None else []
        if batch is not None and batch.worker is not None:
            for rid in members:  # what the worker holds of them is not vouched for any more
                self.dispatch.records.stale(batch.worker, rid)
        applied = self.sched.on_result(BatchOutcome(batch_id, ok=False, charged=charged), now)
        self.dispatch.apply(applied.releases, out)
        self.streaming.settle(members, now, out)
        for r in applied.ended:
            e = self.table.get(r.rid)
            if e is not None:
                self.replies.failed(e, f"its batches failed {r.failures} times in a row; the last: "
                                    f"{why or 'the daemon could not apply its result (see its log)'}",
                                    now, out)
        out.wake = True

    def _evicted(self, res: P.Result) -> None:
        """The worker dropped these requests' KV to make room."""
        if res.kv_evicted:
            self.sched.kv_evicted(res.worker_id, res.kv_evicted)
            self.engines.kv_evicted += len(res.kv_evicted)

    def _apply_rows(self, res: P.Result, rows: list[Row],
                    texts: list[tuple[tuple[int, int, int, int], str, str]], stray: list[str], now: float,
                    out: Effects) -> None:
        outcomes: list[RowOutcome] = []
        deltas: list[tuple[Entry, list[int], str]] = []
        stray = list(stray)
        errors: dict[str, str] = {}
        for row, full in zip(rows, texts, strict=True):
            e, o, k = row.entry, row.output, row.streamed
            if not self.table.holds(e):
                if o.kv_tokens:
                    stray.append(e.rid)
                continue  # cancelled or timed out while we decoded: its row is ignored
            if o.error is not None:
                errors[e.rid] = o.error[:MAX_ROW_ERROR]
                outcomes.append(RowOutcome(o.rid, 0, "error", failed=True))
                self.dispatch.records.dropped(res.worker_id, e.rid)  # a failed row's record goes
                continue
            _started(e, res.stats.queue_wait_s, now)
            tail = e.out.apply_slice(o)
            if o.finish_reason is not None:
                self.dispatch.records.dropped(res.worker_id, e.rid)  # finished there: it dropped it
                self.routes.note(res.worker_id, e.prompt_ids + e.out.ids)  # and may cache it
            else:
                self.dispatch.records.grew(res.worker_id, e.rid, len(e.prompt_ids) + len(e.out.ids))
            final = o.finish_reason is not None
            new_text = e.out.detok.apply_window(*full, final=final)
            reason = "stop" if e.out.detok.stopped else o.finish_reason
            kv = o.kv_tokens
            if kv and reason is not None:
                stray.append(e.rid)  # ended here (a stop string): the worker kept its KV for nothing
                kv = 0
            outcomes.append(RowOutcome(o.rid, k + len(tail), reason, kv_tokens=kv))
            if tail:
                e.tokens_at(now, len(tail))  # what the worker did not stream reaches the client now
            deltas.append((e, tail, new_text))
        stats = res.stats
        self.dispatch.settled(res.batch_id)
        elapsed = stats.prefill_s + stats.decode_s
        applied = self.sched.on_result(BatchOutcome(res.batch_id, outcomes, elapsed=elapsed), now)
        self._evicted(res)  # after the rows: a row kept early in the batch may be evicted later
        # A request cancelled while its row ran is released by the scheduler too: tell once.
        told = {rid for rel in applied.releases if rel.worker == res.worker_id for rid in rel.rids}
        self.dispatch.release(res.worker_id, [rid for rid in stray if rid not in told], out)
        self.dispatch.apply(applied.releases, out)
        out.batch_seconds.append(elapsed)
        self.engines.add(res.worker_id, stats, len(res.outputs))
        for e, ids, text in deltas:
            self.replies.delta(e, ids, text, out)
        for r in applied.ended:
            ended = self.table.get(r.rid)
            if ended is None:
                continue
            if r.rid in errors:
                log.warning("worker=%s batch=%d id=%s: the engine could not serve it: %s", res.worker_id,
                            res.batch_id, r.rid, errors[r.rid])
                self.replies.failed(ended, errors[r.rid], now, out, code="bad_request")
            else:
                self.replies.finish(ended, r.finish_reason or "error", now, out)
        out.wake = True


def _started(e: Entry, queue_wait_s: float, now: float) -> None:
    """A result for ``e`` came back: the first one says when its first slice started, its
    batch's dispatch plus the time the batch waited in the worker's queue (or earlier, when
    tokens of a slice whose worker was lost reached us before)."""
    if e.started_at is not None or e.sent_at is None:
        return
    start = min(now, e.sent_at + max(0.0, queue_wait_s))
    if e.req.first_token is not None:
        start = min(start, e.req.first_token)
    e.started_at = start
