"""The fake engine's continuous batching (worker/engines/fake_cb.py): grants join and leave one
running set of rows, on a virtual clock (the loop's sleeps advance it; nothing sleeps)."""

from __future__ import annotations

import json
import queue
from typing import Any

import pytest

from sclsd import protocol as P
from unit.engine_loop import queue_take, run
from worker.engines.fake import FakeEngine
from worker.engines.fake_cb import ContinuousRows
from worker.engines.kvstore import Retained
from worker.serve import NOTHING


def req(rid: str, ids: list[int], max_new: int = 200, **kw: Any) -> P.BatchRequest:
    kw.setdefault("temperature", 0.0)
    return P.BatchRequest(rid=rid, token_ids=list(ids), max_new_tokens=max_new, **kw)


def batch(bid: int, slice_len: int, *reqs: P.BatchRequest, kv_reuse: bool = True) -> P.BatchMsg:
    return P.BatchMsg(batch_id=bid, slice_len=slice_len, requests=list(reqs), kv_reuse=kv_reuse)


class Clock:
    """Virtual time: the loop's sleeps move it; ``steps`` counts them."""

    def __init__(self) -> None:
        self.t = 0.0
        self.steps = 0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, dt: float) -> None:
        self.t += dt
        self.steps += 1
        self.slept.append(dt)


class Run:
    """Drive the engine's :class:`ContinuousRows` through the worker's loop: batches handed over at
    given steps, then stop; what
    ``stream`` and ``done`` heard, with the step each came in."""

    def __init__(self, eng: FakeEngine, plan: list[tuple[int, P.BatchMsg]]) -> None:
        self.clock = Clock()
        self.plan = sorted(plan, key=lambda x: x[0])
        self.streamed: list[tuple[int, int, P.RequestOutput]] = []
        self.done: list[tuple[int, P.BatchMsg, Any, Any, str | None]] = []
        eng.continuous = ContinuousRows(eng, clock=self.clock, sleep=self.clock.sleep)
        run(eng, self.take, self.on_done, self.on_stream)

    def take(self, timeout: float | None) -> Any:
        if not self.plan:
            return None
        step, b = self.plan[0]
        if step <= self.clock.steps or timeout is None:  # an idle engine waits for it
            self.plan.pop(0)
            return b
        return NOTHING

    def on_stream(self, bid: int, outs: list[P.RequestOutput]) -> None:
        self.streamed += [(self.clock.steps, bid, o) for o in outs]

    def on_done(self, b: P.BatchMsg, outs: Any, stats: Any, error: str | None) -> None:
        self.done.append((self.clock.steps, b, outs, stats, error))

    def result(self, bid: int) -> tuple[int, list[P.RequestOutput], P.BatchStats]:
        ((step, _, outs, stats, err),) = [d for d in self.done if d[1].batch_id == bid]
        assert err is None
        return step, outs, stats

    def tokens(self, rid: str) -> list[int]:
        return [t for _, _, o in self.streamed if o.rid == rid for t in o.token_ids]


def test_a_grant_joining_a_running_one_advances_in_the_same_steps_and_finishes_first() -> None:
    eng = FakeEngine(decode_s=0.01, batching="continuous")
    long = batch(1, 20, req("long", [5, 6, 7], ignore_eos=True))
    short = batch(2, 3, req("short", [9, 9], ignore_eos=True))
    run = Run(eng, [(0, long), (4, short)])
    end_long, (out_long,), _ = run.result(1)
    end_short, (out_short,), _ = run.result(2)
    assert len(out_long.token_ids) == 20 and len(out_short.token_ids) == 3
    # The short grant joined after step 4 and ended three steps later, long before the first.
    assert end_short == 7 and end_long == 20
    steps_of = {rid: [s for s, _, o in run.streamed if o.rid == rid] for rid in ("long", "short")}
    assert steps_of["short"] == [5, 6, 7] and set(steps_of["short"]) <= set(steps_of["long"])
    assert len(run.done) == 2  # done once per grant
    # One decode_s per step for all rows: 20 steps, not 23.
    assert run.clock.steps == 20 and run.clock.t == pytest.approx(20 * 0.01)
    # Every token streamed once, in order: the stream is the output.
    assert run.tokens("long") == out_long.token_ids and run.tokens("short") == out_short.token_ids


RULES: list[dict[str, Any]] = [
    {},
    {"ignore_eos": True},
    {"temperature": 1.0, "seed": 7, "ignore_eos": True},
    {"logprobs": True, "top_logprobs": 2},
    {"min_tokens": 30},
    {"logit_bias": {77: 100.0}},
]


def sliced(serve: Any, prompts: list[list[int]], s: int, max_new: int) -> dict[str, Any]:
    """Serve like the daemon under grants: each unfinished row again with its tokens, one grant
    per request, all grants of a round in flight together; returns what each row produced."""
    gen: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    lps: dict[str, list[Any]] = {k: [] for k in gen}
    reasons: dict[str, str | None] = dict.fromkeys(gen)
    bid = 0
    while any(reasons[k] is None for k in gen):
        grants = []
        for k in gen:
            if reasons[k] is None:
                i = int(k)
                bid += 1
                grants.append(batch(bid, s, req(k, prompts[i] + gen[k], max_new - len(gen[k]),
                                                generated=len(gen[k]), **RULES[i % len(RULES)])))
        for outs in serve(grants):
            for o in outs:
                gen[o.rid] += o.token_ids
                lps[o.rid] += o.logprobs
                reasons[o.rid] = o.finish_reason
    return {"tokens": gen, "logprobs": lps, "reasons": reasons}


def test_tokens_are_those_of_the_static_path_over_any_grants() -> None:
    prompts = [[5, 6, 7], [9] * 11, [42], list(range(3, 40)), [4, 4], [8, 3, 8]]

    def static(grants: list[P.BatchMsg]) -> list[list[P.RequestOutput]]:
        eng = FakeEngine()
        return [eng.serve(b)[0] for b in grants]

    cont_eng = FakeEngine(batching="continuous", max_rows=4, decode_s=0.001)

    def continuous(grants: list[P.BatchMsg]) -> list[list[P.RequestOutput]]:
        run = Run(cont_eng, [(i, b) for i, b in enumerate(grants)])  # staggered joins
        return [run.result(b.batch_id)[1] for b in grants]

    one_pass = sliced(static, prompts, 1000, 60)
    assert set(one_pass["reasons"].values()) == {"stop", "length"}
    for s in (1, 5, 16):
        assert sliced(continuous, prompts, s, 60) == one_pass


def test_kept_kv_is_resumed_and_released_as_on_the_static_path() -> None:
    eng = FakeEngine(batching="continuous")
    ctx = list(range(3, 20))
    run = Run(eng, [(0, batch(1, 4, req("x", ctx, 10, ignore_eos=True)))])
    _, (first,), stats = run.result(1)
    assert first.kv_tokens == len(ctx) + 3 and stats.prefill_tokens == len(ctx) and stats.reused_tokens == 0
    assert eng.kv is not None and eng.kv.store.held() == {"x": len(ctx) + 3}
    nxt = req("x", ctx + first.token_ids, 6, generated=4, ignore_eos=True)
    run = Run(eng, [(0, batch(2, 4, nxt)), (0, batch(3, 4, req("y", [8, 9], 6, ignore_eos=True)))])
    _, (second,), stats = run.result(2)
    assert stats.reused_tokens == len(ctx) + 3 and stats.prefill_tokens == 1
    assert second.reused_tokens == len(ctx) + 3 and second.kv_tokens == len(ctx) + 7
    # The prefill of what is new is its step's: 1 token of x and 2 of y joined together.
    eng2 = FakeEngine(batching="continuous", decode_s=0.01, prefill_s_per_token=0.001)
    clocked = Run(eng2, [(0, batch(1, 2, req("a", [3] * 10, 2, ignore_eos=True))),
                         (0, batch(2, 2, req("b", [3] * 5, 2, ignore_eos=True)))])
    assert clocked.clock.slept == pytest.approx([0.01 + 0.015, 0.01])
    assert clocked.result(1)[2].prefill_s == pytest.approx(0.010)
    # A release drops what was kept; one for a running row leaves nothing kept at its end.
    eng.release(["x", "y"])
    assert eng.kv.store.held() == {}
    rel = FakeEngine(batching="continuous")

    class Releasing(Run):
        def on_stream(self, bid: int, outs: list[P.RequestOutput]) -> None:
            super().on_stream(bid, outs)
            rel.release(["r"])  # from the receive thread, while the row runs

    _, (out,), _ = Releasing(rel, [(0, batch(1, 4, req("r", [5, 5], 10, ignore_eos=True)))]).result(1)
    assert out.kv_tokens == 0 and rel.kv is not None and rel.kv.store.held() == {}


def test_at_most_max_rows_run_and_the_rest_join_as_rows_end() -> None:
    eng = FakeEngine(batching="continuous", max_rows=2, decode_s=0.01)
    rows = [req("a", [5], 2, ignore_eos=True), req("b", [6], 5, ignore_eos=True), req("c", [7], 2, ignore_eos=True)]
    run = Run(eng, [(0, batch(1, 8, *rows))])
    per_step: dict[int, set[str]] = {}
    for step, _, o in run.streamed:
        per_step.setdefault(step, set()).add(o.rid)
    assert max(len(v) for v in per_step.values()) == 2
    assert per_step[1] == per_step[2] == {"a", "b"} and per_step[3] == per_step[4] == {"b", "c"}
    step, outs, stats = run.result(1)
    assert [o.rid for o in outs] == ["a", "b", "c"] and step == 5  # in the batch's order
    assert [len(o.token_ids) for o in outs] == [2, 5, 2] and [o.finish_reason for o in outs] == ["length"] * 3
    assert stats.batch_size == 3 and stats.iterations == 5 and stats.pad_tokens == stats.invalid_tokens == 0
    with pytest.raises(ValueError, match="max_rows"):
        FakeEngine(max_rows=0)


def test_a_batch_that_finds_no_place_stays_in_the_workers_queue() -> None:
    eng = FakeEngine(batching="continuous", max_rows=1, decode_s=0.01)
    q: queue.Queue[Any] = queue.Queue()
    for b in (batch(1, 3, req("a", [5], 9, ignore_eos=True)), batch(2, 3, req("b", [6], 9, ignore_eos=True))):
        q.put(b)
    q.put(None)
    clock = Clock()
    left: list[int] = []

    def on_stream(bid: int, outs: list[P.RequestOutput]) -> None:
        left.append(q.qsize())

    eng.continuous = ContinuousRows(eng, clock=clock, sleep=clock.sleep)
    run(eng, queue_take(q), lambda *a: None, on_stream)
    # While "a" runs, "b" (and the stop) wait in the queue; "b" is taken once "a" is done.
    assert left == [2, 2, 2, 1, 1, 1] and clock.steps == 6


def test_a_bad_batch_fails_alone_and_an_empty_one_is_done_at_once() -> None:
    eng = FakeEngine(batching="continuous", decode_s=0.01)
    good = batch(1, 4, req("g", [5, 6], 4, ignore_eos=True))
    bad = batch(2, 4, req("b", [5, 10**6], 4))
    empty = batch(3, 4)
    run = Run(eng, [(0, good), (1, bad), (1, empty)])
    assert [(d[1].batch_id, d[4] is None) for d in run.done] == [(2, False), (3, True), (1, True)]
    assert "outside vocab" in (run.done[0][4] or "") and run.done[1][2] == []
    assert len(run.result(1)[1][0].token_ids) == 4


def test_the_worker_loop_takes_a_real_queue() -> None:
    """A FakeEngine with batching continuous runs its rows in the worker's loop over a real queue."""
    eng = FakeEngine(batching="continuous")
    q: queue.Queue[Any] = queue.Queue()
    for b in (batch(1, 3, req("a", [5], 9, ignore_eos=True)), batch(2, 3, req("b", [6], 2, ignore_eos=True))):
        q.put(b)
    q.put(None)
    done: list[tuple[int, list[int]]] = []
    run(eng, queue_take(q), lambda b, outs, st, err: done.append((b.batch_id, [len(o.token_ids) for o in outs or []])))
    assert done == [(2, [2]), (1, [3])]


def test_a_row_whose_grammar_cannot_be_built_fails_alone() -> None:
    pytest.importorskip("llguidance")
    from sclsd.structured import grammar_text

    g = grammar_text(P.Structured(kind="json_schema", value=json.dumps(
        {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"]})))
    eng = FakeEngine(batching="continuous", grammar=True)
    assert eng.kv is not None
    eng.kv.store.put("broken", Retained([5, 6], 2))
    rows = [req("json", [5, 6, 7], 60, grammar=g), req("broken", [5, 6, 7], 10, grammar="start: %%%"),
            req("plain", [8, 9], 10, ignore_eos=True)]
    run = Run(eng, [(0, batch(1, 60, *rows))])
    _, outs, _ = run.result(1)
    by = {o.rid: o for o in outs}
    assert [o.rid for o in outs] == ["json", "broken", "plain"]
    assert by["broken"].error and by["broken"].token_ids == []
    assert "broken" not in eng.kv.store.held()  # what was kept for it is dropped
    static, _ = FakeEngine(grammar=True).serve(batch(2, 60, rows[0], rows[2]))
    assert [by["json"].token_ids, by["plain"].token_ids] == [o.token_ids for o in static]
    assert by["json"].finish_reason == "stop"
