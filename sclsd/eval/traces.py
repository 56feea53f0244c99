"""Request traces: CSV with ``arrival_s, input_tokens, output_tokens`` (see the traces README)."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Trace:
    """Parallel arrays, one entry per request, in file order."""

    arrival: np.ndarray  # float seconds from the first request; NaN where the trace has none
    input_tokens: np.ndarray  # int64
    output_tokens: np.ndarray  # int64

    def __len__(self) -> int:
        return len(self.input_tokens)

    @property
    def has_arrivals(self) -> bool:
        return bool(len(self)) and not np.isnan(self.arrival).any()

    def capped(self, max_input: int, max_gen: int) -> Trace:
        """Lengths above the limits capped, as the paper does (1024/1024); zeros raised to 1."""
        return Trace(
            self.arrival,
            np.clip(self.input_tokens, 1, max_input),
            np.clip(self.output_tokens, 1, max_gen),
        )

    def head(self, n: int) -> Trace:
        return Trace(self.arrival[:n], self.input_tokens[:n], self.output_tokens[:n])


def load_trace(path: str | Path) -> Trace:
    """Read a trace CSV. Raises ValueError naming the line of a malformed row."""
    arr: list[float] = []
    inp: list[int] = []
    out: list[int] = []
    if not Path(path).is_file():
        raise FileNotFoundError(
            f"trace {path} not found: the request traces live in ../shared/traces/ beside the "
            "repository (see their README); give another with --trace PATH")
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        need = {"arrival_s", "input_tokens", "output_tokens"}
        if not reader.fieldnames or not need.issubset(reader.fieldnames):
            raise ValueError(f"{path}: header must have {sorted(need)}, got {reader.fieldnames}")
        for lineno, row in enumerate(reader, start=2):
            try:
                a = row["arrival_s"].strip()
                arr.append(float(a) if a else float("nan"))
                inp.append(int(row["input_tokens"]))
                out.append(int(row["output_tokens"]))
            except (ValueError, AttributeError) as exc:
                raise ValueError(f"{path}:{lineno}: bad row {row!r}: {exc}") from None
    return Trace(np.asarray(arr, dtype=float), np.asarray(inp, dtype=np.int64), np.asarray(out, dtype=np.int64))


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> np.ndarray:
    """Arrival times of ``n`` requests of a Poisson process at ``rate`` req/s, starting at 0."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    t = np.cumsum(gaps)
    return t - t[0] if n else t
