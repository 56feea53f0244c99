"""OOM predicates (paper section 4.3): the KV-cache model and profiled rule tables.

Both answer ``oom(n, L, S)``: would a batch of ``n`` rows padded to input
length ``L`` and run for ``S`` iterations run out of memory? Both also give
``max_batch(L, S)``, the largest ``n`` that fits, which the DP batcher uses
to bound its inner loop without calling ``oom`` once per candidate.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

#: Largest batch size reported when memory imposes no limit (e.g. M_ava = ∞).
UNBOUNDED = 1 << 30


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Δ: bytes of K and V cached per token, ``2 · layers · kv_heads · head_dim · bytes``."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes


@dataclass(frozen=True)
class KVMemory:
    """KV-cache memory model: OOM when ``(L + S) · n · Δ > ζ · M_ava`` (eq. 5, 8).

    ``zeta`` < 1 leaves room for the allocator's fragmentation (the paper uses
    0.9 for HF).
    """

    delta: int
    """Δ, bytes per cached token."""
    m_avail: float
    """M_ava = M_cap - M_model - M_engine, bytes (eq. 6)."""
    zeta: float = 0.9

    def __post_init__(self) -> None:
        if self.delta <= 0:
            raise ValueError(f"delta must be > 0, got {self.delta}")
        if not 0 < self.zeta <= 1:
            raise ValueError(f"zeta must be in (0, 1], got {self.zeta}")

    def kv_bytes(self, n: int, L: int, S: int) -> float:
        """M_kv(n, L, S) = (L + S) · n · Δ (eq. 5): pad and invalid tokens count too."""
        return (L + S) * n * self.delta

    def oom(self, n: int, L: int, S: int) -> bool:
        """True when the batch's KV cache would not fit in ζ · M_ava."""
        return self.kv_bytes(n, L, S) > self.zeta * self.m_avail

    def max_batch(self, L: int, S: int) -> int:
        """N_max = ⌊ζ · M_ava / (Δ · (L + S))⌋ (eq. 9); 0 when not even one row fits."""
        tokens = L + S
        if tokens <= 0 or math.isinf(self.m_avail):
            return UNBOUNDED
        return max(0, int(self.zeta * self.m_avail // (self.delta * tokens)))


@dataclass(frozen=True)
class RuleTable:
    """Profiled maximal batch sizes by total length ``L = L_i + S`` (Algorithm 2).

    ``rules`` are ``(min_total_len, max_batch)`` pairs: the first rule (in
    decreasing ``min_total_len``) with ``L > min_total_len`` gives the limit.
    A rule with ``min_total_len`` below every length (e.g. -1 or 0) is the
    fallback; without one, lengths below every threshold are unbounded.
    """

    rules: tuple[tuple[int, int], ...]

    def __init__(self, rules: Iterable[Sequence[int]]) -> None:
        norm = tuple(sorted(((int(a), int(b)) for a, b in rules), reverse=True))
        if not norm:
            raise ValueError("a rule table needs at least one rule")
        if any(b < 0 for _, b in norm):
            raise ValueError(f"max_batch must be >= 0 in {norm}")
        object.__setattr__(self, "rules", norm)

    @classmethod
    def deepspeed(cls) -> RuleTable:
        """Algorithm 2: the paper's DS rules for LLaMA2-13B on an A100-80GB."""
        return cls([(1024, 12), (512, 22), (0, 28)])

    def max_batch(self, L: int, S: int) -> int:
        """Largest batch size allowed for input length ``L`` and slice length ``S``."""
        total = L + S
        for min_len, limit in self.rules:
            if total > min_len:
                return limit
        return UNBOUNDED

    def oom(self, n: int, L: int, S: int) -> bool:
        """True when ``n`` exceeds the rule for total length ``L + S``."""
        return n > self.max_batch(L, S)

    def token_budget(self, max_total: int) -> int:
        """Most tokens one batch may hold under the table, totals capped at ``max_total``.

        Rule k covers totals in (min_k, upper_k], upper_k being the next rule's
        threshold (``max_total`` for the top one); it allows max_batch_k · upper_k
        tokens. For the paper's table and 2048: 12 × 2048 = 24,576.
        """
        best, upper = 0, max_total
        for min_len, limit in self.rules:  # decreasing thresholds
            if min_len < upper:
                best = max(best, limit * upper)
                upper = min_len
        return best

    def to_list(self) -> list[list[int]]:
        return [[a, b] for a, b in self.rules]
