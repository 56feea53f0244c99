"""systemd's notify protocol (sd_notify) without libsystemd: READY, WATCHDOG, STOPPING, STATUS.

The protocol: datagrams of ``KEY=VALUE`` lines sent to the AF_UNIX socket named
by ``$NOTIFY_SOCKET`` (a path, or ``@name`` for the abstract namespace).
``Type=notify`` units wait for ``READY=1``; with ``WatchdogSec=`` systemd sets
``$WATCHDOG_USEC`` and restarts the service when ``WATCHDOG=1`` pings stop.
"""

from __future__ import annotations

import asyncio
import os
import socket


class Notifier:
    """Sends datagrams to ``$NOTIFY_SOCKET``; does nothing when the variable is unset."""

    def __init__(self, address: str | None, watchdog_usec: int | None = None) -> None:
        self.address = address
        self.watchdog_usec = watchdog_usec
        self._sock: socket.socket | None = None
        if address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @classmethod
    def from_env(cls) -> Notifier:
        addr = os.environ.get("NOTIFY_SOCKET") or None
        wd = os.environ.get("WATCHDOG_USEC")
        pid = os.environ.get("WATCHDOG_PID")
        usec = int(wd) if wd and wd.isdigit() and (pid is None or pid == str(os.getpid())) else None
        return cls(addr, usec)

    def notify(self, state: str) -> bool:
        """Send one datagram; False when there is no socket or the send failed."""
        if self._sock is None or not self.address:
            return False
        addr = self.address
        if addr.startswith("@"):  # abstract namespace
            addr = "\0" + addr[1:]
        try:
            self._sock.sendto(state.encode(), addr)
            return True
        except OSError:
            return False

    def ready(self, status: str = "") -> bool:
        """Start-up is complete: the sockets accept connections."""
        return self.notify("READY=1" + (f"\nSTATUS={status}" if status else ""))

    def stopping(self, status: str = "") -> bool:
        """Shutdown has begun (sent once the drain starts)."""
        return self.notify("STOPPING=1" + (f"\nSTATUS={status}" if status else ""))

    def status(self, text: str) -> bool:
        """Free-form status line shown by ``systemctl status``."""
        return self.notify(f"STATUS={text}")

    def close(self) -> None:
        """Close the datagram socket (the daemon calls it when it stops)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    async def watchdog_loop(self) -> None:
        """Ping the watchdog at half its period; returns at once when none is set.

        Running on the event loop is the point: a stuck loop stops the pings
        and systemd restarts the daemon.
        """
        if not self.watchdog_usec:
            return
        period = self.watchdog_usec / 1e6 / 2
        while True:
            self.notify("WATCHDOG=1")
            await asyncio.sleep(period)
