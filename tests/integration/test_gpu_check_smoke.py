"""``sclsd-bench gpu-check --smoke`` end to end on the CPU: the real stages (facts, the hf
engine table, a live daemon replay) on tiny-random, one stage killed at its cap with the
daemon it started, and what the run leaves on disk. The figures say nothing about a GPU."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def processes_mentioning(text: str) -> list[str]:
    """Command lines of the live (non-zombie) processes that mention ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if text in cmd and stat[stat.rfind(")") + 2] not in "ZX":
            found.append(cmd)
    return found


def test_smoke_run_measures_kills_an_overrunning_stage_and_writes_the_summary(tmp_path: Path) -> None:
    out, work = tmp_path / "out", tmp_path / "work"
    # The daemons' directories, short: a Unix socket's path holds at most 107 bytes.
    sockets = Path(tempfile.mkdtemp(prefix="gc-", dir="/tmp"))
    env = {**os.environ, "SCLSD_TEST_TMP": str(sockets)}  # to look for leftovers by
    res = subprocess.run(
        [sys.executable, "-m", "sclsd.bench.cli", "gpu-check", "--smoke", "--out", str(out), "--work", str(work),
         "--stages", "hf,live", "--live", "scls,ils", "--cap", "live-ils=5", "--deadline", "240"],
        capture_output=True, text=True, timeout=280, cwd=REPO, env=env,
    )  # fmt: skip
    assert res.returncode == 1, res.stderr[-3000:]  # one stage timed out
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    ends = {r["stage"]: r for r in rows if r.get("phase") == "end"}
    logs = "".join((out / n).read_text()[-4000:] for n in ("live.log", "engine.log") if (out / n).exists())
    assert {k: v["status"] for k, v in ends.items()} == {
        "setup": "ok", "facts": "ok", "hf": "ok", "live-scls": "ok", "live-ils": "timed out"}, (ends, logs)
    assert ends["live-ils"]["seconds"] < 5 + 3 and "5 s cap" in ends["live-ils"]["note"]
    plan = next(r for r in rows if r["stage"] == "plan")
    assert (plan["smoke"], plan["model"], plan["device"], plan["trace_kind"]) == (True, "tiny-random", "cpu",
                                                                                  "synthetic, seed 0")
    warm = [r for r in rows if r["stage"] == "hf" and r.get("phase") == "shape" and r["call"] == "warm"]
    assert len(warm) == 1 and warm[0]["ms_per_step"] > 0 and "error" not in warm[0]
    assert next(r for r in rows if r["stage"] == "hf" and r.get("phase") == "ready")["ready_since_launch_s"] > 0
    replay = next(r for r in rows if r["stage"] == "live-scls" and r.get("phase") == "replay")
    assert (replay["completed"], replay["requests"], replay["errors"], replay["rate"]) == (4, 4, 0, 2.0)
    assert rows[-1]["stage"] == "done"
    # The killed stage's daemon and worker went with it.
    assert processes_mentioning(str(sockets)) == []
    shutil.rmtree(sockets, ignore_errors=True)

    summary = (out / "summary.md").read_text()
    assert summary.startswith("# sclsd-bench gpu-check") and "Smoke run" in summary
    assert "| live-ils | timed out |" in summary and "| live-scls | ok |" in summary
    # Smoke shapes and rates are not the targets': nothing is judged met or missed from them.
    lines = {line.split(" | ")[0][2:]: line for line in summary.splitlines() if line.startswith("| ")}
    assert lines["hf decode ≤ 12 ms/step at N = 32, P = 256, graphs kept"].endswith("| not measured |")
    assert "replayed at 2.0 req/s" in lines["live at 4 req/s: `scls` ≥ 3 req/s, avg TTFT ≤ 2 s"]
    assert "timed out" in lines["live at 4 req/s: `ils` ≥ 1.5 req/s"]
    assert "not run" in lines["live at 4 req/s: `scls-cb` ≥ 1.5 req/s"]
    assert {p.name for p in out.iterdir()} == {"results.jsonl", "summary.md", "setup.log", "engine.log", "live.log"}
    assert "key lines" in (out / "live.log").read_text()  # the daemons' logs, excerpted
    assert "gpu-check [" in res.stderr  # progress as it goes
