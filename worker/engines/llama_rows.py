"""The ``llama`` engine's running set: rows join and leave between steps, and every step
decodes all of them in one ``llama_decode``.

A batch's rows wait in arrival order, then join the running set while it has fewer than
``max_rows`` rows, a sequence of the context is free for them (kept KV moved out of the
context if need be: :meth:`KVSlots.spill <worker.engines.llama_kv.KVSlots.spill>`) and their
reservation, context plus what they may generate in the slice, fits the KV cells beside the
running rows' reservations. A row that joins resumes its request's kept KV where it
can (:meth:`KVSlots.start <worker.engines.llama_kv.KVSlots.start>`) and feeds the rest of
its context, at most ``batch_tokens`` tokens per step in all: first one token of every row
that decodes, then prefill chunks of the rows that joined, oldest first (a long prompt is
split over steps beside the others' decodes instead of stalling them). A row with the
logits of its last context token picks its next token (:func:`~worker.engines.llama_pick.pick`).

A row ends at a stop token, its request's budget, its slice (``min(max_new_tokens,
slice_len)`` tokens), or a cancel from the daemon (:meth:`Engine.cancel
<worker.engines.base.Engine.cancel>`: waiting or running, it leaves before the next step,
``cancelled``, nothing kept); an unfinished row whose slice ended keeps its KV (``kv_reuse``): the
context tokens it fed, i.e. all but the last token picked (``kv_tokens``). A batch ends
(:class:`~worker.engines.base.BatchDone`) when all its rows did. A row whose grammar
cannot be built fails alone; a malformed batch fails before any row runs; a failure
while picking fails the batches of that step's rows.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sclsd.protocol import BatchMsg, BatchRequest, RequestOutput, TokenLogprobs
from worker.engines.base import BatchDone, BatchFailed, CancelMarks, Event, NewTokens
from worker.engines.constraints import stop_ids
from worker.engines.grammar import GrammarError, row_error
from worker.engines.grant import Grant, grant_stats, rows_memory
from worker.engines.llama_kv import KVSlots
from worker.engines.llama_lib import Batch, Context, LlamaError
from worker.engines.llama_pick import RowPick, pick

__all__ = ["Running"]

log = logging.getLogger("worker")


@dataclass(eq=False)
class _Row:
    """One row of a batch: waiting, then running in sequence ``seq``."""

    grant: Grant
    req: BatchRequest
    picks: RowPick
    cap: int
    """Tokens it may generate in this batch: ``min(max_new_tokens, slice_len)``."""
    stops: frozenset[int]
    tokens: list[int]
    """Its context, then the tokens it generated."""
    seq: int = -1
    fed: int = 0
    """Tokens of ``tokens`` whose KV the sequence holds."""
    out: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    reason: str | None = None
    sent: int = 0
    """Tokens already in a :class:`~worker.engines.base.NewTokens` event."""
    reused: int = 0
    plps: list[TokenLogprobs] = field(default_factory=list)
    """Its prompt's log-probabilities, filled as the prefill's chunks are decoded."""

    @property
    def scores_prompt(self) -> bool:
        """Whether its prefill computes its prompt's log-probabilities (``prompt_logprobs`` in
        the request's first slice, the whole prompt prefilled here)."""
        return self.req.prompt_logprobs is not None and self.req.generated == 0 and self.reused == 0

    @property
    def reserve(self) -> int:
        """KV cells the row may hold: its context and the tokens it may still generate."""
        return len(self.req.token_ids) + self.cap

    def push(self, token: int, lp: TokenLogprobs | None) -> None:
        self.out.append(token)
        self.tokens.append(token)
        if lp is not None:
            self.logprobs.append(lp)
        if token in self.stops:
            self.reason = "stop"
        elif len(self.out) >= self.req.max_new_tokens:
            self.reason = "length"


class Running:
    """The running set of the ``llama`` engine (see the module docstring)."""

    def __init__(self, ctx: Context, kv: KVSlots, max_rows: int, batch_tokens: int, vocab: int,
                 eos: list[int], grammar_tokenizer: Callable[[], Any], kv_bytes: int,
                 cancels: CancelMarks) -> None:
        self.ctx, self.kv = ctx, kv
        self.cancels = cancels
        self.kv_bytes = kv_bytes
        self.max_rows, self.batch_tokens = max_rows, batch_tokens
        self.vocab, self.eos = vocab, eos
        self.grammar_tokenizer = grammar_tokenizer
        self.batch = Batch(ctx.api, batch_tokens)
        self.waiting: deque[_Row] = deque()
        self.rows: list[_Row] = []
        self.events: list[Event] = []
        self.steps = 0
        self.kv_peak = 0
        """The most KV cells held at once (running rows and kept KV in the context)."""

    # ------------------------------------------------------------------ the engine's four

    def has_room(self) -> bool:
        """Whether another batch may come in (a batch that finds every place taken waits in the
        worker's queue, where its wait is measured)."""
        return len(self.rows) + len(self.waiting) < self.max_rows

    def busy(self) -> bool:
        return bool(self.rows or self.waiting or self.events)

    def submit(self, batch: BatchMsg, check: Callable[[BatchMsg], None]) -> None:
        """Check ``batch`` (``check`` raises ValueError) and queue its rows."""
        try:
            check(batch)
            for r in batch.requests:
                if r.generated > len(r.token_ids):
                    raise ValueError(f"request {r.rid!r}: generated exceeds its context")
                need = len(r.token_ids) + min(r.max_new_tokens, batch.slice_len)
                if need > self.ctx.n_ctx:
                    raise ValueError(f"request {r.rid!r}: its context and slice ({need} tokens) do not "
                                     f"fit this worker's KV cache of {self.ctx.n_ctx} tokens")
        except ValueError as exc:
            self.events.append(BatchFailed(batch, str(exc), exc))
            return
        g = Grant(batch, time.perf_counter(), len(batch.requests))
        for r in batch.requests:
            try:
                picks = RowPick.build(r, self.grammar_tokenizer)
            except GrammarError as exc:
                log.warning("batch=%d: %s; the rest of the batch is served", batch.batch_id, exc)
                g.outputs[r.rid] = row_error(exc)
                g.left -= 1
                self.kv.release([r.rid])
                continue
            self.kv.take(r.rid)
            self.waiting.append(_Row(g, r, picks, min(r.max_new_tokens, batch.slice_len),
                                     frozenset(stop_ids(r, self.eos)), list(r.token_ids)))
        if g.left == 0:
            self._finish(g)

    def poll(self) -> list[Event]:
        """One step (when rows run or wait), and what happened since the last poll."""
        if self.rows or self.waiting:
            self.step()
        else:
            self.cancels.take()  # marks of rows no longer here
        events, self.events = self.events, []
        return events

    # ------------------------------------------------------------------ a step

    def step(self) -> None:
        """Join waiting rows, decode one batch of every running row's next tokens, pick (rows
        the daemon cancelled leave first)."""
        self._cancel()
        self.kv.apply_releases()
        self._join()
        if not self.rows:
            return
        t0 = time.perf_counter()
        outs, fed, scored = self._decode()
        self.steps += 1
        self._track_peak()
        if scored:
            try:
                self._score(scored)
            except Exception as exc:  # noqa: BLE001 - these batches fail, the engine goes on
                log.exception("the prompt's log-probabilities failed")
                for g in dict.fromkeys(r.grant for r, _, _, _ in scored):
                    self._fail(g, exc)
                outs = [(r, j) for r, j in outs if r in self.rows]
        if outs:
            picked = [r for r, _ in outs]
            try:
                logits = self.ctx.logits(self.batch.n_out)
                if len(logits) != len(outs):  # a prompt's logits came too: the picks' rows only
                    logits = logits[[j for _, j in outs]]
                toks, lps = pick([(r.picks, r.tokens, r.req.generated + len(r.out)) for r in picked],
                                 logits, self.vocab, self.eos)
            except Exception as exc:  # noqa: BLE001 - these batches fail, the engine goes on
                log.exception("picking failed")
                for g in dict.fromkeys(r.grant for r in picked):
                    self._fail(g, exc)
                return
            for r, tok, lp in zip(picked, toks, lps, strict=True):
                r.push(tok, lp)
        # A grant's prefill time: its rows' share of the tokens of the steps that fed their contexts.
        dt = (time.perf_counter() - t0) / max(1, sum(k for _, k in fed))
        for r, k in fed:
            if r.fed - k < len(r.req.token_ids) - 1:
                r.grant.prefill_s += dt * k
        self._stream()
        ended = [r for r in self.rows if r.reason is not None or len(r.out) >= r.cap]
        if ended:
            self.rows = [r for r in self.rows if r.reason is None and len(r.out) < r.cap]
            for r in ended:
                self._end(r)

    def _cancel(self) -> None:
        """End the rows :meth:`~worker.engines.base.Engine.cancel` named, waiting or running,
        before they get another token: ``cancelled``, their KV dropped."""
        marks = self.cancels.take()
        if not marks:
            return

        def hit(r: _Row) -> bool:
            return (r.grant.batch.batch_id, r.req.rid) in marks

        gone = [r for r in self.waiting if hit(r)] + [r for r in self.rows if hit(r)]
        self.waiting = deque(r for r in self.waiting if not hit(r))
        self.rows = [r for r in self.rows if not hit(r)]
        for r in gone:
            r.reason = "cancelled"
            self._end(r)

    def _join(self) -> None:
        """Move waiting rows into the running set while there is room (module docstring)."""
        while self.waiting and len(self.rows) < self.max_rows:
            row = self.waiting[0]
            busy = sum(r.reserve for r in self.rows)
            free_cells = self.ctx.n_ctx - busy - row.reserve
            if free_cells < 0:
                return  # waits for running rows to end
            if self.kv.resident_tokens() + self.kv.cached_tokens() > free_cells or not self.kv.free:
                self.kv.spill(free_cells, 1)
                self.kv.apply_releases()
            # A row that scores its prompt computes every position's logits: no shared prefix.
            # Not in the paper's slicing either (kv_reuse off: every slice prefills in full).
            got = self.kv.start(row.req.rid, row.tokens,
                                share=row.grant.batch.kv_reuse and row.req.prompt_logprobs is None)
            if got is None:
                return
            self.waiting.popleft()
            row.seq, row.fed = got
            row.reused = row.fed
            g = row.grant
            g.reused_tokens += row.fed
            g.prefill_tokens += len(row.tokens) - row.fed
            self.rows.append(row)

    def _decode(self) -> tuple[list[tuple[_Row, int]], list[tuple[_Row, int]],
                               list[tuple[_Row, int, int, int]]]:
        """Decode the step's tokens (module docstring): the rows that get logits, with their
        index among them; every row fed, with its tokens; and the prompt chunks scored (a row
        whose prompt's log-probabilities are asked for gets every fed token's logits), each as
        (row, index of its first logits, first position, positions). A decode that finds no
        room defragments the cache, then moves kept KV out, then leaves the prefills for a
        later step; LlamaError if none helps."""
        for attempt in range(4):
            b = self.batch
            b.clear()
            outs: list[tuple[_Row, int]] = []
            fed: list[tuple[_Row, int]] = []
            scored: list[tuple[_Row, int, int, int]] = []
            decoding = [r for r in self.rows if r.fed == len(r.tokens) - 1]
            prefilling = [r for r in self.rows if r.fed < len(r.tokens) - 1] if attempt < 3 else []
            for r in decoding + prefilling:
                k = min(len(r.tokens) - r.fed, b.room())
                if k <= 0:
                    break
                last = r.fed + k == len(r.tokens)
                # Positions up to the prompt's last but one predict a prompt token.
                score = min(k, len(r.tokens) - 1 - r.fed) if r.scores_prompt else 0
                if score > 0:
                    j0 = b.add(r.tokens[r.fed:r.fed + k], r.seq, r.fed, last, every=True)
                    scored.append((r, j0, r.fed, score))
                    j = j0 + k - 1
                else:
                    j = b.add(r.tokens[r.fed:r.fed + k], r.seq, r.fed, last)
                fed.append((r, k))
                if last:
                    outs.append((r, j))
            if not fed:
                break
            rc = self.ctx.decode(b)
            if rc == 0:
                for r, k in fed:
                    r.fed += k
                return outs, fed, scored
            if rc < 0:
                raise LlamaError(f"llama_decode failed ({rc})")
            log.info("no room in the KV cache for %d tokens (attempt %d): %s", b.n, attempt + 1,
                     ("defragmenting", "moving kept KV out", "prefills wait")[min(attempt, 2)])
            if attempt == 0:
                self.ctx.defrag()
            elif attempt == 1:
                self.kv.spill(0, 0)
                self.kv.apply_releases()
                self.ctx.defrag()
        raise LlamaError(f"no room in the KV cache of {self.ctx.n_ctx} cells for {len(self.rows)} rows")

    def _score(self, scored: list[tuple[_Row, int, int, int]]) -> None:
        """The prompt's log-probabilities of the chunks just decoded: the logits at position p
        give prompt token p + 1's."""
        import torch

        from worker.engines.sampling import prompt_logprobs

        logits = torch.from_numpy(self.ctx.logits(self.batch.n_out))
        for r, j0, p0, n in scored:
            k = r.req.prompt_logprobs or 0
            targets = torch.tensor(r.tokens[p0 + 1:p0 + 1 + n], dtype=torch.long)
            r.plps.extend(prompt_logprobs(logits[j0:j0 + n], targets, k))

    # ------------------------------------------------------------------ rows and batches

    def _stream(self) -> None:
        by_grant: dict[int, list[RequestOutput]] = {}
        for r in self.rows:
            if len(r.out) > r.sent:
                by_grant.setdefault(r.grant.batch.batch_id, []).append(RequestOutput(
                    rid=r.req.rid, token_ids=r.out[r.sent:], finish_reason=r.reason,  # type: ignore[arg-type]
                    logprobs=r.logprobs[r.sent:], prompt_logprobs=r.plps if r.sent == 0 else []))
                r.sent = len(r.out)
        for bid, outs in by_grant.items():
            self.events.append(NewTokens(bid, outs))

    def _end(self, r: _Row) -> None:
        """A running row ended: keep its KV when its request goes on, record its output."""
        g = r.grant
        keep = g.batch.kv_reuse and r.reason is None and r.cap < r.req.max_new_tokens
        # What the request does not keep stays as a prefix other requests may share.
        kept = self.kv.end(r.req.rid, r.seq, r.tokens[:r.fed] if keep else None,
                           fed=r.tokens[:r.fed] if g.batch.kv_reuse else None)
        g.outputs[r.req.rid] = RequestOutput(
            rid=r.req.rid, token_ids=r.out, finish_reason=r.reason,  # type: ignore[arg-type]
            logprobs=r.logprobs, prompt_logprobs=r.plps, kv_tokens=kept, reused_tokens=r.reused)
        g.left -= 1
        if g.left == 0:
            self._finish(g)

    def _fail(self, g: Grant, exc: BaseException) -> None:
        """``g``'s batch failed: its rows leave (nothing kept) and it ends with the error."""
        for r in [r for r in self.rows + list(self.waiting) if r.grant is g]:
            self.kv.end(r.req.rid, r.seq, None)
        self.rows = [r for r in self.rows if r.grant is not g]
        self.waiting = deque(r for r in self.waiting if r.grant is not g)
        self.events.append(BatchFailed(g.batch, f"{type(exc).__name__}: {exc}", exc))

    def _finish(self, g: Grant) -> None:
        # No padding, no invalid tokens: rows leave as they end.
        outs, stats = grant_stats(g, time.perf_counter(), rows_memory(g, self.kv_bytes), self.kv_peak)
        self.events.append(BatchDone(g.batch, outs, stats))

    def _track_peak(self) -> None:
        held = sum(r.fed for r in self.rows) + self.kv.resident_tokens()
        self.kv_peak = max(self.kv_peak, held)
