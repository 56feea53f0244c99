"""The daemon's budget for half-sent frames, against a real daemon, with clients of two uids.

Connections of uid nobody (made in a forked child, handed over with SCM_RIGHTS: the
daemon sees the uid that connected) and of root hold parts of 1 MiB frames; the
per-uid budget closes the connection that goes over it, the global budget closes the
heaviest uid's largest connection and not the bystander's, a bystander's requests
keep their latency, and the status and the metrics show the bytes held.
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sclsd import protocol as P
from sclsd.client import Client, status
from sclsd.launch import DaemonProcess as Daemon

from .opshelp import reference_tokens
from .test_guarantees import daemon_factory

NOBODY = 65534
KIB = 1024
MIB = 1024 * KIB

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another uid")


@pytest.fixture
def started(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    with daemon_factory(tmp_path) as make:
        yield make


def connect_as(uid: int, path: str, n: int) -> list[socket.socket]:
    """``n`` connections to ``path`` made by a forked child running as ``uid`` (SO_PEERCRED
    names it), handed to this process."""
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:  # child: the syscalls only, then os._exit (no pytest, no cleanup)
        code = 0
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            conns = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(n)]
            for c in conns:
                c.connect(path)
            socket.send_fds(theirs, [b"x"], [c.fileno() for c in conns])
        except BaseException:  # noqa: BLE001 - the parent sees no descriptors
            code = 1
        os._exit(code)
    theirs.close()
    try:
        mine.settimeout(30)
        _, fds, _, _ = socket.recv_fds(mine, 1, n)
    finally:
        mine.close()
        _, st = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(st) == 0 and len(fds) == n, (st, fds)
    return [socket.socket(fileno=fd) for fd in fds]


class Half:
    """A connection that sends part of a 1 MiB frame and reads what the daemon says (blocking
    socket calls, each bounded by a timeout)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        sock.settimeout(10.0)

    @classmethod
    def open(cls, path: str) -> Half:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        return cls(s)

    def send_part(self, n: int) -> None:
        try:
            self.sock.sendall(P.FRAME_HEADER.pack(MIB) + b"\x00" * n)
        except ConnectionError:  # closed by the daemon while sending: closed_with() tells why
            pass

    def _exactly(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            assert chunk, f"EOF after {len(data)} of {n} bytes"
            data += chunk
        return data

    def closed_with(self) -> P.Error:
        """The daemon's last word to a connection it closes: an error frame, then the end."""
        (n,) = P.FRAME_HEADER.unpack(self._exactly(4))
        ev = P.server_decoder.decode(self._exactly(n))
        assert isinstance(ev, P.Error), ev
        try:  # EOF, or a reset where the daemon left some of our bytes unread
            assert self.sock.recv(1) == b""
        except ConnectionResetError:
            pass
        return ev

    def is_open(self) -> bool:
        """Nothing came from the daemon, not even EOF."""
        self.sock.setblocking(False)
        try:
            self.sock.recv(1)
            return False
        except BlockingIOError:
            return True
        except ConnectionError:
            return False
        finally:
            self.sock.settimeout(10.0)

    def close(self) -> None:
        self.sock.close()


def held_becomes(d: Daemon, want: int, timeout: float = 10.0) -> P.StatusSnapshot:
    """Poll the status (bounded) until the daemon holds ``want`` bytes of half-sent frames."""
    deadline = time.monotonic() + timeout
    while True:
        st = d.status()
        if st.partial_frame_bytes == want:
            return st
        assert time.monotonic() < deadline, f"held {st.partial_frame_bytes}, expected {want}"
        time.sleep(0.05)


def round_trip(d: Daemon) -> float:
    """One request on a fresh connection; its seconds (and its tokens checked)."""
    t0 = time.monotonic()
    prompt = [5, 6, 7]
    with Client(d.sock, timeout=10) as c:
        done = c.complete(prompt_ids=prompt, max_tokens=8, temperature=0.0, ignore_eos=True)
    assert done.token_ids == reference_tokens(prompt, 8), done
    return time.monotonic() - t0


def test_half_sent_frames_are_held_within_the_uid_and_global_budgets(started: Callable[..., Daemon]) -> None:
    d = started(workers={"spawn": 1}, daemon={
        "socket_open_to_all_users": True, "max_frame_bytes": MIB, "frame_timeout_s": 60.0,
        "max_partial_frame_bytes_per_uid": 2 * MIB, "max_partial_frame_bytes": 3 * MIB})
    st = d.status()
    assert (st.limits.max_partial_frame_bytes, st.limits.max_partial_frame_bytes_per_uid) == (3 * MIB, 2 * MIB)
    theirs = connect_as(NOBODY, d.sock, 3)

    baseline = round_trip(d)
    a = [Half(s) for s in theirs]
    ours: list[Half] = []
    try:
        # Uid nobody: 900 KiB, 900 KiB, then 900 KiB more would pass its 2 MiB.
        a[0].send_part(900 * KIB)
        held_becomes(d, 900 * KIB)
        a[1].send_part(900 * KIB)
        held_becomes(d, 1800 * KIB)
        a[2].send_part(900 * KIB)
        ev = a[2].closed_with()
        assert ev.code == "overloaded" and f"uid {NOBODY}" in ev.message, ev
        assert "max_partial_frame_bytes_per_uid" in ev.message, ev
        st = held_becomes(d, 1800 * KIB)
        assert st.counters["partial_frame_closed"] == 1, st.counters
        # Root, the bystander: 500 KiB twice fit in 3 MiB; the third 500 KiB would not,
        # and nobody, holding the most, loses its largest connection.
        ours = [Half.open(d.sock) for _ in range(3)]
        ours[0].send_part(500 * KIB)
        held_becomes(d, 2300 * KIB)
        ours[1].send_part(500 * KIB)
        held_becomes(d, 2800 * KIB)
        during = round_trip(d)  # the bystander's latency with 2.8 MiB held
        ours[2].send_part(500 * KIB)
        ev = a[0].closed_with()
        assert ev.code == "overloaded" and "(daemon.max_partial_frame_bytes)" in ev.message, ev
        st = held_becomes(d, 900 * KIB + 1500 * KIB)
        assert st.counters["partial_frame_closed"] == 2, st.counters
        assert a[1].is_open() and all(h.is_open() for h in ours)
        text = status(d.status_sock, metrics=True)
        m = re.search(r"^sclsd:partial_frame_bytes\{model_name=\"fake\"\} (\S+)$", text, re.M)
        assert m is not None and float(m.group(1)) == 2400 * KIB, text[:2000]
        after = round_trip(d)
        # The bystander's latency held: under a second, or 10x the idle one on a loaded machine.
        assert max(during, after) < max(1.0, 10 * baseline), (baseline, during, after)
    finally:
        for h in (*a, *ours):
            h.close()
    held_becomes(d, 0)
    log = d.log.read_text()
    assert log.count("closed: frames in progress") == 2, d.log_text()
