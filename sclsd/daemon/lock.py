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

Another local user must not be able to redirect what the daemon (often root) opens
there: every directory holding an endpoint or a lock file must be owned by the
daemon's user or root and writable by nobody else, and each directory above it must be
too unless it is sticky (``/tmp``), as sshd's ``StrictModes`` requires of a home; a
lock file is opened with ``O_NOFOLLOW`` and must be a regular file of ours, so a link
planted at its name is refused rather than followed.
"""

from __future__ import annotations

import contextlib
import errno
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
        check_run_dir(os.path.dirname(self.path) or ".")
        try:
            # O_NOFOLLOW: a link planted at the name is refused, never followed to a file
            # it would truncate; O_NONBLOCK: a FIFO planted there cannot hang the open.
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK,
                         0o644)
        except OSError as exc:
            why = "it is a symbolic link" if exc.errno == errno.ELOOP else exc.strerror or str(exc)
            raise StartupError(f"cannot open lock file {self.path}: {why}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid not in (os.geteuid(), 0) or st.st_nlink != 1:
                raise StartupError(f"lock file {self.path} is not a plain file of this user or root "
                                   f"(owner uid {st.st_uid}, {st.st_nlink} links): remove it")
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            what = self.guards or "these sockets"
            raise StartupError(f"another sclsd (pid {pid}) is running on {what}: it holds "
                               f"{self.path}") from None
        except BaseException:
            os.close(fd)
            raise
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
        for path, _ in self.endpoints:
            check_run_dir(os.path.dirname(path) or ".")
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


def check_run_dir(path: str) -> None:
    """Make ``path`` (0755, if missing and its parent exists) and check that no other local user can replace
    what the daemon creates in it: ``path`` owned by this user or root and writable by
    nobody else; each directory above it the same, or sticky; a symbolic link on the way
    owned by this user or root (and where it leads checked the same way). Raises
    :class:`StartupError` in one line saying which directory and why."""
    given = os.path.normpath(os.path.abspath(path))
    if not os.path.isdir(given):
        # One level only: a config naming a path whose parent does not exist is a mistake,
        # and a daemon run as root must not lay out directories wherever a typo points.
        if not os.path.isdir(os.path.dirname(given)):
            raise StartupError(f"the directory {given} of a socket or lock file does not exist, "
                               f"nor does its parent {os.path.dirname(given)}")
        with contextlib.suppress(FileExistsError):
            os.mkdir(given, 0o755)
    _check_chain(given, given)
    real = os.path.realpath(given)
    if real != given:
        _check_chain(real, given)


def _check_chain(path: str, run_dir: str) -> None:
    """``path`` and every directory above it, by ``lstat`` (see :func:`check_run_dir`)."""
    me = os.geteuid()
    here, first = path, True
    while True:
        try:
            st = os.lstat(here)
        except OSError as exc:
            raise StartupError(f"cannot check run directory {run_dir}: {here}: {exc.strerror or exc}") from None
        where = "" if here == run_dir else f" (above the run directory {run_dir})"
        if st.st_uid not in (me, 0):
            raise StartupError(f"{here}{where} is owned by uid {st.st_uid}, not by this user ({me}) or "
                               "root: another user could replace the sockets and lock files sclsd makes "
                               "there; use a directory of sclsd's own (e.g. /run/sclsd)")
        writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        # Above the run directory a sticky one (/tmp) is safe: only an entry's owner may
        # rename or remove it there. The run directory itself must admit nobody else. A
        # link's own mode means nothing.
        if not stat.S_ISLNK(st.st_mode) and writable and (first or not st.st_mode & stat.S_ISVTX):
            who = "others" if st.st_mode & stat.S_IWOTH else "its group"
            raise StartupError(f"{here}{where} is writable by {who} (mode {stat.S_IMODE(st.st_mode):o}): "
                               "another user could replace the sockets and lock files sclsd makes there; "
                               "make the run directory 0755 or 0750, owned by sclsd's user")
        parent = os.path.dirname(here)
        if parent == here:
            return
        here, first = parent, False


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
