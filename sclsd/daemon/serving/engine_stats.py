"""What the workers' engines reported, summed over results: waste, reuse, evictions, preemption.

The status shows these beside the scheduler's counts (the replay benchmark
reads them): tokens of padding and past a row's end, context tokens prefilled
and taken from kept KV, rows and results, KV the engines evicted, rows a cancel ended
early and the tokens that saved, and for
continuous engines their preemptions and KV peak (which they report as totals
since their start: the latest of each worker counts).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ... import protocol as P

__all__ = ["EngineStats"]


@dataclass(slots=True)
class EngineStats:
    """Engine-side counts (see the module docstring)."""

    pad_tokens: int = 0
    invalid_tokens: int = 0
    prefill_tokens: int = 0
    reused_tokens: int = 0
    batch_rows: int = 0
    results: int = 0
    kv_evicted: int = 0
    cancelled_rows: int = 0
    """Rows the engines ended early because their requests ended here (``cancel_rows``)."""
    saved_tokens: int = 0
    """Tokens those rows were allowed in their slices and did not generate."""
    totals: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Per worker, the latest (preemptions, KV peak tokens) its engine reported."""

    def add(self, wid: str, stats: P.BatchStats, rows: int) -> None:
        """One applied result of worker ``wid`` with ``rows`` rows."""
        self.pad_tokens += stats.pad_tokens
        self.invalid_tokens += stats.invalid_tokens
        self.prefill_tokens += stats.prefill_tokens
        self.reused_tokens += stats.reused_tokens
        self.batch_rows += rows
        self.results += 1
        self.cancelled_rows += stats.cancelled_rows
        self.saved_tokens += stats.saved_tokens
        if stats.preemptions or stats.kv_peak_tokens:
            self.totals[wid] = (stats.preemptions, stats.kv_peak_tokens)

    def as_counters(self) -> dict[str, int]:
        """The counts by name; preemptions and KV peak once a continuous engine reported them."""
        out = {"pad_tokens": self.pad_tokens, "invalid_tokens": self.invalid_tokens,
               "prefill_tokens": self.prefill_tokens, "reused_tokens": self.reused_tokens,
               "batch_rows": self.batch_rows, "results": self.results, "kv_evicted": self.kv_evicted,
               "cancelled_rows": self.cancelled_rows, "cancel_saved_tokens": self.saved_tokens}
        if self.totals:
            out["preemptions"] = sum(p for p, _ in self.totals.values())
            out["kv_peak_tokens"] = max(k for _, k in self.totals.values())
        return out
