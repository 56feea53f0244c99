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
    "GRANT_POLICIES",
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
    work_conserving: bool = False
    """An idle worker triggers a round at once, and a round with idle workers splits
    batches while that lowers its estimated makespan (docs/design.md §8)."""
    kv_reuse: bool = False
    """Rounds batch requests by the worker holding their KV, estimate only the prefill
    of uncached tokens, weigh KV affinity when placing, and admit requests without
    KV only while the fleet can keep the KV of everything in progress."""
    first_slice_len: int = 0
    """With both switches: newcomers that a work-conserving round places on a worker
    with other work waiting run this many iterations first (0: a whole slice), so
    they give their first tokens without holding that work up for a whole slice (KV
    reuse makes the extra slice boundary cheap). See :mod:`sclsd.core.rounds`."""
    max_slice_gap_s: float | None = None
    """Bound on the wait between two slices of a request already streaming (None or 0:
    off, the paper's rounds). With it on, rounds place streaming requests before
    requests that have not started, and a streaming request that would otherwise wait
    longer than this since its last slice ended goes into the next dispatch, whatever
    the interval (:class:`sclsd.core.scheduler.Scheduler`)."""

    @property
    def gap_bound(self) -> float | None:
        """``max_slice_gap_s`` when on (> 0), else None."""
        b = self.max_slice_gap_s
        return b if b is not None and b > 0 else None


# --------------------------------------------------------------------------- the ablation ladder

#: The paper's ablation ladder (section 6.5), each step adding one feature.
POLICIES = ("sls", "so", "pm", "ab", "lb", "scls")
DEFAULT_POLICY = "scls"

#: Slice grants on continuous-batching workers (:class:`sclsd.core.grants.GrantPolicy`,
#: driven by :class:`sclsd.core.grant_scheduler.SliceGrantScheduler`): not a composition of batcher,
#: offloader and interval; :func:`make_policy` gives it inert parts and its slice length.
GRANT_POLICIES = ("scls-cb",)

#: Default minimal interval Γ in seconds, sized for the embedded CPU model
#: (docs/estimator.md: a slice of one request there takes about 8 s, so a
#: round waits at most ~1/8 of the shortest batch; the paper used 6 s / 3 s
#: for HF / DS on A100s, and profiles may recommend their own ``gamma_s``).
DEFAULT_GAMMA = 1.0

#: Newcomers' first slice under both switches is S / 8 iterations (16 at S = 128):
#: long enough that its fixed cost (one more prefill forward) stays small against
#: it, short enough that the batch it delays waits about a second on the A100
#: profiles (docs/benchmarks.md, "Making slicing pay").
FIRST_SLICE_DIVISOR = 8


def make_policy(
    name: str = DEFAULT_POLICY,
    *,
    slice_len: int = 128,
    max_gen: int = 1024,
    batch_size: int = 16,
    gamma: float = DEFAULT_GAMMA,
    lam: float = 0.5,
    work_conserving: bool = False,
    kv_reuse: bool = False,
    max_slice_gap_s: float | None = None,
) -> Policy:
    """Build a named policy of the ablation ladder.

    - ``sls``: sequence-level: one batch runs to ``max_gen`` (the global
      generation limit), FCFS with a fixed ``batch_size``, round-robin, fixed Γ.
    - ``so``: slice-only: as sls with batches capped at ``slice_len`` iterations.
    - ``pm``: padding-mitigating: the DP batcher capped at ``batch_size``.
    - ``ab``: adaptive batching: the full DP under the memory predicate.
    - ``lb``: load balancing: ab plus max-min offloading.
    - ``scls``: lb plus the adaptive interval ``max(lam · min load, gamma)``.

    ``work_conserving``, ``kv_reuse`` and ``max_slice_gap_s`` go past the paper
    (docs/design.md §8; all off reproduces it) and apply to any of them; see
    :class:`Policy`. The slice-grant policy ignores ``max_slice_gap_s`` (a grant that
    stays on its worker continues at its next iteration).
    """
    if max_slice_gap_s is not None and not max_slice_gap_s >= 0:
        raise ValueError(f"max_slice_gap_s must be >= 0, got {max_slice_gap_s}")
    if slice_len < 1 or max_gen < 1 or batch_size < 1:
        raise ValueError("slice_len, max_gen and batch_size must be >= 1")
    parts: tuple[int, Batcher, Offloader, Interval]
    if name == "sls":
        parts = (max_gen, FCFSBatcher(batch_size), RoundRobin(), FixedInterval(gamma))
    elif name == "so":
        parts = (slice_len, FCFSBatcher(batch_size), RoundRobin(), FixedInterval(gamma))
    elif name == "pm":
        parts = (slice_len, DPBatcher(batch_size), RoundRobin(), FixedInterval(gamma))
    elif name == "ab":
        parts = (slice_len, DPBatcher(), RoundRobin(), FixedInterval(gamma))
    elif name == "lb":
        parts = (slice_len, DPBatcher(), MaxMin(), FixedInterval(gamma))
    elif name == "scls":
        parts = (slice_len, DPBatcher(), MaxMin(), AdaptiveInterval(lam, gamma))
    elif name in GRANT_POLICIES:
        # The grant scheduler (sclsd.core.grant_scheduler) decides by itself; the parts are inert.
        # Grants are work-conserving and keep KV by construction.
        parts = (slice_len, FCFSBatcher(1), MaxMin(), FixedInterval(gamma))
        work_conserving = kv_reuse = True
    else:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
    S, batcher, offloader, interval = parts
    return Policy(
        name,
        S,
        batcher,
        offloader,
        interval,
        work_conserving=work_conserving,
        kv_reuse=kv_reuse,
        first_slice_len=max(1, S // FIRST_SLICE_DIVISOR),
        max_slice_gap_s=None if name in GRANT_POLICIES else max_slice_gap_s,
    )
