"""``sclsd-bench batcher``: wall time of one DP batching round (Algorithm 1).

Input lengths are drawn (without replacement while the trace has enough rows,
fixed seed) from a trace's ``input_tokens`` capped at 1024, as the paper caps
raw inputs; the cost model is the ``a100-llama2-13b-hf`` profile, S = 128.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from sclsd.core.batcher import DPBatcher
from sclsd.core.profiles import load_profile
from sclsd.core.request import Request
from sclsd.eval.traces import load_trace

#: Relative to the repository root (the traces live beside the checkout, in ../shared).
DEFAULT_TRACE = Path(__file__).resolve().parents[2] / ".." / "shared" / "traces" / "sharegpt_lengths.csv"
SWEEP = (64, 256, 1024, 4096, 16384)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n", type=int, default=4096, help="requests in the pool (default 4096)")
    p.add_argument("--trace", default=str(DEFAULT_TRACE), help="trace CSV with input_tokens")
    p.add_argument("--repeat", type=int, default=20, help="timed rounds per n (default 20)")
    p.add_argument("--profile", default="a100-llama2-13b-hf", help="cost profile")
    p.add_argument("--slice-len", type=int, default=128)
    p.add_argument("--max-input", type=int, default=1024, help="cap on input lengths")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sweep", action="store_true", help=f"run n = {', '.join(map(str, SWEEP))}")
    p.add_argument("--json", dest="json_out", default=None, help="write results here")


def make_pool(lengths: np.ndarray, n: int, seed: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    lens = rng.choice(lengths, size=n, replace=n > len(lengths))
    return [Request(f"r{k}", int(L), 1024, arrival=float(k)) for k, L in enumerate(lens)]


def time_batcher(reqs: list[Request], S: int, cost: Any, repeat: int) -> dict[str, float]:
    """Median and p95 wall time (ms) of ``repeat`` rounds, after one untimed warm-up."""
    batcher = DPBatcher()
    batches = batcher(reqs, S, cost)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        batcher(reqs, S, cost)
        times.append((time.perf_counter() - t0) * 1e3)
    arr = np.asarray(times)
    return {
        "n": len(reqs),
        "median_ms": round(float(np.median(arr)), 3),
        "p95_ms": round(float(np.percentile(arr, 95)), 3),
        "batches": len(batches),
        "mean_batch": round(len(reqs) / len(batches), 2),
    }


def run(args: argparse.Namespace) -> int:
    if args.n < 1 or args.repeat < 1:
        print("error: --n and --repeat must be >= 1", file=sys.stderr)
        return 2
    try:
        trace = load_trace(args.trace).capped(args.max_input, 1024)
    except (OSError, ValueError) as exc:
        print(f"error: cannot read trace: {exc}", file=sys.stderr)
        return 1
    cost = load_profile(args.profile).cost()
    sizes = SWEEP if args.sweep else (args.n,)
    results = []
    if args.sweep:
        from tqdm import tqdm

        it = tqdm(sizes, desc="batcher sweep", file=sys.stderr)
    else:
        it = sizes
    for n in it:
        reqs = make_pool(trace.input_tokens, n, args.seed)
        results.append(time_batcher(reqs, args.slice_len, cost, args.repeat))
    out = results if args.sweep else results[0]
    text = json.dumps(out)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    return 0
