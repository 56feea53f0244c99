"""Start ``sclsd-http`` as a child process (benchmarks and tests), on a free port."""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
import time


def start_http(sock: str, status_sock: str, *extra: str, listen: str = "127.0.0.1:0",
               timeout: float = 60.0) -> tuple[subprocess.Popen[str], str]:
    """``python -m sclsd.http`` in front of the daemon at ``sock``; returns the process and
    its URL once it printed where it listens (its further output is drained and dropped).
    Raises ``RuntimeError`` with its output if it exits or does not listen in time."""
    proc = subprocess.Popen([sys.executable, "-m", "sclsd.http", "--socket", sock, "--status-socket",
                             status_sock, "--listen", listen, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = proc.stdout
    assert out is not None
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        for line in out:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.2)
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        seen.append(line)
        if line.startswith("sclsd-http listening on "):
            return proc, line.split()[3]
    proc.kill()
    proc.wait()
    raise RuntimeError("sclsd-http did not start:\n" + "".join(seen))


def stop_http(proc: subprocess.Popen[str], timeout: float = 30.0) -> int:
    """SIGTERM, then SIGKILL after ``timeout``; returns the exit code (0 after a clean stop)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
