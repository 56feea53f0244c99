"""The daemon's signal handlers live on its event loop while it runs; the process's own
handlers are back once it stops (as uvicorn's ``capture_signals``)."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

from sclsd.daemon.signals import captured_signals


def test_captured_signals_call_the_handler_on_the_loop_then_restore_what_was_there() -> None:
    seen: list[int] = []

    def mine(signum: int, frame: Any) -> None:
        seen.append(-signum)

    before = signal.signal(signal.SIGUSR1, mine)
    try:
        async def main() -> None:
            loop = asyncio.get_running_loop()
            got = asyncio.Event()

            def on_signal(sig: int) -> None:
                seen.append(sig)
                got.set()

            with captured_signals(loop, {signal.SIGUSR1: on_signal}):
                assert signal.getsignal(signal.SIGUSR1) is not mine
                os.kill(os.getpid(), signal.SIGUSR1)
                await asyncio.wait_for(got.wait(), 5)
            assert signal.getsignal(signal.SIGUSR1) is mine

        asyncio.run(main())
        assert seen == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_captured_signals_restore_on_an_error_too() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        before = signal.getsignal(signal.SIGINT)  # asyncio.run's own, here
        try:
            with captured_signals(loop, {signal.SIGINT: lambda sig: None}):
                raise RuntimeError("start-up failed")
        except RuntimeError:
            pass
        assert signal.getsignal(signal.SIGINT) is before

    asyncio.run(main())
