"""What ``sclsd-bench chaos`` holds each request to (:mod:`sclsd.bench.chaos` runs it): one
uninterrupted pass's tokens, the fake engine's formula or an engine's on ``tiny-random``, with the
client's cancels and the near ties of the engine's logits taken into account (:func:`check_tokens`)."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgspec

from .. import protocol as P

#: The model of the transformers engines: deterministic weights, small enough for a CPU.
HF_MODEL = "tiny-random"
#: Rows per ``hf`` batch when the references are computed.
REF_BATCH = 32



def reference_tokens(prompt: list[int], max_tokens: int, ignore_eos: bool) -> list[int]:
    """What the fake engine generates for a greedy request served in one pass."""
    from worker.engines.fake import FakeEngine

    out, _ = FakeEngine().serve(P.BatchMsg(batch_id=1, slice_len=10**6, requests=[
        P.BatchRequest(rid="r", token_ids=list(prompt), max_new_tokens=max_tokens, temperature=0.0,
                       ignore_eos=ignore_eos)]))
    return out[0].token_ids


class Reference:
    """One engine's uninterrupted pass on ``tiny-random``: the tokens a request served through
    the daemon must have, greedy or seeded, whatever kills and regrants it went through, and
    for a request that differs, how far the engine's pick was from the reference's
    (:meth:`margin`). Subclasses say which engine and how it computes one context's logits."""

    engine_name = "hf"

    def __init__(self, model: str = HF_MODEL) -> None:
        from worker.engines import create_engine

        self.engine = create_engine(self.engine_name, model)

    def close(self) -> None:
        self.engine.close()

    def tokens(self, specs: list[P.Generate], progress: bool = False) -> list[list[int]]:
        """What the engine generates for each request in one pass, in batches of
        :data:`REF_BATCH` requests of similar prompt lengths."""
        out: list[list[int]] = [[] for _ in specs]
        order = sorted(range(len(specs)), key=lambda i: len(specs[i].prompt_ids or ()))
        for a in range(0, len(order), REF_BATCH):
            idx = order[a:a + REF_BATCH]
            rows = [self._row(str(i), specs[i], list(specs[i].prompt_ids or ()), 0) for i in idx]
            longest = max(r.max_new_tokens for r in rows)  # one pass: a slice as long as the longest
            outs, _ = self.engine.serve(P.BatchMsg(batch_id=a + 1, slice_len=longest, requests=rows))
            for o in outs:
                out[int(o.rid)] = o.token_ids
            if progress and (a // REF_BATCH) % 20 == 19:
                print(f"  references: {a + len(idx)} of {len(specs)}", file=sys.stderr, flush=True)
        return out

    @staticmethod
    def _row(rid: str, spec: P.Generate, context: list[int], generated: int) -> P.BatchRequest:
        """``spec`` as a batch row over ``context``, whose last ``generated`` tokens it generated."""
        from sclsd.structured import grammar_text

        return P.BatchRequest(rid=rid, token_ids=context, max_new_tokens=max(1, (spec.max_tokens or 1) - generated),
                              temperature=spec.temperature, top_p=spec.top_p, seed=spec.seed,
                              ignore_eos=spec.ignore_eos, generated=generated,
                              grammar=None if spec.structured is None else grammar_text(spec.structured))

    def allowed(self, spec: P.Generate, context: list[int], position: int) -> Any:
        """``[1, vocab]`` fp32: 0 for the tokens ``spec``'s grammar allows after ``context``
        (whose last ``position`` tokens it generated), -inf for the rest; 0 everywhere
        without a grammar."""
        import torch

        from worker.engines.constraints import bitmask_addend, grammar_row, words
        from worker.engines.grammar import grammar_for, row_matcher

        engine: Any = self.engine
        vocab = engine.info().vocab_size
        if spec.structured is None:
            return torch.zeros(1, vocab)
        m = row_matcher(self._row("m", spec, context, position), grammar_for(engine.spec, vocab, engine.eos))
        bits = torch.zeros(1, words(vocab), dtype=torch.int32)
        grammar_row(bits[0], m, None, False)
        return bitmask_addend(bits, vocab)

    def logits(self, context: list[int]) -> Any:
        """The engine's fp32 logits for the token after ``context``: a ``[1, vocab]`` tensor."""
        import torch

        engine: Any = self.engine  # a transformers engine: its model and device
        with torch.inference_mode():
            ids = torch.tensor([context], dtype=torch.long, device=engine.device)
            return engine.model(input_ids=ids).logits[:, -1, :].float().cpu()

    def margin(self, spec: P.Generate, context: list[int], position: int, got: int) -> float:
        """How far the engine's pick ``got`` of token ``position`` after ``context`` (the prompt
        and the tokens before it) was from the reference's, in the reference's distribution
        (:func:`pick_margin`), among the tokens its grammar allows there if it has one."""
        return pick_margin(self.logits(context) + self.allowed(spec, context, position), spec, position, got)


class HFReference(Reference):
    """``hf``'s one pass: the reference of the transformers engines, which run the same fp32
    weights through the same kernels."""


class LlamaReference(Reference):
    """``llama``'s one pass on ``tiny-random``'s GGUF: the reference of ``llama`` workers.
    llama.cpp keeps the KV in fp16, so its tokens are not ``hf``'s everywhere (6 of 48 greedy
    requests of 48 tokens differed somewhere; where chaos runs' greedy picks differed, ``hf``'s
    was up to 0.13 nats likelier), but a request gives the same tokens beside other rows,
    alone, or prefilled again from any point of its answer, as a worker killed mid-request has
    it served again."""

    engine_name = "llama"

    def logits(self, context: list[int]) -> Any:
        import torch

        from worker.engines.llama import last_logits
        from worker.engines.llama_lib import Context

        engine: Any = self.engine
        ctx = Context(engine.model, max(256, -(-(len(context) + 1) // 256) * 256), 1, engine.batch_tokens, 1)
        try:
            return torch.from_numpy(last_logits(ctx, context, engine.batch_tokens)).float().view(1, -1)
        finally:
            ctx.close()


def reference_for(engine: str, model: str = HF_MODEL) -> Reference:
    """The reference an engine's tokens are checked against: its own one pass for ``llama``,
    ``hf``'s for the transformers engines."""
    return LlamaReference(model) if engine == "llama" else HFReference(model)


def seeded(spec: P.Generate) -> bool:
    """Whether ``spec``'s tokens are drawn with its seed (else greedy)."""
    return spec.seed is not None and spec.temperature != 0


def pick_margin(x: Any, spec: P.Generate, position: int, got: int) -> float:
    """How far the pick ``got`` of token ``position`` was from the one ``spec`` makes from the
    ``[1, vocab]`` fp32 logits ``x``, in their distribution: greedy, how much less likely
    ``got`` is than the most likely token (in log-probability); seeded, how far the draw lies
    from ``got``'s span of the cumulative distribution
    (:func:`~worker.engines.sampling.inverse_transform`'s), or the nucleus' edge from ``top_p``
    (a token at the edge is in one engine's nucleus and not in the other's), the smaller.
    Logits that differ a little with the rows beside them move a pick only to a token this
    near; a wrong context (KV of another row, a token at the wrong position) picks tokens that
    are not."""
    import torch

    from worker.engines.sampling import filter_logits, uniform

    if not seeded(spec):
        lp = torch.log_softmax(x[0], -1, dtype=torch.float64)
        return float(lp.max() - lp[got])
    assert spec.seed is not None  # seeded
    t = torch.tensor([spec.temperature])
    y = filter_logits(x, t, torch.tensor([spec.top_k]), torch.tensor([spec.top_p]), torch.tensor([spec.min_p]))
    cdf = torch.softmax(y, -1, dtype=torch.float64).cumsum(-1)[0]
    target = uniform(spec.seed, position) * float(cdf[-1])
    lo = float(cdf[got - 1]) if got > 0 else 0.0
    span = max(0.0, lo - target, target - float(cdf[got]))
    if spec.top_p >= 1:  # no nucleus, no edge (every cumulative sum ends at 1)
        return span
    edge = (torch.softmax(x[0] / t, -1, dtype=torch.float64).sort(descending=True).values.cumsum(-1)
            - spec.top_p).abs().min()
    return min(span, float(edge))


class Tolerance(NamedTuple):
    """How far an engine's pick may be from the reference's (:func:`pick_margin`) and
    still be a near tie: a request that first differs from the reference at such a pick, and is
    right up to there, is counted apart, not as wrong."""

    greedy_nats: float
    """A greedy pick at most this much less likely than the most likely token (log-probability)."""
    draw: float
    """A seeded draw at most this far from the picked token's span (probability)."""

    @staticmethod
    def kind(spec: P.Generate) -> str:
        """Which bound a pick of ``spec``'s is held to: ``draw`` (seeded) or ``greedy_nats``."""
        return "draw" if seeded(spec) else "greedy_nats"

    def near(self, spec: P.Generate, margin: float) -> bool:
        """Whether ``margin`` (of a pick of ``spec``'s) is a near tie."""
        return margin <= float(getattr(self, self.kind(spec)))


#: An engine's logits differ from its reference's by about 1e-6 with the rows beside them (fp32
#: on both sides; ``llama`` against its own pass the same).
TIES = Tolerance(greedy_nats=1e-3, draw=1e-4)

#: ``margin(finished, first difference)``: how far the engine's pick there was from the reference's.
Margin = Callable[["Finished", int], float]


@dataclass
class Finished:
    """A request's end, as the client saw it, for the token check after the run."""

    spec: P.Generate
    accepted: bool
    tokens: list[int]
    """Streamed, or the ``done``'s ``token_ids``."""
    counted: int
    """The ``done``'s ``usage.completion_tokens``."""
    reason: str
    cancel_sent: bool


@dataclass
class Tally:
    """What every connection saw, summed."""

    sent: int = 0
    accepted: int = 0
    done: int = 0
    cancelled: int = 0
    """Of ``done``: ended ``cancelled`` (the client cancelled them before their end)."""
    from_kv: int = 0
    """Of ``done``: requests some of whose prompt's KV the engines took from KV kept or cached
    (``usage.cached_tokens``) rather than computed."""
    refused: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    duplicated: int = 0
    late_cancels: int = 0
    """Cancels the daemon answered ``unknown_id``: sent while the request's own end was on its way."""
    unexpected: int = 0
    """Events for no request sent on the connection (or none at all)."""
    wrong: int = 0
    latencies: list[float] = field(default_factory=list)
    finished: list[Finished] = field(default_factory=list)
    """The requests that ended ``done``, their tokens checked by :func:`check_tokens`."""
    examples: list[str] = field(default_factory=list)
    """The first few problems, for the report."""
    near_ties: int = 0
    """Requests that first differ from the reference where its pick was a near tie
    (:func:`check_tokens`), right up to there."""
    ties: list[str] = field(default_factory=list)
    """What each near tie was (the first few)."""
    tie_max: dict[str, float] = field(default_factory=dict)
    """The farthest pick among the near ties, by kind (``greedy_nats``, ``draw``)."""
    prompt_checked: int = 0
    """Requests that asked for their prompt's log-probabilities and ended ``done``, checked by
    :func:`check_prompt`."""
    prompt_wrong: int = 0
    """Of those: the prompt's log-probabilities came more than once, not at all, or not for
    every prompt token after the first."""
    wrong_ones: list[dict[str, Any]] = field(default_factory=list)
    """Each wrong request: its spec, its tokens and the reference (``--keep-dir``: ``wrong.json``)."""

    def problem(self, what: str) -> None:
        if len(self.examples) < 5:
            self.examples.append(what)


def check_prompt(tally: Tally, spec: P.Generate, got: list[list[P.TokenLogprobs]], reason: str) -> None:
    """A ``done`` request's deliveries of its prompt's log-probabilities (``got``): none unless
    asked for; asked, exactly one for a prompt of two tokens or more (none for one token; at
    most one for a request the client cancelled), its entries the prompt's tokens after the
    first, in order, each with the alternatives asked for and no log-probability above 0."""
    asked = spec.prompt_logprobs is not None
    prompt = list(spec.prompt_ids or ())
    tally.prompt_checked += asked
    want = (1 if len(prompt) > 1 else 0) if asked else 0
    count_ok = len(got) == want or (reason == "cancelled" and len(got) <= want)
    k = spec.prompt_logprobs or 0
    entries_ok = all([e.chosen.id for e in lps] == prompt[1:]
                     and all(len(e.top) == k and e.chosen.logprob <= 0 for e in lps) for lps in got)
    if not (count_ok and entries_ok):
        tally.prompt_wrong += 1
        tally.problem(f"{spec.id}: the prompt's log-probabilities came {len(got)} times (asked: {asked}, "
                      f"{len(prompt)} prompt tokens, {reason}); entries right: {entries_ok}")


def check_tokens(tally: Tally, refs: list[list[int]], margin: Margin | None = None,
                 ties: Tolerance = TIES) -> None:
    """Count in ``tally.wrong`` the finished requests whose tokens are not ``refs`` (one per
    :attr:`Tally.finished`): all of the reference, or for one the client cancelled that ended
    ``cancelled``, a prefix of it; and as many as the ``done`` counted. With ``margin``, one
    whose tokens first differ at a pick within ``ties`` of the reference's, and are right up to
    there, counts in ``tally.near_ties`` instead."""
    for f, want in zip(tally.finished, refs, strict=True):
        got = f.tokens
        if f.reason == "cancelled":
            right = f.cancel_sent and got == want[:len(got)]
        else:
            right = got == want
        if f.accepted and right and f.counted == len(got):
            continue
        first = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                     min(len(got), len(want)))
        near = None
        if margin is not None and f.accepted and f.counted == len(got) and first < min(len(got), len(want)):
            near = margin(f, first)
        kind = f"seed {f.spec.seed}" if f.spec.seed is not None else "greedy"
        what = (f"{f.spec.id} ({kind}, {len(f.spec.prompt_ids or ())} prompt tokens): {len(got)} tokens "
                f"({f.reason}), {f.counted} counted, reference {len(want)}; first difference at token {first}"
                + (f", where the pick was {near:.1e} from the reference's" if near is not None else "")
                + f"; cancel sent: {f.cancel_sent}")
        if near is not None and ties.near(f.spec, near):
            tally.near_ties += 1
            bound = Tolerance.kind(f.spec)
            tally.tie_max[bound] = max(tally.tie_max.get(bound, 0.0), near)
            tally.ties.append(what)
            continue
        tally.wrong += 1
        tally.problem(what)
        tally.wrong_ones.append({"spec": msgspec.to_builtins(f.spec), "got": got, "want": want,
                                 "reason": f.reason, "counted": f.counted, "cancel_sent": f.cancel_sent})
