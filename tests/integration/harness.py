"""Start a real sclsd daemon (and its worker processes) in a temporary directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sclsd.client import status


@dataclass
class DaemonProc:
    proc: subprocess.Popen[bytes]
    dir: Path
    sock: str
    status_sock: str
    endpoint: str
    log: Path

    def status(self) -> dict[str, Any]:
        return status(self.status_sock)

    def wait_workers(self, n: int, timeout: float = 120.0) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            assert self.proc.poll() is None, f"daemon exited early:\n{self.log_text()}"
            try:
                if len(self.status()["workers"]) >= n:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"{n} workers not registered in {timeout}s:\n{self.log_text()}")

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"daemon did not stop on SIGTERM:\n{self.log_text()}") from None
        return self.proc.returncode


def start_daemon(tmp: Path, *, engine: str = "fake", model: str = "fake", workers: int = 2,
                 policy: str = "scls", slice_len: int = 8, daemon: str = "", scheduler: str = "",
                 worker_opts: dict[str, Any] | None = None, wait: bool = True,
                 ready_timeout: float = 120.0) -> DaemonProc:
    # ipc:// paths are limited to ~107 bytes: keep the directory short.
    short = Path(os.environ.get("SCLSD_TEST_TMP", "/tmp")) / f"sclsd-{os.getpid()}-{time.monotonic_ns() % 10**9}"
    short.mkdir(parents=True)
    opts = "".join(f"{k} = {v!r}\n".replace("'", '"') for k, v in (worker_opts or {}).items())
    cfg = tmp / "sclsd.toml"
    cfg.write_text(textwrap.dedent(f"""\
        [daemon]
        socket = "{short}/api.sock"
        status_socket = "{short}/status.sock"
        worker_endpoint = "ipc://{short}/w.ipc"
        heartbeat_interval_s = 0.5
        heartbeat_timeout_s = 30.0
        drain_timeout_s = 20.0
        log_level = "debug"
        """) + textwrap.dedent(daemon) + textwrap.dedent(f"""
        [model]
        name = "{model}"

        [scheduler]
        policy = "{policy}"
        slice_len = {slice_len}
        gamma_s = 0.05
        """) + textwrap.dedent(scheduler) + textwrap.dedent(f"""
        [workers]
        spawn = {workers}
        engine = "{engine}"
        threads = 1
        restart_backoff_s = 0.2
        [workers.options]
        """) + opts)
    log = tmp / "sclsd.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "sclsd.daemon", "--config", str(cfg)],
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env)
    d = DaemonProc(proc, short, f"{short}/api.sock", f"{short}/status.sock", f"ipc://{short}/w.ipc", log)
    if wait:
        d.wait_workers(workers, ready_timeout)
    return d
