"""``hf``: a transformers causal LM served with static batching.

One batch = one left-padded prefill of every row's context (prompt + tokens of
earlier slices, by id) followed by a plain decode loop over a ``DynamicCache``
for at most ``slice_len`` iterations (the prefill yields the first token, each
decode step one more). Rows that finish keep being computed (the batch is
static) and are counted as invalid tokens; the loop stops as soon as every row
has finished.

Greedy output served in slices equals greedy output served in one pass: the
attention mask hides the padding and position ids count real tokens only, so a
row's logits do not depend on its padding or its batch neighbours beyond
floating-point reduction order.

KV across slices (``kv_reuse``, on by default): the KV of each unfinished row is
kept after its slice (:mod:`worker.engines.kvstore`), within ``kv_retain_bytes``
(default: the memory budget), least recently used evicted first, and always
shrunk before a batch to what fits beside it; what does not fit waits in host
memory, within ``kv_host_bytes`` (default on CUDA: the memory budget, at most 16 GiB and
a quarter of RAM; none on the CPU), and is copied back when its request returns. A batch whose rows' KV is held
prefills only the tokens beyond it. New tokens are yielded after the prefill and after
every decode step, one step per poll (:class:`~worker.engines.base.SliceEngine`).

The prompt's log-probabilities (``prompt_logprobs``, in a request's first slice): while a
row that asks is in the batch, a hook on the model's decoder keeps each prefill pass's last
hidden states (:class:`~worker.engines.hf_model.HiddenTap`), and that row's positions go
through the model's head 256 at a time (:class:`~worker.engines.hf_model.PromptScore`); the
model itself still computes every row's last logits only, so tokens do not change. Such a
row prefills its whole prompt (it takes no kept KV). The entries ride on the row's first
streamed part and on its output.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from sclsd import models
from sclsd.protocol import (
    BatchMsg,
    BatchRequest,
    BatchStats,
    EngineCaps,
    RequestOutput,
    TokenLogprobs,
)
from worker.engines.base import EngineInfo, SliceEngine, Steps, TokenCursor
from worker.engines.constraints import stop_ids
from worker.engines.grammar import batch_grammar
from worker.engines.grammar import supported as grammar_supported
from worker.engines.graph_check import warm_graphs
from worker.engines.hf_model import (
    HiddenTap,
    PromptScore,
    TransformersModel,
    peak_memory,
    scores_prompt,
)
from worker.engines.kvstore import KVReuse, KVStore, Retained, assemble_past, supports_reuse
from worker.engines.sampling import BatchSampler, Draw, random_seed
from worker.engines.static_cache import (
    STATIC_ATTENTION,
    ChunkDone,
    StaticOptions,
    StaticRun,
    StaticRunner,
    attention_kind,
)

log = logging.getLogger(__name__)

class RowState:
    """Per-row bookkeeping of one batch on the host: output, finish reason, log-probabilities
    (of its tokens, and of its prompt's when it asked for them)."""

    __slots__ = ("req", "stops", "seed", "out", "reason", "logprobs", "plps")

    def __init__(self, req: BatchRequest, eos: list[int]) -> None:
        self.req = req
        self.stops = frozenset(stop_ids(req, eos))
        # Unseeded sampling draws a fresh seed per slice: not reproducible, by request.
        self.seed = req.seed if req.seed is not None else random_seed()
        self.out: list[int] = []
        self.reason: str | None = None
        self.logprobs: list[TokenLogprobs] = []
        self.plps: list[TokenLogprobs] = []
        """Its prompt's log-probabilities (``prompt_logprobs``), filled by its prefill."""

    def prompt_score(self, on: bool = True) -> PromptScore | None:
        """What its prefill fills its prompt's log-probabilities through, when it computes them
        (:func:`~worker.engines.hf_model.scores_prompt`, and ``on``: the engine's model can);
        None otherwise."""
        r = self.req
        if not on or not scores_prompt(r):
            return None
        return PromptScore(r.token_ids, r.prompt_logprobs or 0, self.plps)

    @property
    def done(self) -> bool:
        return self.reason is not None

    def push(self, token: int, logprobs: TokenLogprobs | None = None) -> None:
        """Record a generated token and decide whether the row has finished."""
        self.out.append(token)
        if logprobs is not None:
            self.logprobs.append(logprobs)
        if token in self.stops:
            self.reason = "stop"
        elif len(self.out) >= self.req.max_new_tokens:
            self.reason = "length"


class BatchRun(Protocol):
    """How one batch runs on the model: the eager path (:class:`EagerRun`) or the static
    cache's (:class:`~worker.engines.static_cache.StaticRun`, a captured graph per step). The
    engine's loop (sampling, constraints, streaming, kept KV) is the same over either."""

    def prefill(self, reqs: list[BatchRequest], taken: list[Retained | None], used: list[int],
                chunk_done: ChunkDone | None = None) -> Any:
        """Prefill what the rows' held KV (``taken``, ``used`` tokens each) does not cover;
        returns the ``[rows, vocab]`` logits of every row's last token. ``chunk_done``: told
        after each forward pass of the prefill which columns of the left-padded block of new
        tokens it ran (:data:`~worker.engines.static_cache.ChunkDone`)."""
        ...

    def decode(self, tokens: Any, positions: list[int]) -> Any:
        """Feed every row's latest token (``[rows]``, on the device) at ``positions``; returns
        the next ``[rows, vocab]`` logits."""
        ...

    def keep_view(self, fed: int) -> tuple[Any, Any]:
        """``(cache, 2-D mask)`` to cut the rows' kept KV from, after ``fed`` tokens."""
        ...


class EagerRun:
    """One batch on the eager path: transformers' ``DynamicCache``, grown a column per step."""

    def __init__(self, engine: HFEngine) -> None:
        self.engine = engine
        self.cache: Any = None
        self.mask: Any = None
        self.last: Any = None

    def prefill(self, reqs: list[BatchRequest], taken: list[Retained | None], used: list[int],
                chunk_done: ChunkDone | None = None) -> Any:
        """Prefill what the rows' held KV does not cover, in one pass; the ``[rows, vocab]``
        last logits (``chunk_done``: :meth:`BatchRun.prefill`)."""
        cache, ids, mask, pos = self.inputs(reqs, taken, used)
        out = self.engine.model(input_ids=ids, attention_mask=mask, position_ids=pos,
                                past_key_values=cache, use_cache=True, logits_to_keep=1)
        if chunk_done is not None:
            width = ids.shape[1]
            chunk_done(0, [width - (len(r.token_ids) - u) for r, u in zip(reqs, used, strict=True)])
        self.cache, self.mask, self.last = cache, mask, pos[:, -1:]
        return out.logits[:, -1, :]

    def decode(self, tokens: Any, positions: list[int]) -> Any:
        """Feed every row's latest token (``[rows]``, on the device); the next logits."""
        import torch

        del positions  # they follow from the prefill's
        self.mask = torch.cat([self.mask, self.mask.new_ones((self.mask.shape[0], 1))], dim=1)
        self.last = self.last + 1
        out = self.engine.model(input_ids=tokens.unsqueeze(1), attention_mask=self.mask,
                                position_ids=self.last, past_key_values=self.cache, use_cache=True)
        return out.logits[:, -1, :]

    def keep_view(self, fed: int) -> tuple[Any, Any]:
        """``(cache, 2-D mask)`` to cut the kept rows from (the cache holds exactly what was fed)."""
        del fed
        return self.cache, self.mask

    def inputs(
        self, reqs: list[BatchRequest], taken: list[Retained | None], used: list[int]
    ) -> tuple[Any, Any, Any, Any]:
        """The prefill's cache, input ids, 2-D attention mask and positions.

        The mask spans ``[past | new]``: row ``i``'s ``used[i]`` held tokens sit at the
        right of the past block, its new tokens at the right of the new block
        (left padding in both), every pad slot masked. Positions count real tokens
        only, so they continue where a row's held KV ends.
        """
        import torch
        from transformers import DynamicCache

        eng = self.engine

        n = len(reqs)
        past = max(used, default=0)
        fresh = [len(r.token_ids) - u for r, u in zip(reqs, used, strict=True)]
        width = max(fresh)
        ids = torch.full((n, width), eng.pad_id, dtype=torch.long)
        mask = torch.zeros((n, past + width), dtype=torch.long)
        for i, r in enumerate(reqs):
            ids[i, width - fresh[i] :] = torch.tensor(r.token_ids[used[i] :], dtype=torch.long)
            mask[i, past - used[i] : past] = 1
            mask[i, past + width - fresh[i] :] = 1
        # Pads get position 0 (or repeat their left neighbour's); they are masked anyway.
        pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, past:]
        cache = assemble_past(taken, used, eng.config) if past else None
        if cache is None:
            cache = DynamicCache(config=eng.config)
        dev = eng.device
        return cache, ids.to(dev), mask.to(dev), pos.to(dev)


def to_host(entry: Retained) -> Retained:
    """``entry`` copied to host memory: every layer's keys and values into one buffer,
    allocated once (pinned when the entry comes from a GPU, so the copy back before its next
    slice runs at the link's speed) and filled by copies the host does not wait for (the
    device reads the buffer back in stream order, and torch keeps a pinned block in use until
    the copies that touch it are done)."""
    import torch

    flat = [t for pair in entry.kv for t in pair]
    pin = any(t.is_cuda for t in flat)
    buf = torch.empty(sum(t.numel() for t in flat), dtype=flat[0].dtype, pin_memory=pin)
    out, at = [], 0
    for t in flat:
        h = buf[at:at + t.numel()].view(t.shape)
        h.copy_(t, non_blocking=pin)
        out.append(h)
        at += t.numel()
    return Retained(entry.tokens, entry.nbytes, list(zip(out[0::2], out[1::2], strict=True)), True)


#: Most host memory kept KV takes by default on CUDA (pinned memory is not swappable, and
#: the KV memory of an 80 GB card would pin ~64 GB): 16 GiB, and at most a quarter of RAM.
DEFAULT_HOST_KV_BYTES = 16 * 2**30


def default_host_bytes(device_type: str, kv_limit: int, ram: int | None = None) -> int:
    """Host bytes for kept KV when ``kv_host_bytes`` is not given: none on the CPU (the host
    is the device); on CUDA the KV memory, within :data:`DEFAULT_HOST_KV_BYTES` and a quarter
    of ``ram`` (the machine's physical memory by default)."""
    if device_type != "cuda":
        return 0
    if ram is None:
        import os

        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(0, min(int(kv_limit), DEFAULT_HOST_KV_BYTES, int(ram) // 4))


class HFEngine(TransformersModel, SliceEngine):
    """Static-batching transformers engine (see the module docstring)."""

    name = "hf"
    #: Whether ``static_cache = "auto"`` takes the static-cache path (on CUDA).
    static_default = True

    def __init__(
        self,
        model: str = models.DEFAULT_MODEL,
        device: str = "cpu",
        dtype: Any = None,
        mem_budget: int | None = None,
        threads: int | None = None,
        kv_reuse: bool = True,
        kv_retain_bytes: int | None = None,
        kv_host_bytes: int | None = None,
        static_cache: Any = "auto",
        cuda_graphs: Any = "auto",
        static_share: float = 0.5,
        graph_batch_sizes: Any = None,
        graph_cache_tokens: Any = None,
        prefill_chunk_tokens: int | None = None,
        static_buckets: Any = None,
        graph_capture_s: Any = None,
    ) -> None:
        self.load(model, device, dtype, mem_budget, threads)
        self.scores_prompts()  # checked once, on the model as loaded
        opts = StaticOptions.parse(self.device.type, self.static_default, static_cache, cuda_graphs,
                                   static_share, graph_batch_sizes, graph_cache_tokens, prefill_chunk_tokens,
                                   static_buckets, graph_capture_s)
        self.kv_limit = self.arena_memory(opts)
        """Bytes of KV the batches and the retained caches share, measured once."""
        self.static: StaticRunner | None = None
        """The static-cache path (None: every batch runs eagerly)."""
        if opts.on and not supports_reuse(self.config):
            log.warning("%s: its cache layers are not all full attention; no static cache", self.spec.name)
        elif opts.on and attention_kind(self.config) not in STATIC_ATTENTION:
            log.warning("%s: %s attention takes no 4-D mask; no static cache", self.spec.name,
                        attention_kind(self.config))
        elif opts.on:
            self.static = opts.runner(self.model, self.config, self.device, self.dtype, self.kv_limit,
                                      self.delta, self.pad_id, self.max_context)
            log.info("static cache: %d token slots (%.2f GiB of %.2f GiB for KV), CUDA graphs %s",
                     self.static.arena.tokens, self.static.arena.nbytes / 2**30, self.kv_limit / 2**30,
                     "on" if self.static.graphs_on else "off")
        self.kv = self._kv_store(kv_reuse, kv_retain_bytes, kv_host_bytes)
        self.read_behind = self.device.type == "cuda"
        """Queue step k+1 before reading step k's tokens, so the device never waits on the host
        (the step after a batch's last is then wasted): on CUDA, where kernels run async."""

    # ------------------------------------------------------------------ facts

    def info(self) -> EngineInfo:
        """Δ from the config; M_ava: the static cache's size on the static path, else the KV
        memory measured at start (:meth:`~worker.engines.hf_model.TransformersModel.kv_memory`)."""
        static: StaticRunner | None = getattr(self, "static", None)  # unset during __init__
        mem = static.arena.nbytes if static is not None else self.kv_limit
        return self.model_info(int(mem), self.caps())

    def caps(self) -> EngineCaps:
        """Static batches, per-request sampling with seeds, the model's context length, the
        buckets whose decode step is a captured graph, and the prompt's log-probabilities where
        the model's head allows (:meth:`~worker.engines.hf_model.TransformersModel.scores_prompts`)."""
        static: StaticRunner | None = getattr(self, "static", None)  # unset during __init__
        graphs = static.captured() if static is not None else []
        return EngineCaps(batching="static", sampling=True, seeded=True, max_context=self.max_context,
                          graph_batch_sizes=sorted({n for n, _ in graphs}),
                          graph_cache_tokens=sorted({c for _, c in graphs}), grammar=grammar_supported(),
                          prompt_logprobs=self.scores_prompts())

    def scores_prompts(self) -> bool:
        """Whether rows' prompt log-probabilities are computed: the model's check
        (:meth:`~worker.engines.hf_model.TransformersModel.scores_prompts`), on ``hf``'s own
        model only: ``deepspeed`` runs this loop over ``init_inference``'s wrapper, which that
        check never saw, and computes none."""
        return self.name == HFEngine.name and super().scores_prompts()

    def warm_up(self, progress: Callable[[str], None] | None = None) -> None:
        """Before registering: capture the decode graphs (CUDA) and serve a few small batches,
        so that no first call of a shape is paid while serving."""
        if self.static is None:
            return
        warm_graphs(self, progress)

    # ------------------------------------------------------------------ serving

    def steps(self, batch: BatchMsg) -> Steps:
        """Serve one batch for at most ``batch.slice_len`` iterations, one per step."""
        import torch

        reqs = batch.requests
        if not reqs:
            return [], BatchStats()
        self.check_batch(batch)
        try:
            # Held across the steps: the serve thread runs no autograd work between them.
            with torch.inference_mode():
                return (yield from self._steps(batch))
        except torch.OutOfMemoryError:
            # The batch's cache is garbage now; hand its blocks back before the next batch.
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            raise

    def _steps(self, batch: BatchMsg) -> Steps:
        import torch

        dev = self.device
        reqs = batch.requests
        rows = [RowState(r, self.eos) for r in reqs]
        n = len(rows)
        lens = [len(r.token_ids) for r in reqs]
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        vocab = int(self.config.vocab_size)
        # Before any KV is taken: a row whose grammar cannot be built (GrammarError) fails
        # alone, and the batch is served again without it (SliceEngine.poll).
        grammar = batch_grammar(reqs, self.spec, vocab, self.eos, dev)
        taken, used = self._take_kv(batch)
        try:
            run, taken, used = self._run_for(batch, taken, used)
            # Uniforms drawn ahead for the steps the batch can run (the table grows on demand):
            # a slice longer than every row's budget would draw them for nothing.
            steps = min(batch.slice_len, max((r.max_new_tokens for r in reqs), default=1))
            sampler = BatchSampler(reqs, [r.seed for r in rows], vocab, dev, steps=steps,
                                   eos=self.eos, grammar=grammar)
            cursor = TokenCursor([r.rid for r in reqs])
            t0 = time.perf_counter()
            draw = sampler.sample(self._prefill(run, rows, taken, used))
            del taken  # the batch cache holds their KV now
            ahead = self.read_behind and grammar is None  # a grammar masks from the last token
            iterations, invalid, t1 = 1, 0, 0.0
            while True:
                pending = draw.start()
                nxt: Draw | None = None
                if ahead and iterations < batch.slice_len:
                    nxt = sampler.sample(run.decode(draw.tokens, lens))
                tokens, lps = pending.result(sampler)
                if grammar is not None:
                    grammar.advance(tokens, [r.done for r in rows])
                for r, tok, lp in zip(rows, tokens, lps, strict=True):
                    if not r.done:
                        r.push(tok, lp)
                if iterations == 1:
                    t1 = time.perf_counter()
                yield cursor.new([r.out for r in rows], [r.reason for r in rows], [r.logprobs for r in rows],
                                 [r.plps for r in rows])
                self.end_cancelled(rows)
                if iterations >= batch.slice_len or all(r.done for r in rows):
                    break
                invalid += sum(r.done for r in rows)
                draw = nxt if nxt is not None else sampler.sample(run.decode(draw.tokens, lens))
                iterations += 1
            t2 = time.perf_counter()
            kept = self._keep_kv(rows, *run.keep_view(iterations - 1)) if batch.kv_reuse else [0] * n
        finally:
            if self.kv is not None:
                self.kv.store.done(r.rid for r in reqs)

        outputs = [
            RequestOutput(rid=r.req.rid, token_ids=r.out, finish_reason=r.reason,  # type: ignore[arg-type]
                          kv_tokens=k, logprobs=r.logprobs, prompt_logprobs=r.plps, reused_tokens=u)
            for r, k, u in zip(rows, kept, used, strict=True)
        ]
        fresh = [x - u for x, u in zip(lens, used, strict=True)]
        stats = BatchStats(
            prefill_s=t1 - t0,
            decode_s=t2 - t1,
            iterations=iterations,
            pad_tokens=sum(max(fresh) - x for x in fresh),
            invalid_tokens=invalid,
            peak_memory=peak_memory(dev),
            batch_size=n,
            input_len=max(lens),
            prefill_tokens=sum(fresh),
            reused_tokens=sum(used),
        )
        return outputs, stats

    def _prefill(self, run: BatchRun, rows: list[RowState], taken: list[Retained | None], used: list[int]) -> Any:
        """``run``'s prefill; rows that score their prompt (:meth:`RowState.prompt_score`) get
        their entries from the last hidden states of each of its passes, read by a tap on the
        model (only while such a row is in the batch: the others cost nothing more)."""
        scores = [r.prompt_score(self.scores_prompts()) for r in rows]
        reqs = [r.req for r in rows]
        if all(s is None for s in scores):
            return run.prefill(reqs, taken, used)
        with HiddenTap(self.model) as tap:
            return run.prefill(reqs, taken, used, lambda col, starts: tap.score(scores, col, starts))

    def _run_for(self, batch: BatchMsg, taken: list[Retained | None],
                 used: list[int]) -> tuple[BatchRun, list[Retained | None], list[int]]:
        """How this batch runs: on the static path when the engine has one and its arena holds
        the batch (with the rows' held KV, else prefilled in full), else eagerly."""
        if self.static is None:
            return EagerRun(self), taken, used
        reqs = batch.requests
        n, s = len(reqs), batch.slice_len
        need = max(used) + max(len(r.token_ids) - u for r, u in zip(reqs, used, strict=True)) + s - 1
        plan = self.static.plan(n, need)
        if plan is None and any(used):
            # Held KV widens the layout (longest past + longest new part): prefill in full.
            taken, used = [None] * n, [0] * n
            need = max(len(r.token_ids) for r in reqs) + s - 1
            plan = self.static.plan(n, need)
        if plan is None:
            raise ValueError(f"a batch of {n} rows needing {need} cache tokens each does not fit the "
                             f"static cache ({self.static.arena.tokens} token slots, M_ava)")
        return StaticRun(self.static, plan), taken, used

    # ------------------------------------------------------------------ retained KV

    def _kv_store(self, reuse: bool, retain: int | None, host: int | None) -> KVReuse | None:
        if not reuse:
            return None
        if not supports_reuse(self.config):
            log.warning("%s: its cache layers cannot be split per request; KV is not kept "
                        "across slices", self.spec.name)  # fmt: skip
            return None
        # On the static path the arena is the batches' memory and kept KV has the rest;
        # otherwise the two share the KV memory, batches first.
        arena = self.static.arena.nbytes if self.static is not None else 0
        budget = self.kv_limit - arena if retain is None else int(retain)
        if host is None:
            host = default_host_bytes(self.device.type, self.kv_limit)
        log.info("KV kept across slices: up to %d bytes, %d more in host memory", budget, host)
        if self.static is not None:
            return KVReuse(KVStore(budget, host, to_host), self.delta, arena, beside=False)
        return KVReuse(KVStore(budget, host, to_host), self.delta, self.kv_limit)

    def _take_kv(self, batch: BatchMsg) -> tuple[list[Retained | None], list[int]]:
        n = len(batch.requests)
        taken: list[Retained | None] = [None] * n
        used = [0] * n
        if self.kv is not None:
            taken, used = self.kv.take(batch)
        # A row scoring its prompt prefills all of it (its first slice: nothing is kept for it
        # anyway, but an entry under its id would leave the first positions unscored).
        for i, r in enumerate(batch.requests):
            if used[i] and scores_prompt(r) and self.scores_prompts():
                taken[i], used[i] = None, 0
        return taken, used

    def _keep_kv(self, rows: list[RowState], cache: Any, mask: Any) -> list[int]:
        if self.kv is None:
            return [0] * len(rows)
        return self.kv.keep([(r.req.rid, r.req.token_ids, r.out, r.done) for r in rows], cache, mask)

    def release(self, rids: Iterable[str] | None = None) -> None:
        """Drop retained KV (the daemon's ``release``; None: all of it)."""
        if self.kv is not None:
            self.kv.store.release(rids)

    def take_evicted(self) -> list[str]:
        """Requests whose retained KV was evicted since the last call."""
        return self.kv.store.take_evicted() if self.kv is not None else []

    def close(self) -> None:
        """Drop the model, the static path (its arena and captured graphs) and the kept KV,
        and give cached CUDA memory back."""
        self.static = None
        if self.kv is not None:
            self.kv.store.release()
            self.kv = None
        self.unload()
