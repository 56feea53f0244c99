"""Per-request seeded draws and log-probabilities inside transformers' continuous batching.

transformers 5.23 samples every request of a step with one ``torch.multinomial`` (seeded
per manager, not per request) and reports, at most, the chosen token's probability after
its warpers, no alternatives. For a row that asks for a ``seed``, for ``logprobs``, or for
``min_p`` (which transformers has no per-request warper for), the engine picks the token
itself, exactly as the static engines do (:mod:`worker.engines.sampling`):

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
    random_seed,
    token_logprobs,
    uniform,
    unpack_logprobs,
)

__all__ = ["Picker", "RowPick", "pick_key", "wants_pick"]


def wants_pick(r: BatchRequest) -> bool:
    """Whether the engine picks row ``r``'s tokens itself (see the module docstring)."""
    hot = r.temperature > 0
    return bool(r.logprobs or r.top_logprobs or (hot and (r.seed is not None or r.min_p > 0.0)))


def pick_key(r: BatchRequest) -> tuple[Any, ...]:
    """What a resumed request must share with the row resuming it for its picks to hold."""
    if not wants_pick(r):
        return ()
    return (r.seed, r.temperature, r.top_k, r.top_p, r.min_p, r.logprobs, r.top_logprobs)


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

    @classmethod
    def build(cls, r: BatchRequest) -> RowPick | None:
        """``r``'s picks, or None when transformers picks its tokens."""
        if not wants_pick(r):
            return None
        # An unseeded row draws from a fresh seed: reproducible by nobody, as on ``hf``.
        seed = r.seed if r.seed is not None else random_seed()
        want = r.top_logprobs if (r.logprobs or r.top_logprobs) else None
        return cls(seed, r.generated, r.temperature <= 0.0, r.temperature if r.temperature > 0 else 1.0,
                   r.top_k, r.top_p, r.min_p, want)

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
    lp: Any = None
    """``[m, vocab]`` log-softmax of the model's logits, once :meth:`Picker.before` ran."""


class Picker:
    """The picks of a manager's steps (see the module docstring). :meth:`stage` and
    :meth:`collect` run on the host, :meth:`before`/:meth:`after` inside the step, all on
    transformers' generation thread."""

    def __init__(self, device: Any) -> None:
        self.device = torch.device(device)
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

    def stage(self, rows: list[tuple[int, RowPick, int]], captured: bool) -> None:
        """This step's picks: (logits row, pick, index of the token it draws) per picked row.
        ``captured``: the manager captures steps, so a step with picks runs eagerly."""
        self.collect()  # a step whose outputs were never delivered (it failed)
        if captured:
            self._eager(bool(rows))
        if not rows:
            self.step = None
            return
        dev = self.device
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
            k=max((p.top_logprobs or 0 for _, _, p, _ in lp), default=0))

    def before(self, scores: torch.Tensor) -> None:
        """Inside the step, before any rule: the log-softmax of the rows with log-probabilities."""
        st = self.step
        if st is not None and st.lp_rows is not None:
            st.lp = torch.log_softmax(scores.index_select(0, st.lp_rows), dim=-1)

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
