"""Discrete-event simulator: core's scheduler on a virtual clock, cost-model workers.

``simulate(SimConfig(policy, profile, ...), workload)`` runs a policy of the
ablation ladder (optionally with work-conserving rounds and KV reuse), a
continuous-batching baseline or one of the two oracles until every request
completes; ``sclsd-bench sim`` is its command line. See the
"Simulation" section of docs/benchmarks.md for the model and the baselines.
"""

from __future__ import annotations

from .common import ALL_POLICIES, SimConfig, SimResult
from .engine import simulate
from .workload import Workload, make_workload

__all__ = ["ALL_POLICIES", "SimConfig", "SimResult", "Workload", "make_workload", "simulate"]
