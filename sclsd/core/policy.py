"""Named scheduling policies: compositions of a batcher, an offloader and an interval rule.

A policy decides *what* to batch, *where* to send each batch and *when* to
schedule next; :mod:`sclsd.core.scheduler` is the mechanism that applies it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from .request import Request


class CostModel(Protocol):
    """Serving time and memory predicate of a worker (homogeneous workers)."""

    def t_serve(self, n: int, input_len: int, slice_len: int) -> float:
        """Estimated seconds to serve a batch of ``n`` requests padded to ``input_len``."""
        ...

    def oom(self, n: int, input_len: int, slice_len: int) -> bool:
        """True when such a batch would not fit in memory."""
        ...


class Batcher(Protocol):
    def __call__(
        self, reqs: Sequence[Request], slice_len: int, cost: CostModel
    ) -> list[list[Request]]:
        """Split the pool into batches; every request in exactly one batch."""
        ...


class Offloader(Protocol):
    def assign(self, batches: Sequence, loads: dict[str, float]) -> list[str]:
        """Pick a worker for each batch (same order as ``batches``)."""
        ...


class Interval(Protocol):
    initial: float

    def next(self, loads: dict[str, float]) -> float:
        """Seconds until the next scheduling round, given the active workers' loads."""
        ...


@dataclass(frozen=True)
class Policy:
    name: str
    slice_len: int
    batcher: Batcher
    offloader: Offloader
    interval: Interval


# --------------------------------------------------------------------------- baseline parts


@dataclass(frozen=True)
class FCFSBatcher:
    """First come, first served, fixed batch size (also capped by the memory predicate)."""

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


class RoundRobin:
    """Batches to workers in turn, ignoring load."""

    def __init__(self) -> None:
        self._next = 0

    def assign(self, batches: Sequence, loads: dict[str, float]) -> list[str]:
        workers = sorted(loads)
        out = []
        for _ in batches:
            out.append(workers[self._next % len(workers)])
            self._next += 1
        return out


@dataclass(frozen=True)
class FixedInterval:
    """Schedule every ``gamma`` seconds."""

    gamma: float

    @property
    def initial(self) -> float:
        return self.gamma

    def next(self, loads: dict[str, float]) -> float:
        return self.gamma


POLICIES = ("sls", "so")


def make_policy(
    name: str,
    *,
    slice_len: int = 128,
    max_gen: int = 1024,
    batch_size: int = 16,
    gamma: float = 1.0,
) -> Policy:
    """Build a named policy. ``max_gen`` is the global generation limit."""
    if name == "sls":
        return Policy(name, max_gen, FCFSBatcher(batch_size), RoundRobin(), FixedInterval(gamma))
    if name == "so":
        return Policy(name, slice_len, FCFSBatcher(batch_size), RoundRobin(), FixedInterval(gamma))
    raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
