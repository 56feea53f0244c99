"""Token selection for a whole batch at once, on the logits' device.

:class:`BatchSampler` picks the next token of every row of a batch from the last
position's logits with a fixed number of tensor operations per step, whatever the
batch size: no Python loop over rows, no device sync per row. The host reads the
step's tokens (and log-probabilities, for rows that asked) in one copy
(:meth:`Draw.start`). Transformations follow vLLM's order: repetition, frequency
and presence penalties (over the row's whole context, resp. every token it
generated so far, across slices: the batch row carries both), the row's constraints
(``logit_bias``, the stop tokens held back while a row has fewer than ``min_tokens``
tokens, its grammar: :class:`worker.engines.constraints.DenseConstraints`), then greedy
argmax, or temperature, top-k, top-p, min-p and a draw.

**Reproducible draws.** A sampled row draws its ``g``-th token (counted over the whole
request, not the slice) by inverse transform with the uniform number
``u = mix_seed(seed, g) / 2^63``: the first token whose cumulative probability, in
vocabulary order, exceeds ``u`` times the total. ``u`` depends only on the seed and
the position, so a request served in slices of any size, or in one pass, beside any
neighbours, draws the same numbers for the same positions. The uniforms of a whole
slice are computed once per batch (:meth:`BatchSampler.uniforms`).

Log-probabilities, when a row asks for them, are the log-softmax of the model's logits
for that position, the very row the selection starts from (vLLM's default
``raw_logprobs``).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sclsd.protocol import BatchRequest, Logprob, TokenLogprobs
from worker.engines.constraints import DenseConstraints, RowConstraints

#: Floor for reported log-probabilities: JSON has no -inf (vLLM reports -9999.0 too).
MIN_LOGPROB = -9999.0

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, position: int) -> int:
    """A 63-bit seed for token ``position`` of a request seeded with ``seed`` (splitmix64)."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def penalized(r: BatchRequest) -> bool:
    """Whether row ``r`` has a presence, frequency or repetition penalty."""
    return bool(r.frequency_penalty or r.presence_penalty or r.repetition_penalty != 1.0)


def random_seed() -> int:
    """A fresh seed for requests that did not ask for one."""
    return secrets.randbits(63)


def uniform(seed: int, position: int) -> float:
    """The uniform number in [0, 1) that draws token ``position`` of a request seeded ``seed``."""
    return (mix_seed(seed, position) >> 10) / float(1 << 53)


#: Tokens a top-k or top-p cut on the CPU looks at first: the most likely, found without sorting
#: the vocabulary (:func:`_cut_candidates`); a row whose cut they do not settle is sorted in full.
CUT_CANDIDATES = 256


def filter_logits(x: Any, temperature: Any, top_k: Any, top_p: Any, min_p: Any,
                  cuts: tuple[bool, bool, bool] = (True, True, True)) -> Any:
    """Scale ``[rows, vocab]`` fp32 logits by each row's temperature and mask them to its
    top-k, top-p (nucleus) and min-p (tokens less likely than ``min_p`` times the most
    likely one). Per-row parameters are ``[rows]`` tensors; top-k 0, top-p 1 and min-p 0
    are off. Ties with the k-th value are kept; top-p always keeps the first token.
    ``cuts`` says, from the host, whether any row uses top-k, top-p, min-p (False: that
    step is skipped without asking the device)."""
    import torch

    x = x / temperature.unsqueeze(1)
    any_k, any_p, any_min = cuts
    if any_k or any_p:
        cut = _cut_candidates if x.device.type == "cpu" else _cut_sorted
        x = cut(x, top_k, top_p, any_k, any_p)
    if any_min:
        floor = _min_p_floor(x.max(dim=-1, keepdim=True).values, min_p)
        x = torch.where((min_p > 0.0).unsqueeze(1) & (x < floor), torch.full_like(x, float("-inf")), x)
    return x


def _min_p_floor(top: Any, min_p: Any) -> Any:
    """The min-p floor of rows whose likeliest logit is ``top`` (``[rows, 1]``):
    p_i < min_p * p_max  <=>  x_i < x_max + log(min_p), so no softmax is needed."""
    import torch

    return top + torch.log(min_p.clamp(min=1e-30)).unsqueeze(1)


def _first_candidates(top_k: Any, any_k: bool, vocab: int) -> int:
    """How many of each row's most likely tokens a CPU cut tries first: :data:`CUT_CANDIDATES`,
    or the largest top-k below the vocabulary."""
    ks = [int(k) for k in top_k.tolist()] if any_k else []
    return max([CUT_CANDIDATES, *(k for k in ks if 0 < k < vocab)])


def _cut_sorted(x: Any, top_k: Any, top_p: Any, any_k: bool, any_p: bool) -> Any:
    """Top-k and top-p over the whole vocabulary sorted (on a device: no host sync)."""
    import torch

    vocab = x.shape[-1]
    sorted_x, order = torch.sort(x, dim=-1, descending=True)
    if any_k:
        cut_k = (top_k > 0) & (top_k < vocab)
        k = torch.where(cut_k, top_k, torch.full_like(top_k, vocab)).clamp(1, vocab)
        kth = sorted_x.gather(1, (k - 1).unsqueeze(1))
        sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    if any_p:
        probs = torch.softmax(sorted_x, dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p; top-p 1 cuts
        # nothing (in fp32 the sum reaches 1.0 before the least likely tokens).
        drop = ((torch.cumsum(probs, dim=-1) - probs) >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
        drop[:, 0] = False
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(1, order, sorted_x)


def _cut_candidates(x: Any, top_k: Any, top_p: Any, any_k: bool, any_p: bool) -> Any:
    """The cut of :func:`_cut_sorted` from each row's most likely tokens, found without sorting
    the vocabulary: a full sort of a 49,152-token vocabulary costs about 3.7 ms a row on one
    core, a large part of a small model's decode step, while the nucleus at top-p 0.95 is mostly
    a few hundred or thousand tokens. A row's cut is a floor on its logits: its k-th value, and
    the least likely token its nucleus keeps, settled once the candidates' share of the whole
    distribution reaches top-p. The candidates start at :data:`CUT_CANDIDATES` (or the largest
    top-k) and grow eightfold for the rows not settled yet, up to a quarter of the vocabulary;
    rows still not settled are sorted in full. It differs from the sorted cut only in exact ties
    at the nucleus' edge (all tied tokens are kept, not those the sort happened to put first)."""
    import torch

    rows, vocab = x.shape
    m = _first_candidates(top_k, any_k, vocab)
    out: Any = None
    todo = torch.arange(rows)
    while todo.numel() and 4 * m <= vocab:
        first = out is None  # all rows: no copy of the logits to index them
        cut, done = _cut_top(x if first else x[todo], top_k[todo], top_p[todo], any_k, any_p, m)
        if first:
            out = cut  # a new tensor; the rows it did not settle are cut again below
        else:
            out[todo[done]] = cut[done]
        todo = todo[~done]
        m *= 8
    if out is None:
        out = x.clone()
    if todo.numel():
        out[todo] = _cut_sorted(x[todo], top_k[todo], top_p[todo], any_k, any_p)
    return out


def _top_floor(x: Any, top_k: Any, top_p: Any, any_k: bool, any_p: bool, m: int) -> tuple[Any, Any, Any, Any]:
    """Each row's ``m`` most likely tokens (values and ids, most likely first), the floor its
    top-k and top-p cuts put on its logits (``[rows, 1]``, -inf where nothing is cut), and
    whether those candidates settled it (:func:`_cut_candidates`)."""
    import torch

    rows, vocab = x.shape
    vals, ids = torch.topk(x, m, dim=-1)  # descending
    floor = torch.full((rows, 1), float("-inf"), dtype=x.dtype, device=x.device)
    if any_k:
        cut_k = (top_k > 0) & (top_k < vocab)
        kth = vals.gather(1, (top_k.clamp(1, m) - 1).unsqueeze(1))
        floor = torch.where(cut_k.unsqueeze(1), kth, floor)
    settled = torch.ones(rows, dtype=torch.bool)
    if any_p:
        # Without a top-k every token counts towards the whole distribution's mass.
        kept_x = x.masked_fill(x < floor, float("-inf")) if any_k else x
        cand = vals.masked_fill(vals < floor, float("-inf"))
        probs = torch.exp(cand - torch.logsumexp(kept_x, dim=-1, keepdim=True))
        cum = torch.cumsum(probs, dim=-1)
        p = top_p.unsqueeze(1)
        drop = (cum - probs) >= p
        drop[:, 0] = False
        last = (~drop).sum(dim=-1, keepdim=True) - 1  # the least likely candidate kept
        floor = torch.maximum(floor, torch.where(p < 1.0, cand.gather(1, last), floor))
        # Settled when the candidates' mass reaches top-p (every other token's share of the
        # ones above it does too); top-p 1 cuts nothing.
        settled = ((cum[:, -1:] >= p) | (p >= 1.0)).squeeze(1)
    return vals, ids, floor, settled


def _cut_top(x: Any, top_k: Any, top_p: Any, any_k: bool, any_p: bool, m: int) -> tuple[Any, Any]:
    """:func:`_cut_candidates`' cut from the ``m`` most likely tokens (``m`` at least every top-k
    below the vocabulary): the rows cut, and which of them it settled."""
    _, _, floor, settled = _top_floor(x, top_k, top_p, any_k, any_p, m)
    return x.masked_fill(x < floor, float("-inf")), settled


def inverse_transform(x: Any, u: Any, temperature: Any, top_k: Any, top_p: Any, min_p: Any,
                      cuts: tuple[bool, bool, bool] = (True, True, True)) -> Any:
    """The token each row of ``[rows, vocab]`` fp32 logits ``x`` draws with the uniform number
    ``u[row]`` (``[rows]`` float64): the first token, in vocabulary order, whose cumulative
    probability after :func:`filter_logits` exceeds ``u`` times the total (module docstring).
    Every engine that seeds a request draws through this, so they agree token for token.

    On the CPU a row whose cuts keep only tokens among its most likely few hundred (or few
    thousand) is drawn from those alone (:func:`_draw_from_candidates`); the others, and every
    row on a device, over the whole vocabulary."""
    if x.device.type == "cpu" and any(cuts):
        return _draw_from_candidates(x, u, temperature, top_k, top_p, min_p, cuts)
    return _draw_full(x, u, temperature, top_k, top_p, min_p, cuts)


def _draw_full(x: Any, u: Any, temperature: Any, top_k: Any, top_p: Any, min_p: Any,
               cuts: tuple[bool, bool, bool]) -> Any:
    """:func:`inverse_transform` over the whole vocabulary."""
    import torch

    y = filter_logits(x, temperature, top_k, top_p, min_p, cuts)
    probs = torch.softmax(y, dim=-1, dtype=torch.float64)
    cdf = torch.cumsum(probs, dim=-1)
    target = (u * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp(max=x.shape[-1] - 1)


def _draw_from_candidates(x: Any, u: Any, temperature: Any, top_k: Any, top_p: Any, min_p: Any,
                          cuts: tuple[bool, bool, bool]) -> Any:
    """:func:`inverse_transform` on the CPU from each row's most likely tokens. Every cut is a
    floor on a row's logits (its k-th value, its nucleus' least likely token, ``min_p`` times its
    most likely token's probability: :func:`filter_logits`), so when a row's floor lies above
    its least likely candidate the kept tokens are candidates, and the draw runs over them in
    vocabulary order, with their cumulative sum, as over the whole vocabulary where every other
    token's probability is 0. After a decode step of a small model the whole-vocabulary passes
    (the masked copy, a float64 softmax and its cumulative sum: four arrays of 49,152 numbers a
    row for SmolLM2) ran on caches the model had just filled and cost about as much as the cut
    itself. Rows whose floor the candidates do not settle, or that keep tokens tied with their
    least likely candidate, are drawn over the whole vocabulary."""
    import torch

    any_k, any_p, any_min = cuts
    rows, vocab = x.shape
    # x / 1 is x: a pass over the whole vocabulary saved for the rows at temperature 1.
    y = x if bool((temperature == 1.0).all()) else x / temperature.unsqueeze(1)
    m = _first_candidates(top_k, any_k, vocab)
    out = torch.empty(rows, dtype=torch.long)
    todo = torch.arange(rows)
    while todo.numel() and 4 * m <= vocab:
        sub = y if todo.numel() == rows else y[todo]  # all rows: no copy
        vals, ids, floor, settled = _top_floor(sub, top_k[todo], top_p[todo], any_k, any_p, m)
        if any_min:
            mp = min_p[todo]
            floor = torch.where((mp > 0.0).unsqueeze(1), torch.maximum(floor, _min_p_floor(vals[:, :1], mp)), floor)
        least = vals[:, -1:]
        # Every kept token is a candidate: the floor above the least likely candidate, or
        # every token below the candidates already masked out (-inf: a grammar, a bias).
        done = settled & ((floor > least) | (least == float("-inf"))).squeeze(1) & (vals[:, 0] > float("-inf"))
        if bool(done.any()):
            w = torch.exp(vals.double() - vals[:, :1].double()).masked_fill(vals < floor, 0.0)
            order = ids.argsort(dim=-1)  # vocabulary order
            cdf = torch.cumsum(w.gather(1, order), dim=-1)
            target = (u[todo] * cdf[:, -1]).unsqueeze(1)
            j = torch.searchsorted(cdf, target, right=True).clamp(max=m - 1)
            out[todo[done]] = ids.gather(1, order.gather(1, j)).squeeze(1)[done]
        todo = todo[~done]
        m *= 8
    if todo.numel():
        out[todo] = _draw_full(x[todo], u[todo], temperature[todo], top_k[todo], top_p[todo], min_p[todo], cuts)
    return out


def token_logprobs(lp: Any, tokens: Any, k: int) -> tuple[Any, Any, Any]:
    """From ``[rows, vocab]`` log-probabilities: each row's chosen token's (``[rows]``) and its
    ``k`` most likely tokens' values and ids (``[rows, k]``, most likely first)."""
    chosen = lp.gather(1, tokens.unsqueeze(1)).squeeze(1)
    if k > 0:
        values, ids = lp.topk(k, dim=-1)
        return chosen, values, ids
    return chosen, lp.new_zeros((lp.shape[0], 0)), lp.new_zeros((lp.shape[0], 0))


def pack_logprobs(tokens: Any, chosen: Any, top_values: Any, top_ids: Any) -> Any:
    """One float64 ``[rows, 2 + 2k]`` tensor of a step's picks, for one device-to-host copy:
    token, its log-probability, the ``k`` top values, the ``k`` top ids."""
    import torch

    return torch.cat([tokens.to(torch.float64).unsqueeze(1), chosen.double().unsqueeze(1),
                      top_values.double(), top_ids.double()], dim=1)


def unpack_logprobs(row: Sequence[float], k: int, want: int) -> TokenLogprobs:
    """A row of :func:`pack_logprobs` (as a host list) as the protocol's entry, with the
    ``want`` (at most ``k``) most likely tokens."""
    top = [Logprob(int(row[2 + k + j]), max(MIN_LOGPROB, row[2 + j])) for j in range(want)]
    return TokenLogprobs(Logprob(int(row[0]), max(MIN_LOGPROB, row[1])), top)


def prompt_logprobs(logits: Any, targets: Any, k: int) -> list[TokenLogprobs]:
    """The protocol's entries for prompt positions: ``logits`` ``[n, vocab]`` at n positions,
    ``targets`` ``[n]`` the prompt token that follows each, ``k`` most likely tokens at each.
    The model's own log-softmax (no temperature, penalties or bias), computed as a generated
    token's is (:func:`token_logprobs`), so a chosen token that is the likeliest has exactly
    its top entry's value."""
    import torch

    if logits.shape[0] == 0:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen, values, ids = token_logprobs(lp, targets.to(lp.device).long(), k)
    rows = pack_logprobs(targets.to(lp.device).long(), chosen, values, ids).tolist()
    return [unpack_logprobs(row, k, k) for row in rows]


@dataclass
class Draw:
    """One step's picks, still on the device: ``tokens`` ``[rows]``; for rows that asked for
    log-probabilities, the chosen token's (``chosen``, ``[rows]``) and the ``k`` most likely
    (``top_values``/``top_ids``, ``[rows, k]``)."""

    tokens: Any
    chosen: Any = None
    top_values: Any = None
    top_ids: Any = None

    def start(self) -> PendingDraw:
        """Begin the one device-to-host copy of this step's picks; on CUDA it runs while the
        device goes on with what is queued after it (the next step)."""
        import torch

        if self.chosen is None:
            packed = self.tokens
        else:
            packed = pack_logprobs(self.tokens, self.chosen, self.top_values, self.top_ids)
        if packed.device.type != "cuda":
            return PendingDraw(self, packed, None)
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return PendingDraw(self, host, event)


@dataclass
class PendingDraw:
    """A :class:`Draw` on its way to the host (:meth:`Draw.start`)."""

    draw: Draw
    host: Any
    event: Any

    def result(self, sampler: BatchSampler) -> tuple[list[int], list[TokenLogprobs | None]]:
        """The step's tokens and per-row log-probabilities (None where not asked)."""
        if self.event is not None:
            self.event.synchronize()
        if self.draw.chosen is None:
            return self.host.tolist(), [None] * sampler.rows
        k = self.draw.top_values.shape[1]
        out: list[TokenLogprobs | None] = []
        tokens: list[int] = []
        for i, row in enumerate(self.host.tolist()):
            tokens.append(int(row[0]))
            want = sampler.top_logprobs[i]
            out.append(None if want is None else unpack_logprobs(row, k, want))
        return tokens, out


class BatchSampler:
    """Selection state of one batch's rows during a slice (see the module docstring).

    ``reqs[i]`` is row ``i``; rows beyond ``len(reqs)`` (a padded batch bucket) are never
    read. ``seeds[i]`` seeds row ``i``'s draws. Penalty state lives on the device:
    ``counts`` (``[rows, vocab]``, every token the row generated so far, for the
    frequency and presence penalties) and ``seen`` (every token of its context and
    output, for the repetition penalty), each only when some row uses it.
    """

    def __init__(self, reqs: Sequence[BatchRequest], seeds: Sequence[int], vocab: int, device: Any,
                 steps: int = 1, eos: Sequence[int] = (), grammar: Any = None) -> None:
        import torch

        self.reqs = list(reqs)
        self.rows = n = len(self.reqs)
        self.seeds = list(seeds)
        self.vocab = vocab
        self.device = device
        self.step = 0
        """Tokens drawn in this slice so far."""
        f32 = dict(dtype=torch.float32, device=device)
        self.greedy_rows = [r.temperature <= 0.0 for r in self.reqs]
        self.all_greedy = all(self.greedy_rows)
        self.greedy = torch.tensor(self.greedy_rows, dtype=torch.bool, device=device)
        self.temperature = torch.tensor([r.temperature if r.temperature > 0 else 1.0 for r in self.reqs], **f32)
        self.top_k = torch.tensor([r.top_k for r in self.reqs], dtype=torch.long, device=device)
        self.top_p = torch.tensor([r.top_p for r in self.reqs], **f32)
        self.min_p = torch.tensor([r.min_p for r in self.reqs], **f32)
        hot = [r for r in self.reqs if r.temperature > 0]
        self.cuts = (any(0 < r.top_k < vocab for r in hot), any(r.top_p < 1.0 for r in hot),
                     any(r.min_p > 0.0 for r in hot))
        self.top_logprobs: list[int | None] = [r.top_logprobs if (r.logprobs or r.top_logprobs) else None
                                               for r in self.reqs]
        self.k = max((k for k in self.top_logprobs if k is not None), default=-1)
        # Penalties: only the tensors some row needs.
        self.freq = self.pres = self.rep = None
        self.counts: Any = None
        self.seen: Any = None
        if any(r.frequency_penalty or r.presence_penalty for r in self.reqs):
            self.freq = torch.tensor([r.frequency_penalty for r in self.reqs], **f32).unsqueeze(1)
            self.pres = torch.tensor([r.presence_penalty for r in self.reqs], **f32).unsqueeze(1)
            self.counts = torch.zeros((n, vocab), **f32)
            for i, r in enumerate(self.reqs):
                tail = r.token_ids[len(r.token_ids) - r.generated:] if r.generated else []
                if tail:
                    idx = torch.tensor(tail, dtype=torch.long, device=device)
                    self.counts[i].index_add_(0, idx, torch.ones(len(tail), **f32))
        if any(r.repetition_penalty != 1.0 for r in self.reqs):
            self.rep = torch.tensor([r.repetition_penalty for r in self.reqs], **f32).unsqueeze(1)
            self.seen = torch.zeros((n, vocab), dtype=torch.bool, device=device)
            for i, r in enumerate(self.reqs):
                if r.repetition_penalty != 1.0 and r.token_ids:
                    self.seen[i, torch.tensor(r.token_ids, dtype=torch.long, device=device)] = True
        # logit_bias, min_tokens, grammars: the rules of worker.engines.constraints, dense.
        self.grammar = grammar
        """The rows' grammars (:class:`worker.engines.grammar.BatchGrammar`), or None."""
        self.rules = DenseConstraints([RowConstraints.for_row(r, eos, vocab) for r in self.reqs], vocab, device,
                                      grammar.matchers if grammar is not None else None)
        self.penalized = self.counts is not None or self.seen is not None
        self.constrained = (self.rules.bias is not None or self.rules.stop_mask is not None
                            or self.rules.grammar_rows is not None)
        self._u: Any = None if self.all_greedy else self.uniforms(0, max(1, steps))

    def uniforms(self, first: int, steps: int) -> Any:
        """``[steps, rows]`` uniform numbers for the draws of this slice's tokens ``first`` to
        ``first + steps - 1`` (one host-to-device copy for all of them)."""
        import torch

        table = [[uniform(s, r.generated + j) for s, r in zip(self.seeds, self.reqs, strict=True)]
                 for j in range(first, first + steps)]  # fmt: skip
        return torch.tensor(table, dtype=torch.float64, device=self.device)

    def penalize(self, x: Any) -> Any:
        """``[rows, vocab]`` fp32 logits with each row's penalties applied (a new tensor)."""
        import torch

        if self.seen is not None:
            scaled = torch.where(x > 0, x / self.rep, x * self.rep)
            x = torch.where(self.seen, scaled, x)
        if self.counts is not None:
            x = x - self.freq * self.counts - self.pres * (self.counts > 0).to(x.dtype)
        return x

    def sample(self, logits: Any) -> Draw:
        """The next token of every row from ``[rows(+), vocab]`` logits (extra rows ignored).

        Also advances the rows' penalty state and draw positions by this token; finished
        rows are sampled like the others (their picks are simply not used).
        """
        import torch

        raw = logits[: self.rows]
        x = raw.float()
        if self.penalized:
            x = self.penalize(x)
        if self.constrained:
            x = self.rules.apply(x, self.step)  # a new tensor: raw stays the logprobs' source
        # No greedy row (a batch of sampled rows): no argmax pass over the vocabulary.
        tokens = x.argmax(dim=-1) if self.all_greedy or any(self.greedy_rows) else None
        if not self.all_greedy:
            if self.step >= self._u.shape[0]:  # more steps than announced: extend the table
                self._u = torch.cat([self._u, self.uniforms(self._u.shape[0], self._u.shape[0])])
            drawn = inverse_transform(x, self._u[self.step], self.temperature, self.top_k, self.top_p,
                                      self.min_p, self.cuts)
            tokens = drawn if tokens is None else torch.where(self.greedy, tokens, drawn)
        draw = Draw(tokens)
        if self.k >= 0:
            draw.chosen, draw.top_values, draw.top_ids = token_logprobs(
                torch.log_softmax(raw.float(), dim=-1), tokens, self.k)
        self._advance(tokens)
        return draw

    def _advance(self, tokens: Any) -> None:
        import torch

        self.step += 1
        if self.counts is not None:
            self.counts.scatter_add_(1, tokens.unsqueeze(1), torch.ones_like(tokens, dtype=torch.float32).unsqueeze(1))
        if self.seen is not None:
            self.seen.scatter_(1, tokens.unsqueeze(1), True)


def synthetic_logprobs(token: int, k: int, h: int, lo: int, hi: int) -> TokenLogprobs:
    """Deterministic stand-in log-probabilities for engines without a model (``fake``): the
    chosen token is the likeliest, then ``k - 1`` others of ``[lo, hi)``, each less likely."""
    first = -((h >> 11) % 1000) / 1000.0
    top = [Logprob(token, first)]
    span = hi - lo
    top += [Logprob(lo + (token - lo + j) % span, first - j) for j in range(1, min(k, span))]
    return TokenLogprobs(Logprob(token, first), top[:k])
