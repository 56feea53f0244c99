"""Per-row token selection shared by the torch engines.

Sampling is reproducible across slicing: the random stream for a row's ``g``-th
generated token (counted over the whole request, not the slice) comes from a
generator seeded with ``mix_seed(seed, g)``. A request served in slices of any
size, or in one pass, therefore draws the same numbers for the same positions.
"""

from __future__ import annotations

import secrets
from typing import Any

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, position: int) -> int:
    """A 63-bit seed for token ``position`` of a request seeded with ``seed`` (splitmix64)."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def random_seed() -> int:
    """A fresh seed for requests that did not ask for one."""
    return secrets.randbits(63)


def filter_logits(logits: Any, temperature: float, top_k: int, top_p: float) -> Any:
    """Scale a 1-D fp32 logits row by temperature and mask it to top-k / top-p (nucleus)."""
    import torch

    x = logits.float() / temperature
    vocab = x.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(x, top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p; the
        # first token is always kept.
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop[0] = False
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.empty_like(x).scatter_(0, order, sorted_x)
    return x


def sample_row(
    logits: Any, temperature: float, top_k: int, top_p: float, seed: int, position: int
) -> int:
    """Sample one token id from a 1-D logits row with a generator seeded per position."""
    import torch

    x = filter_logits(logits, temperature, top_k, top_p)
    gen = torch.Generator(device=x.device)
    gen.manual_seed(mix_seed(seed, position))
    probs = torch.softmax(x, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen).item())
