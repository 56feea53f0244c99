"""The engine options of ``[workers.options]``: every key, the engines that take it, its
type and range, checked when the config loads; and the constraints (:class:`Range`,
:class:`Choice`) an option or a config key declares, which :mod:`sclsd.config` puts on its
fields (``Annotated[int, Range(ge=1)]``).

The daemon passes each ``key = value`` to the workers it spawns as the flag
``--key value`` (the value as ``str()`` writes it: ``True``, ``[1, 2, 4]``);
``sclsd-worker`` has one flag per key of :data:`OPTIONS`, made from its declaration, and
hands the engine's constructor the value :func:`parse_option` typed. A key no engine knows,
a value of the wrong type, a number out of range or not finite (TOML allows ``inf`` and
``nan``), or a key the configured engine does not take is refused here, with the key and
the reason, instead of making every worker fail at start or every batch fail later.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["OPTIONS", "Choice", "Option", "Range", "check_option", "check_options", "parse_option"]

TORCH = ("hf", "hf-cb", "hf-static-cb", "deepspeed")
STATIC = ("hf", "deepspeed")
#: Engines with a static KV arena (``hf-static-cb`` always has one).
ARENA = (*STATIC, "hf-static-cb")
#: Engines that keep KV across slices in a store of their own (the byte budgets below).
KEEP = ("hf", "hf-static-cb", "deepspeed")


@dataclass(frozen=True)
class Range:
    """A number's bounds (None: no bound); for a list, every item's. ``note`` follows the
    reason (``0: off``); ``octal`` shows the bounds as file modes."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    note: str = ""
    octal: bool = False

    def _ok(self, v: Any) -> bool:
        return ((self.ge is None or v >= self.ge) and (self.gt is None or v > self.gt)
                and (self.le is None or v <= self.le))

    def _show(self, bound: float | None) -> str:
        if self.octal:
            return oct(int(bound or 0))
        return f"{bound:g}" if isinstance(bound, float) else str(bound)

    def why(self, value: Any) -> str | None:
        """Why ``value`` is out of range, or None when it is within."""
        if all(self._ok(v) for v in (value if isinstance(value, list) else [value])):
            return None
        show = self._show
        if self.le is None:
            bound = f">= {show(self.ge)}" if self.ge is not None else f"> {show(self.gt)}"
        elif self.ge is not None:
            bound = f"in {show(self.ge)}..{show(self.le)}"
        else:
            bound = f"in ({show(self.gt)}, {show(self.le)}]"
        note = f" ({self.note})" if self.note else ""
        return f"{'every item must' if isinstance(value, list) else 'must'} be {bound}{note}"


class Choice:
    """The allowed values: these, or what ``of()`` returns (so that it may import them late)."""

    def __init__(self, *values: str, of: Callable[[], Sequence[str]] | None = None) -> None:
        self.values, self.of = values, of

    def why(self, value: Any) -> str | None:
        """Why ``value`` is not allowed, or None when it is."""
        allowed = tuple(self.of()) if self.of is not None else self.values
        return None if value in allowed else f"must be one of {', '.join(allowed)}"


def dtypes() -> tuple[str, ...]:
    """The weights' dtypes (:data:`sclsd.models.DTYPES`), imported when asked."""
    from .models import DTYPES
    return DTYPES


@dataclass(frozen=True)
class Option:
    """One engine option: the engines that take it, its kind and its range."""

    engines: tuple[str, ...]
    kind: str
    """``bool``, ``int``, ``float``, ``switch`` (true, false or "auto"), ``sizes`` (a
    comma-separated list or a list of positive integers), or ``choice``."""
    rule: Range | Choice | None = None
    """An ``int`` or ``float``'s range, a ``choice``'s values."""
    help: str = ""
    always: bool = False
    """Held to the engine in effect even when the daemon spawns no workers (``sampling``: the
    daemon reads it too; ``kernel_inject``: refused in any case)."""
    default: Any = None
    """The engine's own default where the daemon must know it before any worker registers
    (None: only the engine needs it)."""


OPTIONS: dict[str, Option] = {
    # fake
    "decode_s": Option(("fake",), "float", Range(ge=0.0), help="seconds per decoding iteration"),
    "prefill_s_per_token": Option(("fake",), "float", Range(ge=0.0), help="prefill seconds per token"),
    # The fake model's byte tokenizer has 256 ids: a smaller vocabulary cannot hold a prompt,
    # and the daemon refuses such a worker at register (it would exit and restart for ever).
    "vocab": Option(("fake",), "int", Range(ge=256),
                    help="vocabulary size (at least the byte tokenizer's 256 ids)"),
    "max_natural": Option(("fake",), "int", Range(ge=1), help="longest natural output before EOS"),
    "kv_bytes_per_token": Option(("fake",), "int", Range(ge=1), help="Δ it reports"),
    "batching": Option(("fake",), "choice", Choice("static", "continuous"),
                       help="static: one batch at a time; continuous: grants share a running set of rows "
                            "(it takes slice grants under scls-cb)"),
    "grammar": Option(("fake",), "bool", help="enforce structured-output grammars (needs llguidance)"),
    "max_rows": Option(("fake", "hf-cb", "hf-static-cb", "llama"), "int", Range(ge=1),
                       help="continuous batching: most rows running at once (fake: default 64; hf-cb: "
                            "default as many as its KV cache holds, else transformers' max_requests_per_batch; "
                            "hf-static-cb: default, and at most, 512 or the largest graph bucket if larger; "
                            "llama: default 8, rows beyond wait for a place); the daemon sends no more grants "
                            "than this and a lookahead"),
    # KV kept across slices
    "kv_reuse": Option((*KEEP, "fake"), "bool",
                       help="keep unfinished requests' KV across slices (default true)"),
    "kv_retain_bytes": Option((*KEEP, "fake"), "int", Range(ge=0),
                              help="most bytes of kept KV (default: the memory budget)"),
    "kv_host_bytes": Option(KEEP + ("llama",), "int", Range(ge=0),
                            help="host bytes for kept KV that does not fit beside a batch (default: none "
                                 "on the CPU, 1 GiB for llama; on CUDA the KV memory, at most 16 GiB and a "
                                 "quarter of RAM)"),
    # the static-cache path
    "static_cache": Option(STATIC, "switch",
                           help="serve slices from a static KV cache allocated once (auto: on with CUDA "
                                "for hf, off for deepspeed)"),
    "cuda_graphs": Option(TORCH, "switch", help="capture decode steps as CUDA graphs (auto: with CUDA)"),
    "static_share": Option(ARENA, "float", Range(gt=0.0, le=1.0),
                           help="the static cache's share of KV memory, the rest keeping KV across slices "
                                "(default 0.5; hf-static-cb 0.9)"),
    "static_buckets": Option(ARENA, "bool", help="pad batches to bucket shapes without graphs too"),
    "graph_batch_sizes": Option(ARENA, "sizes", help="batch-size buckets"),
    "graph_cache_tokens": Option(ARENA, "sizes", help="cache-length buckets"),
    "graph_capture_s": Option(ARENA, "float", Range(ge=0.0, note="seconds; 0: no limit"),
                              help="seconds warm-up may spend capturing decode graphs after the first two "
                                   "(default 30), each cache bucket's largest shape first; the smaller bucket "
                                   "shapes not reached leave the grid"),
    "decode_attention": Option(("hf-static-cb",), "choice", Choice("sdpa", "flex"),
                               help="attention of the arena's decode steps: sdpa (default) reads every column of "
                                    "the step's slots; flex: FlexAttention reads only each row's own (compiled at "
                                    "warm-up)"),
    "prefill_chunk_tokens": Option(ARENA, "int", Range(ge=0),
                                   help="most tokens per prefill pass on the static path (0: no chunks; "
                                        "default 8192 on CUDA)"),
    # hf-cb
    # On by default: OpenAI clients send temperature 1 unless told otherwise.
    "sampling": Option(("hf-cb",), "bool", help="per-request sampling (default true; false: greedy only, "
                                                "which saves a sort of the vocabulary per row and step)",
                       always=True, default=True),
    "page_size": Option(("hf-cb",), "int", Range(ge=1), help="tokens per KV page"),
    "num_blocks": Option(("hf-cb",), "int", Range(ge=1), help="pages of the paged cache"),
    "max_batch_tokens": Option(("hf-cb", "llama"), "int", Range(ge=1),
                               help="most tokens per iteration (llama: 64 by default, fewer where warm-up "
                                    "finds the library's large batches wrong on this CPU)"),
    # llama
    "context_tokens": Option(("llama",), "int", Range(ge=256),
                             help="KV cells of the llama.cpp context (default: 1,024 per row of max_rows, at "
                                  "least 2,048, within the memory budget and the model's window)"),
    "share_prefixes": Option(("llama", "hf-static-cb"), "bool",
                             help="a request starts from the KV of another's prompt (and answer) it begins "
                                  "with, and the daemon sends a request to the worker likely to hold its "
                                  "prefix (llama: kept within 1/32 of the cells where recent requests began "
                                  "alike, default false: on quantised weights a seeded request may then draw "
                                  "otherwise; hf-static-cb: kept in the room the kept-KV store leaves, "
                                  "default true)"),
    "memory_share": Option(("hf-cb",), "float", Range(gt=0.0, le=1.0), help="share of free memory"),
    "poll_s": Option(("hf-cb",), "float", Range(gt=0.0), help="result poll interval"),
    "kv_padding_tokens": Option(("hf-cb",), "int", Range(ge=1),
                                help="captured steps pad KV reads to a multiple of this (CUDA graphs)"),
    # deepspeed
    "kernel_inject": Option(("deepspeed",), "bool", help="DeepSpeed kernel injection (true is refused, with "
                                                         "the reason)", always=True),
    # every torch engine (model.dtype is the place for it now)
    "dtype": Option(TORCH, "choice", Choice(of=dtypes), help="weights dtype"),
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
        many = len(opt.engines) > 1
        return (f"the {engine} engine does not take it (only the {', '.join(opt.engines)} "
                f"engine{'s take' if many else ' takes'} it)")
    if opt.kind == "bool" and not isinstance(value, bool):
        return "must be true or false"
    if opt.kind == "switch" and not (isinstance(value, bool) or value == "auto"):
        return 'must be true, false or "auto"'
    if opt.kind == "choice" and opt.rule is not None:
        return opt.rule.why(value)
    if opt.kind == "sizes":
        parts = value.replace(" ", "").split(",") if isinstance(value, str) else value
        if not isinstance(parts, list) or not parts or not all(
                (isinstance(p, int) and not isinstance(p, bool) and p >= 1) or (isinstance(p, str) and p.isdecimal()
                                                                                 and int(p) >= 1)
                for p in parts):
            return "must be a list of positive integers (or their comma-separated text)"
    if opt.kind in ("int", "float"):
        if not _number(value, opt.kind == "int"):
            return f"must be {'an integer' if opt.kind == 'int' else 'a number'}"
        if not math.isfinite(value):
            return "must be a finite number"
        if opt.rule is not None:
            return opt.rule.why(value)
    return None


def _from_text(kind: str, text: str) -> Any:
    """``text`` as the TOML value it stands for, where it reads as one (else ``text``
    itself, for :func:`check_option` to refuse): what ``str()`` makes of a TOML value
    reads back (``True``, ``[1, 2, 4]``)."""
    low = text.strip().lower()
    if kind in ("bool", "switch") and low in ("true", "false"):
        return low == "true"
    if kind == "switch" and low == "auto":
        return "auto"
    if kind in ("int", "float"):
        try:
            return (int if kind == "int" else float)(text.strip())
        except ValueError:
            return text
    if kind == "sizes":
        inner = low[1:-1] if low.startswith("[") and low.endswith("]") else low
        return [int(p) if p.strip().isdecimal() else p for p in inner.split(",")]
    return text


def parse_option(key: str, value: Any) -> Any:
    """``key``'s value typed by its declared kind: a TOML value, or text from a command
    line (``"1,2,4"``, ``"auto"``, ``"false"``, ``"0.5"``). ``bool``: True or False;
    ``switch``: True, False or ``"auto"``; ``int``; ``float`` (an int too); ``sizes``: a
    tuple of ints, ascending and unique; ``choice``: the string. A value already typed
    (or a tuple of sizes) is checked the same way. ``ValueError`` naming the key and why
    (:func:`check_option`'s reasons) when the key is unknown or the value does not fit."""
    opt = OPTIONS.get(key)
    typed = value
    if opt is not None and isinstance(value, str):
        typed = _from_text(opt.kind, value)
    elif opt is not None and opt.kind == "sizes" and isinstance(value, tuple):
        typed = list(value)
    why = check_option(None, key, typed)
    if why is not None:
        raise ValueError(f"{key}: {why}, got {value!r}")
    assert opt is not None  # an unknown key has a reason
    if opt.kind == "sizes":
        return tuple(sorted({int(p) for p in typed}))
    if opt.kind == "float":
        return float(typed)
    return typed


def check_options(engine: str | None, options: dict[str, Any],
                  spawned: bool = True) -> tuple[str, Any, str] | None:
    """The first option ``engine`` (None: any) cannot take: ``(key, value, why)``; None when all
    can. Which engine takes a key matters only for the workers the daemon spawns: with
    ``spawned`` false, only the keys marked :attr:`Option.always` are held to ``engine``."""
    for key, value in options.items():
        opt = OPTIONS.get(key)
        held = spawned or (opt is not None and opt.always)
        why = check_option(engine if held else None, key, value)
        if why is not None:
            return key, value, why
    return None
