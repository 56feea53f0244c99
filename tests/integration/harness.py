"""A real sclsd (and its worker processes) with the defaults of the daemon tests:
fake engine and model, two workers, slice 8, short heartbeats and Γ."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sclsd.launch import DaemonProcess, launch

#: The launcher's handle on a running daemon (status(), wait_workers(), log_text(), stop()).
DaemonProc = DaemonProcess


def start_daemon(tmp: Path, *, engine: str = "fake", model: str = "fake", workers: int = 2,
                 policy: str = "scls", slice_len: int = 8, daemon: dict[str, Any] | None = None,
                 scheduler: dict[str, Any] | None = None, worker_opts: dict[str, Any] | None = None,
                 wait: bool = True, ready_timeout: float = 120.0,
                 workers_cfg: dict[str, Any] | None = None) -> DaemonProc:
    """Start ``sclsd``; its log is ``tmp/sclsd.log`` (kept after ``stop()``)."""
    sections: dict[str, dict[str, Any]] = {
        "daemon": {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 30.0, "drain_timeout_s": 20.0,
                   "log_level": "debug", **(daemon or {})},
        "model": {"name": model},
        "scheduler": {"policy": policy, "slice_len": slice_len, "gamma_s": 0.05, **(scheduler or {})},
        "workers": {"spawn": workers, "engine": engine, "threads": 1, "restart_backoff_s": 0.2,
                    "options": dict(worker_opts or {}), **(workers_cfg or {})},
    }
    return launch(sections, log=tmp / "sclsd.log", wait_workers=workers if wait else None,
                  timeout=ready_timeout)
