"""``sclsd-bench sim``: the JSON contract, arguments, and workload generation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sclsd.bench.cli import main
from sclsd.eval.traces import load_trace
from sclsd.sim.common import ALL_POLICIES
from sclsd.sim.workload import make_workload

CONTRACT = (
    "requests completed duration_s throughput_rps output_tps avg_latency_s p95_latency_s "
    "avg_ttft_s p95_ttft_s avg_batch_size pad_tokens_per_req invalid_tokens_per_req "
    "slices_per_req early_return_ratio ct_std_s oom_events policy profile rate workers slice_len "
    "reprefill_tokens_per_req work_conserving kv_reuse goodput_rps p50_gap_s p95_gap_s "
    "p99_gap_s max_gap_s slo"
).split()


def write_trace(path: Path, arrivals: bool, n: int = 40) -> Path:
    rng = np.random.default_rng(0)
    lines = ["arrival_s,input_tokens,output_tokens"]
    for k in range(n):
        a = f"{k * 0.25:.3f}" if arrivals else ""
        lines.append(f"{a},{int(rng.integers(1, 3000))},{int(rng.integers(1, 1500))}")
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_json_contract(tmp_path: Path, policy: str, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "t.csv", arrivals=False)
    out = tmp_path / "o.json"
    rc = main(
        ["sim", "--trace", str(trace), "--policy", policy, "--profile", "a100-llama2-13b-hf"]
        + ["--workers", "2", "--rate", "4", "--duration", "5", "--json", str(out), "--no-progress"]
    )
    assert rc == 0
    d = json.loads(out.read_text())
    missing = [k for k in CONTRACT if k not in d]
    assert not missing
    assert d["policy"] == policy and d["workers"] == 2 and d["rate"] == 4.0
    assert d["completed"] == d["requests"] > 0
    assert d["slo"] == {"ttft_s": 2.0, "tpot_s": None, "e2e_s": None, "gap_s": 1.0}
    assert 0 <= d["goodput_rps"] <= d["throughput_rps"]
    text = capsys.readouterr().out
    assert "throughput (req/s)" in text and "goodput (req/s)" in text and "max gap p99 (s)" in text


def test_slo_options_replace_the_default_slo(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.csv", arrivals=False)
    runs = {}
    for name, extra in (("loose", ["--slo-gap", "1e9"]), ("tight", ["--slo-gap", "1e-9"])):
        out = tmp_path / f"{name}.json"
        assert main(["sim", "--trace", str(trace), "--policy", "scls", "--workers", "2", "--rate",
                     "4", "--duration", "5", "--json", str(out), "--no-progress", *extra]) == 0
        runs[name] = json.loads(out.read_text())
    assert runs["loose"]["slo"]["ttft_s"] is None and runs["loose"]["slo"]["gap_s"] == 1e9
    # Without a TTFT bound every completed request meets a gap bound no gap reaches.
    assert runs["loose"]["goodput_rps"] == runs["loose"]["throughput_rps"] > 0
    assert runs["tight"]["goodput_rps"] == 0.0


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_json_contract_with_both_switches(tmp_path: Path, policy: str) -> None:
    trace = write_trace(tmp_path / "t.csv", arrivals=False)
    out = tmp_path / "o.json"
    rc = main(
        ["sim", "--trace", str(trace), "--policy", policy, "--work-conserving", "--kv-reuse"]
        + ["--workers", "2", "--rate", "4", "--duration", "5", "--json", str(out), "--no-progress"]
    )
    assert rc == 0
    d = json.loads(out.read_text())
    assert not [k for k in CONTRACT if k not in d]
    assert d["work_conserving"] is True and d["kv_reuse"] is True
    assert d["completed"] == d["requests"] > 0 and d["reprefill_tokens_per_req"] >= 0


def test_trace_without_arrivals_needs_rate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = write_trace(tmp_path / "t.csv", arrivals=False)
    assert main(["sim", "--trace", str(trace), "--no-progress"]) == 2
    assert "--rate" in capsys.readouterr().err


def test_trace_arrivals_are_used_without_rate(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.csv", arrivals=True)
    out = tmp_path / "o.json"
    args = ["sim", "--trace", str(trace), "--workers", "1", "--json", str(out), "--no-progress"]
    assert main(args + ["--duration", "5"]) == 0
    d = json.loads(out.read_text())
    assert d["requests"] == 20 and d["rate"] is None  # arrivals 0, 0.25, ... 4.75 < 5


def test_unknown_profile_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = write_trace(tmp_path / "t.csv", arrivals=True)
    assert main(["sim", "--trace", str(trace), "--profile", "nope", "--no-progress"]) == 2
    assert "nope" in capsys.readouterr().err


def test_workload_caps_cuts_and_wraps(tmp_path: Path) -> None:
    tr = load_trace(write_trace(tmp_path / "t.csv", arrivals=False, n=10))
    wl = make_workload(tr, rate=50.0, duration=2.0, max_input=1024, max_gen=512, seed=3)
    assert 50 < len(wl) < 150  # ~100 Poisson arrivals in 2 s
    assert wl.arrival.max() < 2.0 and np.all(np.diff(wl.arrival) >= 0)
    assert wl.input_len.max() <= 1024 and wl.output_len.max() <= 512 and wl.input_len.min() >= 1
    # Lengths are the trace's, in order, wrapping around.
    capped = tr.capped(1024, 512)
    assert wl.input_len[:10].tolist() == capped.input_tokens.tolist()
    assert wl.input_len[10:20].tolist() == capped.input_tokens.tolist()
    again = make_workload(tr, rate=50.0, duration=2.0, max_input=1024, max_gen=512, seed=3)
    assert np.array_equal(again.arrival, wl.arrival)


def test_long_share_draws_that_share_of_long_generations(tmp_path: Path) -> None:
    tr = load_trace(write_trace(tmp_path / "t.csv", arrivals=False, n=40))
    plain = make_workload(tr, rate=50.0, duration=4.0, seed=3)
    wl = make_workload(tr, rate=50.0, duration=4.0, seed=3, long_share=0.6)
    assert np.array_equal(wl.arrival, plain.arrival)  # only the lengths change
    n_long = int((wl.output_len > 512).sum())
    assert n_long == round(0.6 * len(wl))
    # Every request still carries one of the trace's (capped) requests, input with output.
    capped = tr.capped(1024, 1024)
    pairs = set(zip(capped.input_tokens.tolist(), capped.output_tokens.tolist(), strict=True))
    assert set(zip(wl.input_len.tolist(), wl.output_len.tolist(), strict=True)) <= pairs
    # The long ones are spread over the run, not bunched at its start.
    first_half = int((wl.output_len[: len(wl) // 2] > 512).sum())
    assert 0.3 * n_long < first_half < 0.7 * n_long
    again = make_workload(tr, rate=50.0, duration=4.0, seed=3, long_share=0.6)
    assert np.array_equal(again.output_len, wl.output_len)
    none_long = make_workload(tr, rate=50.0, duration=4.0, seed=3, long_share=0.0)
    assert int((none_long.output_len > 512).sum()) == 0


def test_long_share_errors_name_the_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with_arrivals = write_trace(tmp_path / "a.csv", arrivals=True)
    assert main(["sim", "--trace", str(with_arrivals), "--long-share", "0.6", "--no-progress"]) == 2
    assert "--long-share needs --rate" in capsys.readouterr().err
    trace = write_trace(tmp_path / "t.csv", arrivals=False)
    assert main(["sim", "--trace", str(trace), "--rate", "5", "--long-share", "1.5",
                 "--no-progress"]) == 2
    assert "--long-share must be within [0, 1]" in capsys.readouterr().err
    # No request generates more than 512 tokens under --max-gen 256.
    assert main(["sim", "--trace", str(trace), "--rate", "5", "--long-share", "0.6",
                 "--max-gen", "256", "--no-progress"]) == 2
    assert "no request generating more than 512" in capsys.readouterr().err
