"""The stage runner of ``sclsd-bench gpu-check``: each stage a subprocess under its own time
cap, all of them inside one deadline, every result on disk as soon as it exists.

A stage is a command whose stdout lines that are JSON objects are results (appended to
``results.jsonl`` as they arrive) and whose other output goes to the stage's log. The
runner gives it ``min(cap, time left before the deadline - a reserve)`` seconds, or skips
it when that is less than the stage needs to say anything; a stage that overruns gets
SIGTERM (so a daemon it started can stop), then SIGKILL, it and every process it started,
and is recorded as timed out. After every stage one ``{"stage": NAME, "phase": "end"}``
row says how it ended, and a callback (the summary) runs.

Standard library only: the runner must work before the project's dependencies are
importable (the first stage may be the one that installs them).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

#: Seconds kept free before the deadline when a stage's budget is set (the end row, the
#: summary, the last kill).
RESERVE_S = 5.0
#: Longest wait between SIGTERM and SIGKILL for a stage that overruns.
GRACE_S = 10.0
#: A log over this many bytes keeps its head and its tail (what comes back from a box is bounded).
LOG_LIMIT = 1_500_000
LOG_HEAD, LOG_TAIL = 200_000, 1_200_000
#: Seconds between the "still running" lines on stderr.
HEARTBEAT_S = 30.0
#: Environment variable set in each stage to its launch time (seconds since the epoch): a
#: stage's start-to-ready figures then count the interpreter's start and its imports too.
LAUNCH_ENV = "SCLSD_GPU_CHECK_LAUNCH"
#: Lines of an attached file (a daemon's log) copied into the stage log besides its tail.
ATTACH_KEYS = ("ready in", "registered", "rc=-9", "gave up", "warm-up done", "static cache", "paged cache", "arena:",
               "KV memory", "dropping", "cannot capture", "Traceback", "Error", "preempted", "evicted")


@dataclass
class Stage:
    """One step of the check."""

    name: str
    argv: list[str]
    cap_s: float
    """Longest the stage may run."""
    min_s: float
    """Skipped (and recorded so) when less than this is left before the deadline."""
    log: str
    """File under the output directory that takes the stage's stderr and non-JSON stdout."""
    env: Mapping[str, str] | None = None
    """Environment of the command (default: this process's)."""
    attach: list[Path] = field(default_factory=list)
    """Files (a daemon's log) whose key lines and tail are copied into ``log`` afterwards."""
    skip: str | None = None
    """Known before it starts: why the stage cannot run (recorded as skipped)."""


@dataclass(frozen=True)
class StageEnd:
    """How a stage ended: ``ok``, ``failed``, ``timed out`` or ``skipped``."""

    name: str
    status: str
    rc: int | None
    seconds: float
    note: str = ""

    def row(self) -> dict[str, Any]:
        return {"stage": self.name, "phase": "end", "status": self.status, "rc": self.rc,
                "seconds": round(self.seconds, 1), "note": self.note}  # fmt: skip


def stage_budget(cap_s: float, min_s: float, left_s: float, reserve_s: float = RESERVE_S) -> float | None:
    """Seconds a stage gets: its cap, or what is left before the deadline less the reserve
    if that is smaller; None (skip it) when that is under ``min_s``."""
    budget = min(cap_s, left_s - reserve_s)
    return budget if budget >= min_s else None


def grace_for(budget_s: float) -> float:
    """Seconds between SIGTERM and SIGKILL inside a budget: long enough for a daemon to
    stop its workers, short enough to leave most of a small budget to the stage."""
    return max(0.5, min(GRACE_S, budget_s / 5))


# --------------------------------------------------------------------------- processes


def _proc_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time in clock ticks) of every process, from /proc (empty
    where there is none)."""
    table: dict[int, tuple[int, int]] = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    stat = f.read().decode(errors="replace")
            except OSError:
                continue
            # The command name may hold spaces and parentheses: the fields follow the last ')'.
            fields = stat[stat.rfind(")") + 2 :].split()
            with contextlib.suppress(IndexError, ValueError):
                table[int(entry.name)] = (int(fields[1]), int(fields[19]))
    return table


def descendants(root: int, table: Mapping[int, tuple[int, int]] | None = None) -> dict[int, int]:
    """pid -> start time of every process below ``root`` (its children, theirs, ...)."""
    table = _proc_table() if table is None else table
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out: dict[int, int] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if pid not in out:
            out[pid] = table[pid][1]
            todo += children.get(pid, [])
    return out


def signal_tracked(tracked: Mapping[int, int], sig: int) -> int:
    """Send ``sig`` to each tracked process still alive with the same start time (a pid
    reused since is left alone); returns how many were signalled."""
    table = _proc_table()
    sent = 0
    for pid, start in tracked.items():
        if pid in table and table[pid][1] == start:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
                sent += 1
    return sent


# --------------------------------------------------------------------------- the runner


class Runner:
    """Runs stages in order inside ``deadline_s`` seconds from its creation.

    ``on_row`` sees every result row as it is written; ``on_stage_end`` runs after each
    stage (the summary is rewritten there).
    """

    def __init__(self, out: Path, deadline_s: float, *, on_row: Callable[[dict[str, Any]], None] | None = None,
                 on_stage_end: Callable[[StageEnd], None] | None = None, quiet: bool = False) -> None:
        self.out = out
        self.out.mkdir(parents=True, exist_ok=True)
        self.results = out / "results.jsonl"
        self.deadline_s = deadline_s
        self.t0 = time.monotonic()
        self.on_row = on_row
        self.on_stage_end = on_stage_end
        self.quiet = quiet
        self._lock = threading.Lock()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.deadline_s - self.elapsed()

    def say(self, text: str) -> None:
        """A progress line on stderr, with the time since the start."""
        if not self.quiet:
            print(f"gpu-check [{self.elapsed():4.0f}s] {text}", file=sys.stderr, flush=True)

    def record(self, row: dict[str, Any]) -> None:
        """Append one result row (flushed at once: a call cut short keeps it)."""
        row.setdefault("t", round(time.time(), 1))
        line = json.dumps(row, default=str)
        with self._lock, open(self.results, "a", encoding="utf-8") as f:
            f.write(line + "\n")
        if self.on_row is not None:
            self.on_row(row)

    def run(self, stage: Stage) -> StageEnd:
        """Run ``stage`` (or skip it), record its end row, call ``on_stage_end``."""
        budget = stage_budget(stage.cap_s, stage.min_s, self.left())
        if stage.skip is not None or budget is None:
            note = stage.skip or (f"skipped: {max(0.0, self.left() - RESERVE_S):.0f} s left before the deadline, "
                                  f"needs {stage.min_s:.0f} s")  # fmt: skip
            end = StageEnd(stage.name, "skipped", None, 0.0, note)
            self.say(f"{stage.name}: {note}")
        else:
            end = self._run(stage, budget)
        self.record(end.row())
        if self.on_stage_end is not None:
            self.on_stage_end(end)
        return end

    def _run(self, stage: Stage, budget: float) -> StageEnd:
        log_path = self.out / stage.log
        self.say(f"{stage.name} (cap {budget:.0f} s)")
        t0 = time.monotonic()
        with open(log_path, "a", encoding="utf-8", errors="replace") as log:
            log.write(f"=== {time.strftime('%H:%M:%S')} [{self.elapsed():.0f}s] {stage.name} "
                      f"(cap {budget:.0f} s): {' '.join(stage.argv)}\n")  # fmt: skip
            log.flush()
            env = dict(os.environ if stage.env is None else stage.env)
            env[LAUNCH_ENV] = repr(time.time())
            # A session of its own: the stage, and a daemon it starts, are one process group.
            proc = subprocess.Popen(stage.argv, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True)  # fmt: skip
            reader = threading.Thread(target=self._read, args=(stage.name, proc, log), daemon=True)
            reader.start()
            tracked, timed_out = self._wait(stage.name, proc, budget)
            # Whatever the stage left behind (a daemon's workers live in sessions of their own).
            signal_tracked(tracked, signal.SIGKILL)
            reader.join(timeout=5)
            rc = proc.returncode
            seconds = time.monotonic() - t0
            log.write(f"=== {time.strftime('%H:%M:%S')} [{self.elapsed():.0f}s] {stage.name}: rc={rc}"
                      f"{' (timed out)' if timed_out else ''} after {seconds:.0f} s\n")  # fmt: skip
        for path in stage.attach:
            attach(log_path, path)
        trim(log_path)
        if timed_out:
            end = StageEnd(stage.name, "timed out", rc, seconds, f"killed after its {budget:.0f} s cap")
        elif rc == 0:
            end = StageEnd(stage.name, "ok", rc, seconds)
        else:
            end = StageEnd(stage.name, "failed", rc, seconds, last_line(log_path))
        self.say(f"{stage.name}: {end.status} (rc {rc}, {seconds:.0f} s){' ' + end.note if end.note else ''}")
        return end

    def _wait(self, name: str, proc: subprocess.Popen[bytes], budget: float) -> tuple[dict[int, int], bool]:
        """Wait for ``proc`` within ``budget`` seconds, noting its descendants as they come;
        past ``budget - grace`` SIGTERM them all, past ``budget`` SIGKILL."""
        t0 = time.monotonic()
        term_at = budget - grace_for(budget)
        tracked: dict[int, int] = {}
        beat = t0 + HEARTBEAT_S
        termed = False
        while True:
            try:
                proc.wait(timeout=0.5)
                return tracked, termed
            except subprocess.TimeoutExpired:
                pass
            tracked.update(descendants(proc.pid))
            now = time.monotonic()
            if now >= beat:
                self.say(f"  {name} still running ({now - t0:.0f} of {budget:.0f} s)")
                beat = now + HEARTBEAT_S
            if now - t0 >= budget:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                signal_tracked(tracked, signal.SIGKILL)
                proc.wait()
                return tracked, True
            if not termed and now - t0 >= term_at:
                termed = True
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                signal_tracked(tracked, signal.SIGTERM)

    def _read(self, name: str, proc: subprocess.Popen[bytes], log: TextIO) -> None:
        """Stage stdout: JSON objects to the results, anything else to the log."""
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            row = parse_row(line)
            if row is None:
                log.write(line + "\n")
                log.flush()
                continue
            row.setdefault("stage", name)
            self.record(row)


def parse_row(line: str) -> dict[str, Any] | None:
    """The JSON object on ``line``, or None when it is not one."""
    if not line.startswith("{"):
        return None
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) else None


def read_rows(results: Path) -> list[dict[str, Any]]:
    """Every row of a ``results.jsonl`` (a torn last line is passed by)."""
    if not results.is_file():
        return []
    rows = []
    for line in results.read_text(encoding="utf-8", errors="replace").splitlines():
        row = parse_row(line)
        if row is not None:
            rows.append(row)
    return rows


# --------------------------------------------------------------------------- logs


def last_line(path: Path) -> str:
    """The last non-empty line of a log (progress bars redraw with carriage returns), shortened."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 8192))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    lines = [x.strip() for x in text.replace("\r", "\n").splitlines() if x.strip() and not x.startswith("=== ")]
    return lines[-1][:300] if lines else ""


def attach(log: Path, path: Path, tail: int = 300_000) -> None:
    """Copy the key lines (:data:`ATTACH_KEYS`) and the tail of ``path`` into ``log``."""
    if not path.is_file():
        return
    text = path.read_text(errors="replace")
    keys = [x for x in text.splitlines() if any(k in x for k in ATTACH_KEYS)][:60]
    with open(log, "a", encoding="utf-8") as f:
        f.write(f"----- {path.name}: key lines -----\n" + "\n".join(keys) + "\n")
        f.write(f"----- {path.name}: tail -----\n" + text[-tail:] + "\n")


def trim(path: Path, limit: int = LOG_LIMIT, head: int = LOG_HEAD, tail: int = LOG_TAIL) -> None:
    """Keep a log returnable: over ``limit`` bytes, its head and its tail only."""
    try:
        size = path.stat().st_size
    except OSError:
        return
    if size <= limit:
        return
    with open(path, "rb") as f:
        first = f.read(head)
        f.seek(size - tail)
        last = f.read()
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(first + b"\n[... trimmed ...]\n" + last)
    tmp.replace(path)
