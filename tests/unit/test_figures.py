"""The figures step of make bench draws every figure from simulation data."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from sclsd.bench import figures

TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "sharegpt_lengths.csv"


def _rows(policies: tuple[str, ...], rates: tuple[float, ...], slices: tuple[int, ...] = (128,)) -> list[dict]:
    keys = ("throughput_rps", "avg_latency_s", "p95_latency_s", "invalid_tokens_per_req", "avg_batch_size",
            "pad_tokens_per_req", "slices_per_req", "early_return_ratio", "ct_std_s", "prefill_share")
    return [dict({k: 1.0 + i for i, k in enumerate(keys)}, policy=p, rate=r, slice_len=s)
            for p in policies for r in rates for s in slices]


def test_plot_writes_every_figure(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    grids = {
        "main-hf": _rows(figures.MAIN, figures.RATES),
        "main-ds": _rows(figures.MAIN, figures.RATES),
        "ablation": _rows(figures.LADDER, (20.0,)),
        "slices": _rows(("scls",), (20.0,), figures.SLICES),
    }
    written = figures.plot(grids, tmp_path)
    names = sorted(p.name for p in written)
    assert len(names) == 13
    assert all((tmp_path / n).stat().st_size > 5000 for n in names)
    assert "fig15-ablation.png" in names and "fig11-performance-ds.png" in names


@pytest.mark.skipif(not TRACE.is_file(), reason="shared traces not beside the repository")
def test_collect_runs_short_grids(tmp_path: Path) -> None:
    args = argparse.Namespace(trace=str(TRACE), duration=5.0, rate=20.0, workers=2, data=str(tmp_path / "d.json"),
                              img=str(tmp_path / "img"), tables=str(tmp_path / "t.md"), replot=False)
    assert figures.run(args) == 0
    text = (tmp_path / "t.md").read_text()
    for grid in ("main-hf", "main-ds", "ablation", "slices"):
        assert f"### {grid}" in text
    assert len(list((tmp_path / "img").glob("*.png"))) == 13


def test_the_papers_figures_run_without_the_switches():
    assert not [p for p in (*figures.MAIN, *figures.LADDER) if "+" in p]
