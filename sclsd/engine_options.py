"""The engine options of ``[workers.options]``: every key, the engines that take it, its
type and range, checked when the config loads.

The daemon passes each ``key = value`` to the workers it spawns as the flag
``--key value``; ``sclsd-worker`` takes any key of :data:`OPTIONS` that way and hands it
to the engine's constructor. A key no engine knows, a value of the wrong type, a number
out of range or not finite (TOML allows ``inf`` and ``nan``), or a key the configured
engine does not take is refused here, with the key and the reason, instead of making
every worker fail at start or every batch fail later.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["OPTIONS", "Option", "check_option", "check_options"]

TORCH = ("hf", "hf-cb", "deepspeed")
STATIC = ("hf", "deepspeed")


@dataclass(frozen=True)
class Option:
    """One engine option: the engines that take it, its kind and its range."""

    engines: tuple[str, ...]
    kind: str
    """``bool``, ``int``, ``float``, ``switch`` (true, false or "auto"), ``sizes`` (a
    comma-separated list or a list of positive integers), or ``choice``."""
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    """The lower bound itself is excluded."""
    choices: tuple[str, ...] = ()
    help: str = ""
    default: Any = None
    """The engine's own default where the daemon must know it before any worker registers
    (None: only the engine needs it)."""


OPTIONS: dict[str, Option] = {
    # fake
    "decode_s": Option(("fake",), "float", lo=0.0, help="seconds per decoding iteration"),
    "prefill_s_per_token": Option(("fake",), "float", lo=0.0, help="prefill seconds per token"),
    # The fake model's byte tokenizer has 256 ids: a smaller vocabulary cannot hold a prompt,
    # and the daemon refuses such a worker at register (it would exit and restart for ever).
    "vocab": Option(("fake",), "int", lo=256, help="vocabulary size (at least the byte tokenizer's 256 ids)"),
    "max_natural": Option(("fake",), "int", lo=1, help="longest natural output before EOS"),
    "kv_bytes_per_token": Option(("fake",), "int", lo=1, help="Δ it reports"),
    "batching": Option(("fake",), "choice", choices=("static", "continuous"),
                       help="static: one batch at a time; continuous: grants share a running set of rows"),
    "grammar": Option(("fake",), "bool", help="enforce structured-output grammars (needs llguidance)"),
    "max_rows": Option(("fake",), "int", lo=1, help="continuous batching: most rows running at once (default 64)"),
    # KV kept across slices
    "kv_reuse": Option(("hf", "deepspeed", "fake"), "bool", help="keep unfinished requests' KV across slices"),
    "kv_retain_bytes": Option(("hf", "deepspeed", "fake"), "int", lo=0, help="most bytes of kept KV"),
    "kv_host_bytes": Option(STATIC, "int", lo=0, help="host bytes for kept KV"),
    # the static-cache path
    "static_cache": Option(STATIC, "switch", help="serve slices from a static KV cache"),
    "cuda_graphs": Option(TORCH, "switch", help="capture decode steps as CUDA graphs"),
    "static_share": Option(STATIC, "float", lo=0.0, hi=1.0, lo_open=True, help="the arena's share of KV memory"),
    "static_buckets": Option(STATIC, "bool", help="pad batches to bucket shapes without graphs too"),
    "graph_batch_sizes": Option(STATIC, "sizes", help="batch-size buckets"),
    "graph_cache_tokens": Option(STATIC, "sizes", help="cache-length buckets"),
    "prefill_chunk_tokens": Option(STATIC, "int", lo=0, help="most tokens per prefill pass"),
    # hf-cb
    # On by default: OpenAI clients send temperature 1 unless told otherwise.
    "sampling": Option(("hf-cb",), "bool", help="per-request sampling (default true; false: greedy only)",
                       default=True),
    "page_size": Option(("hf-cb",), "int", lo=1, help="tokens per KV page"),
    "num_blocks": Option(("hf-cb",), "int", lo=1, help="pages of the paged cache"),
    "max_batch_tokens": Option(("hf-cb",), "int", lo=1, help="most tokens per iteration"),
    "memory_share": Option(("hf-cb",), "float", lo=0.0, hi=1.0, lo_open=True, help="share of free memory"),
    "poll_s": Option(("hf-cb",), "float", lo=0.0, lo_open=True, help="result poll interval"),
    "kv_padding_tokens": Option(("hf-cb",), "int", lo=1,
                                help="captured steps pad KV reads to a multiple of this (CUDA graphs)"),
    # deepspeed
    "kernel_inject": Option(("deepspeed",), "bool", help="DeepSpeed kernel injection (refused)"),
    # every torch engine (model.dtype is the place for it now)
    "dtype": Option(TORCH, "choice", choices=("auto", "float32", "bfloat16", "float16"), help="weights dtype"),
}


def _number(value: Any, integer: bool) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int) if integer else isinstance(value, (int, float))


def check_option(engine: str | None, key: str, value: Any) -> str | None:
    """Why ``key = value`` cannot go to ``engine`` (None: to any engine that takes the key), or
    None when it can."""
    opt = OPTIONS.get(key)
    if opt is None:
        return f"unknown engine option (known: {', '.join(sorted(OPTIONS))})"
    if engine is not None and engine not in opt.engines:
        return f"the {engine} engine does not take it (it is for {', '.join(opt.engines)})"
    if opt.kind == "bool" and not isinstance(value, bool):
        return "must be true or false"
    if opt.kind == "switch" and not (isinstance(value, bool) or value == "auto"):
        return 'must be true, false or "auto"'
    if opt.kind == "choice" and value not in opt.choices:
        return f"must be one of {', '.join(opt.choices)}"
    if opt.kind == "sizes":
        parts = value.replace(" ", "").split(",") if isinstance(value, str) else value
        if not isinstance(parts, list) or not parts or not all(
                (isinstance(p, int) and not isinstance(p, bool) and p >= 1) or (isinstance(p, str) and p.isdigit()
                                                                                 and int(p) >= 1)
                for p in parts):
            return "must be a list of positive integers (or their comma-separated text)"
    if opt.kind in ("int", "float"):
        if not _number(value, opt.kind == "int"):
            return f"must be {'an integer' if opt.kind == 'int' else 'a number'}"
        if not math.isfinite(value):
            return "must be a finite number"
        if opt.lo is not None and (value < opt.lo or (opt.lo_open and value == opt.lo)):
            return f"must be {'>' if opt.lo_open else '>='} {opt.lo:g}"
        if opt.hi is not None and value > opt.hi:
            return f"must be <= {opt.hi:g}"
    return None


def check_options(engine: str | None, options: dict[str, Any]) -> tuple[str, Any, str] | None:
    """The first option ``engine`` (None: any) cannot take: ``(key, value, why)``; None when all can."""
    for key, value in options.items():
        why = check_option(engine, key, value)
        if why is not None:
            return key, value, why
    return None
