"""``llama``: llama.cpp's kernels under sclsd's scheduler, for GGUF models on a CPU.

The GGUF as shipped (its quantised weights, memory-mapped) runs in llama.cpp
(:mod:`worker.engines.llama_lib`, the one module that knows the library), and everything
else is sclsd's: the rows, their slices, the KV kept between them, and each token's
selection. The engine batches continuously (``caps.batching = "continuous"``): batches
are taken while others generate, their rows join the running set between steps, and every
step decodes all running rows in one ``llama_decode`` (:mod:`worker.engines.llama_rows`).
It serves slice grants (``scls-cb``) and static slices (``scls``) alike.

Tokens are picked by sclsd from the logits llama.cpp returns (:mod:`worker.engines.llama_pick`):
temperature, top-k, top-p, min-p, seeds (the inverse-transform draw of ``(seed, g)``, so a
seeded request gives ``hf``'s tokens for the same logits), penalties, ``logit_bias``,
stop tokens, ``min_tokens``, grammars and log-probabilities, as ``hf`` and ``hf-cb`` serve them.

KV: one llama.cpp context of ``context_tokens`` cells (fp16) shared by ``max_rows`` running
rows and the KV kept between slices (:mod:`worker.engines.llama_kv`); kept KV that must
leave the context is saved to host memory (``kv_host_bytes``) and loaded back when its
request returns, token-exact. M_ava is what the cells hold, Δ the cache's bytes per token.

Warm-up runs the first decodes (torch, for the sampler, loads in the background) and
checks the library's large batches against small ones on this CPU: a build whose kernels for batches of 32 tokens or more give other logits than
its small-batch kernels (ik_llama.cpp's wheel on x86 machines that do not report AVX2) gets
its steps capped below that size, with a warning (docs/design.md §6).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from sclsd import models
from sclsd.protocol import BatchMsg, EngineCaps
from worker.engines.base import Engine, EngineInfo, Event
from worker.engines.llama_kv import KVSlots
from worker.engines.llama_lib import Context, LlamaError, Model, version
from worker.engines.llama_rows import Running

__all__ = ["LlamaEngine", "gguf_file"]

log = logging.getLogger(__name__)

#: Rows decoding per step, by default. On the 2-core machine one thread's step costs about
#: the same per row from 4 to 8 rows and 1.5-2x more per row past 8 (docs/benchmarks.md).
MAX_ROWS = 8
#: KV cells per running row, by default: the context holds ``max_rows`` requests of this many
#: tokens (context + slice), and one request as long as the model's window allows.
CELLS_PER_ROW = 1024
#: Most tokens one step decodes, by default (decode rows first, then prefill chunks).
BATCH_TOKENS = 64
#: The step sizes tried when large batches give other logits than small ones (below each of
#: the library's thresholds for switching kernels).
SAFE_BATCH_TOKENS = (31, 15, 7)
#: Host memory for kept KV moved out of the context, by default.
HOST_BYTES = 1 << 30
#: The built-in profile of the default model on this engine, one thread.
PROFILE = "cpu-smollm2-135m-llama"


def gguf_file(spec: models.ModelSpec) -> str:
    """The GGUF file the engine loads for ``spec``: a ``.gguf`` (the built-in model among
    them), or for ``tiny-random`` its GGUF, built once (:mod:`worker.engines.llama_tiny`)."""
    if spec.kind == "gguf" and spec.path is not None and spec.gguf_file:
        return str(spec.path / spec.gguf_file)
    if spec.kind == "tiny":
        from worker.engines.llama_tiny import tiny_gguf

        return str(tiny_gguf())
    raise ValueError(f"the llama engine serves GGUF models (a .gguf file, {models.DEFAULT_MODEL}, "
                     f"tiny-random); {spec.name!r} is a transformers model: use engine hf-cb or hf")


class LlamaEngine(Engine):
    """Continuous batching over llama.cpp (see the module docstring)."""

    name = "llama"

    def __init__(self, model: str = models.DEFAULT_MODEL, device: str = "cpu", threads: int | None = None,
                 mem_budget: int | None = None, max_rows: int = MAX_ROWS, context_tokens: int | None = None,
                 max_batch_tokens: int = BATCH_TOKENS, kv_host_bytes: int = HOST_BYTES,
                 share_prefixes: bool = False, dtype: Any = None) -> None:
        if not str(device).startswith("cpu"):
            raise ValueError(f"the llama engine runs on the CPU (device {device!r}): use hf-cb or hf on a GPU")
        if dtype not in (None, "auto"):
            raise ValueError(f"the llama engine runs the GGUF's weights as they are (dtype {dtype!r}): "
                             "leave the dtype auto")
        t0 = time.perf_counter()
        self.spec = models.resolve(model)
        self.threads = max(1, int(threads or 1))
        self.model = Model(gguf_file(self.spec))
        m = self.model
        self.delta = m.kv_bytes_per_token
        self.vocab = m.n_vocab
        self.eos = list(models.SMOLLM2_EOS) if self.spec.kind == "tiny" or self.spec.name == models.DEFAULT_MODEL \
            else [m.eos]
        self.max_rows = max(1, int(max_rows))
        cells = int(context_tokens) if context_tokens else max(2048, self.max_rows * CELLS_PER_ROW)
        if mem_budget and not context_tokens:
            cells = min(cells, int(mem_budget) // self.delta)
        self.n_ctx = max(256, min(cells, m.n_ctx_train or cells)) // 256 * 256
        self.batch_tokens = max(int(max_batch_tokens), self.max_rows)
        self.ctx = self._context(self.batch_tokens)
        self.kv = KVSlots(self.ctx, int(kv_host_bytes), bool(share_prefixes))
        self.running = self._running()
        self.load_s = time.perf_counter() - t0
        log.info("loaded %s (%s, %.0f MiB) in %.2f s: %d threads, %d KV cells (%.0f MiB), %d rows a step",
                 self.spec.name, m.meta("general.file_type") or "?", m.size_bytes / 2**20, self.load_s,
                 self.threads, self.n_ctx, self.n_ctx * self.delta / 2**20, self.max_rows)

    def _context(self, batch_tokens: int) -> Context:
        # Sequences for the running rows and as many kept requests again.
        return Context(self.model, self.n_ctx, 2 * self.max_rows, batch_tokens, self.threads)

    def _running(self) -> Running:
        return Running(self.ctx, self.kv, self.max_rows, self.batch_tokens, self.vocab, self.eos,
                       self._grammar_tokenizer, self.delta, self.cancels)

    def _grammar_tokenizer(self) -> Any:
        from worker.engines.grammar import grammar_for

        return grammar_for(self.spec, self.vocab, self.eos)

    # ------------------------------------------------------------------ facts

    def info(self) -> EngineInfo:
        """The model's facts; M_ava: what the context's KV cells hold."""
        m = self.model
        return EngineInfo(engine=self.name, model=self.spec.name, device="cpu", kv_bytes_per_token=self.delta,
                          mem_available=self.n_ctx * self.delta, eos_token_ids=list(self.eos),
                          vocab_size=self.vocab, caps=self.caps(),
                          extra={"library": version(), "gguf": m.path, "file_type": m.meta("general.file_type"),
                                 "threads": self.threads, "kv_cells": self.n_ctx, "max_rows": self.max_rows,
                                 "batch_tokens": self.batch_tokens, "load_s": round(self.load_s, 3)})

    def caps(self) -> EngineCaps:
        """Continuous batching of at most ``max_rows`` rows a step; sampling, seeds, min_tokens,
        logit_bias and log-probabilities per request (the prompt's too); grammars where
        llguidance is installed; KV per token; prefixes shared between requests where
        ``share_prefixes`` is on."""
        return EngineCaps(batching="continuous", sampling=True, seeded=True, max_context=self.max_context,
                          max_rows=self.max_rows, kv_page_tokens=1, min_tokens=True, logit_bias=True,
                          grammar=_has_llguidance(), prompt_logprobs=True,
                          shared_prefixes=self.kv.share_prefixes)

    def profile(self) -> dict[str, Any] | None:
        """The built-in profile of the default model on one thread (measured with this engine,
        ``sclsd/data/profiles/cpu-smollm2-135m-llama.json``), with this worker's Δ and M_ava;
        None for any other model or thread count."""
        if self.spec.name != models.DEFAULT_MODEL or self.threads != 1:
            return None
        from sclsd.core.profiles import load_profile

        d = load_profile(PROFILE).to_dict()
        d["kv_bytes_per_token"], d["mem_available"] = self.delta, float(self.n_ctx * self.delta)
        return d

    @property
    def max_context(self) -> int:
        """The longest context a request may reach: the model's window, within the cells."""
        return min(self.model.n_ctx_train or self.n_ctx, self.n_ctx)

    # ------------------------------------------------------------------ warm-up

    def warm_up(self, progress: Callable[[str], None] | None = None) -> None:
        """First decodes (the kernels' first calls) and the large-batch check, before the worker
        registers; the sampler's libraries (torch, seconds to import) load in the background
        meanwhile, so the worker is ready without them and a sampled row rarely waits for them
        (one that comes first waits for the import, not for a second one)."""
        threading.Thread(target=_import_sampler, name="llama-sampler-import", daemon=True).start()
        if progress is not None:
            progress("warming: llama.cpp's first decodes and the large-batch check")
        safe = check_batches(self.model, self.threads, self.batch_tokens)
        if safe < self.batch_tokens:
            log.warning("this CPU's llama.cpp kernels for batches of %d tokens give other logits than its "
                        "small batches: steps capped at %d tokens", self.batch_tokens, safe)
            self.ctx.close()
            self.batch_tokens = safe
            self.max_rows = min(self.max_rows, safe)
            self.ctx = self._context(safe)
            self.kv = KVSlots(self.ctx, self.kv.host_limit, self.kv.share_prefixes)
            self.running = self._running()

    # ------------------------------------------------------------------ the engine's four

    def has_room(self) -> bool:
        return self.running.has_room()

    def busy(self) -> bool:
        return self.running.busy()

    def submit(self, batch: BatchMsg) -> None:
        """Queue ``batch``'s rows; a batch that cannot be served fails with its error."""
        self.running.submit(batch, lambda b: self.check_batch(b, self.vocab))

    def poll(self, timeout: float) -> list[Event]:
        """One step of every running row (``timeout`` is not needed: a step is work)."""
        return self.running.poll()

    def release(self, rids: Iterable[str] | None = None) -> None:
        """Drop the kept KV of ``rids`` (None: all); any thread. A running row's KV is dropped
        when it ends (a cancel, :meth:`~worker.engines.base.Engine.cancel`, ends it at the next
        step)."""
        self.kv.release(rids)

    def take_evicted(self) -> list[str]:
        return self.kv.take_evicted()

    def kept(self) -> dict[str, int]:
        """Request id -> KV tokens kept for it (for tests and status)."""
        return self.kv.held()

    def close(self) -> None:
        if self.kv.shared:
            log.info("%d rows started from a prefix another request left, %d tokens not prefilled",
                     self.kv.shared, self.kv.shared_tokens)
        self.kv.clear()
        self.ctx.close()
        self.model.close()


def _import_sampler() -> None:
    """Import what a row that is not plain greedy is picked with (torch, the sampler), on one
    thread (:func:`~worker.engines.llama_pick.one_torch_thread`)."""
    try:
        from worker.engines import sampling  # noqa: F401
        from worker.engines.llama_pick import one_torch_thread

        one_torch_thread()
    except ImportError as exc:  # the first such row then fails with the same error, by name
        log.warning("the sampler cannot be imported: %s", exc)


@functools.cache
def _has_llguidance() -> bool:
    import importlib.util

    return importlib.util.find_spec("llguidance") is not None


def check_batches(model: Model, threads: int, batch_tokens: int) -> int:
    """The largest step size of ``batch_tokens`` and :data:`SAFE_BATCH_TOKENS` whose one-call
    decode gives the logits that chunks of 7 tokens give (within a tenth of their range)."""
    sizes = [batch_tokens] + [s for s in SAFE_BATCH_TOKENS if s < batch_tokens]
    tokens = [(1 + i * 7919) % model.n_vocab for i in range(batch_tokens)]
    for size in sizes:
        ctx = Context(model, max(256, 2 * size), 1, size, threads)
        try:
            one = last_logits(ctx, tokens[:size], size)
            ctx.seq_rm(0)
            ref = last_logits(ctx, tokens[:size], 7)
        finally:
            ctx.close()
        spread = float(ref.max() - ref.min()) or 1.0
        if float(np.abs(one - ref).max()) <= 0.1 * spread:
            return size
    return sizes[-1]


def last_logits(ctx: Context, tokens: list[int], chunk: int) -> np.ndarray:
    """The logits after ``tokens``, decoded into sequence 0 of ``ctx`` (empty) in calls of
    ``chunk`` tokens."""
    from worker.engines.llama_lib import Batch

    b = Batch(ctx.api, chunk)
    for pos in range(0, len(tokens), chunk):
        part = tokens[pos:pos + chunk]
        b.clear()
        b.add(part, 0, pos, pos + len(part) == len(tokens))
        if ctx.decode(b) != 0:
            raise LlamaError(f"{len(tokens)} tokens do not fit the context")
    return ctx.logits(1)[0].copy()
