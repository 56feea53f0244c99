"""Serving-time estimator (paper section 4.2, eq. 1-4).

A batch of ``n`` requests padded to input length ``L`` and run for ``S``
decoding iterations takes::

    T_serve(n, L, S) = T_prefill(n, L) + T_decode(n, L, S)
    T_prefill(n, L)  = p1·n·L + p2·n + p3·L + p4                     (eq. 3)
    tau_decode(l, n) = d1·n·l + d2·n + d3·l + d4                     (eq. 4)
    T_decode(n, L, S) = Σ_{l=L+1}^{L+S} tau_decode(l, n)              (eq. 2)

Because tau_decode is linear in ``l``, the sum has a closed form (see
:meth:`Estimator.t_decode`), so one estimate costs a handful of flops: the DP
batcher calls it O(n · batch) times per round.

KV reuse (docs/design.md §8): when the worker holds part of every row's KV, a
batch's padded context is ``past + new`` positions, of which only the ``new``
ones are computed::

    T_prefill_cached(n, new, past) = T_prefill(n, new) + (d1·n + d3)·past

i.e. eq. 3 over the new positions plus one read of the held KV, which is what
a decode step at context ``past`` spends on it (the d1, d3 terms of eq. 4).
With ``past = 0`` it is eq. 3 exactly. docs/estimator.md has the derivation.

The fitting helpers use scipy, imported lazily so that importing the policy
core stays cheap (the daemon and the simulator never fit).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import numpy as np

PREFILL_KEYS = ("p1", "p2", "p3", "p4")
DECODE_KEYS = ("d1", "d2", "d3", "d4")

# Samples are rows of numbers, tuples or lists alike (profiles store them as JSON lists).
#: (n, L, seconds): one prefill of n rows padded to L tokens.
PrefillSample = Sequence[float]
#: (n, l, seconds): one decoding iteration of n rows at context length l.
DecodeSample = Sequence[float]
#: (n, L, S, seconds): a whole batch, prefill plus S decoding iterations.
BatchSample = Sequence[float]

#: An input length, or a numpy array of them (:meth:`Estimator.linear_terms` is elementwise).
Lengths = TypeVar("Lengths", float, "np.ndarray")


@dataclass(frozen=True)
class Estimator:
    """Fitted coefficients of eq. 3 (p1..p4) and eq. 4 (d1..d4), in seconds."""

    p1: float = 0.0
    p2: float = 0.0
    p3: float = 0.0
    p4: float = 0.0
    d1: float = 0.0
    d2: float = 0.0
    d3: float = 0.0
    d4: float = 0.0

    # ----------------------------------------------------------------- model

    def t_prefill(self, n: float, L: float) -> float:
        """Seconds to prefill ``n`` rows padded to ``L`` tokens (eq. 3)."""
        return self.p1 * n * L + self.p2 * n + self.p3 * L + self.p4

    def tau_decode(self, l: float, n: float) -> float:  # noqa: E741 - the paper's name
        """Seconds of one decoding iteration of ``n`` rows at context length ``l`` (eq. 4)."""
        return self.d1 * n * l + self.d2 * n + self.d3 * l + self.d4

    def t_decode(self, n: float, L: float, S: float) -> float:
        """Σ_{l=L+1}^{L+S} tau_decode(l, n), in closed form.

        tau is ``(d1·n + d3)·l + (d2·n + d4)`` and Σ_{l=L+1}^{L+S} l = S·L + S(S+1)/2.
        """
        if S <= 0:
            return 0.0
        sum_l = S * L + S * (S + 1) / 2.0
        return (self.d1 * n + self.d3) * sum_l + (self.d2 * n + self.d4) * S

    def t_serve(self, n: float, L: float, S: float) -> float:
        """Estimated seconds to serve a batch: prefill plus ``S`` decoding iterations (eq. 1)."""
        return self.t_prefill(n, L) + self.t_decode(n, L, S)

    def t_prefill_cached(self, n: float, new: float, past: float) -> float:
        """Seconds to prefill ``new`` positions of ``n`` rows over ``past`` held (cached) ones."""
        return self.t_prefill(n, new) + (self.d1 * n + self.d3) * past

    def t_serve_cached(self, n: float, past: float, new: float, S: float) -> float:
        """A batch whose rows hold ``past`` positions of KV and prefill ``new`` more, then
        decode ``S`` iterations over the padded context ``past + new``.

        ``t_serve_cached(n, 0, L, S) == t_serve(n, L, S)``.
        """
        return self.t_prefill_cached(n, new, past) + self.t_decode(n, past + new, S)

    def linear_terms(self, L: Lengths, S: float) -> tuple[Lengths, Lengths]:
        """``(a, b)`` with ``t_serve(n, L, S) = a·n + b`` for every n.

        T_serve is affine in the batch size for a fixed input length; the DP
        batcher uses this to turn its inner loop into a window minimum.
        Works elementwise on numpy arrays of ``L`` too.
        """
        sum_l = S * L + S * (S + 1) / 2.0 if S > 0 else 0.0 * L
        s = S if S > 0 else 0
        a = self.p1 * L + self.p2 + self.d1 * sum_l + self.d2 * s
        b = self.p3 * L + self.p4 + self.d3 * sum_l + self.d4 * s
        return a, b

    def linear_terms_cached(self, past: Lengths, new: Lengths, S: float) -> tuple[Lengths, Lengths]:
        """``(a, b)`` with ``t_serve_cached(n, past, new, S) = a·n + b`` (elementwise on arrays)."""
        a, b = self.linear_terms(past + new, S)
        # linear_terms priced a prefill of past + new positions; only `new` are computed,
        # and the held `past` is read once instead.
        a = a - self.p1 * past + self.d1 * past
        b = b - self.p3 * past + self.d3 * past
        return a, b

    # ----------------------------------------------------------------- (de)serialise

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, float]) -> Estimator:
        """Build from a mapping with keys p1..p4, d1..d4 (missing keys are 0)."""
        unknown = set(d) - set(PREFILL_KEYS + DECODE_KEYS)
        if unknown:
            raise ValueError(f"unknown estimator coefficients: {sorted(unknown)}")
        return cls(**{k: float(v) for k, v in d.items()})


# --------------------------------------------------------------------------- errors


def _rmse(errors: Iterable[float]) -> float:
    errs = list(errors)
    if not errs:
        return float("nan")
    return math.sqrt(sum(e * e for e in errs) / len(errs))


def prefill_rmse(est: Estimator, samples: Iterable[PrefillSample]) -> float:
    """RMSE (seconds) of :meth:`Estimator.t_prefill` over measured prefills."""
    return _rmse(est.t_prefill(n, L) - t for n, L, t in samples)


def decode_rmse(est: Estimator, samples: Iterable[DecodeSample]) -> float:
    """RMSE (seconds) of one decoding iteration (paper Fig. 9a)."""
    return _rmse(est.tau_decode(l, n) - t for n, l, t in samples)  # noqa: E741


def batch_rmse(est: Estimator, samples: Iterable[BatchSample]) -> float:
    """RMSE (seconds) of whole S-iteration batches (paper Fig. 9b: S = 128)."""
    return _rmse(est.t_serve(n, L, S) - t for n, L, S, t in samples)


# --------------------------------------------------------------------------- fitting


def _fit_bilinear(
    samples: Sequence[Sequence[float]], nonneg: bool
) -> tuple[float, float, float, float]:
    """Least-squares fit of ``t = c1·x·y + c2·x + c3·y + c4`` with scipy's curve_fit."""
    import warnings

    import numpy as np
    from scipy.optimize import OptimizeWarning, curve_fit

    arr = np.asarray(samples, dtype=float)
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise ValueError("samples must be (x, y, seconds) triples")
    if len(arr) < 4:
        raise ValueError(f"need at least 4 samples to fit 4 coefficients, got {len(arr)}")
    x, y, t = arr[:, 0], arr[:, 1], arr[:, 2]

    def f(xy: np.ndarray, c1: float, c2: float, c3: float, c4: float) -> np.ndarray:
        return c1 * xy[0] * xy[1] + c2 * xy[0] + c3 * xy[1] + c4

    # Start from the unconstrained linear least-squares solution: the model is
    # linear in its coefficients, so this is already the optimum when it is
    # non-negative, and a good start for the bounded solver otherwise.
    design = np.column_stack([x * y, x, y, np.ones_like(x)])
    p0 = np.linalg.lstsq(design, t, rcond=None)[0]
    if nonneg:
        # Negative coefficients would let a small batch cost less than nothing
        # and break the monotonicity the batcher and the offloader rely on.
        p0 = np.clip(p0, 0.0, None)
        bounds = (0.0, np.inf)
    else:
        bounds = (-np.inf, np.inf)
    with warnings.catch_warnings():
        # Exact or degenerate data leave the covariance undefined; we never use it.
        warnings.simplefilter("ignore", OptimizeWarning)
        popt, _ = curve_fit(f, np.vstack([x, y]), t, p0=p0, bounds=bounds, maxfev=20000)
    c1, c2, c3, c4 = (float(c) for c in popt)
    return c1, c2, c3, c4


def fit(
    prefill_samples: Sequence[PrefillSample],
    decode_samples: Sequence[DecodeSample],
    batch_samples: Sequence[BatchSample] = (),
    *,
    nonneg: bool = True,
) -> tuple[Estimator, dict[str, float]]:
    """Fit eq. 3 to prefill samples and eq. 4 to one-iteration decode samples.

    Returns the estimator and its RMSEs in seconds: ``prefill_s``,
    ``decode_s`` (one iteration) and, when ``batch_samples`` are given,
    ``batch_s`` (whole S-iteration batches, never used for fitting). With
    ``nonneg`` (default) every coefficient is constrained to be >= 0.
    """
    p = _fit_bilinear(prefill_samples, nonneg)
    d = _fit_bilinear(decode_samples, nonneg)
    est = Estimator(*p, *d)
    rmse = {
        "prefill_s": prefill_rmse(est, prefill_samples),
        "decode_s": decode_rmse(est, decode_samples),
    }
    if batch_samples:
        rmse["batch_s"] = batch_rmse(est, batch_samples)
    return est, rmse
