"""Making slicing pay: scls with work-conserving rounds and KV reuse, against the baselines.

    python -m sclsd.sim.variants --out out/slicing.json --md out/slicing.md

Runs the grid traces × profiles × rates × variants (defaults: ShareGPT and
Azure code lengths; ``a100-llama2-13b-hf`` and ``-ds``; rates 1, 2, 5, 20;
sls, scls, scls+wc, scls+kv, scls+wc+kv, ils-conservative, ils-paged, oracle,
oracle-static), every cell one ``sclsd-bench sim`` run with 8 workers, S = 128,
600 s of Poisson arrivals, seed 1. Writes every summary as JSON, and Markdown
tables plus the issue's targets checked against the numbers. ``--rates``,
``--traces``, ``--profiles`` and ``--variants`` narrow it. Step ``slicing`` of
``make bench``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from .grid import run_grid

TRACES = {
    "sharegpt": "../shared/traces/sharegpt_lengths.csv",
    "azure-code": "../shared/traces/azure2023_code.csv",
}
PROFILES = ("a100-llama2-13b-hf", "a100-llama2-13b-ds")
RATES = (1.0, 2.0, 5.0, 20.0)
VARIANTS = (
    "sls",
    "scls",
    "scls+wc",
    "scls+kv",
    "scls+wc+kv",
    "ils-conservative",
    "ils-paged",
    "oracle",
    "oracle-static",
)

#: Columns of the tables: (key, header, format).
COLUMNS = (
    ("throughput_rps", "req/s", "{:.2f}"),
    ("avg_latency_s", "avg RT s", "{:.1f}"),
    ("p95_latency_s", "p95 RT s", "{:.1f}"),
    ("avg_ttft_s", "avg TTFT s", "{:.2f}"),
    ("reprefill_tokens_per_req", "re-prefill tok/req", "{:.0f}"),
    ("ct_std_s", "CT STD s", "{:.1f}"),
    ("avg_batch_size", "batch", "{:.1f}"),
    ("pad_tokens_per_req", "pad/req", "{:.0f}"),
    ("prefill_share", "prefill", "{:.2f}"),
    ("host_copy_share", "host copy", "{:.3f}"),
    ("kv_evictions", "evictions", "{:d}"),
)


def run(
    traces: dict[str, str],
    profiles: list[str],
    rates: list[float],
    variants: list[str],
    *,
    workers: int = 8,
    duration: float = 600.0,
    seed: int = 1,
) -> list[dict[str, Any]]:
    """Every cell's summary, tagged with its trace and profile."""
    rows: list[dict[str, Any]] = []
    for tname, tpath in traces.items():
        for prof in profiles:
            print(f"{tname} / {prof}", file=sys.stderr, flush=True)
            for r in run_grid(
                tpath, variants, rates, [128], profile=prof, workers=workers,
                duration=duration, seed=seed,
            ):
                r.pop("busy_s", None)
                r.update(trace=tname, profile=prof)
                rows.append(r)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    """One table per (trace, profile), a row per (rate, variant)."""
    out: list[str] = []
    keys = list(dict.fromkeys((r["trace"], r["profile"]) for r in rows))
    for trace, prof in keys:
        out.append(f"#### {trace}, {prof}\n")
        out.append("| rate | variant | " + " | ".join(h for _, h, _ in COLUMNS) + " |")
        out.append("|---:|---|" + "---:|" * len(COLUMNS))
        for r in rows:
            if (r["trace"], r["profile"]) == (trace, prof):
                cells = [fmt.format(r.get(k, 0)) for k, _, fmt in COLUMNS]
                out.append(f"| {r['rate']:g} | {r['policy']} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def _cell(rows: list[dict[str, Any]], trace: str, prof: str, rate: float, variant: str) -> dict[str, Any] | None:
    for r in rows:
        if (r["trace"], r["profile"], r["rate"], r["policy"]) == (trace, prof, rate, variant):
            return r
    return None


def targets(rows: list[dict[str, Any]]) -> str:
    """The issue's targets (ShareGPT lengths) checked against the numbers, per profile."""
    lines = ["| profile | target | measured | met |", "|---|---|---|---|"]
    for prof in dict.fromkeys(r["profile"] for r in rows if r["trace"] == "sharegpt"):
        def get(rate: float, v: str, prof: str = prof) -> dict[str, Any] | None:
            return _cell(rows, "sharegpt", prof, rate, v)

        s20, kv20, os20 = get(20.0, "scls"), get(20.0, "scls+kv"), get(20.0, "oracle-static")
        if s20 and kv20:
            x = kv20["throughput_rps"] / s20["throughput_rps"]
            lines.append(f"| {prof} | rate 20: scls+kv throughput ≥ 1.2× scls | "
                         f"{kv20['throughput_rps']:.2f} / {s20['throughput_rps']:.2f} = {x:.2f}× | {_yes(x >= 1.2)} |")
            y = kv20["reprefill_tokens_per_req"] / max(s20["reprefill_tokens_per_req"], 1e-9)
            lines.append(f"| {prof} | rate 20: re-prefilled tokens/req ≤ 0.2× scls's | "
                         f"{kv20['reprefill_tokens_per_req']:.0f} / {s20['reprefill_tokens_per_req']:.0f} = {y:.2f}× | {_yes(y <= 0.2)} |")
        if s20 and os20:
            z = s20["throughput_rps"] / os20["throughput_rps"]
            lines.append(f"| {prof} | rate 20: scls ≥ 0.8× oracle-static | "
                         f"{s20['throughput_rps']:.2f} / {os20['throughput_rps']:.2f} = {z:.2f}× | {_yes(z >= 0.8)} |")
        both, paged, sls = get(2.0, "scls+wc+kv"), get(2.0, "ils-paged"), get(2.0, "sls")
        if both and paged:
            a = both["avg_latency_s"] / paged["avg_latency_s"]
            lines.append(f"| {prof} | rate 2: scls+both avg RT ≤ 2× ils-paged's | "
                         f"{both['avg_latency_s']:.1f} / {paged['avg_latency_s']:.1f} s = {a:.2f}× | {_yes(a <= 2)} |")
        if both and sls:
            b = both["avg_latency_s"] / sls["avg_latency_s"]
            lines.append(f"| {prof} | rate 2: scls+both avg RT ≤ 0.5× sls's | "
                         f"{both['avg_latency_s']:.1f} / {sls['avg_latency_s']:.1f} s = {b:.2f}× | {_yes(b <= 0.5)} |")
        if both:
            lines.append(f"| {prof} | rate 2: scls+both avg TTFT ≤ 2 s | "
                         f"{both['avg_ttft_s']:.2f} s | {_yes(both['avg_ttft_s'] <= 2)} |")
    return "\n".join(lines) + "\n"


def _yes(ok: bool) -> str:
    return "yes" if ok else "no"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m sclsd.sim.variants", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--traces", default=",".join(TRACES), help=f"of {', '.join(TRACES)}")
    p.add_argument("--profiles", default=",".join(PROFILES))
    p.add_argument("--rates", default=",".join(f"{r:g}" for r in RATES))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--duration", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default="out/slicing.json", help="every summary, JSON")
    p.add_argument("--md", default="out/slicing.md", help="tables and targets, Markdown")
    a = p.parse_args(argv)
    unknown = [t for t in a.traces.split(",") if t not in TRACES]
    if unknown:
        p.error(f"unknown traces {unknown}; choose from {', '.join(TRACES)}")
    traces = {t: TRACES[t] for t in a.traces.split(",")}
    missing = [path for path in traces.values() if not Path(path).is_file()]
    if missing:
        p.error(f"trace not found: {missing[0]} (run from the repository root, beside ../shared/)")
    t0 = time.perf_counter()
    rows = run(
        traces, a.profiles.split(","), [float(x) for x in a.rates.split(",")],
        a.variants.split(","), workers=a.workers, duration=a.duration, seed=a.seed,
    )
    text = "### Targets\n\n" + targets(rows) + "\n" + markdown(rows)
    for path, body in ((a.out, json.dumps(rows, indent=1) + "\n"), (a.md, text)):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(body)
    print(text)
    print(f"{len(rows)} runs in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
