"""What admission refuses in a ``generate`` by the workers' abilities: sampling the engine
cannot do, ``min_tokens`` / ``logit_bias`` / ``structured`` / ``prompt_logprobs`` it does not apply or with a bad
value, chat messages for a tokenizer without a chat template. Pure checks, no I/O."""

from __future__ import annotations

from typing import Any

from .. import protocol as P
from ..config import Config
from ..defaults import ENGINE_FEATURES
from ..engine_options import OPTIONS
from ..tokenizer import Tokenizer

__all__ = ["feature_refusal", "has_chat_template", "sampling_refusal"]


def has_chat_template(tok: Tokenizer) -> bool:
    """Whether chat messages can be rendered as the model expects: a transformers tokenizer
    with a chat template, or a tokenizer with a format of its own (the ``fake`` model's)."""
    inner: Any = getattr(tok, "tok", None)
    return inner is None or bool(getattr(inner, "chat_template", None))


def sampling_refusal(cfg: Config, caps: list[P.EngineCaps], g: P.Generate) -> str | None:
    """Why the workers cannot sample ``g`` (temperature > 0), if they cannot: what the
    registered workers said they can do (``Register.caps``), else, before any has
    registered, what the configured engine will say."""
    if caps:
        sampling = all(c.sampling for c in caps)
        seeded = all(c.seeded for c in caps)
    else:
        w = cfg.workers
        continuous = cfg.engine == "hf-cb"
        sampling = not continuous or bool(w.options.get("sampling", OPTIONS["sampling"].default))
        seeded = True  # every engine seeds per request (hf-cb too: worker/engines/cb_select.py)
    if not sampling:
        return ("temperature > 0: these workers serve greedy decoding only (hf-cb started with "
                "[workers.options] sampling = false)")
    if g.seed is not None and not seeded:
        return "seed: these workers cannot seed a request (their engine says so in its caps)"
    return None


def feature_refusal(cfg: Config, caps: list[P.EngineCaps], tok: Tokenizer, g: P.Generate
                    ) -> tuple[str, str] | None:
    """(the field, why) when ``g``'s ``min_tokens``, ``logit_bias``, ``structured`` or ``prompt_logprobs`` cannot
    be served: a bad value, or workers that do not apply it (their ``caps``; before any has
    registered, the configured engine's)."""
    engine = cfg.engine

    def can(flag: str) -> bool:
        if caps:
            return all(getattr(c, flag) for c in caps)
        return engine in ENGINE_FEATURES.get(flag, ())

    if g.min_tokens:
        if g.max_tokens is not None and g.min_tokens > g.max_tokens:
            return "min_tokens", f"min_tokens: {g.min_tokens} is more than max_tokens ({g.max_tokens})"
        if not can("min_tokens"):
            return "min_tokens", f"min_tokens: these workers ({engine}) do not apply it"
    if g.logit_bias:
        vocab = tok.vocab_size
        bad = [t for t in g.logit_bias if t >= vocab]
        if bad:
            return "logit_bias", f"logit_bias: token id {bad[0]} is not below the vocabulary size {vocab}"
        if not can("logit_bias"):
            return "logit_bias", f"logit_bias: these workers ({engine}) do not apply it"
    if g.structured is not None:
        if not can("grammar"):
            return "structured", f"structured output: these workers ({engine}) do not enforce grammars"
    if g.prompt_logprobs is not None and not can("prompt_logprobs"):
        return "prompt_logprobs", (f"prompt_logprobs: these workers ({engine}) do not compute the prompt's "
                                   "log-probabilities")
    return None
