"""Drain: stop accepting, let what is in flight finish, then stop.

SIGTERM or SIGINT begins it: new requests get ``draining``, live ones have
``daemon.drain_timeout_s`` to finish, whatever is left then gets
``error: shutdown``. A second signal ends the drain at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Protocol

from .. import protocol as P
from ..sdnotify import Notifier

log = logging.getLogger("sclsd")


class Drained(Protocol):
    """What a drain waits on and ends: the daemon's live requests."""

    idle: asyncio.Event
    """Set while no request is live."""

    def live_count(self) -> int: ...

    def fail_all(self, code: P.ErrorCode, message: str) -> list[str]:
        """End every live request with ``error``; returns their ids."""
        ...


class DrainControl:
    """The drain's state and task; ``stopped`` is set when the daemon may stop."""

    def __init__(self, daemon: Drained, timeout_s: float, notifier: Notifier) -> None:
        self.daemon = daemon
        self.timeout_s = timeout_s
        self.notifier = notifier
        self.draining = False
        self.stopped = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self._signals = 0

    def begin(self, sig: int | None = None) -> None:
        """Stop accepting and finish what is in flight; a second signal ends it now."""
        self._signals += 1
        name = signal.Signals(sig).name if sig else "request"
        live = self.daemon.live_count()
        if self.draining:
            if self._signals > 1 and sig is not None:
                log.warning("second %s: ending %d requests now", name, live)
                self.finish()
            return
        self.draining = True
        log.info("draining (%s): refusing new requests, finishing %d in flight within %.0fs",
                 name, live, self.timeout_s)
        self.notifier.stopping(f"draining {live} requests (up to {self.timeout_s:.0f}s)")
        self.task = asyncio.get_running_loop().create_task(self._run(), name="drain")

    async def _run(self) -> None:
        try:
            await asyncio.wait_for(self.daemon.idle.wait(), self.timeout_s)
        except asyncio.TimeoutError:
            pass
        self.finish()

    def finish(self) -> None:
        """End the drain: what is left gets ``error: shutdown``; the daemon stops."""
        if self.stopped.is_set():
            return
        left = self.daemon.fail_all("shutdown", "the daemon stopped before this request finished")
        if left:
            log.warning("drain ended with %d requests unfinished: ids=%s", len(left), ",".join(left))
        self.stopped.set()

    def check(self) -> None:
        """Raise the drain's error, if it failed (never swallowed)."""
        t = self.task
        if t is not None and t.done() and not t.cancelled() and t.exception():
            raise RuntimeError("the drain failed") from t.exception()
