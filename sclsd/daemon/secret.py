"""The worker secret: what a worker presents at ``register`` when not on CURVE."""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass

from ..config import Config
from .errors import StartupError


@dataclass(frozen=True)
class WorkerSecret:
    """The secret and the file spawned workers read it from (``--secret-file``).

    ``daemon.worker_secret_file`` when it exists (for workers started apart); else a
    new secret for this run, to be written 0600 to that file if configured, or to the
    daemon's private run directory (:meth:`write`). None when CURVE authenticates and
    nothing is spawned.
    """

    value: str | None
    path: str | None
    new: bool
    """The secret was made for this run: :meth:`write` puts it in ``path``."""

    @classmethod
    def for_config(cls, cfg: Config, run_dir: str, curve: bool) -> WorkerSecret:
        d = cfg.daemon
        if d.worker_secret_file and os.path.exists(d.worker_secret_file):
            with open(d.worker_secret_file) as f:
                value = f.read().strip()
            if not value:
                raise StartupError(f"daemon.worker_secret_file {d.worker_secret_file} is empty")
            return cls(value, d.worker_secret_file, new=False)
        if curve and cfg.workers.spawn == 0:
            return cls(None, None, new=False)
        path = d.worker_secret_file or os.path.join(run_dir, "worker.secret")  # run_dir: mkdtemp, 0700
        return cls(secrets.token_hex(32), path, new=True)

    def write(self) -> None:
        """Write a secret made for this run (once the daemon holds its lock)."""
        if self.new and self.path is not None and self.value is not None:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(self.value + "\n")
