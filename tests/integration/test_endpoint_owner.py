"""One owner per endpoint: a second daemon that shares any path the first binds (the
status socket, the ipc:// worker endpoint; the client socket is
``test_guarantees.py::test_second_daemon_on_the_same_sockets_exits_2_and_the_first_keeps_serving``)
exits 2 naming the path and the first daemon's pid, before it touches anything, and the
first keeps serving, a restarted worker of it included. A live endpoint of a process that
holds no sclsd lock is never unlinked either.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sclsd.launch import DaemonProcess as Daemon
from sclsd.launch import short_dir

from .opshelp import reference_tokens
from .test_guarantees import (
    READY_S,
    daemon_factory,
    greedy,
    one_line_error,
    poll,
    run_to_exit,
    write_config,
)


@pytest.fixture
def started(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    with daemon_factory(tmp_path) as make:
        yield make


def second_daemon(tmp: Path, **daemon: str) -> str:
    """Run a daemon whose own sockets are new except ``daemon``'s; it must exit 2 with one
    line, which is returned."""
    tmp.mkdir()
    cfg, short = write_config(tmp, daemon={"log_level": "warning", **daemon}, workers={"spawn": 0})
    try:
        return one_line_error(run_to_exit(cfg))
    finally:
        shutil.rmtree(short, ignore_errors=True)


def test_a_second_daemon_sharing_one_endpoint_exits_2_and_the_first_keeps_it(
        started: Callable[..., Daemon], tmp_path: Path) -> None:
    d = started(workers={"spawn": 1})
    ipc = d.endpoint.removeprefix("ipc://")
    inodes = {p: os.stat(p).st_ino for p in (ipc, d.status_sock, d.sock)}

    line = second_daemon(tmp_path / "shares-endpoint", worker_endpoint=d.endpoint)
    assert ipc in line and f"pid {d.proc.pid}" in line, line
    line = second_daemon(tmp_path / "shares-status", status_socket=d.status_sock)
    assert d.status_sock in line and f"pid {d.proc.pid}" in line, line
    assert {p: os.stat(p).st_ino for p in inodes} == inodes

    # The first daemon still owns its endpoint: a worker killed now comes back and registers.
    old = d.status().workers[0].pid
    os.kill(old, signal.SIGKILL)
    poll(lambda: [w.pid for w in d.status().workers if w.state == "active"] not in ([], [old]), READY_S,
         "the restarted worker to register again", d)
    assert greedy(d, [9, 8, 7]) == reference_tokens([9, 8, 7], 12)


def test_a_live_endpoint_without_a_lock_is_never_unlinked(tmp_path: Path) -> None:
    """Something else (an older daemon, another program) listens on the worker endpoint and
    holds no sclsd lock: the daemon names it and leaves it alone."""
    short = short_dir()
    path = f"{short}/foreign.ipc"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(path)
        listener.listen(4)
        inode = os.stat(path).st_ino
        line = second_daemon(tmp_path / "foreign", worker_endpoint=f"ipc://{path}")
        assert path in line and f"pid {os.getpid()}" in line, line
        assert os.stat(path).st_ino == inode
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(5)
            probe.connect(path)  # still ours, still listening
    finally:
        listener.close()
        shutil.rmtree(short, ignore_errors=True)
