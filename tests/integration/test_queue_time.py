"""Queue time with real worker processes: the time a batch waits in its worker's local queue
(the worker's ``queue_wait_s``) counts, in ``done.timings.queued_s`` and in the histogram.

Slice grants go out as soon as a worker has KV room, so all of them reach the one worker at
once; the fake engine, running one row at a time (``max_rows = 1``), takes the next only when
the one before has ended, so the k-th waits for the k-1 before it in the worker's queue.
Measured to the dispatch alone, every queue time read about 0."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sclsd import protocol as P
from sclsd.client import AsyncClient, status

from .harness import start_daemon

N = 6
DECODE_S = 0.01
SLICE = 8  # one grant of 8 iterations each: about 0.08 s of serving


def test_queue_time_counts_the_wait_in_the_workers_queue(tmp_path: Path) -> None:
    d = start_daemon(tmp_path, workers=1, policy="scls-cb", slice_len=SLICE,
                     worker_opts={"decode_s": DECODE_S, "max_rows": 1})
    try:
        async def run() -> list[P.Done]:
            async with AsyncClient(d.sock) as c:
                return await asyncio.gather(*(c.complete(prompt_ids=[5 + i, 6, 7], max_tokens=SLICE,
                                                         ignore_eos=True) for i in range(N)))

        dones = asyncio.run(run())
        queued = sorted(x.timings.queued_s for x in dones)
        # The last grant waited behind N - 1 others of SLICE iterations each.
        assert queued[-1] >= (N - 1) * SLICE * DECODE_S * 0.9, queued
        for x in dones:
            assert x.timings.ttft_s is not None and 0 <= x.timings.queued_s <= x.timings.ttft_s
        fams = {f.name: f for f in text_string_to_metric_families(status(d.status_sock, metrics=True))}
        hist = {s.name: s.value for s in fams["sclsd:request_queue_time_seconds"].samples
                if not s.name.endswith("_bucket")}
        assert hist["sclsd:request_queue_time_seconds_count"] == N
        assert hist["sclsd:request_queue_time_seconds_sum"] == pytest.approx(sum(queued))
    finally:
        assert d.stop() == 0, d.log_text()
