"""The worker secret: what a worker presents at ``register`` when not on CURVE."""

from __future__ import annotations

import os
import secrets

from ..config import Config
from .errors import StartupError


def worker_secret(cfg: Config, run_dir: str, curve: bool) -> tuple[str | None, str | None]:
    """The secret and the file spawned workers read it from (``--secret-file``).

    ``daemon.worker_secret_file`` when it exists (for workers started apart); else a
    new secret for this run, written 0600 to that file if configured, or to the
    daemon's private run directory. None when CURVE authenticates and nothing is spawned.
    """
    d = cfg.daemon
    if d.worker_secret_file and os.path.exists(d.worker_secret_file):
        with open(d.worker_secret_file) as f:
            secret = f.read().strip()
        if not secret:
            raise StartupError(f"daemon.worker_secret_file {d.worker_secret_file} is empty")
        return secret, d.worker_secret_file
    if curve and cfg.workers.spawn == 0:
        return None, None
    secret = secrets.token_hex(32)
    path = d.worker_secret_file or os.path.join(run_dir, "worker.secret")  # run_dir: mkdtemp, 0700
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    return secret, path
