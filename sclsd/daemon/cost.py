"""The daemon's cost model: a profile's estimator plus the live workers' memory.

The estimator comes from the configured profile, else from the profile a worker
sends at register, else from the built-in profile of the CPU default model. The
memory predicate is ``[scheduler] memory``:

- ``kv``: eq. 8 with the Δ and M_ava the workers report, taking the tightest
  worker so a batch fits wherever it lands (the profile's facts until one registers);
- ``rules``: a rule table (Algorithm 2), the profile's if it has one, else the
  paper's DeepSpeed table; the workers' reports do not change it.
"""

from __future__ import annotations

import logging

import numpy as np

from .. import protocol as P
from ..config import Config
from ..core.estimator import Estimator
from ..core.memory import KVMemory, RuleTable
from ..core.profiles import DEFAULT_PROFILE, Profile, ProfileCost, load_profile

log = logging.getLogger("sclsd.cost")

#: What the batcher counts on of a worker's memory after it ran out of it (again at each).
OOM_SHRINK = 0.85


class DaemonCost:
    """Implements :class:`sclsd.core.interfaces.CostModel` (and the batcher's linear fast path)
    by delegating to a :class:`ProfileCost` rebuilt whenever the set of workers changes."""

    def __init__(self, profile: Profile, zeta: float, pinned: bool = False,
                 memory_model: str = "kv") -> None:
        if memory_model not in ("kv", "rules"):
            raise ValueError(f"memory model must be 'kv' or 'rules', got {memory_model!r}")
        self.profile = profile
        self.zeta = zeta
        self.pinned = pinned  # a configured profile is never replaced by a worker's
        self.memory_model = memory_model
        self.memory: dict[str, tuple[int, int]] = {}
        #: Each worker's KV page in tokens (slice grants reserve whole pages).
        self.pages: dict[str, int] = {}
        self.inner: ProfileCost = profile.cost(zeta)
        self._rebuild()

    @classmethod
    def initial(cls, cfg: Config) -> DaemonCost:
        name = cfg.scheduler.profile or DEFAULT_PROFILE
        return cls(load_profile(name), cfg.scheduler.zeta, pinned=bool(cfg.scheduler.profile),
                   memory_model=cfg.scheduler.memory)

    @property
    def kv_page_tokens(self) -> int:
        """The largest KV page of the live workers (1 without any)."""
        return max(self.pages.values(), default=1)

    @property
    def estimator(self) -> Estimator:
        return self.inner.estimator

    def on_register(self, reg: P.Register) -> None:
        if reg.profile and not self.pinned:
            try:
                self.profile = Profile.from_dict(reg.profile)
                log.info("estimator from worker=%s profile %s", reg.worker_id, self.profile.name)
            except ValueError as exc:
                log.warning("worker=%s sent an unusable profile (%s); keeping %s",
                            reg.worker_id, exc, self.profile.name)
        if reg.kv_bytes_per_token > 0 and reg.mem_available > 0:
            self.memory[reg.worker_id] = (reg.kv_bytes_per_token, reg.mem_available)
        self.pages[reg.worker_id] = reg.caps.kv_page_tokens
        self._rebuild()

    def on_oom(self, wid: str) -> None:
        """Worker ``wid`` ran out of memory on a batch its M_ava said would fit: from now on the
        batcher counts on :data:`OOM_SHRINK` of what it counted on (again at each OOM)."""
        if wid in self.memory:
            delta, mem = self.memory[wid]
            self.memory[wid] = (delta, int(mem * OOM_SHRINK))
            log.warning("worker=%s ran out of memory: counting on %.2f GiB of KV memory from now on",
                        wid, mem * OOM_SHRINK / 2**30)
            self._rebuild()

    def on_dead(self, wid: str) -> None:
        self.memory.pop(wid, None)
        self.pages.pop(wid, None)
        self._rebuild()

    def _rebuild(self) -> None:
        p = self.profile
        est = p.estimator
        delta, m_avail = p.kv_bytes_per_token, p.mem_available
        if self.memory:
            # The tightest worker, so a batch fits wherever it lands.
            delta, m_avail = min(self.memory.values(), key=lambda dm: dm[1] / dm[0])
        mem: KVMemory | RuleTable
        if self.memory_model == "rules":
            mem = p.rules or RuleTable.deepspeed()
        else:
            mem = KVMemory(delta, m_avail, self.zeta)
        # Δ and the host tier feed what KV reuse needs (CachedCost), under either predicate.
        self.inner = ProfileCost(est, mem, delta=delta, host_link=p.host_link_bytes_per_s,
                                 host_kv_bytes=p.host_kv_bytes or 0.0)

    def t_serve(self, n: int, input_len: int, slice_len: int) -> float:
        return self.inner.t_serve(n, input_len, slice_len)

    def oom(self, n: int, input_len: int, slice_len: int) -> bool:
        return self.inner.oom(n, input_len, slice_len)

    def linear_terms(self, L: np.ndarray, S: int) -> tuple[np.ndarray, np.ndarray]:
        return self.inner.linear_terms(L, S)

    def max_batch(self, L: np.ndarray, S: int) -> np.ndarray:
        return self.inner.max_batch(L, S)

    # ------------------------------------------------------------------ CachedCost (KV reuse)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.inner.kv_bytes_per_token

    @property
    def device_kv_bytes(self) -> float:
        return self.inner.device_kv_bytes

    @property
    def retain_bytes(self) -> float:
        return self.inner.retain_bytes

    def t_serve_cached(self, n: int, past: int, new: int, slice_len: int) -> float:
        return self.inner.t_serve_cached(n, past, new, slice_len)

    def linear_terms_cached(self, past: np.ndarray, new: np.ndarray, S: int) -> tuple[np.ndarray, np.ndarray]:
        return self.inner.linear_terms_cached(past, new, S)

    def copy_s(self, nbytes: float) -> float:
        return self.inner.copy_s(nbytes)
