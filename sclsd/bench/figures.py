"""``sclsd-bench figures``: the paper's section 6 figures, in simulation, as PNGs.

Grids (each cell one simulation, see :mod:`sclsd.sim.grid`):

- ``main-hf`` / ``main-ds``: sls, ils-conservative, ils-paged, scls and oracle vs
  arrival rate on the ``a100-llama2-13b-hf`` / ``-ds`` profiles (Fig. 11-14);
- ``ablation``: sls → so → pm → ab → lb → scls at one rate (Fig. 15-16);
- ``slices``: scls over slice lengths at one rate (Fig. 17-19).

All runs: 8 workers, ShareGPT lengths with Poisson arrivals, limits 1024/1024,
S = 128 unless swept. The data goes to ``--data`` (JSON), the pictures to
``--img``, and the tables to ``--tables`` (Markdown).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

RATES = (5.0, 10.0, 15.0, 20.0, 25.0)
MAIN = ("sls", "ils-conservative", "ils-paged", "scls", "oracle")
LADDER = ("sls", "so", "pm", "ab", "lb", "scls")
SLICES = (16, 32, 64, 128, 256, 512)
PERF_KEYS = ("throughput_rps", "avg_latency_s", "p95_latency_s")
PERF_TITLES = ("throughput (req/s)", "average response time (s)", "p95 response time (s)")
TOKEN_KEYS = ("invalid_tokens_per_req", "avg_batch_size", "pad_tokens_per_req")
TOKEN_TITLES = ("invalid tokens per request", "average batch size", "pad tokens per request")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", default="../shared/traces/sharegpt_lengths.csv")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of arrivals per run")
    p.add_argument("--rate", type=float, default=20.0, help="rate of the ablation and slice sweeps")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--data", default="out/figures.json", help="write all summaries here")
    p.add_argument("--img", default="docs/img", help="directory for the PNGs")
    p.add_argument("--tables", default="out/figures.md", help="Markdown tables of every grid")
    p.add_argument("--replot", action="store_true", help="only redraw from --data")


def collect(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    from ..sim.grid import run_grid

    common = dict(workers=args.workers, duration=args.duration)
    grids = {}
    print("grid main-hf", flush=True)
    grids["main-hf"] = run_grid(args.trace, list(MAIN), list(RATES), [128], profile="a100-llama2-13b-hf", **common)
    print("grid main-ds", flush=True)
    grids["main-ds"] = run_grid(args.trace, list(MAIN), list(RATES), [128], profile="a100-llama2-13b-ds", **common)
    print("grid ablation", flush=True)
    grids["ablation"] = run_grid(args.trace, list(LADDER), [args.rate], [128], **common)
    print("grid slices", flush=True)
    grids["slices"] = run_grid(args.trace, ["scls"], [args.rate], list(SLICES), **common)
    for rows in grids.values():
        for r in rows:  # keep the JSON small and plain
            r.pop("busy_s", None)
            r.pop("worker_completion_s", None)
    return grids


def _series(rows: list[dict[str, Any]], policy: str, key: str) -> tuple[list[float], list[float]]:
    pts = sorted((r["rate"], r[key]) for r in rows if r["policy"] == policy)
    return [x for x, _ in pts], [y for _, y in pts]


def plot(grids: dict[str, list[dict[str, Any]]], img: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        path = img / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    for prof in ("hf", "ds"):
        rows = grids[f"main-{prof}"]
        for name, title, keys, titles in (
            (f"fig11-performance-{prof}.png", f"Fig. 11: overall performance, a100-llama2-13b-{prof}, 8 workers",
             PERF_KEYS, PERF_TITLES),
            (f"fig12-tokens-{prof}.png", f"Fig. 12: where the time goes, {prof}", TOKEN_KEYS, TOKEN_TITLES),
        ):
            fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
            for key, ax, t in zip(keys, axes, titles, strict=True):
                for pol in MAIN:
                    ax.plot(*_series(rows, pol, key), marker="o", label=pol)
                ax.set_xlabel("arrival rate (req/s)")
                ax.set_title(t)
                ax.grid(alpha=0.3)
            axes[0].legend(fontsize=8)
            fig.suptitle(title, fontsize=10)
            save(fig, name)

        fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
        axes[0].plot(*_series(rows, "scls", "slices_per_req"), marker="o")
        axes[0].set_title("scls: slices per request")
        axes[1].plot(*_series(rows, "scls", "early_return_ratio"), marker="o")
        axes[1].set_title("scls: early-return ratio")
        for ax in axes:
            ax.set_xlabel("arrival rate (req/s)")
            ax.grid(alpha=0.3)
        fig.suptitle(f"Fig. 13: SCLS overhead, {prof}", fontsize=10)
        save(fig, f"fig13-overhead-{prof}.png")

        fig, ax = plt.subplots(figsize=(5.5, 3.4))
        for pol in MAIN:
            ax.plot(*_series(rows, pol, "ct_std_s"), marker="o", label=pol)
        ax.set_xlabel("arrival rate (req/s)")
        ax.set_ylabel("CT STD (s)")
        ax.set_title(f"Fig. 14: load imbalance, {prof}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        save(fig, f"fig14-ctstd-{prof}.png")

    rows = grids["ablation"]
    names = [r["policy"] for r in rows]
    for name, title, keys, titles in (
        ("fig15-ablation.png", f"Fig. 15: ablation ladder at rate {rows[0]['rate']:g} (hf)", PERF_KEYS, PERF_TITLES),
        ("fig16-ablation-tokens.png", "Fig. 16: contribution of each step", TOKEN_KEYS, TOKEN_TITLES),
    ):
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
        for key, ax, t in zip(keys, axes, titles, strict=True):
            ax.bar(names, [r[key] for r in rows])
            ax.set_title(t)
            ax.grid(alpha=0.3, axis="y")
        fig.suptitle(title, fontsize=10)
        save(fig, name)

    rows = sorted(grids["slices"], key=lambda r: r["slice_len"])
    S = [r["slice_len"] for r in rows]
    panels = [
        ("fig17-slice-performance.png", "Fig. 17: slice length vs performance", PERF_KEYS, PERF_TITLES),
        ("fig18-slice-tokens.png", "Fig. 18: slice length vs tokens and batch size", TOKEN_KEYS, TOKEN_TITLES),
        ("fig19-slice-overhead.png", "Fig. 19: slice length vs overhead",
         ("slices_per_req", "early_return_ratio", "prefill_share"),
         ("slices per request", "early-return ratio", "prefill share of serving time")),
    ]
    for name, title, keys, titles in panels:
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
        for key, ax, t in zip(keys, axes, titles, strict=True):
            ax.plot(S, [r[key] for r in rows], marker="o")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("slice length S")
            ax.set_title(t)
            ax.grid(alpha=0.3)
        fig.suptitle(f"{title} (scls, rate {rows[0]['rate']:g}, hf)", fontsize=10)
        save(fig, name)
    return written


def tables(grids: dict[str, list[dict[str, Any]]]) -> str:
    from ..sim.grid import markdown

    return "\n\n".join(f"### {name}\n\n{markdown(rows)}" for name, rows in grids.items()) + "\n"


def run(args: argparse.Namespace) -> int:
    data = Path(args.data)
    if args.replot:
        grids = json.loads(data.read_text())
    else:
        grids = collect(args)
        data.parent.mkdir(parents=True, exist_ok=True)
        data.write_text(json.dumps(grids, indent=1) + "\n")
    for p in plot(grids, Path(args.img)):
        print(f"wrote {p}")
    Path(args.tables).parent.mkdir(parents=True, exist_ok=True)
    Path(args.tables).write_text(tables(grids))
    print(f"wrote {args.tables}")
    return 0
