"""The engine interface and the loop that drives it: submit, poll for typed events, release
(worker/engines/base.py, worker/serve.py), over the fake engine."""

from __future__ import annotations

import queue
import time
from typing import Any

import pytest

from sclsd import protocol as P
from unit.engine_loop import queue_take, run_batches
from worker.engines.base import BatchDone, BatchFailed, Engine, EngineInfo, Event, NewTokens
from worker.engines.fake import FakeEngine
from worker.rows import RowBook
from worker.serve import NOTHING, Holding, ServeLoop, State, drive


def req(rid: str, ids: list[int], n: int = 5) -> P.BatchRequest:
    return P.BatchRequest(rid=rid, token_ids=ids, max_new_tokens=n, ignore_eos=True, temperature=0.0)


def batch(bid: int, *reqs: P.BatchRequest, slice_len: int = 5) -> P.BatchMsg:
    return P.BatchMsg(batch_id=bid, slice_len=slice_len, requests=list(reqs), kv_reuse=False)


def test_a_static_engine_runs_one_iteration_per_poll() -> None:
    eng = FakeEngine()
    b = batch(1, req("a", [5, 6], 9), req("b", [7], 3), slice_len=5)
    assert eng.has_room() and not eng.busy()
    eng.submit(b)
    assert eng.busy() and not eng.has_room()
    with pytest.raises(RuntimeError, match="still running"):
        eng.submit(batch(2, req("c", [8])))
    polls: list[list[Event]] = []
    while eng.busy():
        polls.append(eng.poll(0.0))
    # Five iterations, each one event of one token per running row ("b" ends at its third),
    # then the batch's end on its own poll.
    assert [[len(o.token_ids) for o in ev.outputs] for p in polls[:5] for ev in p
            if isinstance(ev, NewTokens)] == [[1, 1], [1, 1], [1, 1], [1], [1]]
    (end,) = polls[5]
    assert isinstance(end, BatchDone) and end.batch is b and len(polls) == 6
    assert [len(o.token_ids) for o in end.outputs] == [5, 3] and end.stats.iterations == 5
    streamed = [t for p in polls for ev in p if isinstance(ev, NewTokens) for o in ev.outputs
                if o.rid == "a" for t in o.token_ids]
    assert streamed == end.outputs[0].token_ids
    assert eng.has_room() and eng.poll(0.0) == []


def test_a_bad_batch_fails_with_its_error_and_the_engine_goes_on() -> None:
    eng = FakeEngine(vocab=300)
    bad = batch(1, req("x", [5, 10**6]))
    eng.submit(bad)
    (ev,) = eng.poll(0.0)
    assert isinstance(ev, BatchFailed) and ev.batch is bad and "outside vocab" in ev.error
    assert isinstance(ev.exc, ValueError) and not eng.busy()
    with pytest.raises(ValueError, match="outside vocab"):
        eng.serve(bad)
    outs, _ = eng.serve(batch(2, req("y", [5])))
    assert len(outs[0].token_ids) == 5


@pytest.mark.parametrize("batching", ["static", "continuous"])
def test_every_batch_ends_once_after_its_tokens(batching: str) -> None:
    eng = FakeEngine(batching=batching)
    q: queue.Queue[Any] = queue.Queue()
    for i in range(4):
        q.put(batch(i, req(f"r{i}", [5 + i], 4 + i), req(f"s{i}", [9, i + 5], 2)))
    q.put(None)
    seen: list[tuple[str, int]] = []
    drive(eng, queue_take(q), lambda ev: seen.append((type(ev).__name__, ev.batch_id if isinstance(ev, NewTokens)
                                                      else ev.batch.batch_id)))
    ends = [bid for kind, bid in seen if kind == "BatchDone"]
    assert sorted(ends) == [0, 1, 2, 3]
    for bid in ends:  # no tokens after a batch's end
        last_tokens = max(i for i, s in enumerate(seen) if s == ("NewTokens", bid))
        assert last_tokens < seen.index(("BatchDone", bid))
    assert not eng.busy()


def test_a_second_batch_waits_in_the_queue_while_a_static_engine_runs() -> None:
    eng = FakeEngine()
    q: queue.Queue[Any] = queue.Queue()
    q.put(batch(1, req("a", [5], 4), slice_len=4))
    q.put(batch(2, req("b", [6], 2), slice_len=2))
    q.put(None)
    left: list[tuple[int, int]] = []

    def on_event(ev: Event) -> None:
        if isinstance(ev, NewTokens):
            left.append((ev.batch_id, q.qsize()))

    drive(eng, queue_take(q), on_event)
    # While batch 1 runs, batch 2 and the stop stay queued (the wait is counted there).
    assert left == [(1, 2)] * 4 + [(2, 1)] * 2


class Broken(Engine):
    """An engine whose poll fails: the engine itself is broken."""

    def __init__(self) -> None:
        self.taken: list[P.BatchMsg] = []

    def info(self) -> EngineInfo:
        return EngineInfo(engine="broken", model="m", device="cpu", kv_bytes_per_token=1, mem_available=1)

    def has_room(self) -> bool:
        return True

    def busy(self) -> bool:
        return bool(self.taken)

    def submit(self, batch: P.BatchMsg) -> None:
        self.taken.append(batch)

    def poll(self, timeout: float) -> list[Event]:
        raise RuntimeError("the device is gone")


def test_an_engine_failure_reaches_the_loops_caller() -> None:
    q: queue.Queue[Any] = queue.Queue()
    q.put(batch(1, req("a", [5])))
    with pytest.raises(RuntimeError, match="device is gone"):
        drive(Broken(), queue_take(q), lambda ev: None)


def test_an_idle_engine_waits_in_take_and_a_busy_one_only_looks() -> None:
    timeouts: list[float | None] = []
    items: list[Any] = [batch(1, req("a", [5], 2), slice_len=2), NOTHING, NOTHING, None]

    def take(timeout: float | None) -> Any:
        timeouts.append(timeout)
        return items.pop(0)

    eng = FakeEngine(batching="continuous")
    drive(eng, take, lambda ev: None)
    # Two steps while busy (it only looks), then idle again: it waits for the stop.
    assert timeouts == [None, 0.0, 0.0, None]


def test_the_serve_loop_sends_tokens_before_each_result() -> None:
    q: queue.Queue[Any] = queue.Queue()
    rows, sent = RowBook(), []
    b = batch(7, req("a", [5, 6], 3), slice_len=3)
    q.put((b, time.monotonic()))
    q.put((batch(8, req("bad", [5, 10**6])), time.monotonic()))
    q.put(None)
    ServeLoop(FakeEngine(vocab=300), q, Holding(), rows, State(), "w0", sent.append).run()
    msgs = [P.worker_decoder.decode(m) for m in sent]
    assert [type(m).__name__ for m in msgs] == ["Tokens", "Result", "Result"]
    tokens, done, failed = msgs
    assert isinstance(tokens, P.Tokens) and isinstance(done, P.Result) and isinstance(failed, P.Result)
    assert done.batch_id == 7 and done.error is None and done.stats is not None
    first = tokens.batches[0].outputs[0].token_ids
    assert first and first + done.outputs[0].token_ids == run_batches(FakeEngine(vocab=300), [b])[0][1][0].token_ids
    assert failed.batch_id == 8 and "outside vocab" in (failed.error or "")


def test_a_result_says_the_rows_the_engine_can_run_now() -> None:
    """``Result.rows`` is the engine's ``rows_now`` when the batch ends (0: its caps' rows)."""

    class Narrowing(FakeEngine):
        room = 0

        def rows_now(self) -> int:
            return self.room

    eng = Narrowing(vocab=300)
    q: queue.Queue[Any] = queue.Queue()
    sent: list[bytes] = []
    q.put((batch(1, req("a", [5, 6], 2), slice_len=2), time.monotonic()))
    q.put(None)
    ServeLoop(eng, q, Holding(), RowBook(), State(), "w0", sent.append).run()
    eng.room = 3
    q.put((batch(2, req("b", [5, 7], 2), slice_len=2), time.monotonic()))
    q.put(None)
    ServeLoop(eng, q, Holding(), RowBook(), State(), "w0", sent.append).run()
    results = [m for m in map(P.worker_decoder.decode, sent) if isinstance(m, P.Result)]
    assert [(r.batch_id, r.rows) for r in results] == [(1, 0), (2, 3)]
