"""Workloads for the simulator: arrival times plus true input and output lengths."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..eval.traces import Trace, poisson_arrivals


@dataclass(frozen=True)
class Workload:
    """Parallel arrays, one entry per request, sorted by arrival.

    ``output_len`` is the *true* output length: the simulator makes a request
    generate EOS when it reaches it, and never shows it to a policy.
    """

    arrival: np.ndarray
    input_len: np.ndarray
    output_len: np.ndarray

    def __len__(self) -> int:
        return len(self.arrival)

    @classmethod
    def of(cls, arrivals: list[float], inputs: list[int], outputs: list[int]) -> Workload:
        """A hand-made workload (tests)."""
        return cls(
            np.asarray(arrivals, dtype=float),
            np.asarray(inputs, dtype=np.int64),
            np.asarray(outputs, dtype=np.int64),
        )


def make_workload(
    trace: Trace,
    *,
    rate: float | None = None,
    duration: float | None = None,
    max_input: int = 1024,
    max_gen: int = 1024,
    seed: int = 0,
    long_share: float | None = None,
    long_over: int = 512,
) -> Workload:
    """Arrivals and capped lengths for one run.

    With ``rate``: Poisson arrivals at ``rate`` req/s carrying the trace's
    lengths in file order (wrapping around when the trace is shorter than the
    number of arrivals ``duration`` asks for). Without: the trace's own
    arrival times, which the trace must have. ``duration``: only requests
    arriving before that many seconds are generated. Lengths above
    ``max_input`` / ``max_gen`` are capped as the paper does.

    ``long_share`` (with ``rate``): that share of the requests (rounded) carries the
    lengths of the trace's requests generating more than ``long_over`` tokens after
    the caps, the rest those of its others, each group in file order and placed at
    random (seeded) among the arrivals: the paper's long-generation scenario (section
    6, 60 % over 512 tokens) built from a trace where long answers are rare.
    """
    if len(trace) == 0:
        raise ValueError("the trace is empty")
    capped = trace.capped(max_input, max_gen)
    if long_share is not None and rate is None:
        raise ValueError("--long-share needs --rate (it draws the trace's lengths anew)")
    if rate is not None:
        if rate <= 0:
            raise ValueError(f"--rate must be > 0, got {rate}")
        if duration is None:
            n = len(trace)
            arrivals = poisson_arrivals(n, rate, seed)
        else:
            # Enough draws that the Poisson process passes `duration` (mean + 6 sigma + slack).
            guess = int(rate * duration + 6 * math.sqrt(rate * duration) + 16)
            arrivals = poisson_arrivals(guess, rate, seed)
            while arrivals[-1] < duration:  # pragma: no cover - vanishingly rare
                guess *= 2
                arrivals = poisson_arrivals(guess, rate, seed)
            arrivals = arrivals[arrivals < duration]
            n = len(arrivals)
        if long_share is None:
            idx = np.arange(n) % len(trace)
        else:
            idx = _mixed(capped.output_tokens, n, long_share, long_over, seed)
        return Workload(arrivals, capped.input_tokens[idx], capped.output_tokens[idx])
    if not trace.has_arrivals:
        raise ValueError(
            "this trace has no arrival times (e.g. sharegpt_lengths.csv): give --rate R "
            "for Poisson arrivals at R requests per second"
        )
    arr = capped.arrival - capped.arrival[0]
    order = np.argsort(arr, kind="stable")
    keep = order if duration is None else order[arr[order] < duration]
    return Workload(arr[keep], capped.input_tokens[keep], capped.output_tokens[keep])


def _mixed(outputs: np.ndarray, n: int, share: float, over: int, seed: int) -> np.ndarray:
    """Indices into the trace for ``n`` requests, ``round(share * n)`` of them among those
    generating more than ``over`` tokens (see :func:`make_workload`)."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"--long-share must be within [0, 1], got {share}")
    if over < 0:
        raise ValueError(f"--long-over must be >= 0, got {over}")
    long_pool = np.flatnonzero(outputs > over)
    short_pool = np.flatnonzero(outputs <= over)
    n_long = round(share * n)
    if n_long and not len(long_pool):
        raise ValueError(f"the trace has no request generating more than {over} tokens "
                         "within --max-gen")
    if n - n_long and not len(short_pool):
        raise ValueError(f"the trace has no request generating {over} tokens or fewer")
    picks = np.concatenate([
        long_pool[np.arange(n_long) % max(len(long_pool), 1)],
        short_pool[np.arange(n - n_long) % max(len(short_pool), 1)],
    ])
    # A seeded permutation places the long ones among the arrivals (the arrivals' own
    # seed draws the gaps; this one only the order).
    return picks[np.random.default_rng(seed + 1).permutation(n)]
