"""A busy machine is not a fault: with every core held by other processes and each worker's
first ``register`` slow to build, the daemon (default timings, default policy on ``hf-cb``
workers over the tiny random Llama) kills no worker and serves every request.

Before workers were judged by progress, the slow first register made the worker send it
twice, and the daemon took the second for a restart and SIGKILLed a healthy worker.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import pytest

from sclsd.bench.streams import saturated
from sclsd.client import AsyncClient

from .harness import start_daemon

#: The worker's test hook: seconds its first Register takes to build (worker.runtime).
REGISTER_DELAY_S = 10.0
PROMPTS = ["The capital of France is", "One, two, three,", "Hello", "Once upon a time",
           "Write a haiku", "1 2 3 4 5", "Why", "A B C D"]


@pytest.fixture
def busy_cores() -> Iterator[None]:
    """Two spinning processes per core for the test's length."""
    with saturated(2 * (os.cpu_count() or 2)):
        yield


def test_no_worker_is_killed_on_a_saturated_machine_with_a_slow_first_register(tmp_path, busy_cores) -> None:
    # The daemon's default liveness timings, not the tests' relaxed ones.
    timings = {"heartbeat_interval_s": 1.0, "heartbeat_timeout_s": 10.0, "batch_ack_timeout_s": 5.0,
               "log_level": "info"}
    os.environ["SCLSD_WORKER_REGISTER_DELAY_S"] = str(REGISTER_DELAY_S)  # inherited by the workers
    try:
        d = start_daemon(tmp_path, engine="hf-cb", model="tiny-random", workers=2, policy="scls-cb",
                         slice_len=8, daemon=timings, ready_timeout=300)
    finally:
        del os.environ["SCLSD_WORKER_REGISTER_DELAY_S"]
    try:
        async def run() -> list:
            async with AsyncClient(d.sock) as c:
                return list(await asyncio.gather(*(
                    c.complete(prompt=p, max_tokens=24, temperature=0.0, ignore_eos=True) for p in PROMPTS)))

        done = asyncio.run(run())
        assert [x.finish_reason for x in done] == ["length"] * len(PROMPTS)
        st = d.status()
        assert st.worker_losses == [], st.worker_losses
        assert len(st.workers) == 2 and not st.loading
        log = (tmp_path / "sclsd.log").read_text()
        assert "SCLSD_WORKER_REGISTER_DELAY_S: building the first register takes" in log  # the hook ran
        assert " lost (" not in log and "restarting in" not in log
    finally:
        assert d.stop() == 0, d.log_text()
