"""The ``fake`` engine's continuous batching: grants join and leave one running set of rows.

With ``batching = "continuous"`` (what a fake worker reports under ``scls-cb``) the fake
engine serves as ``hf-cb`` does (:class:`worker.engines.hf_cb.HFCBEngine`), not one
batch at a time: batches are submitted while earlier ones generate (while fewer than
``max_rows`` rows run or wait: the rows of a batch beyond that wait for a place, and a
batch that finds no place stays in the worker's queue), and each poll runs one step, which

* sleeps ``decode_s`` once for every running row, plus ``prefill_s_per_token`` times the
  context tokens that rows joining in this step do not hold KV for (a step lasts that long
  from the previous step's end, however long the bookkeeping between took, as a device
  step would: the host's work overlaps it);
* gives every running row one token (:class:`~worker.engines.fake.FakeRow`: the same
  tokens as static batching, a function of the context) and hands each batch's new tokens
  as :class:`~worker.engines.base.NewTokens`;
* drops the rows the daemon cancelled (:meth:`~worker.engines.base.Engine.cancel`) before
  they get another token, each ending ``cancelled`` with nothing kept;
* ends the rows that stopped (EOS, a stop token), reached their budget or their slice
  (``min(max_new_tokens, slice_len)``), and ends a batch (:class:`~worker.engines.base.BatchDone`)
  once all its rows ended, with the same outputs and KV accounting as static batching
  (:meth:`FakeEngine.steps <worker.engines.fake.FakeEngine.steps>`).

KV (modelled, with ``kv_reuse``): a joining row checks out what the store keeps for its
request (the prefix it shares with the row's context), an unfinished row's context is kept
when it ends (``kv_tokens``), and the store shrinks to what fits beside the running rows'
reservations (context + slice each), least recently used first (``take_evicted``).
``release`` from the receive thread applies at once, or when a running row ends.

A row whose grammar cannot be built fails alone (``RequestOutput.error``), as on ``hf-cb``,
and whatever was kept for it is dropped; a malformed batch fails with its error
(:class:`~worker.engines.base.BatchFailed`) before any row runs; a row that fails
while generating fails its batch (its other rows leave the running set).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from sclsd.protocol import BatchMsg, BatchRequest, RequestOutput
from worker.engines.base import BatchDone, BatchFailed, CancelMarks, Event, NewTokens
from worker.engines.grammar import GrammarError, row_error
from worker.engines.grant import Grant, grant_stats, rows_memory
from worker.engines.kvstore import KVReuse, Retained

__all__ = ["ContinuousRows", "Row", "RowEngine"]

log = logging.getLogger("worker")


class Row(Protocol):
    """One row's token source (:class:`worker.engines.fake.FakeRow`)."""

    req: BatchRequest
    out: list[int]
    lps: list[Any]
    plps: list[Any]
    """The prompt's log-probabilities, when the row computes them (sent with its first tokens)."""
    reason: str | None

    def step(self) -> int: ...


class RowEngine(Protocol):
    """What the running set reads of its engine (:class:`worker.engines.fake.FakeEngine`)."""

    decode_s: float
    prefill_s_per_token: float
    max_rows: int
    vocab: int
    kv: KVReuse | None
    kv_bytes: int
    mem_budget: int
    kv_peak_tokens: int

    def check_batch(self, batch: BatchMsg, vocab: int | None = None) -> None: ...

    def row(self, r: BatchRequest) -> Row: ...

    def release(self, rids: Iterable[str] | None = None) -> None: ...

    @property
    def cancels(self) -> CancelMarks: ...


@dataclass
class _Live:
    """One row of a grant: waiting for a place, then running."""

    grant: Grant
    row: Row
    cap: int
    """Tokens it may generate in this batch: ``min(max_new_tokens, slice_len)``."""
    used: int = 0
    """Context tokens taken from kept KV when it joined."""
    sent: int = 0
    """Tokens already in a :class:`~worker.engines.base.NewTokens` event."""


class ContinuousRows:
    """The continuous fake engine's running set of rows (see the module docstring)."""

    def __init__(self, eng: RowEngine, clock: Any = time.perf_counter, sleep: Any = time.sleep) -> None:
        self.eng = eng
        self.clock = clock
        self.sleep = sleep
        self.waiting: deque[_Live] = deque()
        self.running: list[_Live] = []
        self.events: list[Event] = []
        """What the next :meth:`poll` returns."""
        self.step_at = float("-inf")
        """When the last step's tokens were ready (the next step lasts from there)."""

    # ------------------------------------------------------------------ the engine's four

    def has_room(self) -> bool:
        """Whether another batch may come in: a batch that finds every place taken waits in
        the worker's queue (its wait counts there, ``queue_wait_s``), not in the engine."""
        return len(self.running) + len(self.waiting) < self.eng.max_rows

    def busy(self) -> bool:
        """Whether rows run or wait, or events wait for :meth:`poll`."""
        return bool(self.running or self.waiting or self.events)

    def submit(self, batch: BatchMsg) -> None:
        """Check ``batch`` and queue its rows; a batch that cannot be served fails with its
        error, a row whose grammar cannot be built ends alone."""
        eng = self.eng
        try:
            eng.check_batch(batch, eng.vocab)
            for r in batch.requests:
                if r.generated > len(r.token_ids):
                    raise ValueError(f"request {r.rid!r}: generated exceeds its context")
        except ValueError as exc:
            self.events.append(BatchFailed(batch, str(exc), exc))
            return
        g = Grant(batch, self.clock(), len(batch.requests))
        rows: list[_Live] = []
        for r in batch.requests:
            try:
                rows.append(_Live(g, eng.row(r), min(r.max_new_tokens, batch.slice_len)))
            except GrammarError as exc:
                log.warning("batch=%d: %s; the rest of the batch is served", batch.batch_id, exc)
                g.outputs[r.rid] = row_error(exc)
                g.left -= 1
                eng.release([r.rid])
        if g.left == 0:  # no rows, or every row failed
            self._finish(g)
            return
        self.waiting.extend(rows)

    def poll(self, timeout: float) -> list[Event]:
        """One step of every running row (when rows run or wait), and what happened since the
        last poll."""
        if self.running or self.waiting:
            self.step()
        events, self.events = self.events, []
        return events

    def step(self) -> None:
        """One iteration of every running row (rows that find a place join first; rows the
        daemon cancelled leave before it)."""
        self._cancel()
        joined = self._join()
        fresh = sum(len(lv.row.req.token_ids) - lv.used for lv in joined)
        prefill = self.eng.prefill_s_per_token * fresh
        for lv in joined:
            share = len(lv.row.req.token_ids) - lv.used
            lv.grant.prefill_tokens += share
            lv.grant.reused_tokens += lv.used
            lv.grant.prefill_s += self.eng.prefill_s_per_token * share
        now = self.clock()
        # A step lasts decode_s (and the prefill) from the previous one's end, unless the
        # loop came back later than that: the host's bookkeeping overlaps the device's step.
        start = self.step_at if now - self.step_at < self.eng.decode_s else now
        self.step_at = start + self.eng.decode_s + prefill
        failed: dict[int, tuple[Grant, BaseException]] = {}
        for lv in self.running:
            if lv.grant.batch.batch_id in failed:
                continue
            try:
                lv.row.step()
            except Exception as exc:  # noqa: BLE001 - the batch fails, the engine goes on
                log.exception("batch=%d failed", lv.grant.batch.batch_id)
                failed[lv.grant.batch.batch_id] = (lv.grant, exc)
        self._track_peak()
        wait = self.step_at - self.clock()
        if wait > 0:
            self.sleep(wait)
        for g, why in failed.values():
            self._fail(g, why)
        for bid, outs in self._new_tokens():
            self.events.append(NewTokens(bid, outs))
        ended = [lv for lv in self.running if lv.row.reason is not None or len(lv.row.out) >= lv.cap]
        if ended:
            gone = {id(lv) for lv in ended}
            self.running = [lv for lv in self.running if id(lv) not in gone]
            for lv in ended:
                self._end(lv)

    # ------------------------------------------------------------------ rows

    def _cancel(self) -> None:
        """End the rows :meth:`~worker.engines.base.Engine.cancel` named, waiting or running,
        before they get another token: ``cancelled``, nothing kept."""
        marks = self.eng.cancels.take()
        if not marks:
            return

        def hit(lv: _Live) -> bool:
            return (lv.grant.batch.batch_id, lv.row.req.rid) in marks

        gone = [lv for lv in self.waiting if hit(lv)] + [lv for lv in self.running if hit(lv)]
        if not gone:
            return
        self.waiting = deque(lv for lv in self.waiting if not hit(lv))
        self.running = [lv for lv in self.running if not hit(lv)]
        for lv in gone:
            lv.row.reason = "cancelled"
            self._end(lv)

    def _join(self) -> list[_Live]:
        """Move waiting rows into the running set while it has room; their kept KV is taken."""
        joined: list[_Live] = []
        kv = self.eng.kv
        while self.waiting and len(self.running) < self.eng.max_rows:
            lv = self.waiting.popleft()
            r = lv.row.req
            if kv is not None:
                entry, used = kv.store.take(r.rid, r.token_ids)
                lv.used = used if entry is not None and lv.grant.batch.kv_reuse else 0
            self.running.append(lv)
            joined.append(lv)
        if joined and kv is not None:
            need = sum(len(lv.row.req.token_ids) + lv.cap for lv in self.running) * self.eng.kv_bytes
            kv.store.make_room(self.eng.mem_budget - need)
        return joined

    def _new_tokens(self) -> Iterator[tuple[int, list[RequestOutput]]]:
        """Per batch, the running rows' tokens not streamed yet."""
        by_batch: dict[int, list[RequestOutput]] = {}
        for lv in self.running:
            row = lv.row
            if len(row.out) > lv.sent:
                by_batch.setdefault(lv.grant.batch.batch_id, []).append(RequestOutput(
                    rid=row.req.rid, token_ids=row.out[lv.sent:], finish_reason=row.reason,  # type: ignore[arg-type]
                    logprobs=row.lps[lv.sent:], prompt_logprobs=row.plps if lv.sent == 0 else []))
                lv.sent = len(row.out)
        yield from by_batch.items()

    def _end(self, lv: _Live) -> None:
        """A running row ended: keep its KV when it may go on, record its output."""
        row, r, g = lv.row, lv.row.req, lv.grant
        kept = 0
        kv = self.eng.kv
        if kv is not None:
            if g.batch.kv_reuse and row.reason is None and row.out:
                tokens = list(r.token_ids) + row.out[:-1]  # the last token was sampled, never fed
                if kv.store.put(r.rid, Retained(tokens, len(tokens) * self.eng.kv_bytes)):
                    kept = len(tokens)
            kv.store.done([r.rid])
        g.outputs[r.rid] = RequestOutput(rid=r.rid, token_ids=row.out, finish_reason=row.reason,  # type: ignore[arg-type]
                                         logprobs=row.lps, prompt_logprobs=row.plps, kv_tokens=kept,
                                         reused_tokens=lv.used)
        g.left -= 1
        if g.left == 0:
            self._finish(g)

    def _fail(self, g: Grant, exc: BaseException) -> None:
        """``g``'s batch failed: its rows leave (nothing kept) and it ends with the error."""
        mine = [lv for lv in self.running if lv.grant is g]
        self.running = [lv for lv in self.running if lv.grant is not g]
        self.waiting = deque(lv for lv in self.waiting if lv.grant is not g)
        rids = [lv.row.req.rid for lv in mine]
        if self.eng.kv is not None:
            self.eng.kv.store.done(rids)
        self.events.append(BatchFailed(g.batch, f"{type(exc).__name__}: {exc}", exc))

    def _finish(self, g: Grant) -> None:
        outs = [g.outputs[r.rid] for r in g.batch.requests]
        # No padding, no invalid tokens: rows leave as they end.
        outs, stats = grant_stats(g, self.clock(), rows_memory(g, self.eng.kv_bytes), self.eng.kv_peak_tokens)
        self.events.append(BatchDone(g.batch, outs, stats))

    def _track_peak(self) -> None:
        """KV tokens held once this step ran: the running rows' contexts and what is kept."""
        held = sum(len(lv.row.req.token_ids) + len(lv.row.out) for lv in self.running)
        if self.eng.kv is not None:
            held += self.eng.kv.store.nbytes // max(1, self.eng.kv_bytes)
        self.eng.kv_peak_tokens = max(self.eng.kv_peak_tokens, held)
