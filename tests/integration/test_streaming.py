"""Tokens streamed as generated, through real daemons and workers.

* Fake workers at 20 ms per iteration, S = 64: a 64-token answer's first token
  reaches the client well before its slice (about 1.3 s) ends.

Greedy output with KV kept across slices equals output with full re-prefills: in
process with the counters in tests/unit/daemon/test_kv_identity.py; through real
workers against one pass in test_daemon_hf.py (hf) and test_daemon_scls_cb.py (hf-cb).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from sclsd.client import AsyncClient, Client, Delta, Done

from .harness import start_daemon

STEP_S = 0.02


@pytest.fixture(scope="module")
def fake_daemon(tmp_path_factory: pytest.TempPathFactory):
    d = start_daemon(tmp_path_factory.mktemp("stream"), workers=2, slice_len=64,
                     worker_opts={"decode_s": STEP_S})
    yield d
    assert d.stop() == 0, d.log_text()


async def first_token_and_end(sock: str, **params: object) -> tuple[float, float, list[Delta], Done]:
    """Seconds from sending the request to its first token and to its end, as the client sees them."""
    async with AsyncClient(sock) as c:
        t0 = time.monotonic()
        first: float | None = None
        deltas: list[Delta] = []
        done: Done | None = None
        async for ev in c.stream(**params):
            if isinstance(ev, Delta) and ev.token_ids:
                if first is None:
                    first = time.monotonic() - t0
                deltas.append(ev)
            elif isinstance(ev, Done):
                done = ev
        assert first is not None and done is not None
        return first, time.monotonic() - t0, deltas, done


def test_ttft_of_a_64_token_answer_is_the_prefill_not_the_slice(fake_daemon) -> None:
    ttfts = []
    for i in range(3):  # the best of three: the machine is shared
        ttft, e2e, deltas, done = asyncio.run(first_token_and_end(
            fake_daemon.sock, prompt=f"stream {i}", max_tokens=64, ignore_eos=True, temperature=0.0))
        assert done.finish_reason == "length" and done.timings.slices == 1
        assert sum(len(d.token_ids) for d in deltas) == 64  # each token once
        assert len(deltas) > 10  # coalesced to ~20 ms, not one per slice
        assert e2e >= 64 * STEP_S  # the slice itself takes 1.28 s
        assert done.timings.ttft_s is not None and done.timings.ttft_s < e2e / 2
        ttfts.append(ttft)
    assert min(ttfts) < 0.3, ttfts


def test_streamed_and_whole_outputs_agree(fake_daemon) -> None:
    async def run() -> tuple[list[int], Done]:
        _, _, deltas, done = await first_token_and_end(
            fake_daemon.sock, prompt="agree", max_tokens=150, ignore_eos=True, temperature=0.0)
        return [t for d in deltas for t in d.token_ids], done

    streamed, done = asyncio.run(run())
    with Client(fake_daemon.sock, timeout=60) as c:
        whole = c.complete(prompt="agree", max_tokens=150, ignore_eos=True, temperature=0.0, stream=False)
    assert done.timings.slices == 3  # 64 + 64 + 22
    assert streamed == whole.token_ids and len(streamed) == 150
