"""Start-up helpers: blocking loads off the loop, and worker messages held until the fleet exists.

Workers load their models while the daemon loads its tokenizer; what they send
before the daemon can serve waits in :class:`EarlySink`, in order.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

from .. import protocol as P
from .fleet import Fleet


async def in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a daemon thread: a start abandoned on SIGTERM exits without waiting
    for a download or a conversion to end (a pool's threads are joined at exit)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not fut.done():
            fut.set_result(value) if ok else fut.set_exception(value)

    def work() -> None:
        try:
            ok, value = True, fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            ok, value = False, exc
        try:
            loop.call_soon_threadsafe(settle, ok, value)
        except RuntimeError:  # the loop is gone: nobody waits any more
            pass

    threading.Thread(target=work, name="sclsd-start", daemon=True).start()
    return await fut


class EarlySink:
    """The transport's sink: worker messages that arrive before the fleet exists (workers
    load while the daemon loads its tokenizer) wait here, in order, and go to the fleet
    once it is attached; after that every message goes straight through."""

    #: A worker sends one ``register`` and waits: more than this is no worker of ours.
    MAX_EARLY = 1024

    def __init__(self) -> None:
        self.fleet: Fleet | None = None
        self.early: list[tuple[bytes, P.WorkerMsg]] = []

    def on_message(self, peer: bytes, msg: P.WorkerMsg) -> None:
        if self.fleet is not None:
            self.fleet.on_message(peer, msg)
            return
        if isinstance(msg, P.Register):
            # A worker left unanswered registers again every few seconds: only its latest
            # counts (the fleet takes a second register from a peer for a restart).
            self.early = [(p, m) for p, m in self.early if p != peer or not isinstance(m, P.Register)]
        if len(self.early) < self.MAX_EARLY:  # beyond: dropped; a worker registers again
            self.early.append((peer, msg))

    def attach(self, fleet: Fleet) -> None:
        self.fleet = fleet
        early, self.early = self.early, []
        for peer, msg in early:
            fleet.on_message(peer, msg)
