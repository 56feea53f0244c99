"""`sclsd-bench rates` runs end to end at a tiny size and writes its JSON and tables (no
performance assertions here: the numbers belong to docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
import sys

from .opshelp import REPO


def test_rates_bench_smoke(tmp_path) -> None:
    out, md = tmp_path / "rates.json", tmp_path / "rates.md"
    r = subprocess.run([sys.executable, "-m", "sclsd.bench.cli", "rates", "--workers", "1", "--rows", "4",
                        "--clients", "6", "--connections", "2", "--client-procs", "2", "--tokens", "40",
                        "--short-tokens", "8", "--slice-len", "16", "--prompt-len", "8", "--duration", "2",
                        "--warmup", "1", "--contexts", "16,64", "--json", str(out), "--md", str(md)],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert [ph["output_tokens"] for ph in res["phases"]] == [40, 8]
    for ph in res["phases"]:
        assert ph["errors"] == {} and ph["wrong_length"] == 0
        assert ph["delivered_tokens_per_s"] > 0 and ph["daemon_cpu_us_per_token"] > 0
        assert ph["offered_tokens_per_s"] == 4 / 0.01 and ph["grants_per_s"] > 0
    assert [g["context"] for g in res["grant_bytes"]] == [16, 64] and res["daemon_exit"] == 0
    assert "| 40 |" in md.read_text() and "40-token outputs:" in r.stderr  # the tables, and progress
