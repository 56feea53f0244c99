"""``sclsd-bench gpu-check``'s stage runner: caps, the deadline, results as they come.

The stages here are small Python commands; the one that overruns sleeps in the child
process, which is what the runner must kill (with what it started)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from sclsd.bench import gpu_check
from sclsd.bench.gpu_runner import (
    RESERVE_S,
    Runner,
    Stage,
    StageEnd,
    grace_for,
    read_rows,
    stage_budget,
)

PY = sys.executable


def alive(pid: int) -> bool:
    """Running (a zombie nobody reaped yet counts as dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


def script(code: str) -> list[str]:
    return [PY, "-c", code]


def test_stage_budget_is_the_cap_or_what_the_deadline_leaves() -> None:
    assert stage_budget(140, 40, left_s=500) == 140
    assert stage_budget(140, 40, left_s=100) == 100 - RESERVE_S
    assert stage_budget(140, 40, left_s=40 + RESERVE_S) == 40
    assert stage_budget(140, 40, left_s=39 + RESERVE_S) is None  # would not fit: skipped
    assert grace_for(600) == 10 and grace_for(2) < 1  # SIGTERM leaves most of a small budget


def test_rows_are_recorded_as_they_come_and_other_output_goes_to_the_log(tmp_path: Path) -> None:
    seen: list[dict[str, object]] = []
    ends: list[StageEnd] = []
    r = Runner(tmp_path, 60, on_row=seen.append, on_stage_end=ends.append, quiet=True)
    code = ("import json, sys; print('loading'); print(json.dumps({'phase': 'ready', 'x': 1}), flush=True); "
            "print('{not json'); print('warn', file=sys.stderr); print(json.dumps({'stage': 'other', 'y': 2}))")
    end = r.run(Stage("one", script(code), cap_s=30, min_s=1, log="one.log"))
    assert (end.status, end.rc) == ("ok", 0)
    rows = read_rows(tmp_path / "results.jsonl")
    assert [(x.get("stage"), x.get("phase")) for x in rows] == [("one", "ready"), ("other", None), ("one", "end")]
    assert rows[0]["x"] == 1 and seen == rows and ends == [end]
    log = (tmp_path / "one.log").read_text()
    assert "loading" in log and "{not json" in log and "warn" in log and '"x"' not in log


def test_a_stage_that_overruns_is_killed_with_what_it_started_and_the_next_still_runs(tmp_path: Path) -> None:
    """The child prints a row, starts a grandchild in a session of its own (as a daemon
    starts its workers) and hangs: both are gone after the cap, the row is kept."""
    code = ("import json, subprocess, sys, time; "
            "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], start_new_session=True); "
            "print(json.dumps({'phase': 'started', 'grandchild': g.pid}), flush=True); time.sleep(300)")
    r = Runner(tmp_path, 120, quiet=True)
    hung = r.run(Stage("hung", script(code), cap_s=2.5, min_s=1, log="hung.log"))
    after = r.run(Stage("after", script("print('{\"phase\": \"ran\"}')"), cap_s=30, min_s=1, log="after.log"))
    assert hung.status == "timed out" and hung.note.startswith("killed after its")
    assert hung.seconds < 2.5 + 3
    rows = read_rows(tmp_path / "results.jsonl")
    started = next(x for x in rows if x.get("phase") == "started")
    assert not alive(started["grandchild"])
    assert after.status == "ok" and any(x.get("stage") == "after" and x.get("phase") == "ran" for x in rows)
    ends = [x for x in rows if x.get("phase") == "end"]
    assert [(x["stage"], x["status"]) for x in ends] == [("hung", "timed out"), ("after", "ok")]


def test_stages_that_do_not_fit_the_deadline_are_skipped_and_recorded(tmp_path: Path) -> None:
    """A deadline 2 s past the reserve: the first stage gets those 2 s (not its cap), is
    killed at them, and the next, which needs 1 s, is skipped; so is a stage known not to run."""
    r = Runner(tmp_path, RESERVE_S + 2, quiet=True)
    first = r.run(Stage("first", script("import time; time.sleep(300)"), cap_s=600, min_s=1, log="a.log"))
    second = r.run(Stage("second", script("print(1)"), cap_s=600, min_s=1, log="a.log"))
    third = r.run(Stage("third", script("print(1)"), cap_s=60, min_s=0, log="a.log", skip="no CUDA device"))
    assert first.status == "timed out" and first.seconds < 2 + 3
    assert second.status == "skipped" and "needs 1 s" in second.note and second.rc is None
    assert third.status == "skipped" and third.note == "no CUDA device"
    assert r.elapsed() < RESERVE_S + 2 + 3
    assert [x["status"] for x in read_rows(tmp_path / "results.jsonl")] == ["timed out", "skipped", "skipped"]


def test_a_failing_stage_records_its_last_line(tmp_path: Path) -> None:
    r = Runner(tmp_path, 60, quiet=True)
    end = r.run(Stage("bad", script("import sys; print('step 1', file=sys.stderr); sys.exit('no CUDA here')"),
                      cap_s=30, min_s=1, log="bad.log"))  # fmt: skip
    assert (end.status, end.rc, end.note) == ("failed", 1, "no CUDA here")


def test_the_summary_is_rewritten_after_every_stage(tmp_path: Path) -> None:
    """Wired as gpu-check wires it: after the hf stage the summary already judges its row,
    before any other stage ran."""
    snapshots: list[str] = []

    def summary(_end: StageEnd) -> None:
        gpu_check.write_summary(tmp_path)
        snapshots.append((tmp_path / "summary.md").read_text())

    r = Runner(tmp_path, 60, on_stage_end=summary, quiet=True)
    row = {"phase": "shape", "n": 32, "p": 256, "call": "warm", "ms_per_step": 9.5, "graphs_kept": True}
    r.run(Stage("hf", script(f"print({json.dumps(json.dumps(row))})"), cap_s=30, min_s=1, log="engine.log"))
    r.run(Stage("cb", script("import sys; sys.exit(3)"), cap_s=30, min_s=1, log="engine.log"))
    assert len(snapshots) == 2
    assert "| hf decode ≤ 12 ms/step at N = 32, P = 256, graphs kept | 9.50 ms/step, graphs kept | met |" in snapshots[0]
    assert "| cb | failed | 3 |" not in snapshots[0] and "| cb | failed | 3 |" in snapshots[1]


@pytest.mark.parametrize("bad", ["hf,gpu", "live,warp"])
def test_unknown_stages_are_refused(bad: str) -> None:
    with pytest.raises(SystemExit, match="unknown"):
        gpu_check.parse_stages(bad)
