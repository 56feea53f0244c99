"""A toy estimator and profile (Δ = 1 byte, so memory counts in tokens) for the simulator's
and the policies' unit tests."""

from __future__ import annotations

from sclsd.core.estimator import Estimator
from sclsd.core.profiles import Profile

EST = Estimator(p1=2e-4, p2=1e-3, p3=1e-5, p4=0.02, d1=2e-6, d2=1e-4, d3=1e-6, d4=0.02)


def toy_profile(mem_tokens: float = 50_000, gamma: float = 1.0) -> Profile:
    """A toy profile of ``mem_tokens`` tokens of KV memory."""
    return Profile(name="toy", engine="hf", model="toy", device="sim", estimator=EST,
                   kv_bytes_per_token=1, mem_available=mem_tokens, gamma_s=gamma)
