"""Cost-model workers: what really happens when a batch runs, on a virtual clock.

A worker of the simulator does what a real one does: batches wait in a local
FIFO queue and run one at a time. How long a batch takes and what it produces
come from the profile's estimator applied to what the batch *actually* does
(its true output lengths, which the scheduler never sees), times optional
seeded multiplicative noise.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..core.batch import Batch, RowOutcome
from ..core.estimator import Estimator
from ..core.request import FinishReason, Request
from .retained_kv import RetainedKV


@dataclass(slots=True)
class SimPayload:
    """What the simulator keeps in ``Request.payload``. The policy never reads it.

    ``true_len`` is the request's true output length: it generates EOS there.
    The rest are per-request waste counters for the metrics.
    """

    true_len: int
    pad_tokens: int = 0
    invalid_tokens: int = 0
    preemptions: int = 0
    prefilled: bool = False
    """Its first prefill has run."""
    reprefill_tokens: int = 0
    """Tokens whose KV an earlier prefill or decode step had computed, computed again."""
    last_token_at: float | None = None
    """When a streaming client received its latest token (virtual clock)."""
    max_gap: float | None = None
    """Longest wait between two consecutive tokens so far (None: fewer than two)."""

    def received(self, first: float, last: float, within: float | None) -> None:
        """A run of tokens reached the client: the first at ``first``, the last at ``last``,
        ``within`` the longest gap between two of them (None: a single token).

        The gap from the previous run's last token to ``first`` counts too: that is
        where a stream waits for its next slice (the pool, the worker's queue, the
        next prefill) or for its next admission after a preemption.
        """
        gap = within
        if self.last_token_at is not None:
            into = first - self.last_token_at
            gap = into if gap is None else max(gap, into)
        if gap is not None and (self.max_gap is None or gap > self.max_gap):
            self.max_gap = gap
        self.last_token_at = last

    def count_prefill(self, own_tokens: int) -> None:
        """A prefill computed ``own_tokens`` of this request's context.

        Past the first, all of them but the newest (sampled last, never fed) are recomputed.
        """
        if self.prefilled:
            self.reprefill_tokens += max(0, own_tokens - 1)
        self.prefilled = True


def target_len(r: Request) -> int:
    """Tokens the request will have generated when it finishes: EOS or its budget."""
    return min(r.payload.true_len, r.max_tokens)


def finish_reason(r: Request, generated: int) -> FinishReason | None:
    """``stop`` at the true length, ``length`` at max_tokens, None while it goes on."""
    if generated >= r.payload.true_len:
        return "stop"
    if generated >= r.max_tokens:
        return "length"
    return None


class Noise:
    """Seeded multiplicative noise on serving times: lognormal with mean 1 and shape ``sigma``.

    Lognormal keeps times positive; the ``-sigma²/2`` location makes the mean
    exactly 1, so noise adds error without biasing the estimator.
    """

    def __init__(self, sigma: float, seed: int) -> None:
        if sigma < 0:
            raise ValueError(f"noise must be >= 0, got {sigma}")
        self.sigma = sigma
        self._rng = np.random.default_rng(seed)
        self._buf: list[float] = []

    def __call__(self) -> float:
        if self.sigma == 0:
            return 1.0
        if not self._buf:  # draw in blocks: one numpy call per 4096 factors
            self._buf = self._rng.lognormal(-(self.sigma**2) / 2, self.sigma, 4096).tolist()
        return self._buf.pop()


@dataclass(slots=True)
class Served:
    """The true outcome of one batch (computed when it starts; its requests are frozen meanwhile)."""

    time: float
    """Seconds, before noise."""
    prefill: float
    """The prefill part of ``time`` (host copies of retained KV included): first tokens come then."""
    iterations: int
    rows: list[RowOutcome]
    pad: list[int]
    invalid: list[int]
    early_return: bool
    kv_tokens: int
    """Peak KV-cache tokens the batch really holds."""
    width: int = 0
    """Padded context positions of every row (static batches; held + new with KV reuse)."""
    prefill_tokens: list[int] = field(default_factory=list)
    """Per row, tokens of its own context the prefill computed (the rest of a window is pad)."""


def serve_static(
    batch: Batch, est: Estimator, held: list[int] | None = None, copy_s: float = 0.0
) -> Served:
    """A padded static batch (HF / DS engines) with early return.

    Every row is left-padded to the batch input length L. The batch decodes
    until every row has finished (true EOS or max_tokens) or S iterations,
    whichever comes first; finished rows keep computing (invalid tokens)
    while others go on. Time = T_prefill(n, L) + T_decode(n, L, k) for the k
    iterations run.

    With ``held`` (tokens of KV the worker holds per row), the batch is laid out
    as ``past = max held`` positions then ``new = max (L_r - held_r)``, and only
    ``new`` are prefilled (:meth:`~sclsd.core.estimator.Estimator.t_serve_cached`),
    after ``copy_s`` seconds bringing retained KV back from host memory.
    """
    reqs = batch.requests
    n, S = len(reqs), batch.slice_len
    hold = held if held is not None and any(held) else [0] * n
    if any(hold):
        past = max(hold)
        fresh = max(1, max(r.input_len - h for r, h in zip(reqs, hold, strict=True)))
    else:
        past, fresh = 0, batch.input_len
    L = past + fresh
    remaining = [target_len(r) - r.num_generated for r in reqs]
    k = min(S, max(remaining))
    rows: list[RowOutcome] = []
    pad: list[int] = []
    invalid: list[int] = []
    for r, rem in zip(reqs, remaining, strict=True):
        new = min(k, rem)
        rows.append(RowOutcome(r.rid, new, finish_reason(r, r.num_generated + new)))
        pad.append(L - r.input_len)
        invalid.append(k - new)
    prefill = est.t_prefill_cached(n, fresh, past) + copy_s
    return Served(
        time=prefill + est.t_decode(n, L, k),
        prefill=prefill,
        iterations=k,
        rows=rows,
        pad=pad,
        invalid=invalid,
        early_return=k < S,
        kv_tokens=(L + k) * n,
        width=L,
        prefill_tokens=[r.input_len - h for r, h in zip(reqs, hold, strict=True)],
    )


def serve_ragged(batch: Batch, est: Estimator) -> Served:
    """A ragged batch without padding or invalid tokens (the oracle's idealised engine).

    Prefill costs T_prefill(n, mean L) (the same token count as the rows'
    own lengths, no pad). Every row generates exactly its remaining tokens and
    leaves; decoding iteration t (1-based) costs tau(mean context of the rows
    still running, their number), the context of a row being L_r + t. Between
    two departures the running set is fixed, so each stretch is one closed-form
    ``t_decode``. No slice limit applies: the oracle never slices.
    """
    reqs = batch.requests
    n = len(reqs)
    rem = [target_len(r) - r.num_generated for r in reqs]
    lens = [r.input_len for r in reqs]
    prefill = est.t_prefill(n, sum(lens) / n)
    time = prefill + ragged_decode_time(est, lens, rem)
    rows = [
        RowOutcome(r.rid, g, finish_reason(r, r.num_generated + g))
        for r, g in zip(reqs, rem, strict=True)
    ]
    return Served(
        time=time,
        prefill=prefill,
        iterations=max(rem),
        rows=rows,
        pad=[0] * n,
        invalid=[0] * n,
        early_return=False,
        kv_tokens=sum(lens) + sum(rem),
        prefill_tokens=lens,
    )


def ragged_decode_time(est: Estimator, lens: list[int], outs: list[int]) -> float:
    """Σ_t tau(mean context of running rows at t, rows running at t), rows leaving after ``outs``."""
    order = sorted(range(len(lens)), key=lambda i: outs[i])
    alive = len(lens)
    len_sum = float(sum(lens))
    done_iters = 0
    total = 0.0
    for i in order:
        o = outs[i]
        if o > done_iters:
            # Iterations done_iters+1 .. o with `alive` rows; mean context = mean L + t.
            total += est.t_decode(alive, len_sum / alive + done_iters, o - done_iters)
            done_iters = o
        alive -= 1
        len_sum -= lens[i]
    return total


@dataclass(slots=True, eq=False)
class SimWorker:
    """One simulated worker: a FIFO queue of batches served one at a time."""

    wid: str
    queue: deque[Batch] = field(default_factory=deque)
    busy: bool = False
    last_completion: float | None = None
    busy_time: float = 0.0
    store: RetainedKV | None = None
    """Retained KV across slices (KV reuse); None: nothing is kept."""
