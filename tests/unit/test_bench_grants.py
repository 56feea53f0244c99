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
from sclsd.bench import grants_report as report
from sclsd.core.grants import GrantRules
from sclsd.sim.cb import CBSimulation
from sclsd.sim.common import SimConfig
from sclsd.sim.engine import simulate
from sclsd.sim.workload import Workload

from .toy import toy_profile

PROFILE = toy_profile(20_000)
SHAPES = {"sharegpt": (300, 200), "azure-code": (600, 20), "mooncake": (900, 60)}


def _workload(n: int, seed: int, max_in: int, max_out: int) -> Workload:
    rng = np.random.default_rng(seed)
    arr = np.cumsum(rng.exponential(0.25, n))
    return Workload(arr - arr[0], rng.integers(1, max_in, n).astype(np.int64),
                    rng.integers(1, max_out, n).astype(np.int64))


@pytest.fixture(scope="module")
def rows() -> list[dict[str, Any]]:
    """Every case of the benchmark on synthetic workloads: 3 workers, S = 32, 40 requests each."""
    wls = {(c.trace, c.rate): _workload(40, int(c.rate), *SHAPES[c.trace]) for c in grants.CASES}
    return grants.run_cases(PROFILE, grants.CASES, wls, workers=3, slice_len=32, seed=1, max_gen=256,
                            max_input=1024)


def _csv(path: Path, n: int = 30) -> Path:
    lines = ["arrival_s,input_tokens,output_tokens"] + [f",{50 + 7 * i % 90},{5 + 3 * i % 40}" for i in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_registered_as_subcommand_and_bench_step() -> None:
    assert cli.SUBCOMMANDS["grants"][0] == "sclsd.bench.grants"
    steps = list(bench_all.STEPS)
    assert steps.index("grants") == steps.index("slicing") + 1
    assert bench_all.STEPS["grants"][:2] == ["sclsd.bench.cli", "grants"]


def test_cases_cover_every_trace_at_every_rate() -> None:
    assert {(c.trace, c.rate) for c in grants.CASES} == {
        (t, r) for t in ("sharegpt", "azure-code", "mooncake") for r in (20.0, 5.0, 2.0)}
    assert all({"scls-cb", "ils-paged"} <= set(c.policies) for c in grants.CASES)
    heavy = [c for c in grants.CASES if c.rate == 20.0]
    assert all({"ils-conservative", grants.BASIC} <= set(c.policies) for c in heavy)
    assert not any(grants.BASIC in c.policies for c in grants.CASES if c.rate != 20.0)
    assert [c.trace for c in grants.CASES if "scls" in c.policies] == ["sharegpt"]
    extra = grants.cases_for(("sharegpt", "azure-conv"))
    assert {c.trace for c in extra} == {"sharegpt", "azure-conv"} and len(extra) == 6


def test_runs_every_case_and_matches_a_direct_simulation(rows: list[dict[str, Any]]) -> None:
    assert len(rows) == sum(len(c.policies) for c in grants.CASES) == 25
    assert {r["policy"] for r in rows} == {"scls-cb", "ils-paged", "ils-conservative", "scls", grants.BASIC}
    r = report.find(rows, "toy", "sharegpt", 20.0, "scls-cb")
    assert r is not None and r["completed"] == 40 and "migrations" in r
    wl = _workload(40, 20, *SHAPES["sharegpt"])
    direct = simulate(SimConfig("scls-cb", PROFILE, workers=3, slice_len=32, max_gen=256, seed=1), wl).summary()
    for k in ("throughput_rps", "ct_std_s", "avg_latency_s", "avg_ttft_s", "migrations", "kv_drops"):
        assert r[k] == direct[k]
    basic = report.find(rows, "toy", "sharegpt", 20.0, grants.BASIC)
    assert basic is not None
    plain = CBSimulation(SimConfig("scls-cb", PROFILE, workers=3, slice_len=32, max_gen=256, seed=1), wl,
                         GrantRules.basic()).run().summary()
    for k in ("throughput_rps", "avg_latency_s", "migrations", "kv_drops"):
        assert basic[k] == plain[k]


def test_no_policy_beats_the_arrival_bound(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        assert r["throughput_rps"] <= r["bound_rps"] * (1 + 1e-9)
    # A lone request runs alone: every policy serves exactly the bound.
    wl = Workload.of([0.0], [100], [10])
    bound = grants.bound_rps(wl, PROFILE.estimator, 256)
    for pol in ("scls-cb", "ils-paged"):
        res = simulate(SimConfig(pol, PROFILE, workers=2, slice_len=32, max_gen=256), wl)
        assert res.summary()["throughput_rps"] == pytest.approx(bound)


def test_costs_add_up_to_the_workers_time(rows: list[dict[str, Any]]) -> None:
    md = report.cost_table(rows, "toy")
    lines = [ln for ln in md.splitlines() if ln.startswith("| ShareGPT 20 |")]
    assert {ln.split("|")[2].strip() for ln in lines} == {
        "scls-cb", "ils-paged", "ils-conservative", grants.BASIC}
    for ln in lines:
        cells = [float(c) for c in ln.split("|")[3:-1]]
        assert sum(cells[:-1]) == pytest.approx(cells[-1], abs=0.1 * len(cells))
    for r in rows:
        if "cost_s" in r:  # noise-free model seconds fit in the workers' time
            assert 0 < sum(r["cost_s"].values()) <= r["duration_s"] * r["workers"] * (1 + 1e-9)
            assert 0 < r["kv_used_pct"] <= 100


def test_table_has_scls_cb_rows_and_dashes_for_migrations_of_baselines(rows: list[dict[str, Any]]) -> None:
    md = report.markdown(rows)
    assert "### toy" in md and "Targets:" in md and "by cost term" in md
    for trace in ("ShareGPT", "Azure code", "Mooncake"):
        for rate in (20, 5, 2):
            assert f"| {trace} {rate} | scls-cb |" in md
    paged = next(line for line in md.splitlines() if line.startswith("| ShareGPT 2 | ils-paged |"))
    cells = [c.strip() for c in paged.split("|")]
    header = [c.strip() for c in md.splitlines()[2].split("|")]
    assert cells[header.index("migrations")] == "–"  # no migrations for continuous batching
    for col in ("goodput req/s", "gap p50 s", "gap p99 s"):
        assert cells[header.index(col)] not in ("", "–")


def test_targets_are_derived_from_the_runs(rows: list[dict[str, Any]]) -> None:
    checks = report.targets(rows, "toy")
    # Per trace: at rate 20 six checks, at rates 5 and 2 four each (goodput among them).
    assert len(checks) == 3 * (6 + 4 + 4)
    cb = report.find(rows, "toy", "sharegpt", 20.0, "scls-cb")
    paged = report.find(rows, "toy", "sharegpt", 20.0, "ils-paged")
    assert cb is not None and paged is not None
    thr = next(c for c in checks if c["case"] == "ShareGPT 20" and "ils-paged" in c["target"]
               and "throughput" in c["target"])
    assert thr["ratio"] == pytest.approx(cb["throughput_rps"] / paged["throughput_rps"])
    assert thr["met"] == (thr["ratio"] >= 1.03)

    def edit(src: list[dict[str, Any]], trace: str, rate: float, policy: str, **kw: Any) -> list[dict[str, Any]]:
        out = copy.deepcopy(src)
        for r in out:
            if (r["trace"], r["rate"], r["policy"]) == (trace, rate, policy):
                r.update(kw)
        return out

    def verdicts(src: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
        return {(c["case"], c["target"]): c for c in report.targets(src, "toy")}

    key = ("ShareGPT 20", "throughput ≥ 1.03× ils-paged")
    slow = edit(rows, "sharegpt", 20.0, "ils-paged", throughput_rps=cb["throughput_rps"] / 1.02)
    assert verdicts(slow)[key]["met"] is False
    fast = edit(rows, "sharegpt", 20.0, "ils-paged", throughput_rps=cb["throughput_rps"] / 1.04)
    assert verdicts(fast)[key]["met"] is True and verdicts(fast)[key]["reachable"] is True
    capped = edit(slow, "sharegpt", 20.0, "scls-cb", bound_rps=cb["throughput_rps"])
    assert verdicts(capped)[key]["reachable"] is False
    assert "arrivals allow at most 1.020×" in verdicts(capped)[key]["measured"]
    assert "| no (not reachable) |" in report.target_table(capped, "toy")
    late = edit(rows, "mooncake", 2.0, "scls-cb", avg_latency_s=1e6)
    assert verdicts(late)[("Mooncake 2", "avg RT ≤ 1.0× ils-paged's")]["met"] is False
    good = ("ShareGPT 5", "goodput ≥ ils-paged's (TTFT ≤ 2 s, no gap > 1 s)")
    p5 = report.find(rows, "toy", "sharegpt", 5.0, "ils-paged")
    assert p5 is not None and verdicts(rows)[good]["ratio"] == pytest.approx(
        report.find(rows, "toy", "sharegpt", 5.0, "scls-cb")["goodput_rps"] / p5["goodput_rps"])  # type: ignore[index]
    assert verdicts(edit(rows, "sharegpt", 5.0, "ils-paged", goodput_rps=1e6))[good]["met"] is False
    assert verdicts(edit(rows, "sharegpt", 5.0, "ils-paged", goodput_rps=0.0))[good]["met"] is True
    assert not any("goodput" in t for c, t in verdicts(rows) if c.endswith(" 20"))
    bad = edit(rows, "azure-code", 5.0, "scls-cb", preemptions=3)
    assert verdicts(bad)[("Azure code 5", "preemptions = 0")]["met"] is False


def test_run_reports_a_missing_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = argparse.ArgumentParser()
    grants.add_arguments(p)
    args = p.parse_args(["--sharegpt", str(tmp_path / "none.csv"), "--out", str(tmp_path / "g.json"),
                         "--md", str(tmp_path / "g.md")])
    assert grants.run(args) == 2
    assert "trace not found" in capsys.readouterr().err
    assert not (tmp_path / "g.json").exists()
    args = p.parse_args(["--only-traces", "nope", "--out", str(tmp_path / "g.json")])
    assert grants.run(args) == 2 and "no trace named 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        p.parse_args(["--trace", "no-path"])


def test_run_writes_json_and_markdown_with_a_held_out_trace(tmp_path: Path) -> None:
    for name in ("s.csv", "a.csv", "m.csv", "h.csv"):
        _csv(tmp_path / name)
    p = argparse.ArgumentParser()
    grants.add_arguments(p)
    args = p.parse_args([
        "--profiles", "a100-llama2-13b-hf", "--sharegpt", str(tmp_path / "s.csv"),
        "--azure-code", str(tmp_path / "a.csv"), "--mooncake", str(tmp_path / "m.csv"),
        "--trace", f"held-out={tmp_path / 'h.csv'}", "--only-traces", "sharegpt,held-out",
        "--workers", "2", "--duration", "2", "--no-scale",
        "--out", str(tmp_path / "g.json"), "--md", str(tmp_path / "g.md"), "--no-progress",
    ])
    assert grants.run(args) == 0
    data = json.loads((tmp_path / "g.json").read_text())
    assert data["scale"] == [] and len(data["runs"]) == sum(
        len(c.policies) for c in grants.cases_for(("sharegpt", "held-out")))
    assert {r["trace"] for r in data["runs"]} == {"sharegpt", "held-out"}
    md = (tmp_path / "g.md").read_text()
    assert "### a100-llama2-13b-hf" in md and "| held-out 20 | scls-cb |" in md and "Targets:" in md


def test_the_many_worker_check_times_every_grant_round(tmp_path: Path) -> None:
    trace = _csv(tmp_path / "s.csv", 200)
    scale = grants.run_scale(PROFILE, str(trace), workers=4, slice_len=32, duration=5.0)
    cb, paged = scale
    assert (cb["policy"], paged["policy"]) == ("scls-cb", "ils-paged")
    assert cb["rate"] == 10.0 and cb["completed"] == paged["completed"] > 0
    us = cb["round_us"]
    assert us["count"] > 0 and 0 < us["p50"] <= us["p99"] <= us["max"]
    assert "round_us" not in paged
    md = report.scale_table(scale)
    assert "| 4, ShareGPT, 10 | scls-cb |" in md and "p99 ≤ 1000 µs: " in md  # the verdict, not a timing
    slow = copy.deepcopy(scale)
    slow[0]["round_us"]["p99"], slow[0]["wall_s"] = 1500.0, 61.0
    assert "p99 ≤ 1000 µs: no; ≤ 60 s: no" in report.scale_table(slow)
