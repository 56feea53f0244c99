"""No stalls under static scls: streaming requests before newcomers, and the gap bound
(``scheduler.max_slice_gap_s``) on the wait between two slices of a request."""

from __future__ import annotations

import numpy as np
import pytest

from sclsd.core.estimator import Estimator
from sclsd.core.memory import KVMemory
from sclsd.core.policy import make_policy
from sclsd.core.profiles import ProfileCost, load_profile
from sclsd.core.request import Request
from sclsd.core.scheduler import BatchOutcome, RowOutcome, Scheduler
from sclsd.eval.metrics import DEFAULT_SLO
from sclsd.sim.common import SimConfig
from sclsd.sim.engine import simulate
from sclsd.sim.workload import Workload

EST = Estimator(p1=2e-4, p2=1e-3, p3=1e-5, p4=0.02, d1=2e-6, d2=1e-4, d3=1e-6, d4=0.02)
#: 900 tokens of batch memory: two requests of ~450 tokens never share a batch.
SMALL = ProfileCost(EST, KVMemory(delta=1, m_avail=1000, zeta=0.9))


def sched(bound: float | None, *, wc: bool, workers: int = 1, gamma: float = 5.0) -> Scheduler:
    pol = make_policy("scls", slice_len=32, gamma=gamma, work_conserving=wc,
                      max_slice_gap_s=bound)
    s = Scheduler(pol, SMALL)
    for k in range(workers):
        s.add_worker(f"w{k}")
    return s


def req(rid: str, plen: int, t: float) -> Request:
    return Request(rid=rid, prompt_len=plen, max_tokens=256, arrival=t)


def slice_done(s: Scheduler, rid: str, now: float) -> None:
    """The batch holding ``rid`` served a full slice of 32 tokens; every row goes on."""
    r = s.live[rid]
    assert r.batch_id is not None
    batch = s.batches[r.batch_id]
    rows = [RowOutcome(x.rid, 32, None) for x in batch.requests]
    assert not s.on_result(BatchOutcome(batch.bid, rows, elapsed=1.0), now).ended


def test_a_streaming_request_is_dispatched_at_its_bound_not_at_the_interval() -> None:
    for bound, expect in ((1.0, True), (None, False), (0.0, False)):
        s = sched(bound, wc=False, workers=2)
        s.add(req("a", 100, 0.0), 0.0)
        assert [b.worker for b in s.schedule(0.0).batches] == ["w0"] and s.next_at >= 5.0
        slice_done(s, "a", 1.0)
        # The interval (>= Γ = 5 s) holds the paper's next round back; the bound does not.
        assert s.due(1.5) is False
        assert s.due(2.0) is expect
        if expect:
            assert s.next_at == pytest.approx(2.0)
            (b,) = s.schedule(2.0).batches
            assert [r.rid for r in b.requests] == ["a"]


def test_streaming_requests_start_before_newcomers_that_waited_longer() -> None:
    picked = {}
    for bound in (1.0, None):
        s = sched(bound, wc=True)
        s.add(req("a", 400, 0.0), 0.0)
        (b,) = s.schedule(0.0).batches
        s.add(req("n", 450, 0.5), 0.5)  # a newcomer, in the pool longer than "a" will be
        slice_done(s, "a", 1.0)
        assert s.due(1.0)
        (b,) = s.schedule(1.0).batches  # one idle worker: one of the two batches starts
        picked[bound] = [r.rid for r in b.requests]
    assert picked == {1.0: ["a"], None: ["n"]}


def test_a_due_request_brings_the_papers_round_forward_streaming_ahead_in_the_queue() -> None:
    s = sched(0.5, wc=False)
    s.add(req("a", 400, 0.0), 0.0)
    s.add(req("b", 450, 0.0), 0.0)
    first = s.schedule(0.0).batches  # the paper's round: both batches queued on w0
    assert sorted(len(b.requests) for b in first) == [1, 1] and {b.worker for b in first} == {"w0"}
    x = first[0].requests[0].rid  # served first; the other batch waits behind it
    slice_done(s, x, 1.0)
    s.add(req("n", 300, 0.9), 0.9)  # a newcomer, in the pool before x came back
    # w0 still holds the other batch for longer than the bound: x is due at once, before Γ.
    assert s.workers["w0"].load > 0.5 and s.due(1.0) and s.next_at <= 1.0
    batches = s.schedule(1.0).batches
    assert [[r.rid for r in b.requests] for b in batches] == [[x], ["n"]]  # x first in the queue
    assert not s.pool and s.next_at >= 6.0  # the interval starts again from this round


def test_the_bound_is_validated_and_zero_is_off() -> None:
    assert make_policy("scls", max_slice_gap_s=0.0).gap_bound is None
    assert make_policy("scls", max_slice_gap_s=0.5).gap_bound == 0.5
    assert make_policy("scls-cb", max_slice_gap_s=0.5).gap_bound is None
    with pytest.raises(ValueError, match="max_slice_gap_s"):
        make_policy("scls", max_slice_gap_s=-1.0)


def test_in_the_simulator_the_bound_cuts_the_p99_gap_and_keeps_throughput() -> None:
    # A100 13B profile, 4 workers, more requests in progress than their batches hold: without
    # the bound streams wait out other requests' whole slices (seconds each).
    rng = np.random.default_rng(7)
    n = 60
    wl = Workload(np.sort(rng.uniform(0, 60, n)), rng.integers(100, 2000, n).astype(np.int64),
                  rng.integers(100, 800, n).astype(np.int64))
    out = {}
    for bound in (None, 1.0):
        cfg = SimConfig("scls", load_profile("a100-llama2-13b-hf"), workers=4, seed=1,
                        work_conserving=True, kv_reuse=True, max_slice_gap_s=bound)
        out[bound] = simulate(cfg, wl).summary(DEFAULT_SLO)
    off, on = out[None], out[1.0]
    assert on["completed"] == off["completed"] == n
    assert on["p99_gap_s"] < 0.2 * off["p99_gap_s"]
    assert on["throughput_rps"] >= 0.97 * off["throughput_rps"]
