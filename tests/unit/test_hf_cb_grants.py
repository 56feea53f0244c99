"""hf-cb serving slice grants: KV kept paused in transformers' cache, resumed, moved, released."""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import Any

import pytest

from sclsd import protocol as P
from unit.engine_loop import queue_take, run

pytest.importorskip("torch")

PROMPT = [5, 6, 7, 8, 9]


def make_cb(**kw: Any) -> Any:
    from worker.engines import create_engine

    # A small cache: allocating transformers' default one takes tens of seconds on a CPU.
    kw.setdefault("num_blocks", 64)
    return create_engine("hf-cb", "tiny-random", threads=1, **kw)


@pytest.fixture(scope="module")
def engines():
    from worker.engines import create_engine

    a, b = make_cb(), make_cb()
    yield a, b, create_engine("hf", "tiny-random", threads=1)
    a.close()
    b.close()


def row(rid: str, ctx: list[int], n: int, **kw: Any) -> P.BatchRequest:
    return P.BatchRequest(rid=rid, token_ids=list(ctx), max_new_tokens=n, temperature=0.0, ignore_eos=True, **kw)


_bids = iter(range(1000, 10**6))


def grant(engine: Any, r: P.BatchRequest, s: int, kv_reuse: bool = True) -> tuple[P.RequestOutput, P.BatchStats]:
    (out,), stats = engine.serve(P.BatchMsg(batch_id=next(_bids), slice_len=s, requests=[r], kv_reuse=kv_reuse))
    return out, stats


def settle(engine: Any, cond: Callable[[], bool], timeout: float = 5.0) -> None:
    """The scheduler pauses and frees on the generation thread, a step after the result:
    wait for the turn of its loop that makes ``cond`` true (it notifies every turn)."""
    lock = engine._control.lock
    with lock:
        assert lock.wait_for(cond, timeout), "the generation thread did not catch up"


def held(engine: Any) -> dict[str, int]:
    """Paused transformers request -> KV tokens its blocks hold (the scheduler's view)."""
    with engine._control.lock:
        return dict(engine._control.held)


def block_owners(engine: Any) -> set[str]:
    cache = engine._mgr.batch_processor.cache
    return {tid for a in cache.cache_allocators.values() for tid in a.block_table}


def in_grants(engine: Any, rid: str, ctx: list[int], total: int, s: int,
              **kw: Any) -> tuple[list[int], list[tuple[P.RequestOutput, P.BatchStats]]]:
    """Serve ``total`` tokens in grants of ``s``, each resuming the last; returns tokens and results."""
    got: list[int] = []
    results = []
    while len(got) < total:
        out, stats = grant(engine, row(rid, ctx + got, total - len(got), **kw), s)
        results.append((out, stats))
        got += out.token_ids
        if out.finish_reason is not None:
            break
        assert out.kv_tokens == len(ctx) + len(got) - 1
        # What transformers holds for the paused request is what the engine reported.
        settle(engine, lambda o=out: o.kv_tokens in held(engine).values())
    return got, results


def one_pass(engine: Any, ctx: list[int], n: int, **kw: Any) -> list[int]:
    out, _ = grant(engine, row("one", ctx, n, **kw), 10_000)
    return out.token_ids


def test_grants_match_one_pass_and_static_engine(engines) -> None:
    cb, _, hf = engines
    want = one_pass(hf, PROMPT, 13)
    assert one_pass(cb, PROMPT, 13) == want
    for s in (4, 5, 1):
        got, results = in_grants(cb, f"g{s}", PROMPT, 13, s)
        assert got == want
        assert results[0][1].prefill_tokens == len(PROMPT) and results[0][1].reused_tokens == 0
        ctx = len(PROMPT)
        for (prev, _), (_, stats) in zip(results, results[1:], strict=False):
            ctx += len(prev.token_ids)
            assert stats.prefill_tokens == 0 and stats.reused_tokens == ctx - 1
        last = results[-1][0]
        assert last.finish_reason == "length" and last.kv_tokens == 0
        assert f"g{s}" not in cb.kept()
    settle(cb, lambda: not held(cb))


def test_stop_token_across_grants(engines) -> None:
    cb, _, hf = engines
    full = one_pass(hf, PROMPT, 12)
    stop = full[5]  # the last token of the second grant: the row stops exactly at its cap
    assert full.index(stop) == 5
    want = full[:6]
    got, results = in_grants(cb, "stop", PROMPT, 12, 3, stop_token_ids=[stop])
    assert got == want
    assert results[-1][0].finish_reason == "stop" and results[-1][0].kv_tokens == 0
    assert "stop" not in cb.kept()


def test_interleaved_grants_admitted_while_others_run(engines) -> None:
    cb, _, hf = engines
    plan = {"x": ([3, 4, 5], 14, 2), "y": ([7, 7, 9, 11], 9, 3), "z": ([20] * 12, 11, 5)}
    want = {rid: one_pass(hf, p, n) for rid, (p, n, _) in plan.items()}
    got: dict[str, list[int]] = {rid: [] for rid in plan}
    reused: list[int] = []
    q: queue.Queue = queue.Queue()

    def put(rid: str) -> None:
        prompt, n, s = plan[rid]
        r = row(rid, prompt + got[rid], n - len(got[rid]))
        q.put(P.BatchMsg(batch_id=next(_bids), slice_len=s, requests=[r]))

    def emit(batch: P.BatchMsg, outs: Any, stats: Any, error: str | None) -> None:
        assert error is None
        (out,) = outs
        got[out.rid] += out.token_ids
        if stats.reused_tokens:
            assert stats.prefill_tokens == 0
            reused.append(stats.reused_tokens)
        if out.finish_reason is None:
            put(out.rid)  # the next grant arrives while the others still generate
        elif all(len(got[r]) == plan[r][1] for r in plan):
            q.put(None)

    put("x")
    take = queue_take(q)
    started = [False]

    def take_and_admit(timeout: float | None) -> Any:
        item = take(timeout)
        if not started[0]:
            started[0] = True
            put("y")
            put("z")
        return item

    run(cb, take_and_admit, emit)
    assert got == want
    assert len(reused) == sum(-(-n // s) - 1 for _, n, s in plan.values())


def test_moved_to_another_engine_or_back_after_release(engines) -> None:
    a, b, hf = engines
    want = one_pass(hf, PROMPT, 12)
    got, _ = in_grants(a, "m", PROMPT, 5, 5)  # max_new_tokens 5 = slice: nothing kept
    assert "m" not in a.kept()
    out, _ = grant(a, row("m", PROMPT, 12), 3)  # now kept on a
    assert out.kv_tokens == len(PROMPT) + 2 and a.kept() == {"m": len(PROMPT) + 2}
    got = out.token_ids
    # Moved: b continues with a fresh prefill of prompt + generated tokens.
    out, stats = grant(b, row("m", PROMPT + got, 12 - len(got)), 4)
    assert stats.prefill_tokens == len(PROMPT) + 3 and stats.reused_tokens == 0
    got += out.token_ids
    a.release(["m"])
    settle(a, lambda: not held(a))
    # ... and back to a after the release: fresh again, then resumed in place.
    rest, results = in_grants(a, "m", PROMPT + got, 12 - len(got), 2)
    assert got + rest == want
    assert results[0][1].prefill_tokens == len(PROMPT) + len(got) and results[0][1].reused_tokens == 0
    assert results[1][1].prefill_tokens == 0
    b.release(["m"])


def test_mismatched_context_drops_kept_and_serves_fresh(engines) -> None:
    cb, _, hf = engines
    out, _ = grant(cb, row("mm", PROMPT, 10), 3)
    settle(cb, lambda: len(held(cb)) == 1)
    (old_tid,) = held(cb)
    other = PROMPT + out.token_ids[:-1] + [42]  # same rid, a context the KV does not hold
    out2, stats = grant(cb, row("mm", other, 7), 3)
    assert stats.prefill_tokens == len(other) and stats.reused_tokens == 0
    assert out2.token_ids == one_pass(hf, other, 3)
    settle(cb, lambda: old_tid not in held(cb) and old_tid not in block_owners(cb))
    assert cb.kept() == {"mm": len(other) + 2}
    cb.release(None)
    settle(cb, lambda: not held(cb))


def test_release_frees_blocks_then_serves_fresh(engines) -> None:
    cb, _, hf = engines
    want = one_pass(hf, PROMPT, 8)
    out, _ = grant(cb, row("rel", PROMPT, 8), 4)
    settle(cb, lambda: len(held(cb)) == 1)
    (tid,) = held(cb)
    assert tid in block_owners(cb)
    cb.release(["rel", "unknown"])
    settle(cb, lambda: not held(cb) and tid not in block_owners(cb))
    assert cb.kept() == {} and cb.take_evicted() == []
    out2, stats = grant(cb, row("rel", PROMPT + out.token_ids, 4), 4)
    assert stats.prefill_tokens == len(PROMPT) + 4 and stats.reused_tokens == 0
    assert out.token_ids + out2.token_ids == want


def test_release_while_running_applies_at_its_end(engines) -> None:
    cb, _, _ = engines
    items: list[Any] = [P.BatchMsg(batch_id=next(_bids), slice_len=30, requests=[row("live", PROMPT, 60)])]
    outs: list[P.RequestOutput] = []

    def take(timeout: float | None) -> Any:
        if items:
            return items.pop(0)
        assert "live" in cb._paused.running  # asked right after the admission
        cb.release(None)  # e.g. the daemon re-registered while the grant runs
        return None  # stop once the running row ends

    run(cb, take, lambda b, o, stats, error: outs.append(o[0]))
    (out,) = outs
    assert len(out.token_ids) == 30 and out.finish_reason is None and out.kv_tokens == 0
    assert cb.kept() == {}
    settle(cb, lambda: not held(cb))


def test_kv_reuse_off_keeps_nothing(engines) -> None:
    cb, _, hf = engines
    want = one_pass(hf, PROMPT, 8)
    out, _ = grant(cb, row("off", PROMPT, 8), 4, kv_reuse=False)
    assert out.finish_reason is None and out.kv_tokens == 0 and cb.kept() == {}
    settle(cb, lambda: not held(cb))
    out2, stats = grant(cb, row("off", PROMPT + out.token_ids, 4), 4, kv_reuse=False)
    assert stats.prefill_tokens == len(PROMPT) + 4 and stats.reused_tokens == 0
    assert out.token_ids + out2.token_ids == want and out2.kv_tokens == 0


def test_kv_peak_counts_running_and_paused_contexts() -> None:
    cb = make_cb()
    try:
        rows = [row("a", [3, 4, 5, 6], 10), row("b", [7, 8, 9], 10)]
        outs, stats = cb.serve(P.BatchMsg(batch_id=1, slice_len=5, requests=rows))
        assert [o.kv_tokens for o in outs] == [8, 7]
        assert stats.kv_peak_tokens == 15 and stats.preemptions == 0
        rows = [row(o.rid, r.token_ids + o.token_ids, 5) for r, o in zip(rows, outs, strict=True)]
        outs, stats = cb.serve(P.BatchMsg(batch_id=2, slice_len=3, requests=rows))
        assert [o.kv_tokens for o in outs] == [11, 10] and stats.reused_tokens == 15
        assert stats.kv_peak_tokens == 21 and stats.preemptions == 0
    finally:
        cb.close()


def test_full_cache_evicts_kept_kv_before_preempting() -> None:
    from worker.engines import create_engine

    hf = create_engine("hf", "tiny-random", threads=1)
    cb = make_cb(page_size=16, num_blocks=4)  # room for 64 tokens
    try:
        for rid, new in (("old", row("u", [4] * 20, 30)), ("old2", row("v", [9] * 40, 5))):
            out, _ = grant(cb, row(rid, [3] * 20, 30), 10)
            assert out.kv_tokens == 29  # 2 blocks of 16 kept
            # u outgrows the 2 free blocks while running, v does not fit at all: either
            # way the kept KV gives way and nothing is preempted.
            out, stats = grant(cb, new, 30)
            assert out.token_ids == one_pass(hf, new.token_ids, new.max_new_tokens)
            assert cb.take_evicted() == [rid] and cb.kept() == {} and stats.preemptions == 0
        # Two requests that outgrow the cache together: transformers preempts one, counted.
        rows = [row("s", [6] * 20, 30), row("t", [8] * 21, 30)]
        outs, stats = cb.serve(P.BatchMsg(batch_id=next(_bids), slice_len=30, requests=rows))
        assert stats.preemptions >= 1
        assert [o.token_ids for o in outs] == [one_pass(hf, r.token_ids, 30) for r in rows]
    finally:
        cb.close()


def test_tokens_stream_as_they_are_generated_and_add_up_to_the_result(engines) -> None:
    cb = engines[0]
    r = row("s", PROMPT, 12)
    chunks: list[list[int]] = []
    outs, _ = cb.serve(P.BatchMsg(batch_id=next(_bids), slice_len=12, requests=[r], kv_reuse=False),
                       lambda o: chunks.extend(x.token_ids for x in o))
    streamed = [t for c in chunks for t in c]
    # Every token but the last output's came streamed, in order, before the result.
    assert len(chunks) >= 10 and streamed == outs[0].token_ids[: len(streamed)]
