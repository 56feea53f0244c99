"""One daemon per socket: an exclusive lock held for the daemon's lifetime."""

from __future__ import annotations

import fcntl
import os

from .errors import StartupError


class DaemonLock:
    """``flock`` on a file beside the client socket (``daemon.lock_file``), holding our pid.

    The kernel releases it when the process dies, however it dies, so a stale file
    never blocks a restart; a second daemon on the same paths refuses to start and
    names the pid of the one running.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd: int | None = None

    def acquire(self) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise StartupError(f"another sclsd (pid {pid}) is running on these sockets: it holds "
                               f"{self.path}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
