"""Start a real ``sclsd`` (and the workers it spawns) from a config written on the fly.

One launcher for the demo, the benchmarks and the integration tests::

    with launch({"model": {"name": "fake"}, "workers": {"engine": "fake", "spawn": 2}},
                wait_workers=2) as d:
        print(d.status().workers[0].state)
        ...  # talk to d.sock with sclsd.client

The config goes into a short directory together with the sockets (ipc:// and Unix
socket paths are limited to about 107 bytes), under ``$SCLSD_TEST_TMP`` or /tmp.
The daemon runs as ``python -m sclsd.daemon --config FILE`` with the Hugging Face
libraries switched offline (:func:`sclsd.defaults.offline_env`).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .client import status
from .defaults import offline_env
from .protocol import StatusSnapshot

__all__ = ["DaemonProcess", "launch", "short_dir", "toml_text"]

_dirs = itertools.count()


def short_dir(prefix: str = "sclsd") -> Path:
    """A new, empty directory with a short path (sockets in it stay under the
    ~107-byte limit): under ``$SCLSD_TEST_TMP`` if set, else /tmp."""
    root = Path(os.environ.get("SCLSD_TEST_TMP", "/tmp"))
    root.mkdir(parents=True, exist_ok=True)
    d = Path(tempfile.mkdtemp(prefix=f"{prefix}-{os.getpid()}-{next(_dirs)}-", dir=root))
    # mkdtemp makes it 0700; clients of other uids must reach the sockets inside (the
    # sockets' own modes and allow-lists decide who may use them).
    d.chmod(0o755)
    return d


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        # A JSON string is a TOML basic string, except that TOML also wants DEL escaped.
        return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} {v!r} as a TOML value")


def toml_text(sections: Mapping[str, Mapping[str, Any]]) -> str:
    """A config file from ``{section: {key: value}}``; a dict value is a sub-table
    (``workers.options``)."""
    lines: list[str] = []
    for name, values in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in values.items() if not isinstance(v, Mapping)]
        for k, sub in values.items():
            if isinstance(sub, Mapping):
                lines.append(f"[{name}.{k}]")
                lines += [f"{kk} = {_toml_value(vv)}" for kk, vv in sub.items()]
        lines.append("")
    return "\n".join(lines)


@dataclass
class DaemonProcess:
    """A running daemon. As a context manager it is stopped (SIGTERM) on exit."""

    proc: subprocess.Popen[bytes]
    dir: Path
    """Directory of the config and the sockets."""
    config: Path
    sock: str
    status_sock: str
    endpoint: str
    log: Path
    """The daemon's (and its spawned workers') stdout and stderr."""
    _owns_dir: bool = field(default=False, repr=False)

    def status(self, timeout: float = 10.0) -> StatusSnapshot:
        """One status round trip on the status socket."""
        return status(self.status_sock, timeout=timeout)

    def wait_workers(self, n: int, timeout: float = 120.0, progress: bool = False) -> float:
        """Block until the daemon answers on its status socket with ``n`` workers registered
        (``n = 0``: until it serves); returns the seconds it took.

        Raises ``RuntimeError`` with the log's tail if the daemon exits or the time runs out.
        """
        t0 = time.monotonic()
        last = -1
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sclsd exited with code {self.proc.returncode} during start-up:\n"
                                   + self.log_text())
            have: int | None = None  # None: the daemon does not answer yet
            if Path(self.status_sock).exists():
                try:
                    have = len(self.status().workers)
                except OSError:  # between bind and listen
                    pass
            if progress and have is not None and have != last:
                print(f"  {have}/{n} workers registered ({time.monotonic() - t0:.0f}s)",
                      file=sys.stderr, flush=True)
                last = have
            if have is not None and have >= n:
                return time.monotonic() - t0
            time.sleep(0.1)
        raise RuntimeError(f"{n} workers not registered within {timeout:.0f}s:\n" + self.log_text())

    def log_text(self, n: int = 6000) -> str:
        """The last ``n`` characters of the log."""
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, wait up to ``timeout`` (then SIGKILL); returns the exit code.

        A directory the launcher made is removed, with the log if it lies there.
        """
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                print(f"sclsd did not stop within {timeout:.0f}s of SIGTERM: killed", file=sys.stderr)
                self.proc.kill()
                self.proc.wait()
        if self._owns_dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self._owns_dir = False
        return self.proc.returncode

    def __enter__(self) -> DaemonProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def launch(
    sections: Mapping[str, Mapping[str, Any]],
    *,
    dir: Path | str | None = None,
    log: Path | str | None = None,
    env: Mapping[str, str] | None = None,
    preexec_fn: Callable[[], None] | None = None,
    cwd: Path | str | None = None,
    wait_workers: int | None = None,
    timeout: float = 120.0,
    progress: bool = False,
) -> DaemonProcess:
    """Write a config from ``sections`` and start ``sclsd`` on it.

    ``daemon.socket``, ``daemon.status_socket`` and ``daemon.worker_endpoint`` default
    to paths in ``dir`` (default: a new :func:`short_dir`, removed by ``stop()``; a
    given ``dir`` is left alone). ``log`` (default ``dir/sclsd.log``) takes the
    daemon's output; ``env`` adds variables to its environment. With ``wait_workers``, returns once that many workers
    registered (within ``timeout`` seconds; the daemon is stopped if they do not).
    """
    owns = dir is None
    d = short_dir() if dir is None else Path(dir)
    d.mkdir(parents=True, exist_ok=True)
    daemon = {"socket": f"{d}/sclsd.sock", "status_socket": f"{d}/status.sock",
              "worker_endpoint": f"ipc://{d}/workers.ipc", **sections.get("daemon", {})}
    cfg = d / "sclsd.toml"
    cfg.write_text(toml_text({**sections, "daemon": daemon}))
    log_path = Path(log) if log is not None else d / "sclsd.log"
    full_env = offline_env()
    full_env["PYTHONUNBUFFERED"] = "1"
    full_env.update(env or {})
    with open(log_path, "wb") as out:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen([sys.executable, "-m", "sclsd.daemon", "--config", str(cfg)],
                                stdout=out, stderr=subprocess.STDOUT, env=full_env,
                                preexec_fn=preexec_fn, cwd=cwd)
    dp = DaemonProcess(proc, d, cfg, daemon["socket"], daemon["status_socket"],
                       daemon["worker_endpoint"], log_path, owns)
    if wait_workers is not None:
        try:
            dp.wait_workers(wait_workers, timeout, progress)
        except BaseException:
            dp.stop(timeout=10)
            raise
    return dp
