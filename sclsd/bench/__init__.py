"""Benchmarks: trace replays against a daemon, live comparisons, figures, and the sclsd-bench CLI.

Traces, arrival processes and metrics live in :mod:`sclsd.eval`, shared with
the simulator; the benchmarks may use :mod:`sclsd.sim`, never the reverse.
"""

from __future__ import annotations
