"""Benchmarks: traces, arrival processes, metrics, plots, and the sclsd-bench CLI."""

from __future__ import annotations
