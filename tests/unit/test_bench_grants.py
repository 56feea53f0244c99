"""``sclsd-bench grants``: scls-cb against continuous batching and scls on a tiny synthetic setting."""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sclsd.bench import all as bench_all
from sclsd.bench import cli, grants
from sclsd.sim.common import SimConfig
from sclsd.sim.engine import simulate
from sclsd.sim.workload import Workload

from .toy import toy_profile

PROFILE = toy_profile(20_000)


def _workload(n: int, seed: int, max_in: int, max_out: int) -> Workload:
    rng = np.random.default_rng(seed)
    arr = np.cumsum(rng.exponential(0.25, n))
    return Workload(arr - arr[0], rng.integers(1, max_in, n).astype(np.int64),
                    rng.integers(1, max_out, n).astype(np.int64))


@pytest.fixture(scope="module")
def rows() -> list[dict[str, Any]]:
    """Every case of the benchmark on synthetic workloads: 3 workers, S = 32, 40 requests each."""
    wls = {
        (c.trace, c.rate): _workload(40, int(c.rate), 300 if c.trace == "sharegpt" else 600,
                                     200 if c.trace == "sharegpt" else 20)
        for c in grants.CASES
    }
    return grants.run_cases(PROFILE, grants.CASES, wls, workers=3, slice_len=32, seed=1, max_gen=256,
                            max_input=1024)


def test_registered_as_subcommand_and_bench_step() -> None:
    assert cli.SUBCOMMANDS["grants"][0] == "sclsd.bench.grants"
    steps = list(bench_all.STEPS)
    assert steps.index("grants") == steps.index("slicing") + 1
    assert bench_all.STEPS["grants"][:2] == ["sclsd.bench.cli", "grants"]


def test_runs_every_case_and_matches_a_direct_simulation(rows: list[dict[str, Any]]) -> None:
    assert len(rows) == sum(len(c.policies) for c in grants.CASES) == 11
    assert {r["policy"] for r in rows} == {"scls-cb", "ils-paged", "ils-conservative", "scls"}
    r = grants._find(rows, "toy", "sharegpt", 20.0, "scls-cb")
    assert r is not None and r["completed"] == 40 and "migrations" in r
    wl = _workload(40, 20, 300, 200)
    direct = simulate(SimConfig("scls-cb", PROFILE, workers=3, slice_len=32, max_gen=256, seed=1), wl).summary()
    for k in ("throughput_rps", "ct_std_s", "avg_latency_s", "avg_ttft_s", "migrations"):
        assert r[k] == direct[k]


def test_table_has_scls_cb_rows_and_dashes_for_migrations_of_baselines(rows: list[dict[str, Any]]) -> None:
    md = grants.markdown(rows)
    assert "### toy" in md
    for label in ("ShareGPT 20", "Azure code 20", "ShareGPT 5", "ShareGPT 2"):
        assert f"| {label} | scls-cb |" in md
    paged = next(line for line in md.splitlines() if line.startswith("| ShareGPT 2 | ils-paged |"))
    assert paged.split("|")[9].strip() == "–"  # no migrations column value for continuous batching


def test_targets_are_derived_from_the_runs(rows: list[dict[str, Any]]) -> None:
    checks = grants.targets(rows, "toy")
    # rate 20: 5 checks on each of two traces; rates 5 and 2: 2 checks each.
    assert len(checks) == 14
    cb = grants._find(rows, "toy", "sharegpt", 20.0, "scls-cb")
    cons = grants._find(rows, "toy", "sharegpt", 20.0, "ils-conservative")
    assert cb is not None and cons is not None
    thr = next(c for c in checks if c["case"] == "ShareGPT 20" and "ils-conservative" in c["target"]
               and "throughput" in c["target"])
    assert thr["ratio"] == pytest.approx(cb["throughput_rps"] / cons["throughput_rps"])
    assert thr["met"] == (thr["ratio"] >= 1.05)

    # Change the inputs and the verdicts follow.
    fast = copy.deepcopy(rows)
    for r in fast:
        if (r["trace"], r["rate"], r["policy"]) == ("sharegpt", 20.0, "ils-conservative"):
            r["throughput_rps"] = cb["throughput_rps"] / 2
            r["ct_std_s"] = cb["ct_std_s"] * 4 + 1
        if (r["trace"], r["rate"], r["policy"]) == ("sharegpt", 2.0, "scls-cb"):
            r["avg_ttft_s"] = 5.0
    after = {(c["case"], c["target"]): c for c in grants.targets(fast, "toy")}
    assert after[("ShareGPT 20", "throughput ≥ 1.05× ils-conservative")]["met"] is True
    assert after[("ShareGPT 20", "throughput ≥ 1.05× ils-conservative")]["ratio"] == pytest.approx(2.0)
    assert after[("ShareGPT 20", "CT STD ≤ 0.5× ils-conservative's")]["met"] is True
    assert after[("ShareGPT 2", "avg TTFT ≤ 1 s")]["met"] is False
    slow = copy.deepcopy(fast)
    for r in slow:
        if (r["trace"], r["rate"], r["policy"]) == ("sharegpt", 20.0, "ils-conservative"):
            r["throughput_rps"] = cb["throughput_rps"] * 2
    again = {(c["case"], c["target"]): c for c in grants.targets(slow, "toy")}
    assert again[("ShareGPT 20", "throughput ≥ 1.05× ils-conservative")]["met"] is False
    assert "| ShareGPT 2 | avg TTFT ≤ 1 s | 5.00 s | no |" in grants.target_table(fast, "toy")


def test_run_reports_a_missing_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = argparse.ArgumentParser()
    grants.add_arguments(p)
    args = p.parse_args(["--sharegpt", str(tmp_path / "none.csv"), "--out", str(tmp_path / "g.json"),
                         "--md", str(tmp_path / "g.md")])
    assert grants.run(args) == 2
    assert "trace not found" in capsys.readouterr().err
    assert not (tmp_path / "g.json").exists()


def test_run_writes_json_and_markdown(tmp_path: Path) -> None:
    lines = ["arrival_s,input_tokens,output_tokens"] + [f",{50 + 7 * i % 90},{5 + 3 * i % 40}" for i in range(30)]
    for name in ("s.csv", "a.csv"):
        (tmp_path / name).write_text("\n".join(lines) + "\n")
    p = argparse.ArgumentParser()
    grants.add_arguments(p)
    args = p.parse_args([
        "--profiles", "a100-llama2-13b-hf", "--sharegpt", str(tmp_path / "s.csv"),
        "--azure-code", str(tmp_path / "a.csv"), "--workers", "2", "--duration", "2",
        "--out", str(tmp_path / "g.json"), "--md", str(tmp_path / "g.md"), "--no-progress",
    ])
    assert grants.run(args) == 0
    data = json.loads((tmp_path / "g.json").read_text())
    assert len(data) == 11 and all(r["profile"] == "a100-llama2-13b-hf" for r in data)
    md = (tmp_path / "g.md").read_text()
    assert "### a100-llama2-13b-hf" in md and "| ShareGPT 20 | scls-cb |" in md and "Targets:" in md
