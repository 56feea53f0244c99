"""A transformers causal LM loaded for serving: what the ``hf`` and ``hf-cb`` engines share.

Both engines load the same model the same way and report the same facts about it; they
differ in how they batch (``hf``: static slices, :class:`~worker.engines.base.SliceEngine`;
``hf-cb``: transformers' continuous batching). :class:`TransformersModel` is that shared
part, a mixin each engine class lists beside its way of serving.

The prompt's log-probabilities of the engines whose prefill runs here (``hf``,
``hf-static-cb``) are computed from the prefill's own passes: :class:`HiddenTap` keeps the
decoder's last hidden states of each, and :class:`PromptScore` takes a row's prompt positions
through the model's head (:func:`head_logits`) a chunk of :data:`PROMPT_CHUNK` positions at a
time, so neither the rows that do not ask nor a long prompt ever hold the whole prompt's logits.
:func:`prompt_head_ok` checks once that this gives the model's own logits (``caps``).
"""

from __future__ import annotations

import logging
import resource
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from sclsd import models
from sclsd.protocol import BatchRequest, EngineCaps, TokenLogprobs
from worker.engines.base import EngineInfo
from worker.engines.static_cache import StaticOptions, activation_reserve

__all__ = ["DEFAULT_CPU_BUDGET", "PROMPT_CHUNK", "HiddenTap", "PromptScore", "TransformersModel", "head_logits",
           "maybe_tap", "peak_memory", "prompt_head_ok", "scores_prompt", "vocab_size"]

log = logging.getLogger("worker.engines.hf")

#: M_ava on the CPU when no budget is configured.
DEFAULT_CPU_BUDGET = 4 * 1024**3
#: Prompt positions whose logits one pass of the model's head computes for the prompt's
#: log-probabilities: ``[256, vocab]`` fp32 at a time (150 MiB for a 152k vocabulary), never
#: the whole prompt's (a 16k-token prefill's would be 10 GiB).
PROMPT_CHUNK = 256

#: Share of the free device memory kept back from KV on CUDA for the allocator's fragmentation
#: and for workspaces allocated after the measure (:meth:`TransformersModel.kv_memory`).
FRAGMENTATION_SHARE = 0.03


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
    _prompt_head: bool | None = None

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

    def scores_prompts(self) -> bool:
        """Whether this model's prompt log-probabilities can be computed (``caps.prompt_logprobs``):
        :func:`prompt_head_ok`, checked once, the first time it is asked."""
        if self._prompt_head is None:
            if self.model is None:
                return False
            self._prompt_head = prompt_head_ok(self.model, self.device)
        return self._prompt_head

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
        # Beside the activations, a share the allocator loses to fragmentation once kept KV
        # of every length comes and goes in the store (1.3 GiB on an H200 with the store
        # full), and what libraries and graphs take after this measure.
        reserve = activation_reserve(self.config, self.dtype, reserve_tokens, reserve_rows) + int(
            FRAGMENTATION_SHARE * free)
        log.info("KV memory: %.2f GiB free after the weights, %.2f GiB kept for activations",
                 free / 2**30, reserve / 2**30)
        return max(0, int(free) - reserve)

    def arena_memory(self, opts: StaticOptions) -> int:
        """Bytes of KV for a static path of ``opts``: :meth:`kv_memory` for its prefill chunk and
        sampled rows, less the logits its captured decode steps keep
        (:meth:`~worker.engines.static_cache.StaticOptions.graph_outputs`; none without graphs)."""
        kv = self.kv_memory(opts.reserve_tokens, opts.reserve_rows)
        return kv - opts.graph_outputs(self.config, self.dtype, kv, self.delta, self.max_context)

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


# ---------------------------------------------------------------------- the prompt's log-probabilities


def scores_prompt(req: BatchRequest) -> bool:
    """Whether a row computes its prompt's log-probabilities: it asks for them (``prompt_logprobs``)
    in its request's first slice, whose prefill is the whole prompt."""
    return req.prompt_logprobs is not None and req.generated == 0


class HiddenTap:
    """The last hidden states of a causal LM's forward passes, taken by a forward hook on its
    decoder (``get_decoder()``) while the tap is open: :attr:`hidden` is the last pass's
    ``[rows, q, hidden]``. The model still computes only the logits it is asked for
    (``logits_to_keep``), so the rows' next tokens come from its own logits, unchanged; the
    prompt positions' logits are computed from these by :func:`head_logits`, a chunk of
    positions at a time."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.hidden: Any = None
        self._handle: Any = None

    def _hook(self, module: Any, args: Any, output: Any) -> None:
        del module, args
        last = getattr(output, "last_hidden_state", None)
        self.hidden = last if last is not None else output[0]

    def score(self, scores: Sequence[PromptScore | None], col: int, starts: Sequence[int]) -> None:
        """After a forward pass over the columns from ``col`` of a left-padded block whose row
        ``i`` starts at column ``starts[i]``: the entries of the rows that score their prompt
        (``scores[i]`` not None; their prompt is their block's tokens: no kept KV)."""
        for i, s in enumerate(scores):
            if s is not None:
                s.add_at(self.model, self.hidden[i], col, starts[i])

    def __enter__(self) -> HiddenTap:
        self._handle = self.model.get_decoder().register_forward_hook(self._hook)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._handle is not None:
            self._handle.remove()
        self._handle = self.hidden = None


@contextmanager
def maybe_tap(model: Any, on: bool) -> Iterator[HiddenTap | None]:
    """A :class:`HiddenTap` on ``model`` while the block runs when ``on`` (a row scores its
    prompt), else None: the rows that do not ask cost nothing more."""
    if not on:
        yield None
        return
    with HiddenTap(model) as tap:
        yield tap


def head_logits(model: Any, hidden: Any) -> Any:
    """The logits ``model`` gives for last hidden states ``hidden`` (``[..., hidden]``): its
    output embedding (``lm_head``), then the scalings some architectures apply after it
    (Cohere's ``logit_scale``, Granite's ``logits_scaling``, Gemma's final soft-capping).
    :func:`prompt_head_ok` checks it against the model's own logits."""
    import torch

    logits = model.get_output_embeddings()(hidden)
    cfg = model.config
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    scale = getattr(model, "logit_scale", None)
    if isinstance(scale, (int, float)):
        logits = logits * scale
    scaling = getattr(text, "logits_scaling", None)
    if isinstance(scaling, (int, float)) and scaling:
        logits = logits / scaling
    cap = getattr(text, "final_logit_softcapping", None)
    if isinstance(cap, (int, float)) and cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def prompt_head_ok(model: Any, device: Any) -> bool:
    """Whether :class:`HiddenTap` and :func:`head_logits` give ``model``'s own logits, on a
    4-token probe (every position's logits, both ways): False for a model whose decoder the
    tap does not find or whose head does something :func:`head_logits` does not (its
    ``caps.prompt_logprobs`` is then off, and the daemon refuses such requests by name)."""
    import torch

    try:
        vocab = int(model.get_output_embeddings().weight.shape[0])
        ids = (torch.arange(1, 5, dtype=torch.long) % vocab).view(1, 4).to(device)
        with torch.inference_mode(), HiddenTap(model) as tap:
            want = model(input_ids=ids, use_cache=False).logits[0].float()
            got = head_logits(model, tap.hidden[0]).float()
        # The same product in the model's dtype, maybe by another kernel: a few ulps apart.
        tol = max(1e-4, 4 * torch.finfo(model.dtype).eps)
        ok = got.shape == want.shape and bool(torch.allclose(got, want, rtol=tol,
                                                             atol=tol * (1.0 + float(want.abs().max()))))
    except Exception as exc:  # noqa: BLE001 - a model this does not fit is served without them
        log.warning("the prompt's log-probabilities cannot be computed for this model (%s: %s)",
                    type(exc).__name__, exc)
        return False
    if not ok:
        log.warning("the prompt's log-probabilities cannot be computed for this model: its head is not "
                    "the output embedding and the scalings sclsd knows")
    return ok


@dataclass(eq=False)
class PromptScore:
    """A prefill row's prompt log-probabilities as its chunks are computed: ``prompt``, the row's
    whole prompt; ``k``, the likeliest tokens at each position; ``out``, one entry per prompt
    token after the first so far (the row's list, filled in place)."""

    prompt: Sequence[int]
    k: int
    out: list[TokenLogprobs] = field(default_factory=list)

    def add(self, model: Any, hidden: Any, first: int) -> None:
        """The entries of prompt positions ``first`` to ``first + len(hidden) - 1`` (``hidden``:
        their last hidden states, ``[q, hidden]``): position p's logits give prompt token
        p + 1's, so the prompt's last position gives none. Chunks come in order, from
        position 0 (ValueError otherwise: an entry would be missing)."""
        import torch

        from worker.engines.sampling import prompt_logprobs

        n = min(int(hidden.shape[0]), len(self.prompt) - 1 - first)
        if n <= 0:
            return
        if first != len(self.out):
            raise ValueError(f"prompt positions from {first} scored after {len(self.out)}")
        for a in range(0, n, PROMPT_CHUNK):
            b = min(n, a + PROMPT_CHUNK)
            targets = torch.tensor(list(self.prompt[first + a + 1:first + b + 1]), dtype=torch.long)
            self.out.extend(prompt_logprobs(head_logits(model, hidden[a:b]), targets, self.k))

    def add_at(self, model: Any, hidden: Any, col: int, start: int) -> None:
        """:meth:`add` for ``hidden`` (``[q, hidden]``) at columns ``col`` to ``col + q - 1`` of a
        left-padded block whose column ``start`` holds the prompt's first token (pads before it)."""
        skip = max(0, start - col)
        if skip < int(hidden.shape[0]):
            self.add(model, hidden[skip:], col + skip - start)
