"""The scheduler's mechanism (pool, re-queue, cancel, timeouts, worker loss) under a simple policy."""

from __future__ import annotations

from sclsd.core.policy import FCFSBatcher, FixedInterval, Policy, RoundRobin
from sclsd.core.request import Request, State
from sclsd.core.scheduler import BatchOutcome, RowOutcome, Scheduler


class UnitCost:
    def t_serve(self, n: int, L: int, S: int) -> float:
        return 1.0 + 0.01 * n * (L + S)

    def oom(self, n: int, L: int, S: int) -> bool:
        return n * (L + S) > 1000


def make(batch_size: int = 4, slice_len: int = 4) -> Scheduler:
    pol = Policy("t", slice_len, FCFSBatcher(batch_size), RoundRobin(), FixedInterval(1.0))
    s = Scheduler(pol, UnitCost(), max_failures=1)
    s.add_worker("a")
    s.add_worker("b")
    return s


def req(i: int, plen: int = 10, max_tokens: int = 10, t: float = 0.0, **kw: object) -> Request:
    return Request(rid=f"r{i}", prompt_len=plen, max_tokens=max_tokens, arrival=t, **kw)  # type: ignore[arg-type]


def test_slices_requeue_until_done_and_loads_return_to_zero() -> None:
    s = make()
    for i in range(6):
        s.add(req(i, max_tokens=6), 0.0)
    now, finished = 0.0, []
    while s.live:
        now += 1.0
        assert s.due(now)
        for b in s.schedule(now).batches:
            assert b.worker in ("a", "b") and b.size <= 4
            rows = [RowOutcome(r.rid, min(b.slice_len, r.remaining)) for r in b.requests]
            finished += s.on_result(BatchOutcome(b.bid, rows, elapsed=1.0), now).ended
    assert sorted(r.rid for r in finished) == [f"r{i}" for i in range(6)]
    assert all(r.num_generated == 6 and r.finish_reason == "length" and r.slices == 2 for r in finished)
    assert s.loads() == {"a": 0.0, "b": 0.0}
    assert s.stats().finished == 6


def test_input_len_grows_with_generated_tokens() -> None:
    s = make(batch_size=1)
    s.add(req(0, plen=10, max_tokens=20), 0.0)
    (b,) = s.schedule(0.0).batches
    assert b.input_len == 10
    s.on_result(BatchOutcome(b.bid, [RowOutcome("r0", 4)]), 1.0)
    (b,) = s.schedule(5.0).batches
    assert b.input_len == 14


def test_cancel_while_running_ignores_its_row() -> None:
    s = make()
    s.add(req(0), 0.0)
    s.add(req(1), 0.0)
    (b,) = s.schedule(0.0).batches
    c = s.cancel("r0", 0.5)
    assert c is not None and c.request.state is State.CANCELLED and c.releases == ()
    done = s.on_result(BatchOutcome(b.bid, [RowOutcome("r0", 4, "stop"), RowOutcome("r1", 4, "stop")]), 1.0)
    assert [r.rid for r in done.ended] == ["r1"] and done.requeued == ()
    assert s.cancel("r0", 2.0) is None  # exactly one terminal state


def test_timeouts_fire_in_pool() -> None:
    s = make()
    s.add(req(0, deadline=5.0), 0.0)
    s.add(req(1), 0.0)
    assert s.next_deadline() == 5.0
    assert s.expire(4.9).requests == ()
    (r,) = s.expire(5.0).requests
    assert r.rid == "r0" and r.finish_reason == "timeout" and "r0" not in s.pool


def test_worker_loss_requeues_without_partial_tokens() -> None:
    s = make(batch_size=2)
    for i in range(4):
        s.add(req(i), 0.0)
    batches = s.schedule(0.0).batches
    lost = [b for b in batches if b.worker == "a"]
    removed = s.remove_worker("a", 1.0)
    back = removed.requeued
    assert not removed.ended and not removed.releases
    assert sorted(r.rid for r in back) == sorted(r.rid for b in lost for r in b.requests)
    assert all(r.state is State.QUEUED and r.num_generated == 0 for r in back)
    # A late result of the dead worker's batch changes nothing.
    late = s.on_result(BatchOutcome(lost[0].bid, [RowOutcome(r.rid, 3) for r in lost[0].requests]), 2.0)
    assert late.ended == late.requeued == late.releases == ()
    assert all(r.num_generated == 0 for r in back)
    assert all(b.worker == "b" for b in s.schedule(10.0).batches)


def test_failed_batch_retries_then_fails() -> None:
    s = make()
    s.add(req(0), 0.0)
    (b,) = s.schedule(0.0).batches
    again = s.on_result(BatchOutcome(b.bid, ok=False), 1.0)
    assert again.ended == () and [r.rid for r in again.requeued] == ["r0"]
    (b,) = s.schedule(5.0).batches
    (r,) = s.on_result(BatchOutcome(b.bid, ok=False), 6.0).ended
    assert r.state is State.FAILED and r.finish_reason == "error"


def test_drained_worker_gets_no_batches() -> None:
    s = make(batch_size=1)
    s.set_active("a", False)
    for i in range(3):
        s.add(req(i), 0.0)
    assert {b.worker for b in s.schedule(0.0).batches} == {"b"}
    s.set_active("b", False)
    s.add(req(9), 0.0)
    assert not s.due(100.0) and s.schedule(100.0).batches == ()


def test_early_return_only_when_every_row_ends_before_the_slice() -> None:
    s = make(batch_size=2, slice_len=4)
    s.add(req(0), 0.0)
    s.add(req(1), 0.0)
    (b,) = s.schedule(0.0).batches
    s.on_result(BatchOutcome(b.bid, [RowOutcome("r0", 4, "stop"), RowOutcome("r1", 2, "stop")]), 1.0)
    assert s.stats().early_returns == 0  # a row ran all 4 iterations
    s.add(req(2), 2.0)
    s.add(req(3), 2.0)
    (b,) = s.schedule(5.0).batches
    s.on_result(BatchOutcome(b.bid, [RowOutcome("r2", 3, "stop"), RowOutcome("r3", 1, "stop")]), 6.0)
    assert s.stats().early_returns == 1
