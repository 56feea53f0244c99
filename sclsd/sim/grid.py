"""Run a grid of simulations (the paper's section 6 figures) and print Markdown tables.

    python -m sclsd.sim.grid --trace ../shared/traces/sharegpt_lengths.csv \\
        --policies sls,ils-conservative,ils-paged,scls,oracle --rates 5,10,15,20,25 \\
        --out grid.json

``util`` is the workers' busy time over workers × makespan; ``prefill`` the
share of serving time spent in prefill (re-prefills of later slices and
recomputation after preemption included). Every cell is one ``sclsd-bench sim`` run (same defaults: 8 workers,
a100-llama2-13b-hf, S = 128, 600 s of Poisson arrivals, limits 1024/1024).

A policy may carry switches after ``+``: ``scls+wc`` (work-conserving rounds),
``scls+kv`` (KV reuse), ``scls+wc+kv`` (both), as ``sclsd-bench sim
--work-conserving --kv-reuse`` would run it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from ..core.profiles import load_profile
from ..eval.traces import load_trace
from .common import SimConfig
from .engine import simulate
from .workload import make_workload

#: Switches a grid policy name may carry after "+", and the SimConfig field each sets.
SWITCHES = {"wc": "work_conserving", "kv": "kv_reuse"}


def parse_variant(name: str) -> tuple[str, dict[str, bool]]:
    """``"scls+wc+kv"`` -> ``("scls", {"work_conserving": True, "kv_reuse": True})``."""
    base, *flags = name.split("+")
    unknown = [f for f in flags if f not in SWITCHES]
    if unknown:
        raise ValueError(f"unknown switch {'+'.join(unknown)!r} in {name!r}; known: {', '.join(SWITCHES)}")
    return base, {SWITCHES[f]: True for f in flags}


#: Columns of the printed tables: (key, header, format).
COLUMNS = (
    ("throughput_rps", "req/s", "{:.2f}"),
    ("avg_latency_s", "avg RT s", "{:.0f}"),
    ("p95_latency_s", "p95 RT s", "{:.0f}"),
    ("avg_ttft_s", "avg TTFT s", "{:.0f}"),
    ("avg_batch_size", "batch", "{:.1f}"),
    ("pad_tokens_per_req", "pad/req", "{:.0f}"),
    ("invalid_tokens_per_req", "invalid/req", "{:.0f}"),
    ("slices_per_req", "slices/req", "{:.2f}"),
    ("reprefill_tokens_per_req", "re-prefill/req", "{:.0f}"),
    ("early_return_ratio", "early ret", "{:.3f}"),
    ("ct_std_s", "CT STD s", "{:.1f}"),
    ("util", "util", "{:.2f}"),
    ("prefill_share", "prefill", "{:.2f}"),
    ("preemptions", "preempt", "{:d}"),
    ("oom_events", "OOM", "{:d}"),
)


def run_grid(
    trace_path: str,
    policies: list[str],
    rates: list[float],
    slice_lens: list[int],
    *,
    profile: str = "a100-llama2-13b-hf",
    workers: int = 8,
    duration: float = 600.0,
    seed: int = 0,
    noise: float = 0.0,
    long_share: float | None = None,
) -> list[dict[str, Any]]:
    """One summary per (policy, rate, slice length), in that nesting order. ``long_share``:
    that share of requests generating more than 512 tokens (see :func:`make_workload`)."""
    prof = load_profile(profile)
    trace = load_trace(trace_path)
    rows: list[dict[str, Any]] = []
    for rate in rates:
        wl = make_workload(trace, rate=rate, duration=duration, seed=seed, long_share=long_share)
        for pol in policies:
            for S in slice_lens:
                base, switches = parse_variant(pol)
                cfg = SimConfig(
                    base, prof, workers=workers, slice_len=S, noise=noise, seed=seed, **switches
                )
                t0 = time.perf_counter()
                s = simulate(cfg, wl).summary()
                s.update(policy=pol, rate=rate, slice_len=S, wall_s=time.perf_counter() - t0)
                # Utilisation: serving seconds over workers x makespan.
                busy = sum(s["busy_s"].values())
                s["util"] = busy / (workers * s["duration_s"]) if s["duration_s"] else 0.0
                rows.append(s)
                print(f"  {pol:>16} rate {rate:g} S {S}: {s['wall_s']:.1f} s", file=sys.stderr)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    """One Markdown table, a row per run."""
    head = "| policy | rate | S | " + " | ".join(h for _, h, _ in COLUMNS) + " |"
    sep = "|---|---:|---:|" + "---:|" * len(COLUMNS)
    lines = [head, sep]
    for r in rows:
        cells = [fmt.format(r[k]) for k, _, fmt in COLUMNS]
        lines.append(
            f"| {r['policy']} | {r['rate']:g} | {r['slice_len']} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sclsd.sim.grid", description=__doc__)
    p.add_argument("--trace", required=True)
    p.add_argument("--policies", default="sls,ils-conservative,ils-paged,scls,oracle")
    p.add_argument("--rates", default="5,10,15,20,25")
    p.add_argument("--slice-lens", default="128")
    p.add_argument("--profile", default="a100-llama2-13b-hf")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--duration", type=float, default=600.0)
    p.add_argument("--noise", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--long-share", type=float,
                   help="share of requests generating more than 512 tokens (the paper: 0.6)")
    p.add_argument("--out", help="write all summaries here as JSON")
    a = p.parse_args(argv)
    rows = run_grid(
        a.trace,
        a.policies.split(","),
        [float(x) for x in a.rates.split(",")],
        [int(x) for x in a.slice_lens.split(",")],
        profile=a.profile,
        workers=a.workers,
        duration=a.duration,
        seed=a.seed,
        noise=a.noise,
        long_share=a.long_share,
    )
    print(markdown(rows))
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
