"""The locks of every endpoint the daemon binds: all or none, naming the path and the pid
(the daemons themselves: ``tests/integration/test_endpoint_owner.py``)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from sclsd.config import ConfigError, from_dict
from sclsd.daemon.errors import StartupError
from sclsd.daemon.lock import EndpointLocks


def _daemon(tmp: Path, **keys: str) -> dict[str, dict[str, str]]:
    return {"daemon": {"socket": f"{tmp}/a.sock", "status_socket": f"{tmp}/s.sock",
                       "worker_endpoint": f"ipc://{tmp}/w.ipc", **keys}}


def test_every_bound_path_has_a_lock(tmp_path: Path) -> None:
    d = from_dict(_daemon(tmp_path)).daemon
    assert d.endpoints() == [(f"{tmp_path}/a.sock", f"{tmp_path}/a.sock.lock"),
                             (f"{tmp_path}/s.sock", f"{tmp_path}/s.sock.lock"),
                             (f"{tmp_path}/w.ipc", f"{tmp_path}/w.ipc.lock")]
    tcp = from_dict(_daemon(tmp_path, lock_file=f"{tmp_path}/l")).daemon
    assert tcp.endpoints()[0] == (f"{tmp_path}/a.sock", f"{tmp_path}/l")
    with pytest.raises(ConfigError, match="daemon.worker_endpoint"):
        from_dict(_daemon(tmp_path, worker_endpoint=f"ipc://{tmp_path}/s.sock"))
    with pytest.raises(ConfigError, match="daemon.lock_file"):
        from_dict(_daemon(tmp_path, lock_file=f"{tmp_path}/w.ipc"))


def test_a_second_owner_of_any_path_is_refused_and_keeps_nothing(tmp_path: Path) -> None:
    first = EndpointLocks(from_dict(_daemon(tmp_path)).daemon.endpoints())
    first.acquire()
    try:
        # Its own client and status sockets, the first one's worker endpoint.
        other = tmp_path / "other"
        other.mkdir()
        second = EndpointLocks(from_dict({"daemon": {
            "socket": f"{other}/a.sock", "status_socket": f"{other}/s.sock",
            "worker_endpoint": f"ipc://{tmp_path}/w.ipc"}}).daemon.endpoints())
        with pytest.raises(StartupError) as err:
            second.acquire()
        assert f"pid {os.getpid()}" in str(err.value) and f"{tmp_path}/w.ipc" in str(err.value)
        assert all(lock.fd is None for lock in second.locks)  # nothing kept
        # Its own paths were not taken from anyone: a third daemon there gets them.
        third = EndpointLocks([(f"{other}/a.sock", f"{other}/a.sock.lock")])
        third.acquire()
        third.release()
    finally:
        first.release()
    second.acquire()  # free once the first is gone
    second.release()


def test_a_path_that_is_no_socket_or_that_answers_is_refused(tmp_path: Path) -> None:
    plain = tmp_path / "file.ipc"
    plain.write_text("not a socket")
    with pytest.raises(StartupError, match="exists and is not a socket"):
        EndpointLocks([(str(plain), f"{plain}.lock")]).acquire()
    live = str(tmp_path / "live.ipc")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(live)
        listener.listen(1)
        locks = EndpointLocks([(live, f"{live}.lock")])
        with pytest.raises(StartupError, match=rf"in use by another process \(pid {os.getpid()}\)"):
            locks.acquire()
        assert all(lock.fd is None for lock in locks.locks)
    # A stale socket (nobody listens) is free to bind: its owner is gone.
    EndpointLocks([(live, f"{live}.lock")]).acquire()
