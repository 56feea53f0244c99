"""One owner per endpoint: a lock for every path the daemon binds, held for its lifetime.

The daemon binds the client socket, the status socket and, with an ``ipc://`` worker
endpoint, that endpoint's socket file. Two daemons that share any one of them (a second
config that differs in the rest) would take it from each other: binding a Unix socket
path means unlinking the file that is there, and a worker endpoint taken that way leaves
the first daemon's restarted workers talking to the second. So before it touches any of
those paths the daemon takes an exclusive ``flock`` on a lock file beside each
(``<path>.lock``; the client socket's is ``daemon.lock_file`` where that is set), and
then checks that nothing answers on them; a daemon that cannot do both exits 2 naming
the path and the pid that holds it. A path is unlinked only by its owner: a stale
socket (nothing answers, and its lock was free) at start, its own socket at the end.
"""

from __future__ import annotations

import fcntl
import os
import stat
from collections.abc import Sequence

from .errors import StartupError
from .sockets import listener_pid


class DaemonLock:
    """``flock`` on one lock file, holding our pid, that keeps the endpoint ``guards``.

    The kernel releases it when the process dies, however it dies, so a stale file
    never blocks a restart; another daemon that wants it refuses to start and names
    the pid of the one that holds it.
    """

    def __init__(self, path: str, guards: str = "") -> None:
        self.path = path
        self.guards = guards
        self.fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or raise :class:`StartupError` naming the holder's pid."""
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            what = self.guards or "these sockets"
            raise StartupError(f"another sclsd (pid {pid}) is running on {what}: it holds "
                               f"{self.path}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class EndpointLocks:
    """The locks of every endpoint the daemon binds, taken together or not at all.

    ``endpoints`` are (path the daemon binds, its lock file) pairs
    (:meth:`sclsd.config.DaemonConfig.endpoints`); two endpoints may share a lock file.
    """

    def __init__(self, endpoints: Sequence[tuple[str, str]]) -> None:
        self.endpoints = list(endpoints)
        by_file: dict[str, DaemonLock] = {}
        for path, lock_file in self.endpoints:
            by_file.setdefault(lock_file, DaemonLock(lock_file, path))
        self.locks = list(by_file.values())

    def acquire(self) -> None:
        """Lock every endpoint, then make sure none is live (a process that holds no lock of
        ours: another version, another program); on failure nothing stays locked and
        :class:`StartupError` names the path and the pid that has it."""
        taken: list[DaemonLock] = []
        try:
            for lock in self.locks:
                lock.acquire()
                taken.append(lock)
            for path, _ in self.endpoints:
                _check_not_live(path)
        except BaseException:
            for lock in taken:
                lock.release()
            raise

    def release(self) -> None:
        for lock in self.locks:
            lock.release()


def _check_not_live(path: str) -> None:
    """``path`` is free to bind: absent, or a socket nobody answers on (stale)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise StartupError(f"cannot check {path}: {exc.strerror or exc}") from None
    if not stat.S_ISSOCK(mode):
        raise StartupError(f"{path} exists and is not a socket: remove it or bind elsewhere")
    answered, pid = listener_pid(path)
    if answered:
        raise StartupError(f"{path} is in use by another process (pid {pid if pid is not None else '?'}) "
                           "that holds no sclsd lock on it")
