"""Named scheduling policies: compositions of a batcher, an offloader and an interval rule.

A policy decides *what* to batch, *where* to send each batch and *when* to
schedule next; :mod:`sclsd.core.scheduler` is the mechanism that applies it.
The protocols the parts satisfy live in :mod:`sclsd.core.interfaces` and are
re-exported here with the parts, so a policy can be assembled from this module.
"""

from __future__ import annotations

from dataclasses import dataclass

from .batcher import DPBatcher, FCFSBatcher
from .interfaces import Batcher, CostModel, Interval, Offloader
from .offloader import AdaptiveInterval, FixedInterval, MaxMin, RoundRobin

__all__ = [
    "POLICIES",
    "DEFAULT_POLICY",
    "DEFAULT_GAMMA",
    "AdaptiveInterval",
    "Batcher",
    "CostModel",
    "DPBatcher",
    "FCFSBatcher",
    "FixedInterval",
    "Interval",
    "MaxMin",
    "Offloader",
    "Policy",
    "RoundRobin",
    "make_policy",
]


@dataclass(frozen=True)
class Policy:
    """One named composition of the three decisions, plus the slice length S."""

    name: str
    slice_len: int
    batcher: Batcher
    offloader: Offloader
    interval: Interval


# --------------------------------------------------------------------------- the ablation ladder

#: The paper's ablation ladder (section 6.5), each step adding one feature.
POLICIES = ("sls", "so", "pm", "ab", "lb", "scls")
DEFAULT_POLICY = "scls"

#: Default minimal interval Γ in seconds, sized for the embedded CPU model
#: (docs/estimator.md: a slice of one request there takes about 8 s, so a
#: round waits at most ~1/8 of the shortest batch; the paper used 6 s / 3 s
#: for HF / DS on A100s, and profiles may recommend their own ``gamma_s``).
DEFAULT_GAMMA = 1.0


def make_policy(
    name: str = DEFAULT_POLICY,
    *,
    slice_len: int = 128,
    max_gen: int = 1024,
    batch_size: int = 16,
    gamma: float = DEFAULT_GAMMA,
    lam: float = 0.5,
) -> Policy:
    """Build a named policy of the ablation ladder.

    - ``sls``: sequence-level: one batch runs to ``max_gen`` (the global
      generation limit), FCFS with a fixed ``batch_size``, round-robin, fixed Γ.
    - ``so``: slice-only: as sls with batches capped at ``slice_len`` iterations.
    - ``pm``: padding-mitigating: the DP batcher capped at ``batch_size``.
    - ``ab``: adaptive batching: the full DP under the memory predicate.
    - ``lb``: load balancing: ab plus max-min offloading.
    - ``scls``: lb plus the adaptive interval ``max(lam · min load, gamma)``.
    """
    if slice_len < 1 or max_gen < 1 or batch_size < 1:
        raise ValueError("slice_len, max_gen and batch_size must be >= 1")
    if name == "sls":
        return Policy(name, max_gen, FCFSBatcher(batch_size), RoundRobin(), FixedInterval(gamma))
    if name == "so":
        return Policy(name, slice_len, FCFSBatcher(batch_size), RoundRobin(), FixedInterval(gamma))
    if name == "pm":
        return Policy(name, slice_len, DPBatcher(batch_size), RoundRobin(), FixedInterval(gamma))
    if name == "ab":
        return Policy(name, slice_len, DPBatcher(), RoundRobin(), FixedInterval(gamma))
    if name == "lb":
        return Policy(name, slice_len, DPBatcher(), MaxMin(), FixedInterval(gamma))
    if name == "scls":
        return Policy(name, slice_len, DPBatcher(), MaxMin(), AdaptiveInterval(lam, gamma))
    raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
