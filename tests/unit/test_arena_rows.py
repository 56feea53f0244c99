"""``hf-static-cb``'s arena at its edges, on the CPU: rows moved when the geometry changes,
rows that wait for room (and one that can never fit), the daemon's releases from another
thread, kept KV that spills to host memory and comes back, a turn that fails, malformed
grants, eager attention, and the check of captured steps (graphs stood in for by replays)."""

from __future__ import annotations

import random
import threading
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from sclsd.protocol import BatchMsg, BatchRequest  # noqa: E402
from unit.arena_common import (  # noqa: E402
    DELTA,
    contexts,
    hf_engine,
    make,
    next_batch_id,
    one_pass,
    req,
    runner,
    serve,
)
from worker.engines import arena_rows  # noqa: E402
from worker.engines.arena_rows import RowStep  # noqa: E402
from worker.engines.graph_check import GRAPH_LOGIT_TOLERANCE, check_graphs, verify  # noqa: E402


@pytest.fixture(scope="module")
def hf() -> Any:
    return hf_engine()


@pytest.mark.parametrize("chunk_bytes", [1, 10**9])
def test_relayout_moves_every_row_whole_growing_and_shrinking(monkeypatch, chunk_bytes) -> None:
    """Rows keep their written columns when the columns per slot change, whether the rows move
    one chunk at a time (a chunk's new place overlaps rows not moved yet) or all at once."""
    monkeypatch.setattr(arena_rows, "RELAYOUT_BYTES", chunk_bytes)
    r = runner()
    lens = [5, 16, 1, 9, 13, 16, 2]
    gen = torch.Generator().manual_seed(0)
    for k, v in r.slot_views(0, len(lens), 16):
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
    want = [[(k[i, :, :n].clone(), v[i, :, :n].clone()) for k, v in r.slot_views(0, len(lens), 16)]
            for i, n in enumerate(lens)]
    for old, new in ((16, 48), (48, 64), (64, 16)):
        r.relayout(lens, old, new)
        views = r.slot_views(0, len(lens), new)
        for i, n in enumerate(lens):
            for (k, v), (wk, wv) in zip(views, want[i], strict=True):
                assert torch.equal(k[i, :, :n], wk) and torch.equal(v[i, :, :n], wv), (old, new, i)


def test_a_move_copies_one_row_into_another_slot() -> None:
    r = runner()
    views = r.slot_views(0, 6, 32)
    for k, v in views:
        k.copy_(torch.arange(k.numel(), dtype=torch.float32).view(k.shape))
        v.copy_(-k)
    before = [(k[5, :, :20].clone(), k[0].clone()) for k, _ in views]
    r.move(5, 1, 20, 32)
    for (k, v), (moved, first) in zip(r.slot_views(0, 6, 32), before, strict=True):
        assert torch.equal(k[1, :, :20], moved) and torch.equal(v[1, :, :20], -moved)
        assert torch.equal(k[0], first)  # other slots untouched


def test_geometry_takes_a_cache_bucket_else_the_rows_own_shape() -> None:
    r = runner(tokens=200)
    g = r.geometry(3, 20)
    assert g is not None and (g.c, g.plan.n, g.plan.graph) == (32, 3, False)
    g = r.geometry(4, 50)  # 4 x 64 > 200: the rows' own need
    assert g is not None and (g.c, g.plan.n) == (50, 4)
    assert r.geometry(5, 50) is None and r.geometry(1, 200) is not None and r.geometry(1, 201) is None


def test_rows_wait_for_room_and_a_row_that_never_fits_fails_alone(hf) -> None:
    """An arena of 200 token slots: eight rows needing 30 columns each cannot run at once
    (240); the last wait for rows to leave and still give the one-pass tokens. A row that
    needs more than the whole arena ends with the reason; its neighbours are served."""
    eng = make(static_share=0.5, mem_budget=400 * DELTA)
    assert eng.static.arena.tokens == 200
    ctxs = contexts(8, 20, 21)
    outs, _ = serve(eng, [req(f"w{i}", c, 10) for i, c in enumerate(ctxs)], 10)
    assert [o.token_ids for o in outs] == one_pass(hf, ctxs, 10)
    assert eng.rows.waited_rows >= 2
    big = req("big", [7] * 195, 10)
    outs, _ = serve(eng, [req("small", ctxs[0], 10), big], 10)
    assert outs[0].token_ids == one_pass(hf, ctxs[:1], 10)[0]
    assert outs[1].token_ids == [] and outs[1].error is not None and "arena holds 200" in outs[1].error


def test_released_kv_is_freed_at_once_or_when_the_row_ends(hf) -> None:
    eng = make()
    ctx = contexts(1, 8, 9)[0]
    (out,), _ = serve(eng, [req("a", ctx, 12)], 4)
    assert eng.kept() == {"a": len(ctx) + 3}
    eng.release(["a"])
    assert eng.kept() == {}
    (out2,), stats = serve(eng, [req("a", ctx + out.token_ids, 8)], 4)
    assert (stats.prefill_tokens, stats.reused_tokens) == (len(ctx) + 4, 0)  # served fresh
    # Released while its row runs: the row ends with its slice, nothing kept.
    eng.submit(BatchMsg(batch_id=next_batch_id(), slice_len=4, requests=[req("b", ctx, 12)]))
    eng.poll(0.0)
    eng.release(["b"])
    ends = []
    while eng.busy():
        ends += [e for e in eng.poll(0.0) if hasattr(e, "outputs") and hasattr(e, "stats")]
    (done,) = ends
    assert done.outputs[0].kv_tokens == 0 and len(done.outputs[0].token_ids) == 4
    assert eng.kept() == {"a": out2.kv_tokens} and out2.kv_tokens == len(ctx) + 7
    eng.release(None)
    assert eng.kept() == {}
    assert out.token_ids + out2.token_ids == one_pass(hf, [ctx], 8)[0][:4] + one_pass(hf, [ctx + out.token_ids], 4)[0]


def test_releases_from_another_thread_while_grants_run(hf) -> None:
    """The receive thread releases requests while the serve thread runs their grants: every
    grant ends with its tokens, and nothing of a released request stays kept."""
    eng = make()
    ctxs = contexts(6, 3, 12, seed=4)
    want = one_pass(hf, ctxs, 12)
    got = {f"q{i}": [] for i in range(len(ctxs))}
    stop = threading.Event()
    released: set[str] = set()

    def releaser() -> None:
        rng = random.Random(0)
        while not stop.is_set():
            rid = f"q{rng.randrange(len(ctxs))}"
            released.add(rid)
            eng.release([rid])
            stop.wait(0.001)

    t = threading.Thread(target=releaser)
    t.start()
    try:
        while any(len(g) < 12 for g in got.values()):
            live = [i for i in range(len(ctxs)) if len(got[f"q{i}"]) < 12]
            reqs = [BatchRequest(rid=f"q{i}", token_ids=ctxs[i] + got[f"q{i}"], max_new_tokens=12 - len(got[f"q{i}"]),
                                 generated=len(got[f"q{i}"]), temperature=0.0, ignore_eos=True) for i in live]
            outs, _ = serve(eng, reqs, 3)
            for o in outs:
                got[o.rid] += o.token_ids
    finally:
        stop.set()
        t.join()
    assert [got[f"q{i}"] for i in range(len(ctxs))] == want
    eng.release(sorted(released))
    assert eng.kept() == {}


def test_kept_kv_moves_to_host_memory_and_comes_back(hf) -> None:
    """An arena of 40 token slots (one row of 24 columns at a time), a store of one entry on
    the device and room in host memory: each newcomer spills the paused row before it to the
    store, the older spilled entry goes on to the host, and its request's next grant copies
    it back instead of prefilling."""
    eng = make(static_share=0.5, mem_budget=80 * DELTA, kv_retain_bytes=40 * DELTA, kv_host_bytes=10**7)
    a, b, c = contexts(3, 20, 21, seed=9)
    (oa,), _ = serve(eng, [req("a", a, 8)], 4)
    assert eng.kept() == {"a": len(a) + 3} and eng.kv is not None and eng.kv.held() == {}  # paused in place
    serve(eng, [req("b", b, 8)], 4)
    serve(eng, [req("c", c, 8)], 4)
    assert eng.kv.on_host() == ["a"] and eng.rows.counts["spilled"] == 2
    (oa2,), stats = serve(eng, [req("a", a + oa.token_ids, 4, generated=4)], 4)
    assert (stats.prefill_tokens, stats.reused_tokens) == (0, len(a) + 3)
    assert eng.rows.counts["loaded"] == 1
    assert oa.token_ids + oa2.token_ids == one_pass(hf, [a], 8)[0]


def test_a_failed_turn_fails_its_grants_and_the_engine_goes_on(hf, monkeypatch) -> None:
    eng = make()
    ctxs = contexts(3, 4, 9, seed=2)
    real = eng.static.prefill
    calls = [0]

    def broken(*args: Any) -> None:
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("device lost its way")
        real(*args)

    monkeypatch.setattr(eng.static, "prefill", broken)
    with pytest.raises(RuntimeError, match="device lost its way"):
        serve(eng, [req(f"f{i}", c, 6) for i, c in enumerate(ctxs)], 6)
    assert not eng.busy()
    outs, _ = serve(eng, [req(f"f{i}", c, 6) for i, c in enumerate(ctxs)], 6)
    assert [o.token_ids for o in outs] == one_pass(hf, ctxs, 6)


@pytest.mark.parametrize("bad", [req("e", [], 4), BatchRequest(rid="g", token_ids=[5], max_new_tokens=4, generated=3),
                                 req("v", [10**7], 4)])
def test_a_malformed_grant_fails_with_the_reason(bad) -> None:
    eng = make()
    eng.submit(BatchMsg(batch_id=1, slice_len=4, requests=[req("ok", [5, 6], 4), bad]))
    (ev,) = eng.poll(0.0)
    assert type(ev).__name__ == "BatchFailed" and bad.rid in ev.error and not eng.busy()


def test_eager_attention_gets_an_additive_mask(hf) -> None:
    ctxs = contexts(4, 1, 20, seed=5)
    eng = make(static_buckets=True, graph_batch_sizes="8", graph_cache_tokens="64")
    eng.model.config._attn_implementation = "eager"
    eng.static.additive = True
    outs, _ = serve(eng, [req(f"e{i}", c, 10) for i, c in enumerate(ctxs)], 10, kv_reuse=False)
    assert [o.token_ids for o in outs] == one_pass(hf, ctxs, 10)


class Replay:
    """A captured step stood in for on the CPU: the step's body, its logits changed by ``change``."""

    def __init__(self, step: RowStep, change: Any) -> None:
        self.step, self.change = step, change

    def replay(self) -> None:
        self.step.logits = self.change(self.step.body())


def test_graph_check_drops_the_wrong_replays_and_the_rest_serve(hf) -> None:
    eng = make(static_buckets=True, graph_batch_sizes="2,8", graph_cache_tokens="32,64")
    r = eng.static
    assert r.buckets() == [(2, 32), (2, 64), (8, 32), (8, 64)]
    for key in r.buckets():
        step = r.steps[key]
        assert isinstance(step, RowStep)
        step.graph = Replay(step, (lambda lg: lg * 0) if key == (8, 32) else (lambda lg: lg))
    errors = verify(r, eng.vocab_size)
    assert errors[(8, 32)] > GRAPH_LOGIT_TOLERANCE and errors[(2, 64)] == 0.0
    assert r.captured() == [(2, 32), (2, 64), (8, 64)]
    caps = eng.caps()
    assert caps.graph_batch_sizes == [2, 8] and caps.graph_cache_tokens == [32, 64]
    g = r.geometry(5, 20)
    assert g is not None and (g.c, g.plan.n, g.plan.graph) == (32, 5, False)  # (8, 32) is gone
    g = r.geometry(5, 40)
    assert g is not None and (g.c, g.plan.n, g.plan.graph) == (64, 8, True)
    assert check_graphs(eng) is True
    ctxs = contexts(5, 15, 30, seed=6)
    outs, _ = serve(eng, [req(f"g{i}", c, 10) for i, c in enumerate(ctxs)], 10, kv_reuse=False)
    assert [o.token_ids for o in outs] == one_pass(hf, ctxs, 10)


def test_close_lets_go_of_the_arena_and_the_kept_kv() -> None:
    import gc
    import weakref

    eng = make(static_share=0.5, mem_budget=80 * DELTA)  # one row of 24 columns at a time: the second spills the first
    outs = [serve(eng, [req(f"c{i}", c, 12)], 4)[0][0] for i, c in enumerate(contexts(2, 20, 21))]
    assert all(o.kv_tokens > 0 for o in outs) and eng.kv is not None and eng.kv.nbytes > 0
    assert set(eng.kept()) == {"c0", "c1"} and set(eng.rows.paused) == {"c1"}
    arena = weakref.ref(eng.static.arena.kv[0][0])
    store = eng.kv
    eng.close()
    gc.collect()
    assert arena() is None and store.nbytes == 0 and store.held() == {} and eng.rows.paused == {}


@pytest.mark.parametrize("read_behind", [False, True])
def test_a_cancelled_row_leaves_at_the_next_step_keeping_nothing(read_behind: bool) -> None:
    """:meth:`Engine.cancel`: the row stops (a token of a step already queued is dropped), ends
    ``cancelled`` with nothing kept; its neighbour goes on and keeps its KV; a row of another
    batch of the same id is untouched."""
    from unit.test_cancel_rows import cancel_one_of_two

    eng = make()
    eng.read_behind = read_behind
    cancel_one_of_two(eng, kept=True)
    assert "a" not in eng.kept() and "b" in eng.kept()


def test_cancels_reach_waiting_rows_and_whole_batches() -> None:
    from unit.test_cancel_rows import batch, done_of, run_until, tokens_of

    eng = make(static_share=0.5, mem_budget=400 * DELTA)  # 200 token slots: a second 150-column row must wait
    eng.submit(batch(1, req("a", [5] * 120, 30), slice_len=30))
    eng.submit(batch(2, req("w", [6] * 120, 30), slice_len=30))
    seen = run_until(eng, lambda s: len(tokens_of(s, "a")) >= 1)
    assert [r.rid for r in eng.rows.waiting] == ["w"]
    eng.cancel([(2, "w")])
    seen = run_until(eng, lambda s: len(done_of(s)) >= 1, limit=3)
    (end,) = done_of(seen)
    assert end.batch.batch_id == 2 and end.outputs[0].finish_reason == "cancelled" and end.outputs[0].token_ids == []
    eng.cancel([(1, "a")])
    (end,) = done_of(run_until(eng, done_of, limit=3))
    assert end.outputs[0].finish_reason == "cancelled" and 1 <= len(end.outputs[0].token_ids) < 30
    assert not eng.busy() and eng.kept() == {}
