"""Batchers: the serving-time-oriented DP of Algorithm 1, and FCFS for the baselines.

Algorithm 1 sorts the pool by input length and computes

    T[i] = min_{0 < j <= i} T[j-1] + T_serve(i - j + 1, L_i, S)           (eq. 10)

scanning j downward from i and stopping at the first batch size the memory
predicate rejects. A single request is always a batch of its own (line 8).

The paper's loop is O(n · N_max) calls to T_serve. Here, for a cost model that
exposes the fast path of :class:`~sclsd.core.interfaces.LinearCost` (every
built-in profile does), T_serve is affine in the batch size for fixed L_i:
``a_i · (i-j+1) + b_i``. The inner loop then is
``a_i·(i+1) + b_i + min_j (T[j-1] - a_i·j)`` over a contiguous window of j
bounded by N_max(L_i) -- one numpy reduction per i.
Any other cost model takes the literal loop of Algorithm 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .interfaces import CostModel, LinearCost
from .request import Request

__all__ = ["DPBatcher", "FCFSBatcher", "LinearCost"]


def _sorted_pool(reqs: Sequence[Request]) -> tuple[list[Request], np.ndarray]:
    """Requests in ascending input length (Algorithm 1, line 1) and their lengths.

    The sort is stable over the pool's order, so equal lengths keep arrival order.
    """
    lens = np.fromiter((r.input_len for r in reqs), dtype=np.int64, count=len(reqs))
    order = np.argsort(lens, kind="stable")
    return [reqs[k] for k in order], lens[order]


def _backtrack(ordered: list[Request], P: Sequence[int] | np.ndarray) -> list[list[Request]]:
    """Algorithm 1 lines 17-21: cut at the recorded positions, last batch first."""
    out: list[list[Request]] = []
    i = len(ordered)
    while i > 0:
        p = int(P[i])
        out.append(ordered[p:i])
        i = p
    return out


@dataclass(frozen=True)
class DPBatcher:
    """Algorithm 1 as a :class:`~sclsd.core.interfaces.Batcher`.

    ``max_batch`` optionally caps the batch size on top of the memory
    predicate (the PM step of the ablation caps it at the fixed batch size).
    """

    max_batch: int | None = None

    def __post_init__(self) -> None:
        if self.max_batch is not None and self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")

    def __call__(
        self, reqs: Sequence[Request], slice_len: int, cost: CostModel
    ) -> list[list[Request]]:
        """Split ``reqs`` into batches minimising the total estimated serving time."""
        if not reqs:
            return []
        ordered, lens = _sorted_pool(reqs)
        P: Sequence[int] | np.ndarray
        if isinstance(cost, LinearCost):
            P = self._positions_fast(lens, slice_len, cost)
        else:
            P = self._positions_loop(lens, slice_len, cost)
        return _backtrack(ordered, P)

    def total(self, reqs: Sequence[Request], slice_len: int, cost: CostModel) -> float:
        """Total estimated serving time of the batches this batcher makes (for tests, benches)."""
        total = 0.0
        for b in self(reqs, slice_len, cost):
            total += cost.t_serve(len(b), max(r.input_len for r in b), slice_len)
        return total

    # ----------------------------------------------------------------- the literal loop

    def _positions_loop(self, lens: np.ndarray, S: int, cost: CostModel) -> list[int]:
        """Algorithm 1 line by line, for cost models without the fast path."""
        n = len(lens)
        cap = self.max_batch if self.max_batch is not None else n
        T = [0.0] * (n + 1)
        P = [0] * (n + 1)
        for i in range(1, n + 1):
            P[i] = i - 1
            L = int(lens[i - 1])
            T[i] = T[i - 1] + cost.t_serve(1, L, S)
            j = i - 1
            while j > 0 and i - j + 1 <= cap and not cost.oom(i - j + 1, L, S):
                t = T[j - 1] + cost.t_serve(i - j + 1, L, S)
                if t < T[i]:
                    T[i] = t
                    P[i] = j - 1
                j -= 1
        return P

    # ----------------------------------------------------------------- the fast path

    def _positions_fast(self, lens: np.ndarray, S: int, cost: LinearCost) -> np.ndarray:
        """Same recurrence, with the inner loop as one window minimum per i.

        For fixed i, candidate j (batch ``j..i``, 1-based) costs
        ``T[j-1] + a·(i-j+1) + b``. With ``U[j] = T[j-1] - a·j`` that is
        ``U[j] + a·(i+1) + b``: minimise ``T[j-1] - a·j`` over the window
        ``j in [i - K + 1, i]`` where ``K = min(N_max(L_i), cap)``, at least 1
        (a lone request is always allowed, as in line 8).

        Ties go to the largest j (the smallest batch), exactly as the strict
        ``<`` of Algorithm 1 scanning j downward from i.
        """
        n = len(lens)
        Lf = lens.astype(np.float64)
        a_arr, b_arr = cost.linear_terms(Lf, S)
        a_arr = np.broadcast_to(np.asarray(a_arr, dtype=np.float64), (n,))
        b_arr = np.broadcast_to(np.asarray(b_arr, dtype=np.float64), (n,))
        K = np.asarray(cost.max_batch(lens, S), dtype=np.int64)
        K = np.broadcast_to(K, (n,)).copy()
        if self.max_batch is not None:
            np.minimum(K, self.max_batch, out=K)
        np.maximum(K, 1, out=K)
        P = np.zeros(n + 1, dtype=np.int64)
        a_l = a_arr.tolist()
        b_l = b_arr.tolist()
        K_l = np.minimum(K, np.arange(1, n + 1)).tolist()
        # T is stored reversed, T_rev[n - k] = T[k], so that the window j = i, i-1, ...
        # is a forward slice and argmin's first hit is the largest j (Algorithm 1's tie rule).
        T_rev = np.zeros(n + 1)
        steps = np.arange(n + 1, dtype=np.float64)
        for i in range(1, n + 1):
            a = a_l[i - 1]
            k = K_l[i - 1]
            if k == 1:
                best_j = i
            else:
                # j = i - m for m = 0..k-1: T[j-1] is T_rev[lo + m], and
                # T[j-1] - a·j = T_rev[lo + m] + a·m - a·i (the last term is common).
                lo = n - i + 1
                seg = T_rev[lo : lo + k] + a * steps[:k]
                best_j = i - int(seg.argmin())
            t = T_rev[n - best_j + 1] + a * (i - best_j + 1) + b_l[i - 1]
            T_rev[n - i] = t
            P[i] = best_j - 1
        return P


@dataclass(frozen=True)
class FCFSBatcher:
    """First come, first served, fixed batch size (also capped by the memory predicate).

    The baselines' batcher (SLS, SO): arrival order, no regard for padding.
    """

    size: int

    def __call__(
        self, reqs: Sequence[Request], slice_len: int, cost: CostModel
    ) -> list[list[Request]]:
        ordered = sorted(reqs, key=lambda r: (r.arrival, r.rid))
        out: list[list[Request]] = []
        cur: list[Request] = []
        cur_len = 0
        for r in ordered:
            L = max(cur_len, r.input_len)
            if cur and (len(cur) >= self.size or cost.oom(len(cur) + 1, L, slice_len)):
                out.append(cur)
                cur, L = [], r.input_len
            cur.append(r)
            cur_len = L
        if cur:
            out.append(cur)
        return out
