"""Work-conserving rounds: idle workers get work at once; under saturation the paper's rounds."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sclsd.core.estimator import Estimator
from sclsd.core.memory import KVMemory
from sclsd.core.policy import make_policy
from sclsd.core.profiles import ProfileCost
from sclsd.core.request import Request
from sclsd.core.scheduler import BatchOutcome, RowOutcome, Scheduler
from sclsd.core.spread import finish_time, spread

EST = Estimator(p1=2e-4, p2=1e-3, p3=1e-5, p4=0.02, d1=2e-6, d2=1e-4, d3=1e-6, d4=0.02)
COST = ProfileCost(EST, KVMemory(delta=1, m_avail=200_000, zeta=0.9))


def sched(wc: bool, workers: int = 3, kv: bool = False, gamma: float = 5.0) -> Scheduler:
    pol = make_policy("scls", slice_len=32, gamma=gamma, work_conserving=wc, kv_reuse=kv)
    s = Scheduler(pol, COST)
    for k in range(workers):
        s.add_worker(f"w{k}")
    return s


def req(i: int, plen: int = 100, t: float = 0.0) -> Request:
    return Request(rid=f"r{i}", prompt_len=plen, max_tokens=256, arrival=t)


def occupy(s: Scheduler, now: float) -> None:
    """One batch in flight on every worker (a request of its own each)."""
    for k in range(len(s.workers)):
        s.add(req(1000 + k, 50, now), now)
        s.next_at = float("-inf")
        s.schedule(now)
    assert not s.idle_workers()


def test_idle_worker_makes_a_round_due_at_once() -> None:
    s = sched(wc=True)
    s.add(req(0), 0.0)
    assert s.due(0.0)
    (b,) = s.schedule(0.0).batches
    s.add(req(1, t=0.5), 0.5)
    # Before the interval ends: due only because two workers are idle.
    assert s.next_at > 0.5 and s.due(0.5)
    paper = sched(wc=False)
    paper.add(req(0), 0.0)
    paper.schedule(0.0)
    paper.add(req(1, t=0.5), 0.5)
    assert not paper.due(0.5)


def test_no_early_round_when_every_worker_is_busy() -> None:
    s = sched(wc=True, workers=2)
    for i in range(2):
        s.add(req(i, plen=100 + 300 * i), 0.0)
    batches = s.schedule(0.0).batches
    assert {b.worker for b in batches} == {"w0", "w1"}  # spread: one batch each
    s.add(req(9, t=0.1), 0.1)
    assert not s.idle_workers() and not s.due(0.1)
    assert s.due(s.next_at)  # the interval rule still fires


def test_one_big_batch_is_split_over_idle_workers() -> None:
    s = sched(wc=True, workers=4)
    for i in range(12):
        s.add(req(i, plen=100 + i), 0.0)
    batches = s.schedule(0.0).batches
    paper = sched(wc=False, workers=4)
    for i in range(12):
        paper.add(req(i, plen=100 + i), 0.0)
    (one,) = paper.schedule(0.0).batches  # the DP's choice: all twelve together
    assert one.size == 12
    assert len({b.worker for b in batches}) == len(batches) == 4  # one per idle worker
    assert max(b.est_time for b in batches) < one.est_time
    assert sorted(r.rid for b in batches for r in b.requests) == sorted(f"r{i}" for i in range(12))


def test_spread_lowers_the_finish_time_and_keeps_every_request() -> None:
    reqs = [req(i, plen=50 + 20 * i) for i in range(10)]

    def est(g: list[Request]) -> tuple[float, dict[str, float]]:
        return COST.t_serve(len(g), max(r.input_len for r in g), 32), {}

    loads = {"a": 0.0, "b": 0.0, "c": 3.0}
    groups = spread([reqs], loads, est)
    assert sorted(r.rid for g in groups for r in g) == sorted(r.rid for r in reqs)
    assert len(groups) > 1
    assert finish_time([est(g) for g in groups], loads) < finish_time([est(reqs)], loads)
    # Nothing to gain: a lone request is never split.
    assert spread([[reqs[0]]], loads, est) == [[reqs[0]]]


def test_rest_of_the_pool_waits_for_the_next_idle_worker() -> None:
    s = sched(wc=True, workers=2)
    for i in range(2):
        s.add(req(i, plen=100 + 400 * i), 0.0)
    first = s.schedule(0.0).batches
    assert len(first) == 2
    for i in range(2, 8):
        s.add(req(i, plen=60, t=0.2), 0.2)
    b = first[0]
    s.on_result(BatchOutcome(b.bid, [RowOutcome(r.rid, 32) for r in b.requests]), 1.0)
    assert s.due(1.0)
    (nxt,) = s.schedule(1.0).batches  # one idle worker: one batch
    assert nxt.worker == b.worker
    assert not s.workers[first[1].worker or ""].batches - {first[1].bid}  # nothing queued behind


@settings(max_examples=40, deadline=None)
@given(
    lens=st.lists(st.integers(1, 900), min_size=1, max_size=40),
    gens=st.lists(st.integers(0, 200), min_size=40, max_size=40),
    t=st.floats(0.0, 100.0),
)
def test_saturation_reduces_to_the_paper_exactly(lens: list[int], gens: list[int], t: float) -> None:
    """Every worker busy, the interval rule firing: the same batches, workers and interval."""
    runs = []
    for wc in (False, True):
        s = sched(wc=wc)
        occupy(s, 0.0)
        assert not s.idle_workers()
        for i, (L, g) in enumerate(zip(lens, gens, strict=False)):
            r = req(i, L, 0.0)
            r.num_generated = g
            s.add(r, 0.0)
        assert s.due(0.0) == (s.next_at <= 0.0)
        now = max(t, s.next_at)
        assert s.due(now)
        got = s.schedule(now).batches
        runs.append(
            (
                [(b.worker, [r.rid for r in b.requests], b.slice_len, b.est_time) for b in got],
                s.next_at,
                s.loads(),
            )
        )
    assert runs[0] == runs[1]


def test_a_deep_backlog_is_placed_in_one_round() -> None:
    """Far more batches than idle workers (thousands of requests behind zero-time workers):
    one DP places them all, as the paper's round does, instead of one batch per idle worker
    and a fresh DP over the whole backlog at every slice end."""
    from sclsd.core.scheduler import BACKLOG_BATCHES_PER_IDLE

    tiny = ProfileCost(EST, KVMemory(delta=1, m_avail=2_000, zeta=0.9))  # ~one request a batch
    pol = make_policy("scls", slice_len=32, gamma=5.0, work_conserving=True)
    s = Scheduler(pol, tiny)
    for k in range(2):
        s.add_worker(f"w{k}")
    n = 64
    assert n > BACKLOG_BATCHES_PER_IDLE * 2
    for i in range(n):
        s.add(req(i, plen=1000), 0.0)
    placed = s.schedule(0.0).batches
    assert len(placed) > BACKLOG_BATCHES_PER_IDLE * 2 and not s.pool
    assert {b.worker for b in placed} == {"w0", "w1"}
