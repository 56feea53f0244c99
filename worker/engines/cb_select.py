"""Per-request seeded draws and log-probabilities inside transformers' continuous batching.

transformers 5.23 samples every request of a step with one ``torch.multinomial`` (seeded
per manager, not per request) and reports, at most, the chosen token's probability after
its warpers, no alternatives. For a row that asks for a ``seed``, for ``logprobs``, or for
``min_p`` (which transformers has no per-request warper for), the engine picks the token
itself, exactly as the static engines do (:mod:`worker.engines.sampling`); so it does
for a row with presence, frequency or repetition penalties, which transformers applies to
every request alike or not at all:

* the penalties first, over the model's logits: the frequency and presence penalties
  count the row's generated tokens (its ``generated`` tail, then this transformers
  request's), the repetition penalty its whole context and output, both kept on the
  device per request and fed the request's new tokens before each step;

* the row's logits after its rules (:mod:`worker.engines.cb_constraints`) go through
  :func:`~worker.engines.sampling.inverse_transform` with the uniform number of
  ``(seed, g)``, ``g`` the token's position over the whole request (the row's
  ``generated`` plus what this transformers request generated), or argmax when greedy;
  so a seeded request gives the tokens ``hf`` gives, in one pass or over any grants;
* the row's logits are then replaced by a one-hot row (0 at the pick, -inf elsewhere):
  transformers' temperature, top-k and top-p warpers leave it as it is, and its argmax or
  multinomial draw can only take the pick;
* rows with ``logprobs`` get the log-softmax of the model's own logits (before any rule,
  as ``hf``'s ``raw_logprobs``) at the pick, and the ``top_logprobs`` most likely tokens.
  They are computed on the device in the step and read to the host in one copy once the
  step's tokens are (the manager's output router is wrapped: the results are stored with
  the request before transformers hands its new token to the engine thread).

Rows that ask for none of these are left to transformers, and a step without such rows
costs nothing here. Under CUDA graphs a captured step cannot run this (what the processor
does is frozen at capture), so a step with such a row runs eagerly; the steps without one
still replay their graphs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from sclsd.protocol import BatchRequest, TokenLogprobs
from worker.engines.sampling import (
    inverse_transform,
    pack_logprobs,
    penalized,
    random_seed,
    token_logprobs,
    uniform,
    unpack_logprobs,
)

__all__ = ["Picker", "RowPick", "pick_key", "wants_pick"]


def generated_count(state: Any) -> int:
    """Tokens transformers request ``state`` generated (a soft reset moves them into its
    prompt: ``_true_initial_tokens`` says where they start)."""
    true_initial = state._true_initial_tokens
    moved = len(state.initial_tokens) - true_initial if true_initial else 0
    return moved + len(state.generated_tokens)


def generated_since(state: Any, k: int) -> list[int]:
    """The tokens ``state`` generated after its first ``k``."""
    true_initial = state._true_initial_tokens
    moved = len(state.initial_tokens) - true_initial if true_initial else 0
    if k < moved:
        return list(state.initial_tokens[true_initial + k:]) + list(state.generated_tokens)
    return list(state.generated_tokens[k - moved:])


def wants_pick(r: BatchRequest) -> bool:
    """Whether the engine picks row ``r``'s tokens itself (see the module docstring)."""
    hot = r.temperature > 0
    return bool(r.logprobs or r.top_logprobs or penalized(r)
                or (hot and (r.seed is not None or r.min_p > 0.0)))


def pick_key(r: BatchRequest) -> tuple[Any, ...]:
    """What a resumed request must share with the row resuming it for its picks to hold."""
    if not wants_pick(r):
        return ()
    return (r.seed, r.temperature, r.top_k, r.top_p, r.min_p, r.logprobs, r.top_logprobs,
            r.frequency_penalty, r.presence_penalty, r.repetition_penalty)


@dataclass(eq=False)
class RowPick:
    """How one transformers request's tokens are picked, and the log-probabilities so far."""

    seed: int
    offset: int
    """Tokens the request generated before this transformers request's own (its row's ``generated``)."""
    greedy: bool
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    top_logprobs: int | None
    """Alternatives per token (None: no log-probabilities)."""
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    """Entry ``j``: the transformers request's ``j``-th generated token's (rows with logprobs).
    Written by the generation thread before the token is delivered, read by the engine's."""
    penalties: tuple[float, float, float] | None = None
    """(frequency, presence, repetition), or None."""
    context: list[int] = field(default_factory=list)
    """The row's context, while the penalty state is not built yet."""
    counts: Any = None
    """fp32 ``[vocab]``: each token's count among those generated (penalties only)."""
    seen: Any = None
    """bool ``[vocab]``: the tokens of the context and output (repetition penalty only)."""
    fed: int = 0
    """Tokens of this transformers request's output already counted."""

    @classmethod
    def build(cls, r: BatchRequest) -> RowPick | None:
        """``r``'s picks, or None when transformers picks its tokens."""
        if not wants_pick(r):
            return None
        # An unseeded row draws from a fresh seed: reproducible by nobody, as on ``hf``.
        seed = r.seed if r.seed is not None else random_seed()
        want = r.top_logprobs if (r.logprobs or r.top_logprobs) else None
        pen = (r.frequency_penalty, r.presence_penalty, r.repetition_penalty) if penalized(r) else None
        return cls(seed, r.generated, r.temperature <= 0.0, r.temperature if r.temperature > 0 else 1.0,
                   r.top_k, r.top_p, r.min_p, want, penalties=pen,
                   context=list(r.token_ids) if pen is not None else [])

    def feed(self, state: Any, vocab: int, device: Any) -> None:
        """Bring the penalty state up to ``state``'s tokens (built on first use, as
        :class:`~worker.engines.sampling.BatchSampler` builds it for a slice)."""
        if self.penalties is None:
            return
        if self.counts is None:
            self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
            tail = self.context[len(self.context) - self.offset:] if self.offset else []
            self._count(tail)
            if self.penalties[2] != 1.0:
                self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
                ids = [t for t in self.context if 0 <= t < vocab]
                if ids:
                    self.seen[torch.tensor(ids, dtype=torch.long, device=device)] = True
            self.context = []
        new = generated_since(state, self.fed)
        self.fed += len(new)
        self._count(new)
        if self.seen is not None and new:
            self.seen[torch.tensor([t for t in new if 0 <= t < len(self.seen)], dtype=torch.long,
                                   device=self.seen.device)] = True

    def _count(self, tokens: list[int]) -> None:
        ids = [t for t in tokens if 0 <= t < len(self.counts)]
        if ids:
            idx = torch.tensor(ids, dtype=torch.long, device=self.counts.device)
            self.counts.index_add_(0, idx, torch.ones(len(ids), dtype=torch.float32, device=idx.device))

    def entries(self, start: int, stop: int) -> list[TokenLogprobs]:
        """Log-probabilities of the transformers request's tokens ``start`` to ``stop - 1``
        (empty without ``logprobs``)."""
        if self.top_logprobs is None:
            return []
        out = self.logprobs[start:stop]
        missing = [start + j for j, e in enumerate(out) if e is None]
        if len(out) < stop - start or missing:
            raise RuntimeError(f"log-probabilities of tokens {start}..{stop - 1} were not recorded")
        return out  # type: ignore[return-value]

    def record(self, index: int, entry: TokenLogprobs) -> None:
        if index >= len(self.logprobs):
            self.logprobs.extend([None] * (index + 1 - len(self.logprobs)))
        self.logprobs[index] = entry


@dataclass
class _Step:
    """One step's picks on the device (:meth:`Picker.stage`)."""

    rows: Any
    """Logits rows picked (long ``[p]``)."""
    hot: tuple[Any, ...] | None
    """Sampled rows among them: (greedy, u, temperature, top_k, top_p, min_p, cuts), or None."""
    lp_rows: Any
    """Logits rows with log-probabilities (long ``[m]``), or None."""
    lp_sel: Any
    """Their positions among ``rows`` (long ``[m]``)."""
    lp_for: list[tuple[RowPick, int]]
    """Where each of them is recorded: (pick, index of the token)."""
    k: int
    pen: tuple[Any, ...] | None = None
    """Penalized rows: (logits rows, frequency, presence, counts, repetition, seen), each
    ``[q, ...]``; ``repetition``/``seen`` None when no row has that penalty."""
    lp: Any = None
    """``[m, vocab]`` log-softmax of the model's logits, once :meth:`Picker.before` ran."""


class Picker:
    """The picks of a manager's steps (see the module docstring). :meth:`stage` and
    :meth:`collect` run on the host, :meth:`before`/:meth:`after` inside the step, all on
    transformers' generation thread."""

    def __init__(self, device: Any, vocab: int) -> None:
        self.device = torch.device(device)
        self.vocab = vocab
        self.step: _Step | None = None
        """This step's picks (None: no row picked here)."""
        self._pending: list[tuple[Any, list[tuple[RowPick, int]], int, list[int]]] = []
        """Log-probabilities computed, not read yet: (packed, where, k, wants)."""
        self._graphs: tuple[Any, ...] | None = None
        """(runner, its graph and compile settings) while steps run eagerly for the picks."""
        self.mgr: Any = None

    @property
    def active(self) -> bool:
        return self.step is not None

    def attach(self, mgr: Any) -> None:
        """Hook ``mgr``'s output router: a step's log-probabilities are read before its tokens
        are handed to the engine thread."""
        self.mgr = mgr
        router = mgr.output_router
        deliver = router.deliver_batch

        def deliver_batch(outputs: list[Any]) -> None:
            self.collect()
            deliver(outputs)

        router.deliver_batch = deliver_batch

    def stage(self, states: list[tuple[int, RowPick, Any]], captured: bool) -> None:
        """This step's picks: (logits row, pick, transformers' request state) per picked row.
        ``captured``: the manager captures steps, so a step with picks runs eagerly."""
        self.collect()  # a step whose outputs were never delivered (it failed)
        if captured:
            self._eager(bool(states))
        if not states:
            self.step = None
            return
        dev = self.device
        rows = [(i, p, generated_count(state)) for i, p, state in states]
        for _, p, state in states:
            p.feed(state, self.vocab, dev)
        picks = [p for _, p, _ in rows]
        hot = None
        if not all(p.greedy for p in picks):
            f32: dict[str, Any] = {"dtype": torch.float32, "device": dev}
            sampled = [p for p in picks if not p.greedy]
            vocab_cut = any(p.top_k > 0 for p in sampled)  # ``filter_logits`` ignores k >= vocab itself
            hot = (torch.tensor([p.greedy for p in picks], dtype=torch.bool, device=dev),
                   torch.tensor([uniform(p.seed, p.offset + j) for _, p, j in rows], dtype=torch.float64,
                                device=dev),
                   torch.tensor([p.temperature for p in picks], **f32),
                   torch.tensor([p.top_k for p in picks], dtype=torch.long, device=dev),
                   torch.tensor([p.top_p for p in picks], **f32),
                   torch.tensor([p.min_p for p in picks], **f32),
                   (vocab_cut, any(p.top_p < 1.0 for p in sampled), any(p.min_p > 0.0 for p in sampled)))
        lp = [(n, i, p, j) for n, (i, p, j) in enumerate(rows) if p.top_logprobs is not None]
        self.step = _Step(
            rows=torch.tensor([i for i, _, _ in rows], dtype=torch.long, device=dev), hot=hot,
            lp_rows=torch.tensor([i for _, i, _, _ in lp], dtype=torch.long, device=dev) if lp else None,
            lp_sel=torch.tensor([n for n, _, _, _ in lp], dtype=torch.long, device=dev) if lp else None,
            lp_for=[(p, j) for _, _, p, j in lp],
            k=max((p.top_logprobs or 0 for _, _, p, _ in lp), default=0), pen=self._penalties(rows))

    def _penalties(self, rows: list[tuple[int, RowPick, int]]) -> tuple[Any, ...] | None:
        pen = [(i, p) for i, p, _ in rows if p.penalties is not None]
        if not pen:
            return None
        dev = self.device
        col = [p.penalties for _, p in pen]

        def column(j: int) -> Any:
            return torch.tensor([c[j] for c in col if c is not None], dtype=torch.float32, device=dev).unsqueeze(1)

        rep = any(p.seen is not None for _, p in pen)
        seen = None
        if rep:
            off = torch.zeros(self.vocab, dtype=torch.bool, device=dev)
            seen = torch.stack([p.seen if p.seen is not None else off for _, p in pen])
        return (torch.tensor([i for i, _ in pen], dtype=torch.long, device=dev), column(0), column(1),
                torch.stack([p.counts for _, p in pen]), column(2) if rep else None, seen)

    def before(self, scores: torch.Tensor) -> None:
        """Inside the step, before any rule: the log-softmax of the rows with log-probabilities,
        then the penalties (in ``BatchSampler.penalize``'s order)."""
        st = self.step
        if st is None:
            return
        if st.lp_rows is not None:
            st.lp = torch.log_softmax(scores.index_select(0, st.lp_rows), dim=-1)
        if st.pen is not None:
            rows, freq, pres, counts, rep, seen = st.pen
            x = scores.index_select(0, rows)
            if seen is not None:
                x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
            x = x - freq * counts - pres * (counts > 0).to(x.dtype)
            scores.index_copy_(0, rows, x)

    def after(self, scores: torch.Tensor) -> torch.Tensor:
        """Inside the step, after the rules: pick the rows' tokens, leave only them possible,
        and compute the log-probabilities."""
        st = self.step
        if st is None:
            return scores
        x = scores.index_select(0, st.rows)
        tokens = x.argmax(dim=-1)
        if st.hot is not None:
            greedy, u, temperature, top_k, top_p, min_p, cuts = st.hot
            tokens = torch.where(greedy, tokens, inverse_transform(x, u, temperature, top_k, top_p, min_p, cuts))
        scores.index_fill_(0, st.rows, float("-inf"))
        scores.index_put_((st.rows, tokens), torch.zeros((), dtype=scores.dtype, device=scores.device))
        if st.lp is not None:
            picked = tokens.index_select(0, st.lp_sel)
            chosen, values, ids = token_logprobs(st.lp, picked, st.k)
            wants = [p.top_logprobs or 0 for p, _ in st.lp_for]
            self._pending.append((pack_logprobs(picked, chosen, values, ids), st.lp_for, st.k, wants))
        self.step = None
        return scores

    def collect(self) -> None:
        """Read the log-probabilities of the steps run so far into their requests' picks."""
        while self._pending:
            packed, where, k, wants = self._pending.pop(0)
            for row, (pick, index), want in zip(packed.tolist(), where, wants, strict=True):
                pick.record(index, unpack_logprobs(row, k, want))

    def _eager(self, eager: bool) -> None:
        """Run this step eagerly (no graph replay, no compiled step) or as configured. The
        runner is looked up each time: transformers builds a new one for its loop."""
        if eager and self._graphs is None:
            r = getattr(getattr(self.mgr, "batch_processor", None), "model_runner", None)
            if r is None:
                return
            self._graphs = (r, r.use_cuda_graph_varlen, r.use_cuda_graph_decode, r._compiled_varlen,
                            r._compiled_decode)
            r.use_cuda_graph_varlen = r.use_cuda_graph_decode = False
            r._compiled_varlen = r._compiled_decode = None
        elif not eager and self._graphs is not None:
            r, *saved = self._graphs
            r.use_cuda_graph_varlen, r.use_cuda_graph_decode, r._compiled_varlen, r._compiled_decode = saved
            self._graphs = None
