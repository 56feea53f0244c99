"""The two oracles: scheduling that knows every request's true output length.

Both read the true lengths from the simulator's payload, which no real policy
may do, and drive the same :class:`~sclsd.core.scheduler.Scheduler` as the
named policies: their batchers read the payload, their offloaders replace the
scheduler's padded estimate by the true time before placing a batch (the
scheduler adds ``batch.est_time`` to the load after the offloader returns and
subtracts the same value on completion). Offloading is max-min on true times;
the interval is scls's adaptive ``max(λ · min load, Γ)``. Neither slices:
each request is served by exactly one batch, so nothing is ever re-prefilled.

``oracle``: a ceiling for **any engine** on this cost model, not for static
batching. Its engine is ragged (:func:`sclsd.sim.workers.serve_ragged`): no
pad tokens (prefill and attention over each row's own length) and no invalid
tokens (a row stops costing anything when it finishes). Batching: the DP of
Algorithm 1 over the pool sorted by true output length, minimising the sum of
the batches' *true* ragged serving times, under the KV budget
``Σ (L_r + O_r) · Δ <= ζ · M_ava`` (tokens actually cached). Continuous
batching can come close to it; static batching cannot.

``oracle-static``: the ceiling of **static batching**. Padded static batches
(:func:`sclsd.sim.workers.serve_static`) that run to their longest row: every
row is left-padded to the batch's longest input and computes until the batch's
longest output ends (pad and invalid tokens as for scls, no slice limit).
Batching: Algorithm 1's DP over the pool sorted by true output length, the
cost of a batch its true time ``T_prefill(n, L) + T_decode(n, L, O)`` (L the
longest input, O the longest output), under **the same memory predicate as
scls** read at the batch's true length, ``oom(n, L, O)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core.batch import Batch
from ..core.estimator import Estimator
from ..core.interfaces import CostModel, LinearCost
from ..core.offloader import AdaptiveInterval, MaxMin
from ..core.policy import Policy
from ..core.request import Request
from .workers import serve_ragged, serve_static, target_len


@dataclass(frozen=True)
class OracleBatcher:
    """Algorithm 1's DP on true ragged costs, the pool sorted by true remaining output length.

    Batch ``j..i`` (sorted by output length ``O``) costs
    ``T_prefill(m, mean L) + Σ_t tau(mean context of running rows, running rows)``.
    Extending it downward by row ``j-1`` (the shortest output) only changes
    the first ``O_{j-1}`` iterations, in which every row runs, so the cost
    updates in O(1): the inner loop costs what Algorithm 1's does.
    """

    est: Estimator
    token_budget: float
    """ζ · M_ava / Δ: KV tokens a batch may hold."""
    max_batch: int | None = None

    def __call__(
        self, reqs: Sequence[Request], slice_len: int, cost: CostModel
    ) -> list[list[Request]]:
        if not reqs:
            return []
        ordered = self._sorted(reqs)
        _, P = self._dp(ordered)
        out: list[list[Request]] = []
        i = len(ordered)
        while i > 0:
            out.append(ordered[P[i] : i])
            i = P[i]
        return out

    def total(self, reqs: Sequence[Request]) -> float:
        """The DP's minimal total serving time of ``reqs`` (for tests)."""
        return self._dp(self._sorted(reqs))[0][-1] if reqs else 0.0

    @staticmethod
    def _sorted(reqs: Sequence[Request]) -> list[Request]:
        return sorted(
            reqs, key=lambda r: (target_len(r) - r.num_generated, r.input_len, r.arrival, r.rid)
        )

    def _dp(self, ordered: list[Request]) -> tuple[list[float], list[int]]:
        """T[i]: least total time of the first i requests; P[i]: where their last batch starts."""
        Ls = [r.input_len for r in ordered]
        Os = [target_len(r) - r.num_generated for r in ordered]
        n = len(ordered)
        cap = self.max_batch or n
        est = self.est
        T = [0.0] * (n + 1)
        P = [0] * (n + 1)
        for i in range(1, n + 1):
            L, out = Ls[i - 1], Os[i - 1]
            m, len_sum, tokens = 1, float(L), L + out
            c = est.t_prefill(1, L) + est.t_decode(1, L, out)
            best, best_p = T[i - 1] + c, i - 1
            j = i - 1
            while j >= 1 and m < cap:
                Lj, Oj = Ls[j - 1], Os[j - 1]
                if tokens + Lj + Oj > self.token_budget:
                    break
                old = len_sum / m
                new = (len_sum + Lj) / (m + 1)
                c += (
                    est.t_prefill(m + 1, new)
                    - est.t_prefill(m, old)
                    + est.t_decode(m + 1, new, Oj)
                    - est.t_decode(m, old, Oj)
                )
                m += 1
                len_sum += Lj
                tokens += Lj + Oj
                t = T[j - 1] + c
                if t < best:
                    best, best_p = t, j - 1
                j -= 1
            T[i], P[i] = best, best_p
        return T, P


class OracleOffloader:
    """Max-min on true serving times: sets each batch's ``est_time`` to its true time,
    served ragged (rows leave as they finish) or, with ``static``, padded to the longest row."""

    def __init__(self, est: Estimator, static: bool = False) -> None:
        self.est = est
        self.serve = serve_static if static else serve_ragged
        self._maxmin = MaxMin()

    def assign(self, batches: Sequence[Batch], loads: Mapping[str, float]) -> list[str]:
        """Max-min placement after replacing each batch's estimate by its true time."""
        for b in batches:
            b.est_time = self.serve(b, self.est).time
        return self._maxmin.assign(batches, loads)


def make_oracle_policy(
    est: Estimator,
    *,
    token_budget: float,
    max_gen: int,
    gamma: float,
    lam: float = 0.5,
) -> Policy:
    """The oracle as a :class:`~sclsd.core.policy.Policy` (its slice is the whole generation limit)."""
    return Policy(
        "oracle",
        max_gen,
        OracleBatcher(est, token_budget),
        OracleOffloader(est),
        AdaptiveInterval(lam, gamma),
    )


# --------------------------------------------------------------------------- oracle-static


def _by_output(reqs: Sequence[Request]) -> list[Request]:
    return sorted(
        reqs, key=lambda r: (target_len(r) - r.num_generated, r.input_len, r.arrival, r.rid)
    )


@dataclass(frozen=True)
class StaticOracleBatcher:
    """Algorithm 1's DP on true padded static costs, the pool sorted by true remaining output.

    Batch ``j..i`` (sorted by output length) runs ``O_i`` iterations padded to
    ``L = max input of j..i`` and costs ``T_prefill(m, L) + T_decode(m, L, O_i)``;
    it is allowed while ``not cost.oom(m, L, O_i)`` (monotone as j falls: m and
    L only grow), and a lone request always is. For each i the candidate j form
    one numpy window, as in the DP batcher's fast path.
    """

    est: Estimator

    def __call__(
        self, reqs: Sequence[Request], slice_len: int, cost: CostModel
    ) -> list[list[Request]]:
        if not reqs:
            return []
        ordered = _by_output(reqs)
        _, P = self._dp(ordered, cost)
        out: list[list[Request]] = []
        i = len(ordered)
        while i > 0:
            out.append(ordered[P[i] : i])
            i = P[i]
        return out

    def total(self, reqs: Sequence[Request], cost: CostModel) -> float:
        """The DP's minimal total serving time of ``reqs`` (for tests)."""
        return self._dp(_by_output(reqs), cost)[0][-1] if reqs else 0.0

    def _dp(self, ordered: list[Request], cost: CostModel) -> tuple[list[float], list[int]]:
        n = len(ordered)
        Ls = np.array([r.input_len for r in ordered], dtype=np.int64)
        Os = [target_len(r) - r.num_generated for r in ordered]
        est = self.est
        T = np.zeros(n + 1)
        P = [0] * (n + 1)
        for i in range(1, n + 1):
            out = Os[i - 1]
            k = min(i, max(1, _fits(cost, int(Ls[i - 1]), out)))
            # Candidates j = i, i-1, ..., i-k+1: batch sizes m = 1..k, padded to the
            # running maximum of the inputs.
            L = np.maximum.accumulate(Ls[i - k : i][::-1]).astype(np.float64)
            m = np.arange(1, k + 1, dtype=np.float64)
            ok = _allowed(cost, m, L, out)
            vec: Any = est  # its closed forms are numpy-vectorised: arrays in, arrays out
            t = vec.t_prefill(m, L) + vec.t_decode(m, L, out) + T[i - m.astype(np.int64)]
            t = np.where(ok, t, np.inf)
            best = int(t.argmin())  # ties: the smallest batch, as Algorithm 1's strict <
            T[i] = t[best]
            P[i] = i - best - 1
        return T.tolist(), P


def _fits(cost: CostModel, L: int, out: int) -> int:
    """Largest batch size at input length ``L`` run ``out`` iterations (0: not even one row)."""
    if isinstance(cost, LinearCost):
        return int(np.asarray(cost.max_batch(np.array([L]), out)).reshape(-1)[0])
    m = 0
    while not cost.oom(m + 1, L, out) and m < 1 << 16:
        m += 1
    return m


def _allowed(cost: CostModel, m: np.ndarray, L: np.ndarray, out: int) -> np.ndarray:
    """``not oom(m, L, out)`` per candidate, up to the first refusal; the lone row always."""
    if isinstance(cost, LinearCost):
        ok = m <= np.asarray(cost.max_batch(L.astype(np.int64), out))
    else:
        ok = np.array([not cost.oom(int(a), int(b), out) for a, b in zip(m, L, strict=True)])
    ok[0] = True
    return np.logical_and.accumulate(ok)


def make_static_oracle_policy(
    est: Estimator, *, max_gen: int, gamma: float, lam: float = 0.5
) -> Policy:
    """``oracle-static`` as a :class:`~sclsd.core.policy.Policy` (batches run to their longest row)."""
    return Policy(
        "oracle-static",
        max_gen,
        StaticOracleBatcher(est),
        OracleOffloader(est, static=True),
        AdaptiveInterval(lam, gamma),
    )
