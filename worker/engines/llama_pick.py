"""The ``llama`` engine's token selection: sclsd's own, on the logits llama.cpp returns.

Every row of a step that asks for nothing but greedy decoding takes the argmax of its
logits (numpy, on the library's buffer). Any other row, sampled, seeded, penalized,
constrained (``logit_bias``, ``min_tokens``, a grammar) or with log-probabilities, is picked
by :class:`~worker.engines.sampling.BatchSampler`, the static engines' selection, over the
step's such rows at once: each row enters it as a one-token slice at its position in the
request (``generated`` counting the tokens it generated in earlier slices and in this
row), so its draw uses the uniform number of ``(seed, g)``, its ``min_tokens`` counts from
the request's start, and its penalties count what the request generated, exactly as
``hf`` computes them (:mod:`worker.engines.sampling`). A seeded request therefore draws
what ``hf`` draws from the same logits, in any slices, beside any rows.

A row with a grammar keeps one llguidance matcher for its whole row (built with the tokens
of earlier slices replayed: :func:`~worker.engines.grammar.row_matcher`), masks each pick
with it (:class:`~worker.engines.constraints.DenseConstraints`) and feeds it the token
picked.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from sclsd.protocol import BatchRequest, TokenLogprobs
from worker.engines.grammar import row_matcher
from worker.engines.sampling import penalized, random_seed

__all__ = ["RowPick", "one_torch_thread", "pick"]

log = logging.getLogger(__name__)


@dataclass(eq=False)
class RowPick:
    """How one row's tokens are picked: its request, its seed, its grammar's matcher."""

    req: BatchRequest
    seed: int
    matcher: Any = None

    @classmethod
    def build(cls, r: BatchRequest, grammar_tokenizer: Callable[[], Any]) -> RowPick:
        """Row ``r``'s picks; a row with a grammar builds its matcher now
        (:class:`~worker.engines.grammar.GrammarError` when it cannot be built)."""
        # Unseeded sampling draws from a fresh seed per row: reproducible by nobody, as on hf.
        seed = r.seed if r.seed is not None else random_seed()
        matcher = row_matcher(r, grammar_tokenizer()) if r.grammar else None
        return cls(r, seed, matcher)

    def plain(self, g: int) -> bool:
        """Whether the request's token ``g`` is the argmax of the model's logits: greedy,
        no rule that can change it, no log-probabilities."""
        r = self.req
        return (r.temperature <= 0.0 and not r.logit_bias and self.matcher is None and r.min_tokens <= g
                and not penalized(r) and not (r.logprobs or r.top_logprobs))


def one_torch_thread() -> None:
    """torch's operations on one thread. Its default, a thread per core, keeps OpenMP threads
    spinning after every operation, on the cores llama.cpp's own thread decodes on: the
    sampled rows' picks then slowed a one-row step from 10 to 28 ms on the 2-core machine."""
    import torch

    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


class _Matchers:
    """The grammar rows of a step's sampler (what :class:`~worker.engines.sampling.BatchSampler`
    reads of :class:`~worker.engines.grammar.BatchGrammar`)."""

    def __init__(self, matchers: dict[int, Any]) -> None:
        self.matchers = matchers


def pick(rows: Sequence[tuple[RowPick, list[int], int]], logits: np.ndarray, vocab: int,
         eos: Sequence[int]) -> tuple[list[int], list[TokenLogprobs | None]]:
    """The next token of each row, and its log-probabilities (None where not asked).

    ``rows[i]``: (the row's picks, its context so far as token ids, the tokens its request
    generated before this pick, in earlier slices and this row); ``logits[i]``: its
    ``[vocab]`` logits. Grammar rows' matchers are fed the tokens picked."""
    tokens: list[int] = [0] * len(rows)
    lps: list[TokenLogprobs | None] = [None] * len(rows)
    hard: list[int] = []
    for i, (p, _, g) in enumerate(rows):
        if p.plain(g):
            tokens[i] = int(logits[i, :vocab].argmax())
        else:
            hard.append(i)
    if hard:
        # Every row sampled (the common case of a client's default temperature): no copy.
        _sample([rows[i] for i in hard], logits if len(hard) == len(rows) else logits[hard], vocab, eos, hard,
                tokens, lps)
    return tokens, lps


def _sample(rows: Sequence[tuple[RowPick, list[int], int]], logits: np.ndarray, vocab: int,
            eos: Sequence[int], where: list[int], tokens: list[int], lps: list[TokenLogprobs | None]) -> None:
    import torch

    from worker.engines.sampling import BatchSampler

    one_torch_thread()
    views = [msgspec.structs.replace(p.req, token_ids=ctx, generated=g) for p, ctx, g in rows]
    matchers = {j: p.matcher for j, (p, _, _) in enumerate(rows) if p.matcher is not None}
    sampler = BatchSampler(views, [p.seed for p, _, _ in rows], vocab, "cpu", steps=1, eos=eos,
                           grammar=_Matchers(matchers) if matchers else None)
    got, got_lps = sampler.sample(torch.from_numpy(np.ascontiguousarray(logits[:, :vocab]))).start().result(sampler)
    for j, (tok, lp) in enumerate(zip(got, got_lps, strict=True)):
        tokens[where[j]] = int(tok)
        lps[where[j]] = lp
        m = matchers.get(j)
        if m is not None and not m.is_stopped() and not m.consume_token(int(tok)):
            log.warning("token %d refused by its grammar (%s)", tok, m.get_error())
