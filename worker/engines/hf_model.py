"""A transformers causal LM loaded for serving: what the ``hf`` and ``hf-cb`` engines share.

Both engines load the same model the same way and report the same facts about it; they
differ in how they batch (``hf``: static slices, :class:`~worker.engines.base.SliceEngine`;
``hf-cb``: transformers' continuous batching). :class:`TransformersModel` is that shared
part, a mixin each engine class lists beside its way of serving.
"""

from __future__ import annotations

import logging
import resource
import time
from typing import Any

from sclsd import models
from sclsd.protocol import EngineCaps
from worker.engines.base import EngineInfo
from worker.engines.static_cache import activation_reserve

__all__ = ["DEFAULT_CPU_BUDGET", "TransformersModel", "peak_memory", "vocab_size"]

log = logging.getLogger("worker.engines.hf")

#: M_ava on the CPU when no budget is configured.
DEFAULT_CPU_BUDGET = 4 * 1024**3


class TransformersModel:
    """The loaded model and its facts (:meth:`load` fills them; :meth:`unload` drops the model)."""

    name: str
    spec: models.ModelSpec
    device: Any
    """The ``torch.device`` it runs on."""
    dtype: Any
    mem_budget: int | None
    model: Any
    config: Any
    load_s: float
    eos: list[int]
    pad_id: int
    delta: int
    """Δ: bytes of KV per token."""
    vocab_size: int

    def load(self, model: str, device: str, dtype: Any, mem_budget: int | None, threads: int | None) -> None:
        """Load ``model`` on ``device`` in ``dtype`` (``threads``: torch's CPU threads)."""
        import torch

        if threads:
            torch.set_num_threads(int(threads))
        self.spec = models.resolve(model)
        self.device = torch.device(device)
        self.dtype = models.resolve_dtype(dtype)
        self.mem_budget = mem_budget
        t0 = time.perf_counter()
        self.model = models.load_model(self.spec, device=str(self.device), dtype=self.dtype)
        self.load_s = time.perf_counter() - t0
        self.config = self.model.config
        self.eos = models.eos_token_ids(self.model)
        pad = getattr(self.config, "pad_token_id", None)
        # Pad id only fills masked slots; any valid id works.
        self.pad_id = int(pad) if isinstance(pad, int) else (self.eos[0] if self.eos else 0)
        self.delta = models.kv_bytes_per_token(self.config, self.dtype)
        self.vocab_size = vocab_size(self.spec, self.config)
        log.info("loaded %s on %s in %.1f s", self.spec.name, self.device, self.load_s)

    @property
    def max_context(self) -> int:
        """The model's longest context (``max_position_embeddings``; 0: unknown)."""
        return int(getattr(self.config, "max_position_embeddings", 0) or 0)

    def kv_memory(self, reserve_tokens: int, reserve_rows: int) -> int:
        """Bytes for KV: on CUDA the free memory once the weights are resident, less what a
        forward pass of ``reserve_tokens`` tokens and the sampling of ``reserve_rows`` rows need
        beside it (:func:`~worker.engines.static_cache.activation_reserve`); on the CPU
        ``mem_budget`` (4 GiB by default)."""
        import torch

        if self.device.type != "cuda":
            return int(self.mem_budget or DEFAULT_CPU_BUDGET)
        free, _total = torch.cuda.mem_get_info(self.device)
        reserve = activation_reserve(self.config, self.dtype, reserve_tokens, reserve_rows)
        log.info("KV memory: %.2f GiB free after the weights, %.2f GiB kept for activations",
                 free / 2**30, reserve / 2**30)
        return max(0, int(free) - reserve)

    def model_info(self, mem_available: int, caps: EngineCaps) -> EngineInfo:
        """What a worker registers with: the model's facts, ``mem_available`` (M_ava) and ``caps``."""
        return EngineInfo(
            engine=self.name,
            model=self.spec.name,
            device=str(self.device),
            kv_bytes_per_token=self.delta,
            mem_available=mem_available,
            eos_token_ids=list(self.eos),
            vocab_size=self.vocab_size,
            caps=caps,
            extra={"dtype": str(self.dtype).removeprefix("torch."), "load_s": round(self.load_s, 3)},
        )

    def unload(self) -> None:
        """Drop the model and give cached CUDA memory back."""
        import torch

        self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def vocab_size(spec: models.ModelSpec, config: Any) -> int:
        """``len(tokenizer)`` (added tokens included), as the daemon's tokenizer counts it.

        Capped at the config's ``vocab_size``: a model whose embedding is smaller than
        its tokenizer cannot take every id, and the daemon's check should see that.
        Loaded here, with the model, so that registering never waits on it.
        ``tiny-random`` is built with exactly the SmolLM2 tokenizer's size, so its
        config answers without the seconds a GGUF tokenizer takes to load. Without a
        tokenizer the config's ``vocab_size`` is the best guess.
        """
        config_vocab = int(getattr(config, "vocab_size", 0) or 0)
        if spec.kind == "tiny":
            return config_vocab
        try:
            tok_vocab = len(models.load_tokenizer(spec))
        except Exception as exc:  # a model may come without any tokenizer: still servable
            log.warning("no tokenizer for %s (%s): reporting the config's vocab_size %d",
                        spec.name, exc, config_vocab)  # fmt: skip
            return config_vocab
        if config_vocab and tok_vocab > config_vocab:
            log.warning("%s: tokenizer has %d tokens, the model only %d",
                        spec.name, tok_vocab, config_vocab)  # fmt: skip
            return config_vocab
        return tok_vocab


def peak_memory(device: Any) -> int:
    """CUDA: max allocated bytes since the last reset; CPU: the process's peak RSS."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    # ru_maxrss is in KiB on Linux.
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


