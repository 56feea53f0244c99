"""The scheduling loop: time out what is overdue, run a round when one is due, sleep.

A round asks the core scheduler for batches (the policy decides what, where
and when) and hands each to the dispatcher. The loop wakes early whenever
something changes (a request admitted, a result applied, a worker joined).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from ..core.scheduler_api import SchedulerInterface
from .dispatch import Dispatcher
from .requests import LiveRequests

log = logging.getLogger("sclsd")


class Rounds:
    """Drives :class:`~sclsd.core.scheduler.Scheduler` with the real clock."""

    def __init__(self, sched: SchedulerInterface, live: LiveRequests, dispatcher: Dispatcher,
                 clock: Callable[[], float], wake: asyncio.Event) -> None:
        self.sched = sched
        self.live = live
        self.dispatcher = dispatcher
        self.clock = clock
        self.wake = wake

    def step(self, now: float) -> float:
        """One turn: expire timeouts, schedule if due. Returns seconds until the next turn."""
        for req in self.sched.expire(now):
            c = self.live.get(req.rid)
            if c is not None:
                log.info("id=%s timed out", req.rid)
                self.live.finish(c, "timeout")
        if self.sched.due(now):
            for batch in self.sched.schedule(now):
                self.dispatcher.dispatch(batch)
        wait = 1.0
        if self.sched.pool and self.sched.active_workers():
            wait = min(wait, self.sched.next_at - now)
        nd = self.sched.next_deadline()
        if nd is not None:
            wait = min(wait, nd - now)
        return wait

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self.wake.clear()
            wait = self.step(self.clock())
            if wait > 0:
                # A timer sets the same event a change would (not asyncio.wait_for, whose
                # timeout racing a cancellation can swallow the cancel on Python 3.11).
                timer = loop.call_later(wait, self.wake.set)
                try:
                    await self.wake.wait()
                finally:
                    timer.cancel()
            else:
                await asyncio.sleep(0)
