"""`sclsd-bench api` runs end to end and writes its JSON (no performance assertions here:
the numbers belong to docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
import sys

from .opshelp import REPO


def test_api_bench_smoke(tmp_path) -> None:
    out = tmp_path / "api.json"
    r = subprocess.run([sys.executable, "-m", "sclsd.bench.cli", "api", "--duration", "1", "--warmup", "0.3",
                        "--connections", "4", "--inflight", "4", "--latency-requests", "20",
                        "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["rps"] > 0 and res["p99_overhead_ms"] > 0
    assert res["lost"] == 0 and res["errors"] == {} and res["wrong_length"] == 0
    assert res["daemon_live_after"] == 0 and res["daemon_finished"] == res["total_requests"]
    assert "throughput:" in r.stderr  # progress
