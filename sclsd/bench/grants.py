"""``sclsd-bench grants``: ``scls-cb`` against continuous batching and ``scls``, in simulation.

    sclsd-bench grants --out out/grants.json --md out/grants.md
    sclsd-bench grants --trace azure-conv=PATH --trace mooncake-conv=PATH   # held-out traces too

For each profile of ``--profiles`` (default ``a100-llama2-13b-hf`` and
``a100-llama2-13b-ds``) it runs the paper's setting (8 workers, S = 128,
600 s of Poisson arrivals, seed 1, limits 1024/1024) on every trace (ShareGPT
lengths, Azure code, Mooncake, and any ``--trace NAME=PATH``):

- at 20 req/s: scls-cb, ils-paged, ils-conservative, scls-cb with the plain
  grant rules (``scls-cb/basic``: :meth:`~sclsd.core.grants.GrantRules.basic`,
  full grants and moves priced by their re-prefill alone, as before the rules
  that keep reservations close to use) and, on ShareGPT, scls;
- at 5 and 2 req/s: scls-cb, ils-paged.

Every run reports goodput under :data:`~sclsd.eval.metrics.DEFAULT_SLO` (TTFT
<= 2 s, no inter-token gap over 1 s) and the percentiles of the requests'
longest inter-token gaps beside throughput; ``--only-rates 5,2`` runs the
goodput target's rows alone.

Every run is what ``sclsd-bench sim --trace T --policy P --profile X
--workers 8 --slice-len 128 --rate R --duration 600 --seed 1`` prints (same
workload, same :class:`~sclsd.sim.common.SimConfig`), called through the
simulator's Python API, plus the continuous-batching simulators' counters
(KV used, model seconds by cost term) and ``bound_rps``, the most any
schedule could serve given the arrivals. Then, unless ``--no-scale``, the
many-worker check: 64 workers on ShareGPT at 8 × 20 req/s, scls-cb with every
grant round timed, and ils-paged beside it.

Writes every run's summary as JSON (``--out``) and, per profile, Markdown
tables of the runs, of their costs and of the targets checked against the
numbers (``--md``; :mod:`sclsd.bench.grants_report`). Step ``grants`` of
``make bench``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..core.estimator import Estimator
from ..core.grants import GrantRules
from ..core.profiles import Profile, load_profile
from ..eval.metrics import DEFAULT_SLO
from ..eval.traces import load_trace
from ..sim.cb import CBSimulation
from ..sim.common import SimConfig, SimResult
from ..sim.engine import simulate
from ..sim.ils import ILSSimulation
from ..sim.workload import Workload, make_workload
from .grants_report import HEAVY_RATE, LIGHT_RATES, label, markdown

#: Trace names and their files (relative to the repository root).
TRACES: dict[str, str] = {
    "sharegpt": "../shared/traces/sharegpt_lengths.csv",
    "azure-code": "../shared/traces/azure2023_code.csv",
    "mooncake": "../shared/traces/mooncake_synthetic.csv",
}
PROFILES: tuple[str, ...] = ("a100-llama2-13b-hf", "a100-llama2-13b-ds")
#: The many-worker check: workers, and the rate per worker of the paper's setting.
SCALE_WORKERS = 64
SCALE_RATE_PER_WORKER = HEAVY_RATE / 8
#: scls-cb under the plain grant rules (GrantRules.basic()), as a policy name of the tables.
BASIC = "scls-cb/basic"


@dataclass(frozen=True)
class Case:
    """One workload (trace at a Poisson rate) and the policies run on it."""

    trace: str
    rate: float
    policies: tuple[str, ...]


def cases_for(traces: Sequence[str]) -> tuple[Case, ...]:
    """The runs of one profile on ``traces``, in table order."""
    out = [Case(t, HEAVY_RATE, ("scls-cb", "ils-paged", "ils-conservative", BASIC)
                + (("scls",) if t == "sharegpt" else ())) for t in traces]
    out += [Case(t, rate, ("scls-cb", "ils-paged")) for rate in LIGHT_RATES for t in traces]
    return tuple(out)


#: The runs of one profile on the shared traces.
CASES: tuple[Case, ...] = cases_for(tuple(TRACES))


def _named_trace(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, path


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``sclsd-bench grants``."""
    p.add_argument("--profiles", default=",".join(PROFILES), help="comma-separated profile names")
    p.add_argument("--sharegpt", default=TRACES["sharegpt"], help="ShareGPT lengths trace CSV")
    p.add_argument("--azure-code", default=TRACES["azure-code"], help="Azure 2023 code trace CSV")
    p.add_argument("--mooncake", default=TRACES["mooncake"], help="Mooncake trace CSV")
    p.add_argument("--trace", action="append", type=_named_trace, default=[], metavar="NAME=PATH",
                   help="another trace to run every case on (e.g. a held-out one); repeatable")
    p.add_argument("--only-traces", help="comma-separated trace names to run (default: all)")
    p.add_argument("--only-rates", help="comma-separated rates to run (default: 20,5,2); "
                   "5,2 gives the goodput target's rows alone")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--slice-len", type=int, default=128)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of Poisson arrivals")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--no-scale", action="store_true", help="skip the 64-worker check")
    p.add_argument("--scale-workers", type=int, default=SCALE_WORKERS)
    p.add_argument("--out", default="out/grants.json",
                   help="every run's summary, JSON: {runs: [...], scale: [...]}")
    p.add_argument("--md", default="out/grants.md", help="tables and target checks, Markdown")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    """Run every case on every profile, write JSON and Markdown; 0 on success, 2 on a usage error."""
    paths = {"sharegpt": args.sharegpt, "azure-code": args.azure_code, "mooncake": args.mooncake}
    paths.update(dict(args.trace))
    try:
        if args.only_traces:
            keep = [t for t in args.only_traces.split(",") if t]
            unknown = [t for t in keep if t not in paths]
            if unknown:
                raise ValueError(f"--only-traces: no trace named {unknown[0]!r}")
            paths = {t: paths[t] for t in keep}
        if args.workers < 1 or args.slice_len < 1 or args.scale_workers < 1:
            raise ValueError("--workers, --scale-workers and --slice-len must be >= 1")
        if args.duration <= 0:
            raise ValueError("--duration must be > 0")
        missing = [p for p in paths.values() if not Path(p).is_file()]
        if missing:
            raise ValueError(
                f"trace not found: {missing[0]} (run from the repository root, beside ../shared/)"
            )
        profiles = [load_profile(name) for name in args.profiles.split(",") if name]
        if not profiles:
            raise ValueError("--profiles names no profile")
        cases = cases_for(tuple(paths))
        if args.only_rates:
            rates = {float(x) for x in args.only_rates.split(",") if x}
            cases = tuple(c for c in cases if c.rate in rates)
            if not cases:
                raise ValueError(f"--only-rates: no case at {args.only_rates}")
        workloads = build_workloads(paths, cases, duration=args.duration, seed=args.seed)
    except (ValueError, OSError) as exc:
        print(f"sclsd-bench grants: error: {exc}", file=sys.stderr)
        return 2
    progress = not args.no_progress and sys.stderr.isatty()
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for prof in profiles:
        rows += run_cases(
            prof, cases, workloads, workers=args.workers, slice_len=args.slice_len,
            seed=args.seed, duration=args.duration, progress=progress,
        )
    scale: list[dict[str, Any]] = []
    if not args.no_scale and "sharegpt" in paths:
        scale = run_scale(profiles[0], paths["sharegpt"], workers=args.scale_workers,
                          slice_len=args.slice_len, duration=args.duration, seed=args.seed,
                          progress=progress)
    text = markdown(rows, scale)
    body = json.dumps({"runs": rows, "scale": scale}, indent=1) + "\n"
    for path, content in ((args.out, body), (args.md, text)):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(content)
    print(text)
    print(f"{len(rows) + len(scale)} runs in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return 0


def build_workloads(
    paths: Mapping[str, str], cases: Sequence[Case], *, duration: float, seed: int,
    max_input: int = 1024, max_gen: int = 1024,
) -> dict[tuple[str, float], Workload]:
    """One workload per (trace, rate) of ``cases``, built as ``sclsd-bench sim`` builds it."""
    out: dict[tuple[str, float], Workload] = {}
    for case in cases:
        key = (case.trace, case.rate)
        if key not in out:
            out[key] = make_workload(
                load_trace(paths[case.trace]), rate=case.rate, duration=duration,
                max_input=max_input, max_gen=max_gen, seed=seed,
            )
    return out


def bound_rps(wl: Workload, est: Estimator, max_gen: int) -> float:
    """The most requests per second any schedule can serve ``wl``: each request alone on a
    worker from its arrival (its prefill, then one-row decode steps) ends no sooner, so the
    run lasts at least until the latest of those ends (eq. 1-4 with n = 1)."""
    if not len(wl):
        return 0.0
    out = np.minimum(wl.output_len, max_gen).astype(float)
    inp = wl.input_len.astype(float)
    alone = est.p1 * inp + est.p2 + est.p3 * inp + est.p4
    s_l = out * inp + out * (out + 1) / 2.0  # Σ contexts over its decode steps
    alone = alone + (est.d1 + est.d3) * s_l + (est.d2 + est.d4) * out
    span = float(np.max(wl.arrival + alone) - wl.arrival[0])
    return len(wl) / span if span > 0 else float("inf")


def simulate_counted(cfg: SimConfig, wl: Workload,
                     rules: GrantRules | None = None) -> tuple[SimResult, dict[str, Any]]:
    """Run one simulation (scls-cb under ``rules``, if given); for the continuous-batching
    policies also their counters."""
    if cfg.policy == "scls-cb":
        cb = CBSimulation(cfg, wl, rules)
        return cb.run(), cb.counters()
    if cfg.policy in ("ils-paged", "ils-conservative"):
        ils = ILSSimulation(cfg, wl)
        return ils.run(), ils.counters()
    return simulate(cfg, wl), {}


def _summary(res: SimResult, counters: Mapping[str, Any]) -> dict[str, Any]:
    summary = res.summary(DEFAULT_SLO)
    summary.pop("busy_s", None)
    summary.update(counters)
    if "kv_used_frac" in summary:
        summary["kv_used_pct"] = 100.0 * summary["kv_used_frac"]
    return summary


def run_cases(
    profile: Profile,
    cases: Sequence[Case],
    workloads: Mapping[tuple[str, float], Workload],
    *,
    workers: int = 8,
    slice_len: int = 128,
    seed: int = 1,
    duration: float | None = None,
    max_input: int = 1024,
    max_gen: int = 1024,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """Every (case, policy) on one profile: the run's summary tagged with its settings.

    The :class:`SimConfig` is the one ``sclsd-bench sim`` builds from its
    defaults, so each summary holds what that command reports.
    """
    rows: list[dict[str, Any]] = []
    name = profile.name or "profile"
    for case in cases:
        wl = workloads[(case.trace, case.rate)]
        bound = bound_rps(wl, profile.estimator, max_gen)
        for pol in case.policies:
            cfg = SimConfig(
                policy="scls-cb" if pol == BASIC else pol, profile=profile, workers=workers,
                slice_len=slice_len, max_gen=max_gen, max_input=max_input, seed=seed,
                progress=progress,
            )
            t0 = time.perf_counter()
            res, counters = simulate_counted(cfg, wl, GrantRules.basic() if pol == BASIC else None)
            wall = time.perf_counter() - t0
            row: dict[str, Any] = {
                "profile": name, "trace": case.trace, "rate": case.rate, "policy": pol,
                "workers": workers, "slice_len": slice_len, "arrival_window_s": duration,
                "seed": seed, "bound_rps": bound,
            }
            row.update(_summary(res, counters))
            row["worker_completion_s"] = res.worker_completion
            row["wall_s"] = wall
            rows.append(row)
            print(f"  {name} {label(case.trace)} {case.rate:g} {pol}: "
                  f"{row['throughput_rps']:.3f} req/s, goodput {row['goodput_rps']:.3f}, "
                  f"gap p99 {row.get('p99_gap_s', 0.0):.2f} s, simulated in {wall:.1f} s",
                  file=sys.stderr, flush=True)
    return rows


def run_scale(
    profile: Profile, trace: str, *, workers: int = SCALE_WORKERS, slice_len: int = 128,
    duration: float = 600.0, seed: int = 1, progress: bool = False,
) -> list[dict[str, Any]]:
    """ShareGPT on ``workers`` workers at the paper's rate per worker: scls-cb with every grant
    round timed (``round_us``: count, p50, p99, max), then ils-paged; wall seconds of each."""
    rate = SCALE_RATE_PER_WORKER * workers
    wl = make_workload(load_trace(trace), rate=rate, duration=duration, seed=seed)
    out: list[dict[str, Any]] = []
    for pol in ("scls-cb", "ils-paged"):
        cfg = SimConfig(policy=pol, profile=profile, workers=workers, slice_len=slice_len,
                        seed=seed, progress=progress)
        row: dict[str, Any] = {"profile": profile.name, "trace": "sharegpt", "rate": rate,
                               "policy": pol, "workers": workers}
        t0 = time.perf_counter()
        if pol == "scls-cb":
            sim = CBSimulation(cfg, wl)
            sim.round_s = []
            res = sim.run()
            us = np.asarray(sim.round_s) * 1e6
            row["round_us"] = {"count": int(len(us)), "p50": float(np.percentile(us, 50)),
                               "p99": float(np.percentile(us, 99)), "max": float(us.max())}
        else:
            res = simulate(cfg, wl)
        row["wall_s"] = time.perf_counter() - t0
        s = res.summary()
        row.update({k: s[k] for k in ("throughput_rps", "completed", "preemptions", "oom_events")})
        out.append(row)
        print(f"  {workers} workers {pol}: {row['throughput_rps']:.3f} req/s, simulated in "
              f"{row['wall_s']:.1f} s", file=sys.stderr, flush=True)
    return out
