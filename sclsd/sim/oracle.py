"""The oracle: static batching that knows every true output length and wastes nothing.

Definition (docs/benchmarks.md, "Simulation"):

- **Knowledge**: the true output length of every request (read from the
  simulator's payload, which no real policy may do).
- **Engine**: ragged batches (:func:`sclsd.sim.workers.serve_ragged`): no
  pad tokens (prefill and attention over each row's own length), no invalid
  tokens (a row stops costing anything when it finishes), no slicing and so
  no re-prefill: each request is served by exactly one batch.
- **Batching**: the DP of Algorithm 1 over the pool sorted by true output
  length, minimising the sum of the batches' *true* serving times, under the
  KV budget ``Σ (L_r + O_r) · Δ <= ζ · M_ava`` (tokens actually cached).
- **Offloading and interval**: max-min over the true serving times, and
  scls's adaptive interval ``max(λ · min load, Γ)``.

So it is scls with every waste removed and perfect estimates: an upper bound
for slice-level scheduling on the same cost and memory model. It is not an
upper bound for continuous batching, which also avoids waiting for a round
and for a batch to finish before new requests start.

It drives the same :class:`~sclsd.core.scheduler.Scheduler` as the named
policies: the batcher reads true lengths from the payload, and the offloader
replaces the scheduler's padded estimate by the true ragged time before
placing a batch (the scheduler adds ``batch.est_time`` to the load after the
offloader returns and subtracts the same value on completion).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..core.batch import Batch
from ..core.estimator import Estimator
from ..core.interfaces import CostModel
from ..core.offloader import AdaptiveInterval, MaxMin
from ..core.policy import Policy
from ..core.request import Request
from .workers import serve_ragged, target_len


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
    """Max-min on true serving times: sets each batch's ``est_time`` to its true ragged time."""

    def __init__(self, est: Estimator) -> None:
        self.est = est
        self._maxmin = MaxMin()

    def assign(self, batches: Sequence[Batch], loads: Mapping[str, float]) -> list[str]:
        """Max-min placement after replacing each batch's estimate by its true time."""
        for b in batches:
            b.est_time = serve_ragged(b, self.est).time
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
