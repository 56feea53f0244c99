"""Traces, arrival processes and metrics shared by the simulator and the benchmarks.

:mod:`sclsd.eval.traces` reads request traces and draws Poisson arrivals;
:mod:`sclsd.eval.metrics` is the one definition of the serving metrics, filled
alike by :mod:`sclsd.sim` (virtual clock) and :mod:`sclsd.bench` (real replays).
"""

from __future__ import annotations
