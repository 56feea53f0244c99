"""sclsd-bench replay against a real daemon with fake workers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sclsd.bench.cli import main as bench_main
from sclsd.eval.metrics import SUMMARY_KEYS

from .harness import start_daemon


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    d = start_daemon(tmp_path_factory.mktemp("replay"), workers=2, slice_len=4,
                     worker_opts={"decode_s": 0.002})
    yield d
    assert d.stop() == 0, d.log_text()


def test_replay_trace_times_and_poisson(daemon, tmp_path: Path) -> None:
    trace = tmp_path / "t.csv"
    rows = [(0.00, 5, 9), (0.05, 30, 3), (0.10, 12, 17), (0.10, 1, 1), (0.30, 60, 8), (0.31, 8, 12)]
    trace.write_text("arrival_s,input_tokens,output_tokens\n" + "".join(f"{a},{i},{o}\n" for a, i, o in rows))
    out = tmp_path / "r.json"
    rc = bench_main(["replay", "--socket", daemon.sock, "--status-socket", daemon.status_sock,
                     "--trace", str(trace), "--num", "6", "--id-range", "256", "--no-progress",
                     "--json", str(out)])
    assert rc == 0
    s = json.loads(out.read_text())
    assert set(SUMMARY_KEYS) <= set(s)
    assert s["requests"] == s["completed"] == 6
    # ignore_eos + max_tokens = the trace's output lengths: exactly those tokens were generated.
    assert s["output_tps"] * s["duration_s"] == pytest.approx(sum(o for _, _, o in rows))
    # Slices of 4: ceil(out / 4) per request.
    assert s["slices_per_req"] == pytest.approx(sum(-(-o // 4) for _, _, o in rows) / 6)
    assert s["batches"] > 0 and s["avg_batch_size"] >= 1
    # The sends follow the trace's times (0 to 0.31 s; the first may leave a little late).
    assert 0.25 <= s["arrivals_s"] and 0 <= s["late_starts"] <= 6 and s["late_start_s"] == 1.0
    assert s["policy"] == "scls" and s["workers"] == 2
    # Every request of more than one token streamed across slices: its longest gap between
    # two deltas is measured, bounded by the run, and goodput counts against both SLOs.
    assert 0 < s["p50_gap_s"] <= s["max_gap_s"] <= s["duration_s"]
    assert 0 <= s["goodput_rps"] <= s["throughput_rps"]

    rc = bench_main(["replay", "--socket", daemon.sock, "--status-socket", daemon.status_sock,
                     "--trace", str(trace), "--num", "6", "--id-range", "256", "--no-progress",
                     "--slo-gap", "0", "--json", str(out)])
    s = json.loads(out.read_text())
    # No request of two tokens or more has its tokens all at once: a gap bound of 0 fails them.
    assert rc == 0 and s["goodput_rps"] * s["duration_s"] == pytest.approx(1)  # the 1-token request

    rc = bench_main(["replay", "--socket", daemon.sock, "--status-socket", daemon.status_sock,
                     "--trace", str(trace), "--num", "6", "--rate", "50", "--scale", "0.5",
                     "--id-range", "256", "--no-progress", "--json", str(out)])
    s = json.loads(out.read_text())
    assert rc == 0 and s["completed"] == 6 and s["scale"] == 0.5


def test_a_max_tokens_cap_with_the_client_ending_each_request_at_its_length(daemon, tmp_path: Path) -> None:
    """``--max-tokens-cap``: requests ask a cap, as clients do, and the client ends each at its
    trace length, as EOS would: the trace's tokens are counted, every request is ended by a
    cancel, and none runs to the cap."""
    from sclsd.client import status

    trace = tmp_path / "t.csv"
    rows = [(0.00, 5, 9), (0.05, 30, 3), (0.10, 12, 17), (0.20, 8, 12)]
    trace.write_text("arrival_s,input_tokens,output_tokens\n" + "".join(f"{a},{i},{o}\n" for a, i, o in rows))
    out = tmp_path / "r.json"
    before = status(daemon.status_sock).counters
    rc = bench_main(["replay", "--socket", daemon.sock, "--status-socket", daemon.status_sock,
                     "--trace", str(trace), "--num", "4", "--id-range", "256", "--no-progress",
                     "--max-tokens-cap", "400", "--json", str(out)])
    s = json.loads(out.read_text())
    assert rc == 0 and s["requests"] == s["completed"] == 4 and s["errors"] == 0
    assert s["output_tps"] * s["duration_s"] == pytest.approx(sum(o for _, _, o in rows))
    after = status(daemon.status_sock).counters
    assert after["cancelled"] - before.get("cancelled", 0) == 4, after
    assert after["finished"] == before.get("finished", 0)  # none ran to its cap of 400
    # Slices of 4, counted by the daemon (the requests' done never comes): each request's
    # slices up to its length, and at most one more that the cancel ended.
    exact = sum(-(-o // 4) for _, _, o in rows) / 4
    assert exact <= s["slices_per_req"] <= exact + 1, s["slices_per_req"]
