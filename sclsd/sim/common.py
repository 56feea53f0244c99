"""What both simulators share: the run's settings, its result, and request plumbing.

:mod:`sclsd.sim.engine` (slice-level and sequence-level scheduling through
core's scheduler) and :mod:`sclsd.sim.ils` (the continuous-batching
baselines) both build on this module and on no part of each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ..core.memory import RuleTable
from ..core.policy import DEFAULT_GAMMA, GRANT_POLICIES, POLICIES
from ..core.profiles import Profile
from ..core.request import Request
from ..eval.metrics import SLO, BatchStats, RequestRecord, summarize
from .workers import SimPayload
from .workload import Workload

#: Continuous-batching baselines (sclsd.sim.ils) and the two oracles, beside core's policies.
BASELINES = ("ils-conservative", "ils-paged", "oracle", "oracle-static")
#: Core's policies, slice grants on continuous batching (sclsd.sim.cb), then the baselines.
ALL_POLICIES = POLICIES + GRANT_POLICIES + BASELINES

@dataclass
class SimConfig:
    """Everything a run needs besides the workload."""

    policy: str
    profile: Profile
    workers: int = 8
    slice_len: int = 128
    max_gen: int = 1024
    max_input: int = 1024
    """Input cap of the workload (bounds the totals of a rule table)."""
    batch_size: int = 16
    gamma: float | None = None
    """Minimal scheduling interval Γ; None takes the profile's ``gamma_s`` (else core's default)."""
    lam: float = 0.5
    zeta: float = 0.9
    noise: float = 0.0
    seed: int = 0
    block_size: int = 16
    """ils-paged: tokens per KV block."""
    watermark: float = 0.01
    """ils-paged: fraction of blocks kept free when admitting (vLLM's default)."""
    work_conserving: bool = False
    """Core's work-conserving rounds (slice-level policies and the oracles)."""
    kv_reuse: bool = False
    """Workers keep KV across slices and the policy reuses it (slice-level policies)."""
    max_slice_gap_s: float | None = None
    """Core's gap bound on the wait between two slices of a streaming request (slice-level
    policies; None or 0: off, the paper's rounds)."""
    host_kv_bytes: float | None = None
    """Host memory per worker for retained KV; None: the profile's ``host_kv_bytes``."""
    progress: bool = False

    def __post_init__(self) -> None:
        if self.policy not in ALL_POLICIES:
            raise ValueError(
                f"unknown policy {self.policy!r}; choose one of {', '.join(ALL_POLICIES)}"
            )
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")

    @property
    def gamma_s(self) -> float:
        if self.gamma is not None:
            return self.gamma
        return self.profile.gamma_s if self.profile.gamma_s is not None else DEFAULT_GAMMA

    @property
    def effective_profile(self) -> Profile:
        """The profile with ``host_kv_bytes`` overridden when given."""
        if self.host_kv_bytes is None:
            return self.profile
        return replace(self.profile, host_kv_bytes=self.host_kv_bytes)

    @property
    def kv_token_budget(self) -> float:
        """KV tokens a worker may fill: the continuous engines' and the oracle's budget.

        ζ · M_ava / Δ under the KV model. A profile with a rule table (DeepSpeed)
        says instead how many padded rows fit at each total length; the budget
        is then the most tokens the table lets one batch hold (for the paper's
        table, 12 rows × 2048 = 24,576), since M_ava / Δ overstates what that
        engine can use (the paper: eq. 8 fails for DS whatever ζ).
        """
        rules = self.profile.rules
        if rules is not None:
            return float(rules_token_budget(rules.rules, self.max_input + self.max_gen))
        return self.zeta * self.profile.mem_available / self.profile.kv_bytes_per_token

    @property
    def kv_token_capacity(self) -> float:
        """KV tokens that physically fit; above it a worker runs out of memory.

        M_ava / Δ (no safety factor) under the KV model; the table's budget for a rule table.
        """
        if self.profile.rules is not None:
            return self.kv_token_budget
        return self.profile.mem_available / self.profile.kv_bytes_per_token


def rules_token_budget(rules: tuple[tuple[int, int], ...], max_total: int) -> int:
    """Most tokens one batch may hold under a rule table ``((min_total_len, max_batch), ...)``
    (:meth:`sclsd.core.memory.RuleTable.token_budget`)."""
    return RuleTable(rules).token_budget(max_total)


@dataclass
class SimResult:
    """Per-request records and per-run counters of one simulation."""

    config: SimConfig
    requests: list[RequestRecord]
    batches: BatchStats
    worker_completion: dict[str, float | None]
    oom_events: int = 0
    preemptions: int = 0
    events: int = 0
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self, slo: SLO | None = None) -> dict[str, Any]:
        """The shared metrics (:func:`sclsd.eval.metrics.summarize`) plus run counters."""
        out: dict[str, Any] = summarize(
            self.requests,
            self.batches,
            worker_completion=self.worker_completion,
            oom_events=self.oom_events,
            slo=slo,
        )
        out["preemptions"] = self.preemptions
        out["events"] = self.events
        out["wall_s"] = self.wall_s
        out.update(self.extra)
        return out


def make_requests(workload: Workload, max_gen: int) -> list[Request]:
    """One scheduler request per workload entry; the true length hides in the payload."""
    return [
        Request(
            rid=f"r{i}",
            prompt_len=int(L),
            max_tokens=max_gen,
            arrival=float(t),
            payload=SimPayload(true_len=int(out)),
        )
        for i, (t, L, out) in enumerate(
            zip(
                workload.arrival.tolist(),
                workload.input_len.tolist(),
                workload.output_len.tolist(),
                strict=True,
            )
        )
    ]


def record_of(r: Request) -> RequestRecord:
    p: SimPayload = r.payload
    return RequestRecord(
        rid=r.rid,
        arrival=r.arrival,
        prompt_len=r.prompt_len,
        output_len=r.num_generated,
        first_token=r.first_token,
        finished=r.finished_at,
        finish_reason=r.finish_reason,
        slices=r.slices,
        pad_tokens=p.pad_tokens,
        invalid_tokens=p.invalid_tokens,
        preemptions=p.preemptions,
        reprefill_tokens=p.reprefill_tokens,
        max_gap_s=p.max_gap,
    )


def progress_bar(total: int, enabled: bool, desc: str) -> Any:
    """A tqdm bar over completed requests, or a no-op stand-in."""
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="req", desc=desc, mininterval=0.5, leave=False)


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass
