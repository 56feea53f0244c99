"""The worker secret: what a worker presents at ``register`` when not on CURVE."""

from __future__ import annotations

import os
import secrets
import stat
import string
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
            return cls(_read_existing(d.worker_secret_file), d.worker_secret_file, new=False)
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


def _read_existing(path: str) -> str:
    """The secret in an existing ``daemon.worker_secret_file``: refused unless it is a
    regular file private to its owner holding one hex string, what every worker demands of
    it (``sclsd-worker --secret-file``). Any other file (a config typo naming
    ``/etc/passwd``) would start a daemon whose workers all refuse to start."""
    key = "daemon.worker_secret_file"
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise StartupError(f"{key} {path} is not a regular file")
        value = os.read(fd, 4096).decode("ascii", errors="replace").strip()
        if not value:
            raise StartupError(f"{key} {path} is empty")
        if info.st_mode & 0o077:
            raise StartupError(f"{key} {path} has mode {stat.S_IMODE(info.st_mode):04o}: it must be "
                               "private to its owner (chmod 600)")
    finally:
        os.close(fd)
    if len(value) > 256 or not all(c in string.hexdigits for c in value):
        raise StartupError(f"{key} {path} must hold one hex string of at most 256 characters "
                           "(sclsctl keygen writes one; or remove it and the daemon writes one)")
    return value
