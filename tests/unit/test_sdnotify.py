"""sd_notify against a datagram socket the test creates as NOTIFY_SOCKET."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import pytest

from sclsd.sdnotify import Notifier


@pytest.fixture
def notify_sock(tmp_path: Path):
    path = tmp_path / "notify"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(path))
    s.settimeout(5)
    yield str(path), s
    s.close()


def test_ready_status_stopping(notify_sock) -> None:
    path, s = notify_sock
    n = Notifier(path)
    assert n.ready("serving on /run/sclsd/sclsd.sock")
    assert s.recv(4096) == b"READY=1\nSTATUS=serving on /run/sclsd/sclsd.sock"
    assert n.status("draining 3 requests")
    assert s.recv(4096) == b"STATUS=draining 3 requests"
    assert n.stopping()
    assert s.recv(4096) == b"STOPPING=1"


def test_abstract_namespace_address() -> None:
    name = f"sclsd-test-{os.getpid()}"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind("\0" + name)
    s.settimeout(5)
    try:
        assert Notifier("@" + name).ready()
        assert s.recv(4096) == b"READY=1"
    finally:
        s.close()


def test_from_env_and_watchdog_pings(notify_sock, monkeypatch: pytest.MonkeyPatch) -> None:
    path, s = notify_sock
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    monkeypatch.setenv("WATCHDOG_USEC", "100000")  # pings every 50 ms
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    n = Notifier.from_env()
    assert n.watchdog_usec == 100_000

    s.settimeout(5)

    async def run() -> list[bytes]:
        task = asyncio.create_task(n.watchdog_loop())
        try:  # three pings in a row, each within the 5 s the socket waits
            return [await asyncio.to_thread(s.recv, 4096) for _ in range(3)]
        finally:
            task.cancel()

    assert asyncio.run(run()) == [b"WATCHDOG=1"] * 3


def test_watchdog_meant_for_another_process_is_ignored(notify_sock, monkeypatch: pytest.MonkeyPatch) -> None:
    path, _ = notify_sock
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    monkeypatch.setenv("WATCHDOG_USEC", "100000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    n = Notifier.from_env()
    assert n.watchdog_usec is None
    asyncio.run(asyncio.wait_for(n.watchdog_loop(), 1))  # returns at once


def test_without_notify_socket_nothing_is_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    n = Notifier.from_env()
    assert not n.ready() and not n.stopping()


def test_a_vanished_socket_is_not_an_error(tmp_path: Path) -> None:
    assert not Notifier(str(tmp_path / "nobody-listens")).ready()
