"""KV reuse in the policy: cached estimates, affinity, partitions, admission, bookkeeping."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sclsd.core import kvreuse
from sclsd.core.batch import Batch
from sclsd.core.decisions import Release
from sclsd.core.estimator import Estimator
from sclsd.core.interfaces import CachedCost
from sclsd.core.memory import KVMemory
from sclsd.core.offloader import MaxMin
from sclsd.core.policy import DPBatcher, make_policy
from sclsd.core.profiles import ProfileCost
from sclsd.core.request import Request, State
from sclsd.core.scheduler import BatchOutcome, RowOutcome, Scheduler

EST = Estimator(p1=2e-4, p2=1e-3, p3=1e-5, p4=0.02, d1=2e-6, d2=1e-4, d3=1e-6, d4=0.02)


def cost(retain: float = 1e9, host_link: float | None = None, host: float = 0.0) -> ProfileCost:
    """Δ = 1 byte: memory counted in tokens."""
    return ProfileCost(EST, KVMemory(1, retain, 1.0), host_link=host_link, host_kv_bytes=host)


def req(i: int, plen: int = 100, gen: int = 0, kv: str | None = None, t: float = 0.0) -> Request:
    r = Request(rid=f"r{i}", prompt_len=plen, max_tokens=1000, arrival=t)
    r.num_generated = gen
    if kv is not None:
        r.kv_worker, r.kv_tokens = kv, r.input_len - 1
    return r


def sched(c: ProfileCost | None = None, workers: int = 2, wc: bool = False) -> Scheduler:
    s = Scheduler(make_policy("scls", slice_len=32, gamma=1.0, kv_reuse=True, work_conserving=wc),
                  c or cost())
    for k in range(workers):
        s.add_worker(f"w{k}")
    return s


# --------------------------------------------------------------------------- estimates


@given(n=st.integers(1, 64), L=st.integers(1, 4000), S=st.integers(0, 512))
def test_nothing_held_is_the_papers_estimate(n: int, L: int, S: int) -> None:
    assert EST.t_serve_cached(n, 0, L, S) == pytest.approx(EST.t_serve(n, L, S), rel=1e-12)


@given(
    past=st.lists(st.integers(0, 3000), min_size=1, max_size=20),
    new=st.lists(st.integers(1, 3000), min_size=20, max_size=20),
    n=st.integers(1, 64),
    S=st.integers(1, 256),
)
def test_cached_linear_terms_agree_with_the_estimate(past: list[int], new: list[int], n: int, S: int) -> None:
    P = np.array(past, dtype=float)
    N = np.array(new[: len(past)], dtype=float)
    a, b = EST.linear_terms_cached(P, N, S)
    for p, q, ai, bi in zip(P, N, a, b, strict=True):
        assert ai * n + bi == pytest.approx(EST.t_serve_cached(n, p, q, S), rel=1e-9)


def test_held_prefix_is_read_not_recomputed() -> None:
    # One new token over 999 held: eq. 3 for one position plus one read of the held KV.
    assert EST.t_prefill_cached(4, 1, 999) == pytest.approx(
        EST.t_prefill(4, 1) + (EST.d1 * 4 + EST.d3) * 999
    )
    assert EST.t_prefill_cached(4, 1, 999) < EST.t_prefill(4, 1000) / 10


def test_profile_cost_is_a_cached_cost_with_a_host_tier() -> None:
    c = cost(retain=1000, host_link=100.0, host=5000)
    assert isinstance(c, CachedCost)
    assert c.kv_bytes_per_token == 1 and c.device_kv_bytes == 1000
    assert c.retain_bytes == 6000 and c.copy_s(250) == 2.5
    assert cost().copy_s(1e9) == 0.0 and cost().retain_bytes == 1e9  # no host link: no tier


def test_layout_and_estimate_of_a_partly_cached_group() -> None:
    c = cost()
    g = [req(0, 500, 20, kv="w0"), req(1, 300, 40, kv="w0"), req(2, 200, kv=None)]
    # Held: 519 and 339 tokens; tails 1, 1 and 200 (the uncached row): past 519, new 200.
    assert kvreuse.layout(g, "w0", c, 32) == (519, 200)
    assert kvreuse.layout(g, "w1", c, 32) == (0, 520)
    on = kvreuse.estimate_on(g, "w0", c, 32, retained=0.0)
    assert on == pytest.approx(EST.t_serve_cached(3, 519, 200, 32))
    assert on < EST.t_serve(3, 520, 32)
    # A layout that does not fit makes the worker prefill in full, as the engine does.
    tight = cost(retain=3 * (520 + 32) + 10)
    assert kvreuse.layout(g, "w0", tight, 32) == (0, 520)


def test_host_copy_counts_what_does_not_fit_beside_the_batch() -> None:
    c = cost(retain=1000, host_link=10.0, host=1e6)
    g = [req(0, 400, kv="w0")]  # holds 399 tokens; the batch needs (399 + 1 + 32) = 432
    # Room beside the batch 568 of 568 + 4000 retained: most of it is in host memory.
    t = kvreuse.estimate_on(g, "w0", c, 32, retained=4000 + 399)
    spill = 1 - (1000 - 432) / (4000 + 399)
    assert t == pytest.approx(EST.t_serve_cached(1, 399, 1, 32) + 399 * spill / 10.0)
    assert kvreuse.estimate_on(g, "w0", c, 32, retained=399) == pytest.approx(
        EST.t_serve_cached(1, 399, 1, 32)
    )


# --------------------------------------------------------------------------- affinity


def _held_batch(est_anywhere: float, est_home: float) -> Batch:
    return Batch(1, [], 32, 100, est_time=est_anywhere, est_on={"w0": est_home})


def test_affinity_keeps_a_batch_with_its_kv_unless_the_gap_exceeds_the_saving() -> None:
    b = _held_batch(10.0, 7.0)  # the KV saves 3 s on w0
    assert MaxMin().assign([b], {"w0": 2.9, "w1": 0.0}) == ["w0"]
    assert MaxMin().assign([b], {"w0": 3.1, "w1": 0.0}) == ["w1"]
    # Without est_on a batch is the paper's: the least loaded worker.
    assert MaxMin().assign([Batch(2, [], 32, 100, est_time=10.0)], {"w0": 0.1, "w1": 0.0}) == ["w1"]


@given(gap=st.floats(0.0, 50.0), saving=st.floats(0.01, 20.0), base=st.floats(0.1, 30.0))
def test_affinity_rule(gap: float, saving: float, base: float) -> None:
    b = _held_batch(base + saving, base)
    got = MaxMin().assign([b], {"w0": gap, "w1": 0.0})
    if gap < saving * (1 - 1e-9):
        assert got == ["w0"]
    elif gap > saving * (1 + 1e-9):
        assert got == ["w1"]


def test_scheduler_keeps_requests_on_their_kv_worker() -> None:
    s = sched()
    for i in range(4):
        s.add(req(i, 300 + i), 0.0)
    batches = s.schedule(0.0).batches
    home = {r.rid: b.worker for b in batches for r in b.requests}
    for b in batches:
        rows = [RowOutcome(r.rid, 32, kv_tokens=r.input_len + 32 - 1) for r in b.requests]
        s.on_result(BatchOutcome(b.bid, rows), 1.0)
    assert all(r.kv_worker == home[r.rid] and r.kv_tokens == r.input_len - 1 for r in s.pool.values())
    again = s.schedule(2.0)
    for b in again.batches:
        assert all(home[r.rid] == b.worker for r in b.requests)  # batched by KV holder, kept there
        assert b.est_time < EST.t_serve(b.size, b.input_len, 32)  # priced as cached
    assert again.releases == ()


def test_moving_a_request_releases_its_kv() -> None:
    s = sched()
    r = req(0, 300, 10, kv="w0")
    s.add(r, 0.0)
    s.workers["w0"].load = 1000.0  # far more than the prefill the KV saves
    s.workers["w0"].batches.add(99)
    rnd = s.schedule(0.0)
    (b,) = rnd.batches
    assert b.worker == "w1" and r.kv_worker is None and r.kv_tokens == 0
    assert rnd.releases == (Release("w0", ("r0",)),)  # returned by the round that moved it


def test_evictions_and_finished_rows_clear_the_kv() -> None:
    s = sched()
    s.add(req(0, 100), 0.0)
    s.add(req(1, 100), 0.0)
    (b,) = s.schedule(0.0).batches
    rows = [RowOutcome("r0", 32, kv_tokens=131), RowOutcome("r1", 5, finish_reason="stop", kv_tokens=104)]
    (done,) = s.on_result(BatchOutcome(b.bid, rows), 1.0).ended
    r0 = s.get("r0")
    assert done.rid == "r1" and done.kv_worker is None
    assert r0 is not None and r0.kv_worker == b.worker and r0.kv_tokens == 131
    s.kv_evicted("other", ["r0"])  # not where we think it is: ignored
    assert r0.kv_worker == b.worker
    s.kv_evicted(b.worker or "", ["r0", "nobody"])
    assert r0.kv_worker is None and r0.kv_tokens == 0


def test_a_worker_that_dies_or_rejoins_holds_nothing() -> None:
    s = sched()
    r = req(0, 100, 5, kv="w1")
    s.add(r, 0.0)
    s.add_worker("w1")
    assert r.kv_worker is None
    r.kv_worker, r.kv_tokens = "w0", 104
    removed = s.remove_worker("w0", 0.0)
    assert r.kv_worker is None and removed.releases == ()


# --------------------------------------------------------------------------- partitions, admission


def test_partitions_never_mix_kv_holders() -> None:
    pool = [req(0, 100, kv="w0"), req(1, 101, kv="w1"), req(2, 102), req(3, 103, kv="gone")]
    parts = kvreuse.partition(pool, {"w0", "w1"})
    assert {k: [r.rid for r in v] for k, v in parts.items()} == {
        "w0": ["r0"], "w1": ["r1"], None: ["r2", "r3"]
    }
    groups, waiting = kvreuse.plan(pool, pool, ["w0", "w1"], DPBatcher(), cost(), 32)
    assert not waiting
    for g in groups:
        assert len({r.kv_worker if r.kv_worker in ("w0", "w1") else None for r in g}) == 1


def test_admission_keeps_in_progress_kv_within_the_fleets_budget() -> None:
    # Two workers of 1,000 tokens each; every request holds (100 + 32) when in progress.
    c = cost(retain=1000)
    s = sched(c)
    for i in range(30):
        s.add(req(i, 100, t=float(i)), float(i))
    got = s.schedule(30.0)
    admitted = sorted(int(r.rid[1:]) for b in got.batches for r in b.requests)
    assert admitted == list(range(15))  # 15 × 132 = 1980 <= 2000; oldest first
    assert all(r.state is State.QUEUED for r in s.pool.values()) and len(s.pool) == 15
    # The oldest is always admitted when nothing is in progress, however large.
    big, rest = kvreuse.admit([req(0, 5000)], 0.0, 10.0, 32, 1)
    assert [r.rid for r in big] == ["r0"] and not rest


def test_without_kv_reuse_nothing_changes() -> None:
    pol = make_policy("scls", slice_len=32, gamma=1.0)
    a, b = Scheduler(pol, cost()), Scheduler(make_policy("scls", slice_len=32, gamma=1.0), cost())
    for s in (a, b):
        s.add_worker("w0")
        s.add_worker("w1")
    for i in range(6):
        a.add(req(i, 100 + 50 * i, kv="w0" if i % 2 else None), 0.0)
        b.add(req(i, 100 + 50 * i), 0.0)
    sa, sb = a.schedule(0.0), b.schedule(0.0)
    assert [(x.worker, [r.rid for r in x.requests], x.est_time) for x in sa.batches] == [
        (x.worker, [r.rid for r in x.requests], x.est_time) for x in sb.batches
    ]


def test_kv_on_a_drained_worker_does_not_hold_a_request_back() -> None:
    s = sched(wc=True)
    r = req(0, 100, 10, kv="w0")
    s.add(r, 0.0)
    s.set_active("w0", False)  # drained: its next slice must go elsewhere
    assert s.due(0.0)
    rnd = s.schedule(0.0)
    (b,) = rnd.batches
    assert b.worker == "w1" and r.kv_worker is None
    assert rnd.releases == (Release("w0", ("r0",)),)  # the drained worker still holds it: tell it


def test_kv_on_a_busy_worker_waits_for_it_in_a_work_conserving_round() -> None:
    s = sched(wc=True)
    s.add(req(9, 50), 0.0)
    (first,) = s.schedule(0.0).batches
    busy = first.worker or ""
    r = req(0, 100, 10, kv=busy)
    s.add(r, 0.1)
    assert s.due(0.1) and s.schedule(0.1).batches == ()  # the other worker is idle, but the KV is here
    assert r.state is State.QUEUED
    s.on_result(BatchOutcome(first.bid, [RowOutcome("r9", 32, "stop")]), 1.0)
    (b,) = s.schedule(1.0).batches
    assert b.worker == busy and b.requests == [r]
