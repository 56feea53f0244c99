"""``sclsd-bench sim``: simulate one policy on a trace with a virtual clock.

    sclsd-bench sim --trace ../shared/traces/sharegpt_lengths.csv --policy scls \\
        --profile a100-llama2-13b-hf --workers 8 --rate 20 --duration 600 --json out.json
    sclsd-bench sim ... --policy scls --work-conserving --kv-reuse   # past the paper

Writes the metrics of :mod:`sclsd.eval.metrics` (plus the run's settings)
as JSON and prints a short summary table. Exit status 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..core.profiles import load_profile
from ..eval.metrics import DEFAULT_SLO, SLO
from ..eval.traces import load_trace
from .common import ALL_POLICIES, SimConfig
from .engine import simulate
from .workload import make_workload

#: Rows of the printed summary: (JSON key, label, format).
_TABLE = (
    ("completed", "completed", "{:d}"),
    ("duration_s", "duration (s)", "{:.1f}"),
    ("throughput_rps", "throughput (req/s)", "{:.3f}"),
    ("goodput_rps", "goodput (req/s)", "{:.3f}"),
    ("output_tps", "output (tok/s)", "{:.1f}"),
    ("avg_latency_s", "latency avg (s)", "{:.2f}"),
    ("p95_latency_s", "latency p95 (s)", "{:.2f}"),
    ("avg_ttft_s", "TTFT avg (s)", "{:.2f}"),
    ("p95_ttft_s", "TTFT p95 (s)", "{:.2f}"),
    ("p50_gap_s", "max gap p50 (s)", "{:.2f}"),
    ("p95_gap_s", "max gap p95 (s)", "{:.2f}"),
    ("p99_gap_s", "max gap p99 (s)", "{:.2f}"),
    ("max_gap_s", "max gap max (s)", "{:.2f}"),
    ("avg_batch_size", "batch size avg", "{:.1f}"),
    ("pad_tokens_per_req", "pad tokens / req", "{:.1f}"),
    ("invalid_tokens_per_req", "invalid tokens / req", "{:.1f}"),
    ("slices_per_req", "slices / req", "{:.2f}"),
    ("reprefill_tokens_per_req", "re-prefilled tok / req", "{:.1f}"),
    ("early_return_ratio", "early-return ratio", "{:.3f}"),
    ("ct_std_s", "CT STD (s)", "{:.2f}"),
    ("oom_events", "OOM events", "{:d}"),
    ("preemptions", "preemptions", "{:d}"),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``sclsd-bench sim`` (the contract other tools rely on)."""
    p.add_argument(
        "--trace", required=True, help="trace CSV (arrival_s,input_tokens,output_tokens)"
    )
    p.add_argument("--policy", default="scls", choices=ALL_POLICIES)
    p.add_argument("--profile", default="a100-llama2-13b-hf", help="built-in name or JSON path")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument(
        "--rate", type=float, help="Poisson arrivals at R req/s (else the trace's own times)"
    )
    p.add_argument("--duration", type=float, help="generate arrivals for this many seconds")
    p.add_argument("--slice-len", type=int, default=128)
    p.add_argument("--max-input", type=int, default=1024, help="cap on input lengths")
    p.add_argument("--max-gen", type=int, default=1024, help="generation limit (max_tokens)")
    p.add_argument("--batch-size", type=int, default=16, help="fixed batch size (sls, so, pm)")
    p.add_argument("--gamma", type=float, help="minimal interval Γ, s (default: the profile's)")
    p.add_argument("--lam", type=float, default=0.5, help="λ of the adaptive interval")
    p.add_argument("--zeta", type=float, default=0.9, help="ζ, KV memory safety factor")
    p.add_argument("--noise", type=float, default=0.0, help="lognormal σ on serving times")
    p.add_argument("--seed", type=int, default=0, help="seeds arrivals and noise")
    p.add_argument("--block-size", type=int, default=16, help="ils-paged KV block, tokens")
    p.add_argument(
        "--work-conserving",
        action="store_true",
        help="an idle worker triggers a round at once; rounds spread work over idle workers",
    )
    p.add_argument(
        "--kv-reuse",
        action="store_true",
        help="workers keep KV across slices; the policy batches by KV holder and reuses it",
    )
    p.add_argument(
        "--max-slice-gap",
        type=float,
        metavar="S",
        help="bound the wait between two slices of a streaming request (scheduler."
        "max_slice_gap_s; default off, the paper's rounds)",
    )
    p.add_argument(
        "--host-kv-bytes",
        type=float,
        help="host memory per worker for retained KV (default: the profile's host_kv_bytes)",
    )
    p.add_argument("--slo-ttft", type=float,
                   help="goodput SLO on TTFT, s (with no --slo-*: TTFT <= 2 s and no gap over 1 s)")
    p.add_argument("--slo-tpot", type=float, help="goodput SLO on TPOT, s")
    p.add_argument("--slo-e2e", type=float, help="goodput SLO on end-to-end latency, s")
    p.add_argument("--slo-gap", type=float,
                   help="goodput SLO on a request's longest inter-token gap, s")
    p.add_argument("--long-share", type=float,
                   help="share of requests drawn from the trace's long generations "
                        "(the paper's long-generation scenario: 0.6; needs --rate)")
    p.add_argument("--long-over", type=int, default=512,
                   help="what --long-share counts as long: more than this many tokens")
    p.add_argument("--json", metavar="OUT", help="write the metrics here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    """Run the simulation the arguments describe; 0 on success, 2 on a usage error."""
    try:
        result = _run(args)
    except (ValueError, OSError) as exc:
        print(f"sclsd-bench sim: error: {exc}", file=sys.stderr)
        return 2
    print(format_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _run(args: argparse.Namespace) -> dict[str, Any]:
    for name in ("workers", "slice_len", "max_input", "max_gen", "batch_size", "block_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.duration is not None and args.duration <= 0:
        raise ValueError("--duration must be > 0")
    if args.max_slice_gap is not None and not args.max_slice_gap >= 0:
        raise ValueError("--max-slice-gap must be >= 0")
    if args.host_kv_bytes is not None and args.host_kv_bytes < 0:
        raise ValueError("--host-kv-bytes must be >= 0")
    profile = load_profile(args.profile)
    trace = load_trace(args.trace)
    workload = make_workload(
        trace,
        rate=args.rate,
        duration=args.duration,
        max_input=args.max_input,
        max_gen=args.max_gen,
        seed=args.seed,
        long_share=args.long_share,
        long_over=args.long_over,
    )
    if len(workload) == 0:
        raise ValueError("no request arrives within --duration")
    cfg = SimConfig(
        policy=args.policy,
        profile=profile,
        workers=args.workers,
        slice_len=args.slice_len,
        max_gen=args.max_gen,
        max_input=args.max_input,
        batch_size=args.batch_size,
        gamma=args.gamma,
        lam=args.lam,
        zeta=args.zeta,
        noise=args.noise,
        seed=args.seed,
        block_size=args.block_size,
        work_conserving=args.work_conserving,
        kv_reuse=args.kv_reuse,
        max_slice_gap_s=args.max_slice_gap,
        host_kv_bytes=args.host_kv_bytes,
        progress=not args.no_progress and sys.stderr.isatty(),
    )
    # Goodput is always reported: under the SLOs given, else the targets' (DEFAULT_SLO).
    slo = DEFAULT_SLO
    bounds = (args.slo_ttft, args.slo_tpot, args.slo_e2e, args.slo_gap)
    if any(x is not None for x in bounds):
        slo = SLO(ttft_s=args.slo_ttft, tpot_s=args.slo_tpot, e2e_s=args.slo_e2e,
                  gap_s=args.slo_gap)
    res = simulate(cfg, workload)
    if args.policy in ("sls", "oracle", "oracle-static"):
        effective_slice: int | None = args.max_gen  # one batch runs to the generation limit
    elif args.policy.startswith("ils-"):
        effective_slice = None  # continuous batching has no slices
    else:
        effective_slice = args.slice_len
    out: dict[str, Any] = {
        "policy": args.policy,
        "profile": profile.name or str(args.profile),
        "trace": str(args.trace),
        "rate": args.rate,
        "arrival_window_s": args.duration,
        "workers": args.workers,
        "slice_len": args.slice_len,
        "effective_slice_len": effective_slice,
        "max_input": args.max_input,
        "max_gen": args.max_gen,
        "batch_size": args.batch_size,
        "gamma": cfg.gamma_s,
        "lam": args.lam,
        "zeta": args.zeta,
        "noise": args.noise,
        "seed": args.seed,
        "long_share": args.long_share,
        "long_over": args.long_over,
        "work_conserving": args.work_conserving,
        "kv_reuse": args.kv_reuse,
        "max_slice_gap_s": args.max_slice_gap,
        "host_kv_bytes": cfg.effective_profile.host_kv_bytes,
    }
    out["slo"] = {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "e2e_s": slo.e2e_s,
                  "gap_s": slo.gap_s}
    out.update(res.summary(slo))
    out["worker_completion_s"] = res.worker_completion
    return out


def format_table(r: dict[str, Any]) -> str:
    """A short human summary of one run."""
    rate = "trace arrivals" if r["rate"] is None else f"{r['rate']:g} req/s"
    switches = "".join(
        f" +{name}" for name in ("work_conserving", "kv_reuse") if r.get(name)
    )
    if r.get("max_slice_gap_s"):
        switches += f" +max_slice_gap_s={r['max_slice_gap_s']:g}"
    lines = [
        f"{r['policy']}{switches} on {r['profile']}, {r['workers']} workers, {rate}, "
        f"{r['requests']} requests (simulated in {r['wall_s']:.2f} s)"
    ]
    for key, label, fmt in _TABLE:
        # The gap rows are absent when no request had two tokens.
        lines.append(f"  {label:<22} {fmt.format(r[key]) if key in r else '–'}")
    return "\n".join(lines)
