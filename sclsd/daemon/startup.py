"""Start-up helpers: blocking loads off the loop, and worker messages held until the daemon
can serve.

Workers load their models while the daemon loads its tokenizer; what they send
before the daemon can serve waits in :class:`EarlyMessages`, in order.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

from .. import protocol as P


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


class EarlyMessages:
    """Worker messages that arrive before the daemon can serve (workers load while the
    daemon loads its tokenizer): held in order, handed over once it can."""

    #: A worker sends one ``register`` and waits: more than this is no worker of ours.
    MAX_EARLY = 1024

    def __init__(self) -> None:
        self.held: list[tuple[bytes, P.WorkerMsg]] = []

    def hold(self, peer: bytes, msg: P.WorkerMsg) -> None:
        if isinstance(msg, P.Register):
            # A worker left unanswered registers again every few seconds: only its latest
            # counts (a second register from a peer would be taken for a restart).
            self.held = [(p, m) for p, m in self.held if p != peer or not isinstance(m, P.Register)]
        if len(self.held) < self.MAX_EARLY:  # beyond: dropped; a worker registers again
            self.held.append((peer, msg))

    def take(self) -> list[tuple[bytes, P.WorkerMsg]]:
        """Everything held, in arrival order (and nothing held any more)."""
        held, self.held = self.held, []
        return held
