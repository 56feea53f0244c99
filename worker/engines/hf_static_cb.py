"""``hf-static-cb``: continuous batching on ``hf``'s static KV arena and captured decode graphs.

The engine of slice grants (``scls-cb``) with ``hf``'s decode step: the same arena
(:class:`~worker.engines.static_cache.KVArena`), buckets and CUDA graphs, with rows that
join and leave between steps (:mod:`worker.engines.arena_rows`: each row writes its own
column, so rows of any lengths run side by side; :mod:`worker.engines.arena_set`: which rows
wait, run, pause and leave). One poll is one turn:

1. the step's tokens are read, streamed (:class:`~worker.engines.base.NewTokens`) and checked
   for their ends; a row that ended gives its output to its grant at once, and one whose
   slice ended first, with its request's KV kept, pauses in its slot
   (:meth:`~worker.engines.arena_set.ArenaRows.settle`): its next grant on this worker resumes
   it there, with nothing copied or prefilled;
2. when the running rows' geometry changes, a waiting row can join, or rows have grammars,
   the rows regroup (:meth:`~worker.engines.arena_set.ArenaRows.regroup`): rows that ended
   leave the step, waiting rows join (returning rows first, resumed in place or copied in from
   the kept-KV store, :class:`~worker.engines.kvstore.KVStore`; newcomers' context but the last
   token prefilled in their slots, in chunks of at most ``prefill_chunk_tokens`` tokens and no
   more than one chunk's worth of newcomers per turn; a newcomer asking for its prompt's
   log-probabilities gets them from its prefill's chunks, :mod:`worker.engines.arena_rows`,
   and sends them with its first tokens), paused rows spill to the store only
   when a joining row needs their room, and the rows take their slots in one geometry (``n``
   slots of ``c`` columns, ``c`` at least every row's ``context + slice``: slices bound how
   far a row grows, so a row that joined always finishes its grant);
3. one decode step of every running row (a captured graph when its bucket has one), the
   rows' tokens picked by :class:`~worker.engines.sampling.BatchSampler`, the static engines'
   own (greedy, seeded sampling, penalties, ``logit_bias``, ``min_tokens``, grammars,
   log-probabilities).

On CUDA the next step is queued before the host reads a step's tokens (``read_behind``),
while the step's rows stay the same and no row has a grammar: a row that ended stays in the
step until the next regroup, its tokens never read. The rows never wait on KV memory: the
daemon reserves ``context + slice`` per grant and a kept request's context against M_ava,
which is the arena. Rows of very different lengths share one geometry, so the arena may hold
fewer of them than the reservations allow: a row that does not fit yet waits (its grant's
time counts), never fails, and one that cannot fit even alone fails alone with the reason.

:meth:`release` comes from the receive thread: it drops kept KV in the store at once (the
store's lock) and marks the request for the serve thread's next turn
(:class:`~worker.engines.arena_cb.Releases`), where a paused row of it leaves its slot and a
row of it that is waiting or running will keep nothing when it ends; rows
:meth:`~worker.engines.base.Engine.cancel` names end there, ``cancelled``: a waiting one at
once, a running one before it gets another token.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from sclsd import models
from sclsd.protocol import BatchMsg, EngineCaps, RequestOutput
from worker.engines.arena_cb import Row
from worker.engines.arena_rows import RowRunner
from worker.engines.arena_set import ArenaRows
from worker.engines.base import (
    BatchDone,
    BatchFailed,
    Engine,
    EngineInfo,
    Event,
    ModelUnsupported,
    NewTokens,
)
from worker.engines.grammar import BatchGrammar, GrammarError, grammar_for, row_error, row_matcher
from worker.engines.grammar import supported as grammar_supported
from worker.engines.grant import Grant, grant_stats
from worker.engines.graph_check import warm_graphs
from worker.engines.hf import default_host_bytes, to_host
from worker.engines.hf_model import TransformersModel, peak_memory
from worker.engines.kvstore import KVStore, supports_reuse
from worker.engines.sampling import BatchSampler, Draw, PendingDraw
from worker.engines.static_cache import STATIC_ATTENTION, StaticOptions, attention_kind

log = logging.getLogger(__name__)

__all__ = ["HFStaticCBEngine"]

#: Uniform numbers drawn ahead per sampled row when the rows change (the table grows on demand).
DRAWS_AHEAD = 8

#: The arena's share of the KV memory by default. ``hf`` gives half to the kept-KV store, which
#: holds every request's KV between its slices; here a paused row keeps its KV in its arena slot
#: and the store takes only the rows a joining row spills, which come back within a few turns.
#: So most of the memory is the arena (the rows a step holds at saturation, and M_ava), the rest
#: the spills' store, with pinned host memory behind it on CUDA.
ARENA_SHARE = 0.9


@dataclass
class _Flight:
    """A decode step whose tokens the host has not read yet."""

    pending: PendingDraw
    draw: Draw
    sampler: BatchSampler
    grammar: BatchGrammar | None
    rows: list[Row]


def _kv_store(reuse: bool, retain: int | None, host: int | None, kv_limit: int, arena_bytes: int,
              device_type: str) -> KVStore | None:
    """Kept KV's store: the KV memory (``kv_limit``) the arena leaves, or ``kv_retain_bytes``,
    and host memory behind it (on CUDA, by default); None without ``kv_reuse``."""
    if not reuse:
        return None
    budget = kv_limit - arena_bytes if retain is None else int(retain)
    if host is None:
        host = default_host_bytes(device_type, kv_limit)
    log.info("KV kept between grants: up to %d bytes, %d more in host memory", budget, host)
    return KVStore(budget, host, to_host)


def _unsupported(model: str, config: Any, decode_attention: str) -> str | None:
    """Why the arena cannot serve ``model`` (None: it can): its cache layers must all be full
    attention, its attention take a 4-D mask, and SDPA's for FlexAttention to replace it."""
    kind = attention_kind(config)
    if not supports_reuse(config):
        return f"{model}'s cache layers are not all full attention (the arena needs them)"
    if kind not in STATIC_ATTENTION:
        return f"{kind} attention takes no 4-D mask (the arena needs one)"
    if decode_attention == "flex" and kind != "sdpa":
        return f'decode_attention = "flex" replaces SDPA, and {model} runs {kind}'
    return None


def _attention_options(opts: StaticOptions, decode_attention: str, device_type: str) -> StaticOptions:
    """``opts`` for ``decode_attention``: FlexAttention runs batches in bucket shapes unless told
    otherwise (few kernels to compile, all at warm-up on CUDA); off CUDA, where each shape
    compiles its own kernel, it needs them (ValueError)."""
    if decode_attention != "flex":
        return opts
    if opts.buckets is None:
        opts = replace(opts, buckets=True)
    if device_type != "cuda" and not opts.buckets:
        raise ValueError(f'{HFStaticCBEngine.name}: decode_attention = "flex" off CUDA compiles its kernel for '
                         "each step shape (the CPU's has no dynamic shapes): leave static_buckets on to bound them")
    return opts


class HFStaticCBEngine(TransformersModel, Engine):
    """Continuous batching over the static arena (see the module docstring)."""

    name = "hf-static-cb"

    def __init__(self, model: str = models.DEFAULT_MODEL, device: str = "cpu", dtype: Any = None,
                 mem_budget: int | None = None, threads: int | None = None, kv_reuse: bool = True,
                 kv_retain_bytes: int | None = None, kv_host_bytes: int | None = None, cuda_graphs: Any = "auto",
                 static_share: float = ARENA_SHARE, graph_batch_sizes: Any = None, graph_cache_tokens: Any = None,
                 prefill_chunk_tokens: int | None = None, static_buckets: Any = None, max_rows: int | None = None,
                 decode_attention: str = "sdpa", share_prefixes: bool = True, graph_capture_s: Any = None) -> None:
        self.load(model, device, dtype, mem_budget, threads)
        self.scores_prompts()  # checked once, on the model as loaded (before FlexAttention may replace SDPA)
        opts = StaticOptions.parse(self.device.type, True, True, cuda_graphs, static_share, graph_batch_sizes,
                                   graph_cache_tokens, prefill_chunk_tokens, static_buckets, graph_capture_s)
        try:
            opts = _attention_options(opts, decode_attention, self.device.type)
            why = _unsupported(self.spec.name, self.config, decode_attention)
        except ValueError:
            self.unload()
            raise
        if why is not None:
            self.unload()
            raise ModelUnsupported(f"{self.name}: {why}: use engine hf-cb")
        self.kv_limit = self.arena_memory(opts)
        """Bytes of KV the arena and the kept KV share, measured once."""
        tokens = int(opts.share * self.kv_limit) // max(1, self.delta)
        if tokens < 1:
            raise ValueError(f"{self.name}: no memory for the arena ({self.kv_limit} bytes of KV memory)")
        self.static = RowRunner(self.model, self.config, self.device, self.dtype, tokens, self.pad_id,
                                opts.batch_sizes, opts.cache_tokens, opts.graphs, opts.prefill_chunk_tokens,
                                self.max_context, opts.buckets, max_rows=min(int(max_rows or opts.reserve_rows),
                                                                             opts.reserve_rows),
                                flex=decode_attention == "flex", capture_budget_s=opts.capture_budget_s)
        log.info("arena: %d token slots (%.2f GiB of %.2f GiB for KV), CUDA graphs %s", tokens,
                 self.static.arena.nbytes / 2**30, self.kv_limit / 2**30, "on" if self.static.graphs_on else "off")
        self.kv = _kv_store(kv_reuse, kv_retain_bytes, kv_host_bytes, self.kv_limit, self.static.arena.nbytes,
                            self.device.type)
        self.read_behind = self.device.type == "cuda"
        """Queue step k+1 before reading step k's tokens (on CUDA, where kernels run async)."""
        self.vocab = int(self.config.vocab_size)
        self.rows = ArenaRows(self.static, self.kv, self.device, self._row_done, bool(share_prefixes))
        """The rows waiting, running and ended, and their geometry."""
        self._sampler: BatchSampler | None = None
        self._grammar: BatchGrammar | None = None
        self._last: Any = None
        """The last step's tokens, on the device (the next step's inputs when nothing changed)."""
        self._flight: _Flight | None = None
        self._events: list[Event] = []
        self.kv_peak_tokens = 0
        """Most KV tokens held at once: the running rows' and the kept."""
        self._room_c = 0  # the columns per slot rows_now last counted rows at

    # ------------------------------------------------------------------ facts

    def info(self) -> EngineInfo:
        """Δ from the config; M_ava: the arena (kept KV has memory of its own beside it)."""
        static: RowRunner | None = getattr(self, "static", None)
        return self.model_info(int(static.arena.nbytes) if static is not None else 0, self.caps())

    def caps(self) -> EngineCaps:
        """Continuous batching, per-request sampling with seeds, min_tokens, logit_bias,
        grammars, KV per token, the prompt's log-probabilities where the model's head allows
        (:meth:`~worker.engines.hf_model.TransformersModel.scores_prompts`); the buckets whose
        decode step is a captured graph; prefixes shared where ``share_prefixes`` is on."""
        static: RowRunner | None = getattr(self, "static", None)
        graphs = static.captured() if static is not None else []
        return EngineCaps(batching="continuous", sampling=True, seeded=True, max_context=self.max_context,
                          max_rows=static.max_rows if static is not None else 0,
                          graph_batch_sizes=sorted({n for n, _ in graphs}),
                          graph_cache_tokens=sorted({c for _, c in graphs}),
                          min_tokens=True, logit_bias=True, grammar=grammar_supported(),
                          prompt_logprobs=self.scores_prompts(), shared_prefixes=getattr(self, "rows", None) is not None and self.rows.share)

    def warm_up(self, progress: Callable[[str], None] | None = None) -> None:
        """Before registering: capture the decode graphs (CUDA), check them against the eager
        step and serve a small grant, as ``hf`` does."""
        warm_graphs(self, progress, on_drop=self.rows.reset)

    # ------------------------------------------------------------------ the engine's four

    def has_room(self) -> bool:
        """While fewer rows wait than a step runs (they wait here: returning rows go first)."""
        return len(self.rows.waiting) < self.static.max_rows

    def busy(self) -> bool:
        """Rows wait or run, or events wait (a step in flight whose rows all ended is not work)."""
        return bool(self.rows.busy() or self._events)

    def submit(self, batch: BatchMsg) -> None:
        """Queue ``batch``'s rows; a malformed batch fails, a row whose grammar cannot be built
        ends alone with its error."""
        self.rows.apply_releases()  # releases received before this batch are not for its rows
        try:
            self.check_batch(batch, self.vocab_size or None)
            grant, rows = self._rows(batch)
        except ValueError as exc:
            self._events.append(BatchFailed(batch, str(exc), exc))
            return
        if grant.left == 0:  # no rows, or every row failed
            self._finish(grant)
            return
        self.rows.add(rows)

    def poll(self, timeout: float) -> list[Event]:
        """One turn (module docstring); ``timeout`` is not needed: a turn is work. A turn that
        fails fails every grant in flight; the engine goes on with the next."""
        del timeout
        self.rows.apply_releases()
        if marks := self.cancels.take():
            self.rows.cancel(marks)
        if self.rows.busy() or self._flight is not None:
            import torch

            t0 = time.perf_counter()
            try:
                with torch.inference_mode():
                    self._turn()
            except Exception as exc:  # noqa: BLE001 - the worker outlives a failing turn
                log.error("%s: a turn failed; failing the grants in flight", self.name, exc_info=exc)
                self._fail_all(exc)
            self.rows.tally.turns_s += time.perf_counter() - t0
        events, self._events = self._events, []
        return events

    def release(self, rids: Iterable[str] | None = None) -> None:
        """Drop kept KV (the daemon's ``release``; None: all of it) at once; a waiting or running
        row of a released request keeps nothing when it ends. Any thread."""
        self.rows.release(rids)

    def take_evicted(self) -> list[str]:
        """Requests whose kept KV was lost since the last call (evicted, or spilled and not kept)."""
        return [*self.rows.take_evicted(), *(self.kv.take_evicted() if self.kv is not None else [])]

    def rows_now(self) -> int:
        """Rows that step together at the columns per slot (as wide as the widest row needs:
        :meth:`~worker.engines.arena_rows.RowRunner.rows_at`); idle, at the columns it last had
        (the next burst likely looks like the last; the first result at other columns corrects
        it); 0 before it ever held a row."""
        static: RowRunner | None = self.static
        self._room_c = self.rows.c or self._room_c
        if static is None or not self._room_c:
            return 0
        return static.rows_at(self._room_c)

    def kept(self) -> dict[str, int]:
        """rid -> KV tokens kept for it now, paused in place or in the store (for tests and status)."""
        return {**(self.kv.held() if self.kv is not None else {}), **self.rows.held()}

    def close(self) -> None:
        """Drop the arena, its graphs, the rows and the kept KV, then the model."""
        log.info("%s: %s", self.name, self.rows.account())
        self.rows.reset()
        self.rows.runner = None  # type: ignore[assignment]
        self.static = None  # type: ignore[assignment]
        self._flight = self._sampler = self._grammar = self._last = None
        if self.kv is not None:
            self.kv.release()
        self.unload()

    # ------------------------------------------------------------------ a turn

    def _turn(self) -> None:
        fl = self._flight
        if fl is not None:
            self._flight = None
            if not self._must_drain():
                self._flight = self._launch()  # queued before reading fl: the device goes on
                self._read(fl)
                return
            self._read(fl)
        if self.rows.regroup_due(strict=self._grammar is not None):
            self.rows.regroup()
        if self.rows.live():
            fl = self._launch()
            if self.read_behind and self._grammar is None:
                self._flight = fl
            else:
                self._read(fl)

    def _must_drain(self) -> bool:
        """Whether the step's rows change before the next step (a row joins, the running rows'
        geometry changes) or a grammar needs this step's tokens; a row's end alone does not
        drain (it stays in the step as a ghost: :mod:`worker.engines.arena_set`)."""
        return self._grammar is not None or self.rows.regroup_due()

    def _launch(self) -> _Flight:
        """Queue one decode step of the running rows and the pick of their tokens."""
        import torch

        geo = self.rows.geometry
        assert geo is not None
        step = self.static.step_for(geo.plan)
        rows = list(self.rows.slots)
        k, n = len(rows), geo.plan.n
        live = [r for r in rows if not r.ended]
        own = sum(r.fed + 1 for r in live)
        needs = [r.need for r in live]
        self.rows.tally.add(len(live), n, geo.c, own, self.static.bucketing and not geo.bucket, slots=k,
                            widest=max(needs, default=0), needs=sum(needs))
        if self.rows.dirty:
            pad = [self.pad_id] * (n - k)
            ids = torch.tensor([r.next_input() for r in rows] + pad, dtype=torch.long)
            pos = torch.tensor([r.fed for r in rows] + [geo.c - 1] * (n - k), dtype=torch.long)
            step.ids.copy_(ids.view(n, 1), non_blocking=True)
            step.pos.copy_(pos.view(n, 1), non_blocking=True)
            self.static.live.fill_(k)
            matchers = {i: r.matcher for i, r in enumerate(rows) if r.matcher is not None}
            self._grammar = BatchGrammar.of(matchers, self.device) if matchers else None
            steps = min(DRAWS_AHEAD, max(r.cap - len(r.state.out) for r in rows))
            self._sampler = BatchSampler([r.now() for r in rows], [r.state.seed for r in rows], self.vocab,
                                         self.device, steps=max(1, steps), eos=self.eos, grammar=self._grammar)
            self.rows.dirty = False
        else:
            step.ids[:k, 0].copy_(self._last)
        assert self._sampler is not None
        draw = self._sampler.sample(step.run())
        self._last = draw.tokens
        self._track_peak(own)
        return _Flight(draw.start(), draw, self._sampler, self._grammar, rows)

    def _read(self, fl: _Flight) -> None:
        """The step's tokens to their rows (a row that ended before this step takes none)."""
        tokens, lps = fl.pending.result(fl.sampler)
        done = [r.ended for r in fl.rows]
        if fl.grammar is not None:
            fl.grammar.advance(tokens, done)
        new: dict[int, list[RequestOutput]] = {}
        ended: list[Row] = []
        for row, was, tok, lp in zip(fl.rows, done, tokens, lps, strict=True):
            if was:
                continue
            row.state.push(tok, lp)
            part = row.fresh()
            if part is not None:
                new.setdefault(row.grant.batch_id, []).append(part)
            if row.ended:
                ended.append(row)
        for bid, outs in new.items():
            self._events.append(NewTokens(bid, outs))
        if ended:
            self.rows.settle(ended)

    # ------------------------------------------------------------------ grants

    def _rows(self, batch: BatchMsg) -> tuple[Grant, list[Row]]:
        """``batch``'s grant and the rows to serve; a row whose grammar cannot be built ends
        alone (ValueError: llguidance is missing)."""
        g = Grant(batch, time.perf_counter(), len(batch.requests))
        rows: list[Row] = []
        for r in batch.requests:
            if r.generated > len(r.token_ids):
                raise ValueError(f"request {r.rid!r}: generated exceeds its context")
            row = Row(g, r, self.eos, self.scores_prompts())
            if r.grammar:
                try:
                    row.matcher = row_matcher(r, grammar_for(self.spec, self.vocab, self.eos))
                except GrammarError as exc:
                    log.warning("batch=%d: %s; the rest of the batch is served", batch.batch_id, exc)
                    g.outputs[r.rid] = row_error(exc)
                    g.left -= 1
                    self.rows.release([r.rid])
                    continue
            rows.append(row)
        return g, rows

    def _row_done(self, row: Row, out: RequestOutput) -> None:
        g = row.grant
        g.outputs[row.rid] = out
        g.left -= 1
        if g.left == 0:
            self._finish(g)

    def _finish(self, g: Grant) -> None:
        outs, stats = grant_stats(g, time.perf_counter(), peak_memory(self.device), self.kv_peak_tokens)
        self._events.append(BatchDone(g.batch, outs, stats))

    def _fail_all(self, exc: BaseException) -> None:
        """Every grant with a row in the engine fails; the arena starts empty."""
        grants: dict[int, Grant] = {}
        for row in [*self.rows.every_row(), *(self._flight.rows if self._flight else [])]:
            if row.grant.left > 0:  # not the grants whose rows all ended already
                grants.setdefault(id(row.grant), row.grant)
            if self.kv is not None:
                self.kv.done([row.rid])
        self.rows.reset()
        self._flight = None
        self.rows.after_failure(exc)  # the allocator's cache, and on running out the cached prefixes
        for g in grants.values():
            self._events.append(BatchFailed(g.batch, f"{type(exc).__name__}: {exc}", exc))

    # ------------------------------------------------------------------ memory

    def _track_peak(self, running: int) -> None:
        """``running``: the running rows' KV columns; the paused and stored kept KV too, not prefixes."""
        held = running + sum(len(p.tokens) for p in self.rows.paused.values())
        if self.kv is not None:
            held += (self.kv.nbytes - self.kv.prefix_bytes + self.kv.host_nbytes) // max(1, self.delta)
        self.kv_peak_tokens = max(self.kv_peak_tokens, held)
