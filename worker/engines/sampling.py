"""Per-row token selection shared by the torch engines.

Sampling is reproducible across slicing: the random stream for a row's ``g``-th
generated token (counted over the whole request, not the slice) comes from a
generator seeded with ``mix_seed(seed, g)``. A request served in slices of any
size, or in one pass, therefore draws the same numbers for the same positions.

:func:`select` picks the next token of every unfinished row of a batch from the
last position's logits, in the order vLLM applies them: repetition, frequency and
presence penalties (over the row's whole context, resp. all of its generated
tokens, across slices: the batch row carries both), then greedy argmax or
temperature, top-k, top-p and min-p and a draw. Log-probabilities, when a row asks
for them, are the log-softmax of the model's logits for that position, the very
row the selection starts from (vLLM's default ``raw_logprobs``).
"""

from __future__ import annotations

import secrets
from collections import Counter
from dataclasses import dataclass
from typing import Any

from sclsd.protocol import BatchRequest, Logprob, TokenLogprobs

#: Floor for reported log-probabilities: JSON has no -inf (vLLM reports -9999.0 too).
MIN_LOGPROB = -9999.0

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


def filter_logits(logits: Any, temperature: float, top_k: int, top_p: float, min_p: float = 0.0) -> Any:
    """Scale a 1-D fp32 logits row by temperature and mask it to top-k / top-p (nucleus) /
    min-p (tokens less likely than ``min_p`` times the most likely one)."""
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
    if min_p > 0.0:
        # p_i < min_p * p_max  <=>  x_i < x_max + log(min_p): no softmax needed.
        x = x.masked_fill(x < x.max() + torch.log(torch.tensor(min_p)), float("-inf"))
    return x


def sample_row(
    logits: Any, temperature: float, top_k: int, top_p: float, seed: int, position: int,
    min_p: float = 0.0,
) -> int:
    """Sample one token id from a 1-D logits row with a generator seeded per position."""
    import torch

    x = filter_logits(logits, temperature, top_k, top_p, min_p)
    gen = torch.Generator(device=x.device)
    gen.manual_seed(mix_seed(seed, position))
    probs = torch.softmax(x, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen).item())


class RowSampler:
    """One batch row's selection state during a slice: what its penalties count.

    ``counts`` holds the row's generated tokens so far (earlier slices: the last
    ``generated`` ids of its context; this slice: each :meth:`push`), ``seen`` every
    token of its context and output (for the repetition penalty).
    """

    __slots__ = ("req", "seed", "n", "counts", "seen", "penalized")

    def __init__(self, req: BatchRequest, seed: int) -> None:
        self.req = req
        self.seed = seed
        self.n = 0
        """Tokens generated in this slice."""
        self.penalized = (req.presence_penalty != 0.0 or req.frequency_penalty != 0.0
                          or req.repetition_penalty != 1.0)
        ids = req.token_ids
        self.counts: Counter[int] = Counter(ids[len(ids) - req.generated:] if req.generated else ())
        self.seen: set[int] = set(ids) if req.repetition_penalty != 1.0 else set()

    @property
    def position(self) -> int:
        """Index of the next token over the whole request (the sampling stream's position)."""
        return self.req.generated + self.n

    def push(self, token: int) -> None:
        self.n += 1
        if self.penalized:
            self.counts[token] += 1
            if self.req.repetition_penalty != 1.0:
                self.seen.add(token)

    def penalize(self, x: Any) -> Any:
        """The row's logits with its penalties applied (a new fp32 tensor)."""
        import torch

        req = self.req
        x = x.float().clone()
        if req.repetition_penalty != 1.0 and self.seen:
            idx = torch.tensor(sorted(self.seen), dtype=torch.long, device=x.device)
            v = x[idx]
            x[idx] = torch.where(v > 0, v / req.repetition_penalty, v * req.repetition_penalty)
        if (req.frequency_penalty or req.presence_penalty) and self.counts:
            idx = torch.tensor(list(self.counts), dtype=torch.long, device=x.device)
            cnt = torch.tensor(list(self.counts.values()), dtype=x.dtype, device=x.device)
            x[idx] -= req.frequency_penalty * cnt + req.presence_penalty
        return x


@dataclass(frozen=True)
class Pick:
    """A row's next token and, when it asked, its log-probabilities."""

    token: int
    logprobs: TokenLogprobs | None = None


def _logprobs(raw: Any, token: int, k: int) -> TokenLogprobs:
    """Chosen-token and top-``k`` log-probabilities of one position's logits."""
    import torch

    lp = torch.log_softmax(raw.float(), dim=-1)
    top: list[Logprob] = []
    if k:
        vals, ids = torch.topk(lp, k)
        top = [Logprob(int(i), max(MIN_LOGPROB, float(v))) for v, i in zip(vals.tolist(), ids.tolist(),
                                                                          strict=True)]
    return TokenLogprobs(Logprob(token, max(MIN_LOGPROB, float(lp[token]))), top)


def select(logits: Any, rows: list[RowSampler | None]) -> list[Pick | None]:
    """The next token of every row (None for rows given as None: finished) from a
    ``[rows, vocab]`` logits tensor; the caller :meth:`RowSampler.push` es each pick."""
    greedy: list[int] | None = None
    picks: list[Pick | None] = []
    for i, s in enumerate(rows):
        if s is None:
            picks.append(None)
            continue
        req = s.req
        raw = logits[i]
        x = s.penalize(raw) if s.penalized else raw
        if req.temperature <= 0.0:
            if x is raw:
                if greedy is None:
                    # One argmax over the batch (a single device sync) serves the plain greedy rows.
                    greedy = logits.argmax(dim=-1).tolist()
                token = int(greedy[i])
            else:
                token = int(x.argmax().item())
        else:
            token = sample_row(x, req.temperature, req.top_k, req.top_p, s.seed, s.position, req.min_p)
        lps = _logprobs(raw, token, req.top_logprobs) if req.logprobs or req.top_logprobs else None
        picks.append(Pick(token, lps))
    return picks


def synthetic_logprobs(token: int, k: int, h: int, lo: int, hi: int) -> TokenLogprobs:
    """Deterministic stand-in log-probabilities for engines without a model (``fake``): the
    chosen token is the likeliest, then ``k - 1`` others of ``[lo, hi)``, each less likely."""
    first = -((h >> 11) % 1000) / 1000.0
    top = [Logprob(token, first)]
    span = hi - lo
    top += [Logprob(lo + (token - lo + j) % span, first - j) for j in range(1, min(k, span))]
    return TokenLogprobs(Logprob(token, first), top[:k])
