"""Signal handlers on the event loop, and the process's own handlers back afterwards.

As uvicorn's ``capture_signals``: the daemon's handlers are installed for a
stretch of its life and the handlers that were there before (Python's
``KeyboardInterrupt`` for SIGINT, the default for SIGTERM, whatever an
embedding program set) are restored when it ends, so a daemon run inside
another program, or run twice, leaves the process as it found it.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Iterator, Mapping

__all__ = ["captured_signals"]


@contextlib.contextmanager
def captured_signals(loop: asyncio.AbstractEventLoop,
                     handlers: Mapping[signal.Signals, Callable[[int], None]]) -> Iterator[None]:
    """Call ``handlers[sig](sig)`` on ``loop`` for each signal while inside; restore after."""
    before = {sig: signal.getsignal(sig) for sig in handlers}
    try:
        for sig, handler in handlers.items():
            loop.add_signal_handler(sig, handler, sig)
        yield
    finally:
        for sig, old in before.items():
            loop.remove_signal_handler(sig)
            if old is not None:  # None: set from outside Python; leave the default
                signal.signal(sig, old)
