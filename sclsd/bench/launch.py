"""Start a real sclsd daemon with local workers in a temporary directory (demo and benchmarks)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..client import status


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(v)


@dataclass
class Launched:
    """A running daemon; use as a context manager to stop it (SIGTERM) on exit."""

    proc: subprocess.Popen[bytes]
    dir: Path
    sock: str
    status_sock: str
    log: Path
    _tmp: Any = field(default=None, repr=False)

    def status(self) -> dict[str, Any]:
        return status(self.status_sock)

    def wait_workers(self, n: int, timeout: float = 300.0, progress: bool = True) -> float:
        """Block until ``n`` workers registered; returns the seconds it took."""
        t0 = time.monotonic()
        last = -1
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sclsd exited with code {self.proc.returncode} during start-up:\n"
                                   + self.log_tail())
            try:
                have = len(self.status()["workers"]) if Path(self.status_sock).exists() else 0
            except OSError:
                have = 0
            if progress and have != last:
                print(f"  {have}/{n} workers registered ({time.monotonic() - t0:.0f}s)", file=sys.stderr,
                      flush=True)
                last = have
            if have >= n:
                return time.monotonic() - t0
            time.sleep(0.5)
        raise RuntimeError(f"{n} workers not registered within {timeout:.0f}s:\n" + self.log_tail())

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def stop(self, timeout: float = 90.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        return self.proc.returncode

    def __enter__(self) -> Launched:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def launch(sections: dict[str, dict[str, Any]], *, keep_dir: str | None = None) -> Launched:
    """Write a config from ``sections`` (daemon sockets filled in) and start ``sclsd`` on it."""
    tmp = None
    if keep_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="sclsd-")
        d = Path(tmp.name)
    else:
        d = Path(keep_dir)
        d.mkdir(parents=True, exist_ok=True)
    daemon = {"socket": f"{d}/sclsd.sock", "status_socket": f"{d}/status.sock",
              "worker_endpoint": f"ipc://{d}/workers.ipc"}
    daemon.update(sections.get("daemon", {}))
    secs = dict(sections, daemon=daemon)
    lines: list[str] = []
    for name, values in secs.items():
        plain = {k: v for k, v in values.items() if not isinstance(v, dict)}
        lines.append(f"[{name}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in plain.items()]
        for k, sub in values.items():
            if isinstance(sub, dict):
                lines.append(f"[{name}.{k}]")
                lines += [f"{kk} = {_toml_value(vv)}" for kk, vv in sub.items()]
        lines.append("")
    cfg = d / "sclsd.toml"
    cfg.write_text("\n".join(lines))
    log = d / "sclsd.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "sclsd.daemon", "--config", str(cfg)],
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env)
    return Launched(proc, d, daemon["socket"], daemon["status_socket"], log, tmp)
