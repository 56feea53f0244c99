"""``hf-cb``: transformers' own continuous batching, for the ILS baseline and slice grants.

Same model and library as ``hf``; the difference is the batching. Requests go to
transformers' ``ContinuousBatchingManager`` (paged KV cache, a background
generation thread that admits new requests at every iteration), so a request
joins the running batch as soon as it arrives and leaves it as soon as it
finishes: no padding, no invalid tokens. The manager lives as long as the engine
(:meth:`HFCBEngine.close` stops it), so KV can outlive a batch. Batches are submitted
while earlier ones generate, and each poll collects the tokens transformers streamed
(:class:`~worker.engines.base.Engine`). It shares the model's loading and facts with
``hf`` (:class:`~worker.engines.hf_model.TransformersModel`), not its serving.

A row generates at most ``min(max_new_tokens, slice_len)`` tokens in its batch
(finish_reason None when the slice ended first). **Grants** (``scls-cb``,
``kv_reuse`` on): a row stopped by its slice keeps its KV in transformers' cache,
paused (:mod:`worker.engines.cb_grants`), reported as ``kv_tokens`` (prompt +
generated - 1: the last sampled token is not fed yet). A later row with the same
rid whose ``token_ids`` are exactly that request's tokens resumes it in place, no
prefill (``reused_tokens``); any other row is served fresh (``prefill_tokens``),
dropping what was kept. :meth:`release` frees kept KV from any thread; the engine
drops kept KV by itself only to make room for running requests
(:meth:`take_evicted`). transformers' preemptions under a full cache are counted
(``BatchStats.preemptions``, since the engine started), as is the most KV held at
once (``kv_peak_tokens``). With ``kv_reuse`` off a row ends with its batch.

Sampling: on unless started with ``sampling = false`` (greedy only); each request's
temperature, top-k and top-p go to transformers' per-request warpers (greedy rows as
top-k 1). A row with a ``seed``, ``min_p`` or ``logprobs`` has its tokens picked by the
engine instead, as the static engines pick them (:mod:`worker.engines.cb_select`): a
seeded request gives ``hf``'s tokens, over any grants, and ``logprobs`` are the model's
log-softmax at each pick with the ``top_logprobs`` likeliest tokens, streamed with their
tokens. Each row's
``min_tokens``, ``logit_bias`` and grammar are applied per request, greedy or sampled,
by a logits processor of the engine's own that transformers runs before its warpers
(:mod:`worker.engines.cb_constraints`); a grammar's matcher stays with a request kept
between grants and is replayed from the row's tokens when the request is served
fresh. Prefix sharing is off: the daemon's KV accounting (and ``prefill_tokens``)
assumes every request holds its own blocks.

The manager's setup is :mod:`worker.engines.cb_setup`'s: the cache's size, on CUDA the memory
share (at most transformers' own), the KV padding of captured steps (``kv_padding_tokens``,
2,048 by default) and the step shapes captured at warm-up.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from sclsd import models
from sclsd.protocol import (
    BatchMsg,
    BatchRequest,
    BatchStats,
    EngineCaps,
    RequestOutput,
    TokenLogprobs,
)
from worker.engines.base import BatchDone, BatchFailed, Engine, EngineInfo, Event, NewTokens
from worker.engines.cb_constraints import RequestRules, RowRules
from worker.engines.cb_grants import Allowance, GrantControl, unregister
from worker.engines.cb_select import RowPick
from worker.engines.cb_setup import (  # noqa: F401 - GPU_GRAPHS_MEMORY_SHARE: part of this module's API
    GPU_GRAPHS_MEMORY_SHARE,
    cache_size,
    cache_tokens,
    generation_config,
    graph_padding,
    manager_options,
    start_manager,
    warm_graphs,
)
from worker.engines.constraints import stop_ids
from worker.engines.grammar import GrammarError, row_error
from worker.engines.grammar import supported as grammar_supported
from worker.engines.hf_model import TransformersModel, peak_memory
from worker.engines.static_cache import EAGER_RESERVE_TOKENS, RESERVE_ROWS

log = logging.getLogger(__name__)

#: transformers' "no limit" for max_new_tokens: rows stop at their allowance or a stop token.
NO_LIMIT = 2**31 - 1
def sampling_refusal(batch: BatchMsg, sampling: bool) -> str | None:
    """Why this engine cannot serve ``batch``'s sampling settings, if it cannot."""
    if not sampling and any(r.temperature > 0 for r in batch.requests):
        return "hf-cb serves greedy decoding only (temperature 0) unless started with sampling = true"
    return None


def sampling_kwargs(r: BatchRequest, vocab: int) -> dict[str, Any]:
    """transformers' per-request sampling settings for ``r``. Greedy (temperature 0) is
    top-k 1: only the argmax keeps any probability, so the draw is the argmax."""
    if r.temperature <= 0:
        return {"temperature": 1.0, "top_k": 1, "top_p": 1.0}
    top_k = r.top_k if 0 < r.top_k < vocab else vocab  # the whole vocabulary: no cut
    return {"temperature": float(r.temperature), "top_k": int(top_k), "top_p": float(r.top_p)}


def resumes(kept: _Kept | None, batch: BatchMsg, r: BatchRequest, stops: tuple[int, ...],
            rules: RequestRules) -> bool:
    """Whether row ``r`` of ``batch`` resumes request ``kept`` (unless it is evicted first): the
    same context, stop tokens and rules, and ``kv_reuse`` on."""
    return (kept is not None and batch.kv_reuse and kept.tokens == list(r.token_ids)
            and kept.stops == stops and rules.same(kept.tid, r))


@dataclass
class _Pending:
    """A batch in flight: its rows' outputs as they end, and its prefill accounting."""

    batch: BatchMsg
    started: float
    outputs: dict[str, RequestOutput] = field(default_factory=dict)
    prefill_tokens: int = 0
    reused_tokens: int = 0

    def done(self, control: GrantControl, device: Any) -> BatchDone:
        """Every row ended: the batch's end, with its stats (and the engine's totals)."""
        outs = [self.outputs[r.rid] for r in self.batch.requests]
        elapsed = time.perf_counter() - self.started
        with control.lock:
            preemptions, kv_peak = control.preemptions, control.kv_peak
        # No padding, no invalid tokens; prefill and decode interleave: one wall time.
        stats = BatchStats(decode_s=elapsed, iterations=max((len(o.token_ids) for o in outs), default=0),
                           peak_memory=peak_memory(device), batch_size=len(outs),
                           input_len=max((len(r.token_ids) for r in self.batch.requests), default=0),
                           prefill_tokens=self.prefill_tokens, reused_tokens=self.reused_tokens,
                           preemptions=preemptions, kv_peak_tokens=kv_peak)
        return BatchDone(self.batch, outs, stats)


@dataclass
class _Row:
    """One row of a batch in flight, served by transformers request ``tid``."""

    batch_id: int
    req: BatchRequest
    tid: str
    cap: int
    base: int
    """Tokens ``tid`` had generated before this batch (its outputs count from its creation)."""
    added_len: int
    """Length of the context ``tid`` was created with."""
    stops: tuple[int, ...]
    keep: bool
    sent: int = 0
    """Tokens of this batch already streamed."""
    reused: int = 0
    """Context tokens resumed from the request's kept KV (no prefill)."""
    pick: RowPick | None = None
    """The engine's own picks of ``tid``'s tokens (and their log-probabilities), if any."""
    out: list[int] = field(default_factory=list)
    """This batch's tokens streamed so far (what a cancelled row ends with)."""

    def logprobs(self, toks: list[int], start: int = 0) -> list[TokenLogprobs]:
        """Log-probabilities of this batch's tokens ``toks[start:]`` (empty if not asked)."""
        if self.pick is None:
            return []
        return self.pick.entries(self.base + start, self.base + len(toks))


def _pick_of(rules: RowRules | None) -> RowPick | None:
    """The engine's own picks among ``rules`` (a request's), if any."""
    return rules.pick if rules is not None else None


@dataclass(frozen=True)
class _Kept:
    """A paused request between grants: its KV is held for ``tokens[:-1]``."""

    tid: str
    tokens: list[int]
    added_len: int
    stops: tuple[int, ...]


class PausedRequests:
    """Requests paused between grants, their KV held in transformers' cache: what the serve
    thread keeps and resumes, and what ``release`` (the receive thread) frees. Every method
    holds one lock; ``control`` is the running manager's scheduler control."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.kept: dict[str, _Kept] = {}
        self.running: set[str] = set()
        """Rids of rows in flight: a release for them applies when their batch ends."""
        self.release_at_end: set[str] = set()
        self.evicted: list[str] = []

    def start(self, rid: str) -> _Kept | None:
        """A row of ``rid`` starts: what was kept for it (taken out), if anything."""
        with self.lock:
            self.running.add(rid)
            return self.kept.pop(rid, None)

    def peek(self, rid: str) -> _Kept | None:
        """What is kept for ``rid`` (left there)."""
        with self.lock:
            return self.kept.get(rid)

    def end_unstarted(self, rid: str) -> None:
        """A row of ``rid`` that :meth:`start` announced did not start after all."""
        with self.lock:
            self.running.discard(rid)
            self.release_at_end.discard(rid)

    def end(self, row: _Row, generated: list[int] | None, control: GrantControl) -> int:
        """Keep ``row``'s request paused (``generated``: this batch's tokens) or drop it;
        returns the KV tokens kept."""
        rid = row.req.rid
        with self.lock:
            self.running.discard(rid)
            released = rid in self.release_at_end
            self.release_at_end.discard(rid)
            evicted = row.keep and bool(control.take_evicted([row.tid]))
            if generated is not None and row.keep and not released and not evicted:
                ctx = list(row.req.token_ids) + generated
                old = self.kept.pop(rid, None)  # only if the rid ran twice at once: newest wins
                self.kept[rid] = _Kept(row.tid, ctx, row.added_len, row.stops)
                if old is not None:
                    control.drop(old.tid)
                return len(ctx) - 1
        control.drop(row.tid)
        return 0

    def note_evictions(self, control: GrantControl) -> None:
        """Move kept requests the scheduler evicted to the evicted list."""
        if not control.evicted:
            return
        with self.lock:
            by_tid = {k.tid: rid for rid, k in self.kept.items()}
            for tid in control.take_evicted(by_tid):
                rid = by_tid[tid]
                del self.kept[rid]
                self.evicted.append(rid)

    def release(self, rids: Iterable[str] | None, control: GrantControl) -> None:
        with self.lock:
            names = list(self.kept) if rids is None else list(rids)
            if rids is None:
                self.release_at_end.update(self.running)
            for rid in names:
                kept = self.kept.pop(rid, None)
                if kept is not None:
                    control.drop(kept.tid)
                elif rid in self.running:
                    self.release_at_end.add(rid)

    def take_evicted(self) -> list[str]:
        with self.lock:
            out, self.evicted = self.evicted, []
        return out

    def held(self) -> dict[str, int]:
        with self.lock:
            return {rid: len(k.tokens) - 1 for rid, k in self.kept.items()}

    def clear(self) -> None:
        """The manager stopped: everything kept is gone (reported as evicted)."""
        with self.lock:
            self.evicted.extend(self.kept)
            self.kept.clear()
            self.running.clear()
            self.release_at_end.clear()


def _rules_or_errors(engine: HFCBEngine, batch: BatchMsg,
                     p: _Pending) -> list[tuple[BatchRequest, RowRules | None]]:
    """``batch``'s rows to start, each with its rules (grammars compiled, replayed; None for a
    row that will resume its kept request). A row whose grammar cannot be built fails alone:
    its error output goes in ``p.outputs`` and whatever the engine kept for it is dropped.
    ValueError: other rules that cannot be built (the batch fails)."""
    todo: list[tuple[BatchRequest, RowRules | None]] = []
    for r in batch.requests:
        try:
            todo.append((r, None if engine._resumable(batch, r) else engine._row_rules(r)))
        except GrammarError as exc:
            log.warning("batch=%d: %s; the rest of the batch is served", batch.batch_id, exc)
            p.outputs[r.rid] = row_error(exc)
            engine.release([r.rid])
    return todo


class HFCBEngine(TransformersModel, Engine):
    """Continuous-batching engine over transformers' ``init_continuous_batching``."""

    name = "hf-cb"

    def __init__(self, model: str = models.DEFAULT_MODEL, device: str = "cpu", dtype: Any = None,
                 mem_budget: int | None = None, threads: int | None = None, poll_s: float = 0.005,
                 page_size: int | None = None, num_blocks: int | None = None, sampling: bool = True,
                 cuda_graphs: Any = "auto", memory_share: float | None = None,
                 max_batch_tokens: int | None = None, kv_padding_tokens: int | None = None,
                 max_rows: int | None = None) -> None:
        self.load(model, device, dtype, mem_budget, threads)
        # transformers' paged cache owns the KV here; the reserve is the eager path's.
        self.kv_limit = self.kv_memory(EAGER_RESERVE_TOKENS, RESERVE_ROWS)
        """Bytes of KV the paged cache may take, measured once."""
        self.poll_s = poll_s
        self.sampling = bool(sampling)
        self.gen_config = generation_config(self.sampling, self.pad_id, self.eos)
        page_size, num_blocks = cache_size(self.device.type, self.kv_limit, self.delta,
                                           page_size, num_blocks)
        self.cache_opts = manager_options(self.device.type, page_size, num_blocks, cuda_graphs,
                                          memory_share, max_batch_tokens)
        self.cache_opts |= graph_padding(self.device.type, bool(self.cache_opts.get("use_cuda_graph")),
                                         kv_padding_tokens)
        self.max_rows = int(max_rows or 0)
        """Most rows a step runs (0: as many as the cache holds); the daemon's grants follow it."""
        if self.max_rows:
            self.cache_opts["max_requests_per_batch"] = self.max_rows
        self.cache_tokens = num_blocks * page_size if num_blocks is not None else 0
        """Tokens the paged cache holds (0 until transformers has sized it: :meth:`warm_up`)."""
        self._mgr: Any = None
        self.warmed_shapes: int | None = None
        """Step shapes captured by :func:`~worker.engines.cb_setup.warm_graphs` (None: not run)."""
        self._control = GrantControl()  # replaced with the manager's own; never None
        self._scheduler_name = ""
        self._tids = itertools.count()
        self._paused = PausedRequests()
        self._rules = RequestRules(1, "cpu")  # replaced with the manager's own; never None
        """The running manager's per-request rules (min_tokens, logit_bias, grammars)."""
        self._pending: dict[int, _Pending] = {}
        """The batches in flight, by id."""
        self._owner: dict[str, _Row] = {}
        """transformers request id -> the row it serves now."""
        self._events: list[Event] = []
        """What the next :meth:`poll` returns."""

    def info(self) -> EngineInfo:
        """The model's facts; M_ava: what the paged cache holds once it exists (on the CPU at most
        the memory budget), else the KV memory measured at start."""
        mem = self.kv_limit
        if tokens := self.cache_tokens:
            mem = tokens * self.delta if self.device.type != "cpu" else min(mem, tokens * self.delta)
        return self.model_info(mem, self.caps())

    def warm_up(self, progress: Callable[[str], None] | None = None) -> None:
        """Start the manager before registering: transformers sizes and allocates its cache (and
        captures its graphs, when on), so the M_ava reported is what the cache holds."""
        if progress is not None:
            progress("warming: starting transformers' continuous batching")
        self._manager(progress)
        log.info("paged cache: %d tokens of KV (%.2f GiB)", self.cache_tokens, self.cache_tokens * self.delta / 2**30)

    def caps(self) -> EngineCaps:
        """Continuous batching; sampling when started with it, seeded; whole pages (the daemon's
        grants reserve them); min_tokens, logit_bias, grammars and log-probabilities per request."""
        page = self.cache_opts.get("page_size", 1) or 1
        return EngineCaps(batching="continuous", sampling=self.sampling,
                          seeded=True, max_context=self.max_context, kv_page_tokens=page, max_rows=self.max_rows,
                          min_tokens=True, logit_bias=True, grammar=grammar_supported())

    # ------------------------------------------------------------------ the manager

    def _manager(self, progress: Callable[[str], None] | None = None) -> Any:
        """The continuous batching manager, created and started on first use."""
        if self._mgr is None:
            mgr, control, name, rules = start_manager(self.model, self.gen_config, self.cache_opts,
                                                      self.sampling, self.device, progress)
            if self.device.type == "cuda":
                self.cache_tokens = cache_tokens(mgr)
                self.warmed_shapes = control.warmed_shapes
            self._mgr, self._control, self._scheduler_name, self._rules = mgr, control, name, rules
        return self._mgr

    def _drop_manager(self) -> None:
        """Stop the manager; whatever KV it kept is gone (reported as evicted)."""
        mgr, self._mgr = self._mgr, None
        if mgr is not None:
            try:
                # A hard stop: the default flushes, serving every request the manager holds
                # to its end first, which a worker that is closing or failing has no use for.
                mgr.stop(block=True, timeout=30, hard_stop=True)
            finally:
                unregister(self._scheduler_name)
        self._paused.clear()

    def close(self) -> None:
        """Stop the generation thread, then drop the model."""
        self._drop_manager()
        self.unload()

    # ------------------------------------------------------------------ the engine's four

    def has_room(self) -> bool:
        """Always: transformers queues the rows the cache cannot take yet (the daemon's grants
        reserve the pages they need)."""
        return True

    def busy(self) -> bool:
        """Whether a batch is in flight, or events wait for :meth:`poll`."""
        return bool(self._pending or self._events)

    def submit(self, batch: BatchMsg) -> None:
        """Add ``batch``'s rows to the running manager (started on first use): each resumes its
        kept request or starts fresh; a batch that cannot be served fails with its error."""
        self._admit(self._manager(), batch)

    def poll(self, timeout: float) -> list[Event]:
        """The rows' tokens that came within ``timeout`` (at most ``poll_s``), the batches whose
        rows all ended, and those that failed. Raises if the generation thread died (the worker
        exits and the daemon re-queues), the manager then stopped."""
        self._cancel()
        if self._owner:
            try:
                self._collect(self._manager(), min(timeout, self.poll_s))
            except BaseException:
                # The engine is broken: the worker exits, and the daemon serves these elsewhere.
                self._pending.clear()
                self._owner.clear()
                self._events.clear()
                self._drop_manager()
                raise
        events, self._events = self._events, []
        return events

    def _cancel(self) -> None:
        """End the rows :meth:`cancel` named (``cancelled``): transformers' own cancellation frees
        their blocks before its next step (:meth:`GrantControl.drop`), nothing is kept, and
        outputs of theirs still on the way are ignored."""
        marks = self.cancels.take()
        if not marks:
            return
        for tid, row in list(self._owner.items()):
            if (row.batch_id, row.req.rid) not in marks:
                continue
            del self._owner[tid]
            self._paused.end(row, None, self._control)
            self._row_ended(row, RequestOutput(rid=row.req.rid, token_ids=list(row.out),
                                               finish_reason="cancelled", logprobs=row.logprobs(row.out)))

    def _admit(self, mgr: Any, batch: BatchMsg) -> None:
        if why := sampling_refusal(batch, self.sampling):
            self._events.append(BatchFailed(batch, why))
            return
        p = _Pending(batch, time.perf_counter())
        try:
            self.check_batch(batch, self.vocab_size or None)
            # Rules for the rows to start; a row whose grammar cannot be built fails alone.
            todo = _rules_or_errors(self, batch, p)
        except ValueError as exc:
            self._events.append(BatchFailed(batch, str(exc), exc))
            return
        started: list[_Row] = []
        for r, rr in todo:
            try:
                started.append(self._start_row(mgr, batch, r, p, rr))
            except ValueError as exc:  # only a kept request evicted just now, whose rules then fail
                self._paused.end_unstarted(r.rid)
                for row in started:
                    self._paused.end(row, None, self._control)
                self._events.append(BatchFailed(batch, str(exc), exc))
                return
        if not started:  # no rows, or every row failed
            self._end(p)
            return
        self._pending[batch.batch_id] = p
        for row in started:
            self._owner[row.tid] = row

    def _resumable(self, batch: BatchMsg, r: BatchRequest) -> bool:
        """Whether ``r`` will resume its kept request (unless evicted meanwhile)."""
        return resumes(self._paused.peek(r.rid), batch, r, stop_ids(r, self.eos), self._rules)

    def _row_rules(self, r: BatchRequest) -> RowRules | None:
        return self._rules.for_row(r, stop_ids(r, self.eos), self.spec, self.eos)

    def _start_row(self, mgr: Any, batch: BatchMsg, r: BatchRequest, p: _Pending,
                   rules: RowRules | None) -> _Row:
        """Resume ``r``'s kept request if its context (and rules) match, else add a fresh one
        with ``rules`` (``r``'s, built unless it was to resume: a resumed request keeps its
        own, matcher included). ValueError: rules that cannot be built."""
        cap = min(r.max_new_tokens, batch.slice_len)
        stops = stop_ids(r, self.eos)
        keep = batch.kv_reuse and cap < r.max_new_tokens  # only a slice's end leaves more to do
        kept = self._paused.start(r.rid)
        ctx = list(r.token_ids)
        if (kept is not None and resumes(kept, batch, r, stops, self._rules)
                and self._control.resume(kept.tid, Allowance(len(ctx) + cap, keep))):
            p.reused_tokens += len(ctx) - 1
            return _Row(batch.batch_id, r, kept.tid, cap, len(ctx) - kept.added_len, kept.added_len,
                        stops, keep, reused=len(ctx) - 1, pick=_pick_of(self._rules.get(kept.tid)))
        if kept is not None:
            self._control.drop(kept.tid)
        if rules is None:  # it was to resume, but was evicted meanwhile
            rules = self._row_rules(r)
        tid = f"{r.rid}#{next(self._tids)}"  # unique: a rid served again never meets its old self
        if rules is not None:
            self._rules.add(tid, rules)  # before transformers can schedule it
        self._control.admit(tid, Allowance(len(ctx) + cap, keep))
        mgr.add_request(input_ids=ctx, request_id=tid, max_new_tokens=NO_LIMIT, streaming=True,
                        eos_token_id=list(stops) if stops else -1,
                        **(sampling_kwargs(r, int(self.config.vocab_size)) if self.sampling else {}))
        p.prefill_tokens += len(ctx)
        return _Row(batch.batch_id, r, tid, cap, 0, len(ctx), stops, keep, pick=_pick_of(rules))

    def _collect(self, mgr: Any, timeout: float) -> None:
        res = mgr.get_result(timeout=timeout)
        while res is not None:
            row = self._owner.get(res.request_id)
            if row is not None and row.batch_id in self._pending:
                self._on_output(row, res)
            res = mgr.get_result(timeout=0)
        self._paused.note_evictions(self._control)
        if not mgr.is_running():
            raise RuntimeError("continuous batching generation thread stopped unexpectedly")

    def _on_output(self, row: _Row, res: Any) -> None:
        """One streamed output of ``row``'s request: end the row at its cap or a stop token."""
        p = self._pending[row.batch_id]
        if res.error is not None:  # fail the whole batch: its other rows are dropped
            del self._pending[row.batch_id]
            for other in [o for o in self._owner.values() if o.batch_id == row.batch_id]:
                del self._owner[other.tid]
                self._paused.end(other, None, self._control)
            self._events.append(BatchFailed(p.batch, f"transformers failed request {row.req.rid}: {res.error}"))
            return
        toks = [int(t) for t in res.generated_tokens[row.base :]]
        finished = res.is_finished()
        if not finished and len(toks) < row.cap:
            self._stream_new(row, toks)
            return
        toks = toks[: row.cap]
        del self._owner[row.tid]
        if finished and toks and toks[-1] in row.stops:
            reason: str | None = "stop"
        elif len(toks) >= row.req.max_new_tokens:
            reason = "length"
        else:
            reason = None  # the slice ended first
        kept = self._paused.end(row, toks if reason is None and not finished else None, self._control)
        self._row_ended(row, RequestOutput(
            rid=row.req.rid, token_ids=toks, finish_reason=reason, kv_tokens=kept,  # type: ignore[arg-type]
            reused_tokens=row.reused, logprobs=row.logprobs(toks)))

    def _stream_new(self, row: _Row, toks: list[int]) -> None:
        """The tokens ``row`` generated since the last call, as an event (the batch's end still
        carries all of them)."""
        if len(toks) > row.sent:
            self._events.append(NewTokens(row.batch_id, [RequestOutput(
                rid=row.req.rid, token_ids=toks[row.sent:], logprobs=row.logprobs(toks, row.sent))]))
            row.sent = len(toks)
            row.out = toks

    def _end(self, p: _Pending) -> None:
        self._events.append(p.done(self._control, self.device))

    def _row_ended(self, row: _Row, out: RequestOutput) -> None:
        """``row`` ended with ``out``; its batch ends with its last row."""
        p = self._pending.get(row.batch_id)
        if p is None:
            return
        p.outputs[row.req.rid] = out
        if len(p.outputs) == len(p.batch.requests):
            del self._pending[row.batch_id]
            self._end(p)

    # ------------------------------------------------------------------ kept KV

    def release(self, rids: Iterable[str] | None = None) -> None:
        """Free kept KV (the daemon's ``release``; None: all). Any thread; a rid whose
        batch is still running is released when that batch ends."""
        self._paused.release(rids, self._control)

    def take_evicted(self) -> list[str]:
        """Requests whose kept KV the engine dropped by itself since the last call."""
        return self._paused.take_evicted()

    def kept(self) -> dict[str, int]:
        """rid -> KV tokens kept for it now (engine's view; for tests and status)."""
        return self._paused.held()
