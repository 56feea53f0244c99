"""`sclsd-bench batcher` on a small synthetic trace."""

from __future__ import annotations

import json

from sclsd.bench.cli import main


def test_batcher_bench_writes_json(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,input_tokens,output_tokens\n" + "".join(
        f",{L},10\n" for L in (5, 50, 500, 2000, 900, 12, 1024, 300)
    ))  # fmt: skip
    out = tmp_path / "r.json"
    rc = main(["batcher", "--n", "40", "--trace", str(trace), "--repeat", "3", "--json", str(out)])
    assert rc == 0
    d = json.loads(out.read_text())
    assert d["n"] == 40 and d["median_ms"] >= 0 and d["p95_ms"] >= d["median_ms"]
    assert 1 <= d["batches"] <= 40
    assert json.loads(capsys.readouterr().out.strip()) == d


def test_batcher_bench_bad_trace(tmp_path):
    assert main(["batcher", "--n", "4", "--trace", str(tmp_path / "missing.csv")]) == 1
