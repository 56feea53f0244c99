"""``[grammar]``: where and within what limits structured-output grammars are compiled.

The daemon compiles and checks each request's grammar in a child process (``processes``
of them, each capped at ``memory_bytes`` of address space beyond what it starts with, each
check at ``timeout_s``, first tries past ``quick_s`` kept from taking every slot, results
kept by content in a cache of ``cache_entries`` / ``cache_bytes``), so a hostile schema costs
at most that request; llguidance's own
limits (the rest of the keys, its defaults unless set) bound the check there and the
matcher each worker builds for the row (they travel with the row:
``BatchRequest.grammar_limits``). Registered in :mod:`sclsd.config`, checked with it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["LIMIT_KEYS", "GrammarConfig", "check"]

#: The keys of :class:`GrammarConfig` that are llguidance's ``LLParserLimits``.
LIMIT_KEYS = ("max_grammar_size", "max_items_in_row", "initial_lexer_fuel", "step_lexer_fuel",
              "step_max_items", "max_lexer_states")


@dataclass(frozen=True)
class GrammarConfig:
    """``[grammar]`` (see the module docstring)."""

    processes: int = 2
    """Child processes that compile grammars for the daemon: checks at once."""
    timeout_s: float = 5.0
    """A grammar not compiled and checked within this is refused (its child is killed)."""
    quick_s: float = 0.2
    """A grammar still compiling after this on its first try goes on only while a slot is
    left for quicker ones (one of ``processes``, when there are two or more); else it is
    stopped and tried again, from the start and up to ``timeout_s``, when no first try waits."""
    cache_entries: int = 1024
    """Grammars whose check is kept (by content: the compiled text, or the refusal)."""
    cache_bytes: int = 64 * 1024**2
    """Bytes of compiled grammar text the cache keeps at most."""
    memory_bytes: int = 1024**3
    """Address space a child may add while compiling (RLIMIT_AS over its size at start)."""
    max_grammar_size: int = 500_000
    """llguidance: symbols in the grammar's productions."""
    max_items_in_row: int = 2000
    """llguidance: Earley items in one row (the grammar's branching)."""
    initial_lexer_fuel: int = 1_000_000
    """llguidance: work building the lexer's regexes (about 50k a millisecond)."""
    step_lexer_fuel: int = 200_000
    """llguidance: lexer work per token mask (about 14k a millisecond)."""
    step_max_items: int = 50_000
    """llguidance: Earley items per token mask."""
    max_lexer_states: int = 250_000
    """llguidance: lexer states (1-2 kB each)."""

    def limits(self) -> dict[str, int]:
        """llguidance's ``LLParserLimits`` keyword arguments."""
        return {k: getattr(self, k) for k in LIMIT_KEYS}


#: Inclusive bounds of each key: a value outside them is a config error.
_BOUNDS: dict[str, tuple[float, float]] = {
    "processes": (1, 64), "timeout_s": (0.1, 600.0), "memory_bytes": (64 * 1024**2, 1 << 50),
    "quick_s": (0.01, 600.0), "cache_entries": (0, 1 << 20), "cache_bytes": (0, 1 << 40),
    **{k: (1, 1 << 40) for k in LIMIT_KEYS},
}


def check(g: GrammarConfig, need: Callable[[bool, str, Any, str], None]) -> None:
    """Every key of ``g`` within its bounds; ``need(ok, key, value, why)`` raises the config
    error (:func:`sclsd.config._need`)."""
    for f in fields(g):
        lo, hi = _BOUNDS[f.name]
        value = getattr(g, f.name)
        need(lo <= value <= hi, f"grammar.{f.name}", value, f"must be in {lo}..{hi}")
    need(g.quick_s <= g.timeout_s, "grammar.quick_s", g.quick_s,
         f"must be at most grammar.timeout_s ({g.timeout_s:g})")
