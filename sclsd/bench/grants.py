"""``sclsd-bench grants``: ``scls-cb`` against continuous batching and ``scls``, in simulation.

    sclsd-bench grants --out out/grants.json --md out/grants.md

For each profile of ``--profiles`` (default ``a100-llama2-13b-hf`` and
``a100-llama2-13b-ds``) it runs the paper's setting (8 workers, S = 128,
600 s of Poisson arrivals, seed 1) for

- ShareGPT lengths at 20 req/s: scls-cb, ils-paged, ils-conservative, scls;
- Azure code lengths at 20 req/s: scls-cb, ils-paged, ils-conservative;
- ShareGPT lengths at 5 and 2 req/s: scls-cb, ils-paged.

Every run is what ``sclsd-bench sim --trace T --policy P --profile X
--workers 8 --slice-len 128 --rate R --duration 600 --seed 1`` prints (same
workload, same :class:`~sclsd.sim.common.SimConfig`), called through the
simulator's Python API. Writes every run's summary as JSON (``--out``) and,
per profile, a Markdown table plus the targets of scls-cb checked against the
numbers (``--md``). Step ``grants`` of ``make bench``.
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

from ..core.profiles import Profile, load_profile
from ..eval.traces import load_trace
from ..sim.common import SimConfig
from ..sim.engine import simulate
from ..sim.workload import Workload, make_workload

#: Trace names and their files (relative to the repository root).
TRACES: dict[str, str] = {
    "sharegpt": "../shared/traces/sharegpt_lengths.csv",
    "azure-code": "../shared/traces/azure2023_code.csv",
}
#: Trace names as the tables print them.
TRACE_LABELS: dict[str, str] = {"sharegpt": "ShareGPT", "azure-code": "Azure code"}
PROFILES: tuple[str, ...] = ("a100-llama2-13b-hf", "a100-llama2-13b-ds")


@dataclass(frozen=True)
class Case:
    """One workload (trace at a Poisson rate) and the policies run on it."""

    trace: str
    rate: float
    policies: tuple[str, ...]


#: The runs of one profile, in table order.
CASES: tuple[Case, ...] = (
    Case("sharegpt", 20.0, ("scls-cb", "ils-paged", "ils-conservative", "scls")),
    Case("azure-code", 20.0, ("scls-cb", "ils-paged", "ils-conservative")),
    Case("sharegpt", 5.0, ("scls-cb", "ils-paged")),
    Case("sharegpt", 2.0, ("scls-cb", "ils-paged")),
)

#: Columns of the per-profile table after trace+rate and policy: (key, header, format).
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("throughput_rps", "req/s", "{:.3f}"),
    ("ct_std_s", "CT STD s", "{:.2f}"),
    ("avg_latency_s", "avg RT s", "{:.2f}"),
    ("avg_ttft_s", "avg TTFT s", "{:.2f}"),
    ("preemptions", "preemptions", "{:d}"),
    ("oom_events", "OOM events", "{:d}"),
    ("migrations", "migrations", "{:d}"),
    ("reprefill_tokens_per_req", "re-prefill tok/req", "{:.0f}"),
)

#: Rates at which scls-cb must match continuous batching's throughput (heavy load).
HEAVY_RATE = 20.0
#: Rates at which scls-cb must match its latency (light load).
LIGHT_RATES: tuple[float, ...] = (5.0, 2.0)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``sclsd-bench grants``."""
    p.add_argument("--profiles", default=",".join(PROFILES), help="comma-separated profile names")
    p.add_argument("--sharegpt", default=TRACES["sharegpt"], help="ShareGPT lengths trace CSV")
    p.add_argument("--azure-code", default=TRACES["azure-code"], help="Azure 2023 code trace CSV")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--slice-len", type=int, default=128)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of Poisson arrivals")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default="out/grants.json", help="every run's summary, JSON")
    p.add_argument("--md", default="out/grants.md", help="tables and target checks, Markdown")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    """Run every case on every profile, write JSON and Markdown; 0 on success, 2 on a usage error."""
    paths = {"sharegpt": args.sharegpt, "azure-code": args.azure_code}
    try:
        if args.workers < 1 or args.slice_len < 1:
            raise ValueError("--workers and --slice-len must be >= 1")
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
        workloads = build_workloads(paths, CASES, duration=args.duration, seed=args.seed)
    except (ValueError, OSError) as exc:
        print(f"sclsd-bench grants: error: {exc}", file=sys.stderr)
        return 2
    progress = not args.no_progress and sys.stderr.isatty()
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for prof in profiles:
        rows += run_cases(
            prof, CASES, workloads, workers=args.workers, slice_len=args.slice_len,
            seed=args.seed, duration=args.duration, progress=progress,
        )
    text = markdown(rows)
    for path, body in ((args.out, json.dumps(rows, indent=1) + "\n"), (args.md, text)):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(body)
    print(text)
    print(f"{len(rows)} runs in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
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
    defaults, so each summary equals what that command reports.
    """
    rows: list[dict[str, Any]] = []
    name = profile.name or "profile"
    for case in cases:
        wl = workloads[(case.trace, case.rate)]
        for pol in case.policies:
            cfg = SimConfig(
                policy=pol, profile=profile, workers=workers, slice_len=slice_len,
                max_gen=max_gen, max_input=max_input, seed=seed, progress=progress,
            )
            t0 = time.perf_counter()
            res = simulate(cfg, wl)
            summary = res.summary()
            wall = time.perf_counter() - t0
            summary.pop("busy_s", None)
            row: dict[str, Any] = {
                "profile": name, "trace": case.trace, "rate": case.rate, "policy": pol,
                "workers": workers, "slice_len": slice_len, "arrival_window_s": duration,
                "seed": seed,
            }
            row.update(summary)
            row["worker_completion_s"] = res.worker_completion
            row["wall_s"] = wall
            rows.append(row)
            print(
                f"  {name} {TRACE_LABELS.get(case.trace, case.trace)} {case.rate:g} {pol}: "
                f"{summary['throughput_rps']:.3f} req/s, simulated in {wall:.1f} s",
                file=sys.stderr, flush=True,
            )
    return rows


def _find(rows: Sequence[dict[str, Any]], profile: str, trace: str, rate: float,
          policy: str) -> dict[str, Any] | None:
    for r in rows:
        if (r["profile"], r["trace"], r["rate"], r["policy"]) == (profile, trace, rate, policy):
            return r
    return None


def _ratio(a: float, b: float) -> float:
    return a / b if b else (1.0 if a == 0 else float("inf"))


def targets(rows: Sequence[dict[str, Any]], profile: str) -> list[dict[str, Any]]:
    """scls-cb's targets on one profile, each checked against the runs.

    Each entry: ``case`` (e.g. ``"ShareGPT 20"``), ``target``, ``measured``
    (text), ``ratio`` (the measured ratio, or the value itself for absolute
    targets) and ``met``. A target whose runs are missing is left out.
    """
    out: list[dict[str, Any]] = []

    def add(case: str, target: str, measured: str, ratio: float, met: bool) -> None:
        out.append({"case": case, "target": target, "measured": measured, "ratio": ratio, "met": met})

    for trace in ("sharegpt", "azure-code"):
        case = f"{TRACE_LABELS[trace]} {HEAVY_RATE:g}"
        cb = _find(rows, profile, trace, HEAVY_RATE, "scls-cb")
        if cb is None:
            continue
        cons = _find(rows, profile, trace, HEAVY_RATE, "ils-conservative")
        paged = _find(rows, profile, trace, HEAVY_RATE, "ils-paged")
        if cons is not None:
            x = _ratio(cb["throughput_rps"], cons["throughput_rps"])
            add(case, "throughput ≥ 1.05× ils-conservative",
                f"{cb['throughput_rps']:.3f} / {cons['throughput_rps']:.3f} = {x:.3f}×", x, x >= 1.05)
        if paged is not None:
            x = _ratio(cb["throughput_rps"], paged["throughput_rps"])
            add(case, "throughput ≥ 1.0× ils-paged",
                f"{cb['throughput_rps']:.3f} / {paged['throughput_rps']:.3f} = {x:.3f}×", x, x >= 1.0)
        add(case, "preemptions = 0", f"{cb['preemptions']:d}", float(cb["preemptions"]),
            cb["preemptions"] == 0)
        add(case, "OOM events = 0", f"{cb['oom_events']:d}", float(cb["oom_events"]),
            cb["oom_events"] == 0)
        if cons is not None:
            x = _ratio(cb["ct_std_s"], cons["ct_std_s"])
            add(case, "CT STD ≤ 0.5× ils-conservative's",
                f"{cb['ct_std_s']:.2f} / {cons['ct_std_s']:.2f} s = {x:.3f}×", x, x <= 0.5)
    for rate in LIGHT_RATES:
        case = f"{TRACE_LABELS['sharegpt']} {rate:g}"
        cb = _find(rows, profile, "sharegpt", rate, "scls-cb")
        if cb is None:
            continue
        paged = _find(rows, profile, "sharegpt", rate, "ils-paged")
        if paged is not None:
            x = _ratio(cb["avg_latency_s"], paged["avg_latency_s"])
            add(case, "avg RT ≤ 1.1× ils-paged's",
                f"{cb['avg_latency_s']:.2f} / {paged['avg_latency_s']:.2f} s = {x:.3f}×", x, x <= 1.1)
        add(case, "avg TTFT ≤ 1 s", f"{cb['avg_ttft_s']:.2f} s", cb["avg_ttft_s"],
            cb["avg_ttft_s"] <= 1.0)
    return out


def table(rows: Sequence[dict[str, Any]], profile: str) -> str:
    """The runs of one profile as a Markdown table, a row per (trace, rate, policy)."""
    lines = [
        "| trace, rate | policy | " + " | ".join(h for _, h, _ in COLUMNS) + " |",
        "|---|---|" + "---:|" * len(COLUMNS),
    ]
    for r in rows:
        if r["profile"] != profile:
            continue
        cells = [fmt.format(r[k]) if k in r else "–" for k, _, fmt in COLUMNS]
        label = f"{TRACE_LABELS.get(r['trace'], r['trace'])} {r['rate']:g}"
        lines.append(f"| {label} | {r['policy']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def target_table(rows: Sequence[dict[str, Any]], profile: str) -> str:
    """:func:`targets` of one profile as a Markdown table."""
    lines = ["| case | scls-cb target | measured | met |", "|---|---|---|---|"]
    for t in targets(rows, profile):
        lines.append(f"| {t['case']} | {t['target']} | {t['measured']} | {'yes' if t['met'] else 'no'} |")
    return "\n".join(lines) + "\n"


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """Per profile: a heading, the runs' table, then the target checks."""
    out: list[str] = []
    for prof in dict.fromkeys(r["profile"] for r in rows):
        out += [f"### {prof}\n", table(rows, prof), "Targets:\n", target_table(rows, prof)]
    return "\n".join(out)
