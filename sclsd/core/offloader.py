"""Where each batch goes (offloaders) and when to schedule next (interval rules).

Offloaders satisfy :class:`~sclsd.core.interfaces.Offloader`; interval rules
:class:`~sclsd.core.interfaces.Interval`. ``loads`` are the active workers'
estimated queued seconds (eq. 11); the scheduler adds a batch's estimate on
dispatch and subtracts it on completion, so offloaders never mutate them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .batch import Batch


class MaxMin:
    """Max-min offloading (paper section 4.5), with a KV affinity term.

    Batches in decreasing estimated serving time, each to the least-loaded
    worker, counting the batches already placed in this call (eq. 11).

    KV reuse makes a batch cheaper on a worker that holds some of its rows' KV
    (``Batch.est_on``). Such a batch goes to the worker where it would *finish*
    first, ``load(w) + estimate on w``: it stays with its KV unless another
    worker's load is lower by more than the prefill the KV saves. The loads it
    is weighed against are those of the whole round: batches with KV are first
    counted where their KV is, the batches free to go anywhere (no ``est_on``)
    are placed max-min around them, and then each batch with KV, largest
    first, takes the worker where it finishes first. Without KV reuse only
    the middle step runs: the paper's rule, literally.

    Ties between equally loaded workers rotate (the worker after the last
    one chosen, in name order, goes first): at light load every worker is
    idle at each round, and a fixed tie-break would send every lone batch to
    the same worker while the others idle.
    """

    def __init__(self) -> None:
        self._after: str | None = None  # the worker chosen last, across calls

    def assign(self, batches: Sequence[Batch], loads: Mapping[str, float]) -> list[str]:
        """Each batch to a worker (see the class docstring); never mutates ``loads``."""
        if not loads:
            raise ValueError("no worker to assign batches to")
        local = dict(loads)  # the scheduler applies the real update after we return
        names = sorted(local)
        out: list[str] = [""] * len(batches)
        held = sorted((k for k, b in enumerate(batches) if b.est_on), key=lambda k: -_size(batches[k]))
        free = sorted((k for k, b in enumerate(batches) if not b.est_on), key=lambda k: -batches[k].est_time)
        for k in held:  # provisionally where the KV is (the cheapest holder among ``loads``)
            b = batches[k]
            here = [w for w in b.est_on if w in local] or names
            out[k] = min(here, key=lambda w: (b.est_for(w), w))
            local[out[k]] += b.est_for(out[k])
        for k in free:
            w = min(names, key=lambda w: (local[w], self._rank(names, w)))
            out[k] = w
            local[w] += batches[k].est_time
            self._after = w
        for k in held:
            b = batches[k]
            local[out[k]] -= b.est_for(out[k])
            w = min(names, key=lambda w: (local[w] + b.est_for(w), self._rank(names, w)))
            out[k] = w
            local[w] += b.est_for(w)
            self._after = w
        return out

    def _rank(self, names: list[str], w: str) -> int:
        """Tie-break: workers in name order starting after the one chosen last."""
        start = _rotation_start(names, self._after)
        return (names.index(w) - start) % len(names)


def _size(b: Batch) -> float:
    """A batch's estimate where it is cheapest: what max-min orders by."""
    return min(b.est_time, *b.est_on.values()) if b.est_on else b.est_time


def _rotation_start(names: list[str], after: str | None) -> int:
    """Index in ``names`` of the first worker (in name order) that sorts after ``after``."""
    if after is None:
        return 0
    for i, w in enumerate(names):
        if w > after:
            return i
    return 0


class RoundRobin:
    """Batches to workers in turn, ignoring load (the SLS, SO, PM and AB steps)."""

    def __init__(self) -> None:
        self._next = 0

    def assign(self, batches: Sequence[Batch], loads: Mapping[str, float]) -> list[str]:
        """Each batch to the next worker in name order."""
        if not loads:
            raise ValueError("no worker to assign batches to")
        workers = sorted(loads)
        out: list[str] = []
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
        """The first round waits Γ."""
        return self.gamma

    def next(self, loads: Mapping[str, float]) -> float:
        """Always Γ."""
        return self.gamma


@dataclass(frozen=True)
class AdaptiveInterval:
    """``T = max(λ · min_w load(w), Γ)`` (eq. 12).

    Busy workers stretch the interval so the batcher sees more requests at
    once (bigger, better-padded batches); idle ones shrink it to Γ so new
    requests do not wait. λ < 1 keeps workers from idling when the load is
    over-estimated; Γ keeps rounds from starving the batcher when it is
    under-estimated.
    """

    lam: float = 0.5
    gamma: float = 1.0

    def __post_init__(self) -> None:
        if not 0 <= self.lam <= 1:
            raise ValueError(f"lam must be in [0, 1], got {self.lam}")
        if self.gamma < 0:
            raise ValueError(f"gamma must be >= 0, got {self.gamma}")

    @property
    def initial(self) -> float:
        """The first round waits Γ."""
        return self.gamma

    def next(self, loads: Mapping[str, float]) -> float:
        """``max(λ · min load, Γ)``; Γ without workers."""
        if not loads:
            return self.gamma
        return max(self.lam * min(loads.values()), self.gamma)
