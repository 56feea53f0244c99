"""The daemon's cost model: a fitted estimator plus the workers' memory predicate.

The estimator comes from the configured profile, else from the profile a worker
sends at register, else from the built-in profile of the CPU default model. The
memory predicate is eq. 8 with the Δ and M_ava the workers report, taking the
smallest budget so a batch fits on whichever worker gets it; a profile with a
rule table (DeepSpeed, Algorithm 2) uses the table instead.
"""

from __future__ import annotations

import logging
from typing import Any

from . import protocol as P
from .config import Config
from .core.estimator import Estimator
from .core.memory import KVMemory

log = logging.getLogger("sclsd.cost")

DEFAULT_PROFILE = "cpu-smollm2-135m"


class DaemonCost:
    """Implements :class:`sclsd.core.policy.CostModel` for the live daemon."""

    def __init__(self, estimator: Estimator, zeta: float, rules: Any = None, pinned: bool = False) -> None:
        self.estimator = estimator
        self.zeta = zeta
        self.rules = rules
        self.pinned = pinned  # a configured profile is never replaced by a worker's
        self.memory: dict[str, KVMemory] = {}
        self._tightest: KVMemory | None = None

    @classmethod
    def initial(cls, cfg: Config) -> DaemonCost:
        from .core.profiles import load_profile

        name = cfg.scheduler.profile or DEFAULT_PROFILE
        prof = load_profile(name)
        return cls(prof.estimator, cfg.scheduler.zeta, getattr(prof, "rules", None),
                   pinned=bool(cfg.scheduler.profile))

    def on_register(self, reg: P.Register) -> None:
        if reg.kv_bytes_per_token > 0 and reg.mem_available > 0:
            self.memory[reg.worker_id] = KVMemory(reg.kv_bytes_per_token, reg.mem_available, self.zeta)
        self._recompute()
        if reg.profile and not self.pinned:
            from .core.profiles import Profile

            try:
                prof = Profile.from_dict(reg.profile)
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("worker=%s sent an unusable profile (%s); keeping the current one",
                            reg.worker_id, exc)
                return
            self.estimator = prof.estimator
            self.rules = getattr(prof, "rules", None)
            log.info("estimator from worker=%s profile: %s", reg.worker_id, prof.estimator)

    def on_dead(self, wid: str) -> None:
        self.memory.pop(wid, None)
        self._recompute()

    def _recompute(self) -> None:
        self._tightest = min(self.memory.values(), key=lambda m: m.m_avail * m.zeta / m.delta, default=None)

    def t_serve(self, n: int, input_len: int, slice_len: int) -> float:
        return self.estimator.t_serve(n, input_len, slice_len)

    def oom(self, n: int, input_len: int, slice_len: int) -> bool:
        if self.rules is not None:
            return self.rules.oom(n, input_len, slice_len)
        if self._tightest is None:
            return False
        return self._tightest.oom(n, input_len, slice_len)
