"""What a gateway reads of a box, through the in-process transport: requests waiting (no
worker started them) and running (started, not ended), and KV usage per worker and overall
under static batches (``scls``) and slice grants (``scls-cb``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from sclsd import protocol as P
from sclsd.core.grant_scheduler import SliceGrantScheduler
from sclsd.daemon.admission import daemon_id
from unit.inproc import InprocWorker

from .conftest import Harness, RecConn, held, until
from .scrape import scrape, value

#: Δ and M_ava of the test workers: 1000 tokens of KV each (2000 for the second).
DELTA = 1000
M_AVA = 1000 * DELTA
PROMPT = list(range(3, 13))  # 10 tokens


def _footprint(b: P.BatchMsg) -> int:
    """A static batch's KV in tokens, as eq. 5 counts it: (L + S) · n."""
    return (max(len(r.token_ids) for r in b.requests) + b.slice_len) * len(b.requests)


def _rows(w: InprocWorker) -> int:
    return sum(len(b.requests) for b in w.held)


async def _turns(pred: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait, loop turn by loop turn (within ``timeout``), until ``pred()`` holds."""
    async def loop() -> None:
        while not pred():
            await asyncio.sleep(0)

    await asyncio.wait_for(loop(), timeout)


def test_static_batches_waiting_running_and_kv(daemon) -> None:
    async def body(h: Harness) -> None:
        w = h.worker("w0", hold=True, mem_budget=M_AVA, kv_bytes_per_token=DELTA)
        await h.registered("w0")
        conn = RecConn()
        await h.submit(conn, id="r0", prompt_ids=PROMPT, max_tokens=32, ignore_eos=True)
        await held(w)
        first = w.held[0]
        st = h.server.snapshot()
        assert (st.waiting_requests, st.started_requests) == (0, 1)  # the batch w0 serves
        assert st.workers[0].kv_cache_usage == pytest.approx(_footprint(first) * DELTA / M_AVA)

        for rid in ("r1", "r2"):
            await h.submit(conn, id=rid, prompt_ids=PROMPT[:5], max_tokens=32, ignore_eos=True)
        await until(w.got, lambda: _rows(w) == 3)
        st = h.server.snapshot()
        # Their batch waits behind the one w0 serves: no worker started them, no KV held.
        assert (st.waiting_requests, st.started_requests, st.live_requests) == (2, 1, 3)
        assert st.workers[0].kv_cache_usage == pytest.approx(_footprint(first) * DELTA / M_AVA)
        s = scrape(h.server)
        assert value(s, "sclsd:num_requests_waiting") == 2
        assert value(s, "sclsd:num_requests_running") == 1
        assert value(s, "sclsd:num_requests_in_batches") == 3
        assert value(s, "sclsd:kv_cache_usage_perc") == pytest.approx(st.kv_cache_usage)
        assert value(s, "sclsd:worker_kv_cache_usage_perc", worker="w0") == pytest.approx(st.kv_cache_usage)

        h.drain("w0")  # r0 comes back from its slice and stays in the pool, its KV kept on w0
        sched = h.server.sched
        w.release(1)
        rid0 = daemon_id(conn, "r0")  # what the daemon and its workers call it
        await until(h.wake, lambda: sched.live[rid0].slices == 1)
        r0 = sched.live[rid0]
        assert r0.kv_worker == "w0" and r0.kv_tokens > 0
        second, *behind = w.held  # w0 now serves the oldest batch it holds
        st = h.server.snapshot()
        started = 1 + len(second.requests)  # r0 (between slices) and the rows served now
        assert (st.waiting_requests, st.started_requests, st.pool_size) == (3 - started, started, 1)
        assert sum(len(b.requests) for b in behind) == 3 - started
        assert st.kv_cache_usage == pytest.approx((_footprint(second) + r0.kv_tokens) * DELTA / M_AVA)

        h.drain("w0", resume=True)
        w.hold = False
        w.release()
        await h.finished(conn, "r0", "r1", "r2")
        st = h.server.snapshot()
        assert (st.waiting_requests, st.started_requests, st.kv_cache_usage) == (0, 0, 0.0)

    daemon(body)


def test_overall_kv_usage_is_used_over_capacity_of_all_workers(daemon) -> None:
    async def body(h: Harness) -> None:
        w0 = h.worker("w0", hold=True, mem_budget=M_AVA, kv_bytes_per_token=DELTA)
        w1 = h.worker("w1", hold=True, mem_budget=2 * M_AVA, kv_bytes_per_token=DELTA)
        await h.registered("w0", "w1")
        conn = RecConn()
        for rid in ("a", "b"):
            await h.submit(conn, id=rid, prompt_ids=PROMPT, max_tokens=32, ignore_eos=True)
        await _turns(lambda: _rows(w0) + _rows(w1) == 2)
        st = h.server.snapshot()
        use = {ws.id: ws.kv_cache_usage for ws in st.workers}
        for w, cap in ((w0, M_AVA), (w1, 2 * M_AVA)):
            tokens = _footprint(w.held[0]) if w.held else 0  # each serves its oldest batch
            assert use[w.wid] == pytest.approx(tokens * DELTA / cap)
        assert st.kv_cache_usage == pytest.approx((use["w0"] * M_AVA + use["w1"] * 2 * M_AVA) / (3 * M_AVA))
        assert 0 < st.kv_cache_usage < 1

    daemon(body)


def test_slice_grants_kv_is_what_the_grants_reserve(daemon) -> None:
    async def body(h: Harness) -> None:
        sched = h.server.sched
        assert isinstance(sched, SliceGrantScheduler)
        w = h.worker("w0", hold=True, mem_budget=M_AVA, kv_bytes_per_token=DELTA)
        await h.registered("w0")
        budget = sched.token_budget()
        assert budget == int(h.server.cfg.scheduler.zeta * M_AVA) // DELTA
        conn = RecConn()
        await h.submit(conn, id="a", prompt_ids=PROMPT, max_tokens=32, ignore_eos=True)
        await h.submit(conn, id="b", prompt_ids=PROMPT[:4], max_tokens=32, ignore_eos=True)
        await held(w, 2)
        # Each grant reserves its context plus its granted tokens (pages of one token here).
        reserved = sum(len(g.requests[0].token_ids) + g.slice_len for g in w.held)
        st = h.server.snapshot()
        assert st.workers[0].kv_cache_usage == pytest.approx(reserved / budget)
        assert st.kv_cache_usage == pytest.approx(reserved / budget)
        # A continuous worker's engine takes every grant at once: both run.
        assert (st.waiting_requests, st.started_requests) == (0, 2)
        w.hold = False
        w.release()
        await h.finished(conn, "a", "b")
        st = h.server.snapshot()
        assert (st.waiting_requests, st.started_requests, st.kv_cache_usage) == (0, 0, 0.0)

    daemon(body, scheduler={"policy": "scls-cb", "slice_len": 8})
