"""Daemon level, in process: greedy output is the same with and without KV kept across
slices, on two hf tiny-random workers (requests move between them, and evict)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from sclsd import protocol as P

from .conftest import Harness, RecConn

pytest.importorskip("torch")

PROMPTS = ["The capital of France is", "One, two, three,", "Hello", "def main():",
           "A long time ago in a galaxy far, far away", "1 2 3 4 5 6 7 8 9"]


def serve_all(daemon, reuse: bool, retain: int | None) -> tuple[list[list[int]], dict[str, int]]:
    from worker.engines import create_engine

    got: dict[str, list[int]] = {}
    counters: dict[str, int] = {}

    async def body(h: Harness) -> None:
        h.server.sched.policy = dataclasses.replace(h.server.sched.policy, kv_reuse=reuse)
        for wid in ("w0", "w1"):
            eng = create_engine("hf", "tiny-random", threads=1, kv_retain_bytes=retain)
            h.transport.connect(wid, eng, auth=h.server.fleet.secret or "")
        await h.registered("w0", "w1")
        conn = RecConn()
        for i, p in enumerate(PROMPTS):
            await h.submit(conn, id=f"q{i}", prompt=p, max_tokens=11 + 2 * i, ignore_eos=True)
            await asyncio.sleep(0)  # arrivals spread over rounds: batches mix new and held rows
        await h.finished(conn, *[f"q{i}" for i in range(len(PROMPTS))], timeout=120)
        for i in range(len(PROMPTS)):
            (done,) = conn.terminal(f"q{i}")
            assert isinstance(done, P.Done) and done.finish_reason == "length"
            got[f"q{i}"] = done.token_ids
        counters.update(h.counters())

    daemon(body, scheduler={"slice_len": 4})
    return [got[f"q{i}"] for i in range(len(PROMPTS))], counters


def test_greedy_output_is_the_same_with_and_without_kept_kv(daemon) -> None:
    without, off = serve_all(daemon, reuse=False, retain=None)
    with_kv, on = serve_all(daemon, reuse=True, retain=None)
    assert with_kv == without
    assert off["reused_tokens"] == 0 and on["reused_tokens"] > 0
    # Most of the context was reused rather than prefilled. (The two runs' totals need not
    # match: with reuse a newcomer's first slice may be cut short, Policy.first_slice_len,
    # so requests may be served in a different number of slices.)
    assert on["prefill_tokens"] < off["prefill_tokens"] / 2
    # Workers that can keep little (whether they evict depends on how rounds fall on the
    # real clock; tests/unit/test_hf_kv_reuse.py evicts deterministically): same output.
    small, _tight = serve_all(daemon, reuse=True, retain=40 * 512)
    assert small == without
