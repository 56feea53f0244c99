"""Cancels reach the engine (``cancel_rows``, :meth:`worker.engines.base.Engine.cancel`): a row
whose request ended in the daemon stops being computed at the engine's next step (one not
started at once), ends ``cancelled`` with nothing kept, and its batch still ends once; rows
still in the worker's queue are dropped as their batch is taken, and the work saved is counted.
Over the fake engine in both modes, ``hf`` (static batches) and ``hf-cb`` (transformers' own
cancellation), on a tiny random Llama."""

from __future__ import annotations

import queue
from typing import Any

import pytest

from sclsd import protocol as P
from worker.engines.base import BatchDone, Engine, Event, NewTokens
from worker.engines.fake import FakeEngine
from worker.rows import RowBook
from worker.serve import Holding, ServeLoop, State


def req(rid: str, ids: list[int], n: int = 40) -> P.BatchRequest:
    return P.BatchRequest(rid=rid, token_ids=ids, max_new_tokens=n, ignore_eos=True, temperature=0.0)


def batch(bid: int, *reqs: P.BatchRequest, slice_len: int = 40, kv_reuse: bool = True) -> P.BatchMsg:
    return P.BatchMsg(batch_id=bid, slice_len=slice_len, requests=list(reqs), kv_reuse=kv_reuse)


def run_until(eng: Engine, pred: Any, limit: int | None = None) -> list[Event]:
    """Poll ``eng`` until ``pred(events so far)``; every event. ``limit``: at most that many
    polls (what a test asserts); else as long as the engine is busy (a busy machine is slow,
    not wrong: the engine ends every batch it took)."""
    seen: list[Event] = []
    polls = 0
    while limit is None or polls < limit:
        seen += eng.poll(0.01)
        polls += 1
        if pred(seen):
            return seen
        if limit is None and not eng.busy():
            break
    raise AssertionError(f"not reached in {polls} polls: {seen}")


def tokens_of(events: list[Event], rid: str) -> list[int]:
    return [t for ev in events if isinstance(ev, NewTokens) for o in ev.outputs if o.rid == rid
            for t in o.token_ids]


def done_of(events: list[Event]) -> list[BatchDone]:
    return [ev for ev in events if isinstance(ev, BatchDone)]


def cancel_one_of_two(eng: Engine, kept: bool) -> None:
    """Two rows run; one is cancelled after a few steps: it stops at once, the other goes on to
    its end, the batch ends once; the cancelled row keeps no KV, the other does."""
    b = batch(7, req("a", [5, 6, 7]), req("b", [8, 9]), slice_len=20)
    eng.submit(b)
    seen = run_until(eng, lambda s: len(tokens_of(s, "a")) >= 3)
    eng.cancel([(7, "a"), (6, "b")])  # "b" of another batch: untouched
    at_cancel = len(tokens_of(seen, "a"))
    seen += run_until(eng, done_of)
    (end,) = done_of(seen)
    outs = {o.rid: o for o in end.outputs}
    assert outs["a"].finish_reason == "cancelled" and outs["a"].kv_tokens == 0
    # The step under way when the cancel came may still give it a token, no more.
    assert at_cancel <= len(tokens_of(seen, "a")) <= at_cancel + 1
    assert outs["b"].finish_reason is None and len(outs["b"].token_ids) == 20
    assert (outs["b"].kv_tokens > 0) == kept
    assert not eng.busy()


@pytest.mark.parametrize("batching", ["static", "continuous"])
def test_the_fake_engine_ends_a_cancelled_row_at_its_next_step(batching: str) -> None:
    cancel_one_of_two(FakeEngine(batching=batching, max_rows=8), kept=True)


@pytest.mark.parametrize("batching", ["static", "continuous"])
def test_a_batch_whose_rows_are_all_cancelled_ends_at_once(batching: str) -> None:
    eng = FakeEngine(batching=batching, decode_s=0.0)
    b = batch(3, req("a", [5, 6]), req("b", [7, 8]), slice_len=1000)
    eng.submit(b)
    seen = run_until(eng, lambda s: len(tokens_of(s, "a")) >= 2)
    eng.cancel([(3, "a"), (3, "b")])
    seen += run_until(eng, done_of, limit=3)  # not the 1,000 steps of its slice
    (end,) = done_of(seen)
    assert {o.finish_reason for o in end.outputs} == {"cancelled"} and not eng.busy()


def test_a_static_batch_cancelled_before_it_started_computes_nothing() -> None:
    eng = FakeEngine(prefill_s_per_token=10.0)  # a prefill would take a minute: it must not run
    eng.submit(batch(4, req("a", [5, 6, 7])))
    eng.cancel([(4, "a")])
    (end,) = eng.poll(0.0)
    assert isinstance(end, BatchDone) and [o.finish_reason for o in end.outputs] == ["cancelled"]
    assert end.outputs[0].token_ids == [] and not eng.busy()


def test_a_continuous_engine_drops_a_cancelled_row_still_waiting_for_a_place() -> None:
    eng = FakeEngine(batching="continuous", max_rows=1)
    eng.submit(batch(1, req("a", [5], n=30), slice_len=30))
    eng.submit(batch(2, req("w", [6], n=30), slice_len=30))  # waits: one row at a time
    run_until(eng, lambda s: len(tokens_of(s, "a")) >= 1)
    eng.cancel([(2, "w")])
    seen = run_until(eng, lambda s: len(done_of(s)) >= 1, limit=3)
    (end,) = done_of(seen)
    assert end.batch.batch_id == 2 and end.outputs[0].finish_reason == "cancelled"
    assert end.outputs[0].token_ids == []


def loop_with(eng: Engine) -> tuple[ServeLoop, queue.Queue[Any], list[P.Result]]:
    q: queue.Queue[Any] = queue.Queue()
    sent: list[P.Result] = []

    def send(body: bytes) -> None:
        msg = P.worker_decoder.decode(body)
        if isinstance(msg, P.Result):
            sent.append(msg)

    return ServeLoop(eng, q, Holding(), RowBook(), State(), "w0", send), q, sent


def test_the_serve_loop_drops_cancelled_rows_of_queued_batches_and_counts_the_work_saved() -> None:
    eng = FakeEngine(decode_s=0.0)
    loop, q, sent = loop_with(eng)
    q.put((batch(1, req("a", [5], n=10), req("b", [6], n=10), slice_len=8), 0.0))
    q.put((batch(2, req("c", [7], n=10), slice_len=8), 0.0))
    q.put(None)
    loop.cancels.add([(1, "b"), (2, "c")])  # as the receive thread marks them
    loop.loop()
    by_batch = {r.batch_id: r for r in sent}
    one, two = by_batch[1], by_batch[2]
    assert {o.rid: o.finish_reason for o in one.outputs} == {"a": None, "b": "cancelled"}
    (a,) = [o for o in one.outputs if o.rid == "a"]
    assert a.start + len(a.token_ids) == 8  # its slice served whole (some of it streamed)
    assert one.stats.cancelled_rows == 1 and one.stats.saved_tokens == 8
    # A batch left with no row is answered unserved, its budget counted as saved.
    assert [o.finish_reason for o in two.outputs] == ["cancelled"] and two.error is None
    assert two.stats.cancelled_rows == 1 and two.stats.saved_tokens == 8


def test_a_cancel_names_its_batch_and_spares_a_later_one_of_the_same_id() -> None:
    eng = FakeEngine(decode_s=0.0)
    loop, q, sent = loop_with(eng)
    loop.cancels.add([(1, "a")])
    q.put((batch(1, req("a", [5], n=4), slice_len=4), 0.0))
    q.put((batch(2, req("a", [5], n=4), slice_len=4), 0.0))  # the id reused by a new request
    q.put(None)
    loop.loop()
    reasons = {r.batch_id: [o.finish_reason for o in r.outputs] for r in sent}
    assert reasons == {1: ["cancelled"], 2: ["length"]}


@pytest.fixture(scope="module")
def torch_engines() -> Any:
    from worker.engines import create_engine

    hf = create_engine("hf", "tiny-random", threads=1, mem_budget=2**24)
    cb = create_engine("hf-cb", "tiny-random", threads=1, mem_budget=2**24)
    yield hf, cb
    hf.close()
    cb.close()


def test_hf_ends_a_cancelled_row_of_its_static_batch(torch_engines: Any) -> None:
    hf, _ = torch_engines
    cancel_one_of_two(hf, kept=True)


def test_hf_cb_cancels_through_transformers_and_frees_the_row(torch_engines: Any) -> None:
    _, cb = torch_engines
    cancel_one_of_two(cb, kept=True)
    assert "a" not in cb.kept()  # nothing kept for the cancelled request
    # The engine goes on serving: the same row again, whole.
    outs, _ = cb.serve(batch(9, req("a", [5, 6, 7], n=6), slice_len=6))
    assert len(outs[0].token_ids) == 6
