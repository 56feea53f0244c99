"""Rows of ``hf-static-cb`` paused in place between grants, on the CPU (tiny random Llama): a
grant's next grant resumes in its slot with ``hf``'s tokens and no KV copied; rows run beside
paused ones (dummy rows of a bucket writing into paused slots) with their one-pass tokens; a
paused row spills to the store only when room is needed and comes back exact; releases and
cancels free its slot; returning rows join ahead of newcomers; a row's end does not drain the
pipeline. Also the slot placement and the ordering of its copies (pure), and the copies
themselves on an arena."""

from __future__ import annotations

import itertools
import queue
import random
from typing import Any

import pytest

from worker.engines.arena_slots import Move, order_moves, place

torch = pytest.importorskip("torch")

from sclsd.protocol import BatchMsg  # noqa: E402
from unit.arena_common import DELTA, contexts, hf_engine, make, one_pass, req, runner, serve  # noqa: E402
from unit.engine_loop import queue_take, run  # noqa: E402
from unit.test_cancel_rows import done_of, run_until, tokens_of  # noqa: E402
from worker.engines.base import NewTokens  # noqa: E402

_bids = itertools.count(9000)


@pytest.fixture(scope="module")
def hf() -> Any:
    return hf_engine()


class Copies:
    """Counts the arena's KV copies between slots and the store (``load``: store to slot,
    ``cut``: slot to store) by wrapping the runner's own."""

    def __init__(self, eng: Any, monkeypatch: Any) -> None:
        self.load = self.cut = 0
        real_load, real_cut = eng.static.load, eng.static.cut

        def load(*a: Any, **k: Any) -> Any:
            self.load += 1
            return real_load(*a, **k)

        def cut(*a: Any, **k: Any) -> Any:
            self.cut += 1
            return real_cut(*a, **k)

        monkeypatch.setattr(eng.static, "load", load)
        monkeypatch.setattr(eng.static, "cut", cut)


def grants(eng: Any, rid: str, ctx: list[int], total: int, s: int) -> tuple[list[int], list[Any]]:
    """``total`` tokens of one request in grants of ``s``, each resuming the last."""
    got: list[int] = []
    stats = []
    while len(got) < total:
        (out,), st = serve(eng, [req(rid, ctx + got, total - len(got), generated=len(got))], s)
        got += out.token_ids
        stats.append(st)
    return got, stats


@pytest.mark.parametrize("read_behind", [False, True])
def test_a_row_resumed_in_place_gives_hf_tokens_and_copies_no_kv(hf, monkeypatch, read_behind) -> None:
    eng = make(static_buckets=True, graph_batch_sizes="2,8", graph_cache_tokens="32,64,128")
    eng.read_behind = read_behind
    copies = Copies(eng, monkeypatch)
    ctx = contexts(1, 11, 12, seed=3)[0]
    got, stats = grants(eng, "p", ctx, 20, 3)
    assert got == one_pass(hf, [ctx], 20)[0]
    assert [(s.prefill_tokens, s.reused_tokens) for s in stats[1:]] == [(0, len(ctx) - 1 + 3 * i) for i in range(1, 7)]
    assert (copies.load, copies.cut) == (0, 0) and eng.kv is not None and eng.kv.held() == {}
    assert eng.rows.counts["resumed"] == 6 and eng.kept() == {}  # the last grant ended the request


def test_rows_beside_paused_ones_and_bucket_dummies_keep_their_tokens(hf, monkeypatch) -> None:
    """A long grant runs while three requests in grants of 3 pause between them, each regranted
    only after the long row made a few more tokens: every request gets its one-pass tokens,
    paused rows sit in slots the bucket's dummy rows write, and no KV goes through the store
    (shared prefixes off: a finished row's KV would go to the store as one)."""
    eng = make(static_buckets=True, graph_batch_sizes="2,8", graph_cache_tokens="32,64,128", share_prefixes=False)
    eng.read_behind = True
    copies = Copies(eng, monkeypatch)
    plan = {"long": (contexts(1, 30, 31, seed=1)[0], 40, 40)}
    plan |= {f"p{i}": (c, 15, 3) for i, c in enumerate(contexts(3, 4, 14, seed=2))}
    want = {rid: one_pass(hf, [c], n)[0] for rid, (c, n, _) in plan.items()}
    got: dict[str, list[int]] = {rid: [] for rid in plan}
    q: queue.Queue[Any] = queue.Queue()
    later: list[str] = []
    paused_seen = [0]
    long_made = [0]

    def put(rid: str) -> None:
        ctx, n, s = plan[rid]
        q.put(BatchMsg(batch_id=next(_bids), slice_len=s,
                       requests=[req(rid, ctx + got[rid], n - len(got[rid]), generated=len(got[rid]))]))

    def done(batch: BatchMsg, outs: Any, stats: Any, error: str | None) -> None:
        assert error is None
        (out,) = outs
        got[out.rid] += out.token_ids
        if out.finish_reason is None:
            later.append(out.rid)  # regranted after the long row made more tokens
        if got["long"]:  # the long row is done: no more waiting for it
            flush()
        if all(len(got[r]) == plan[r][1] for r in plan):
            q.put(None)

    def flush() -> None:
        for rid in later:
            put(rid)
        later.clear()

    def stream(batch_id: int, outs: Any) -> None:
        paused_seen[0] = max(paused_seen[0], len(eng.rows.paused))
        for o in outs:
            if o.rid == "long":
                long_made[0] += len(o.token_ids)
                if long_made[0] % 4 == 0:
                    flush()

    for rid in plan:
        put(rid)
    run(eng, queue_take(q), done, stream)
    assert got == want
    assert paused_seen[0] >= 2 and eng.rows.counts["resumed"] >= 9
    assert (copies.load, copies.cut, eng.rows.counts["spilled"]) == (0, 0, 0)


def test_a_paused_row_spills_when_room_is_needed_and_comes_back_exact(hf, monkeypatch) -> None:
    """An arena of 40 token slots: a paused row of 24 columns stays until a newcomer needs its
    room, then goes to the store (one cut), and its next grant copies it back (one load) and
    gives the one-pass tokens; the newcomer's own tokens are right too."""
    eng = make(static_share=0.5, mem_budget=80 * DELTA)
    copies = Copies(eng, monkeypatch)
    a, b = contexts(2, 20, 21, seed=11)
    (oa,), _ = serve(eng, [req("a", a, 8)], 4)
    assert set(eng.rows.paused) == {"a"} and copies.cut == 0
    (ob,), _ = serve(eng, [req("b", b, 4)], 4)  # needs a's room
    assert ob.token_ids == one_pass(hf, [b], 4)[0]
    assert copies.cut == 1 and eng.rows.paused == {} and eng.kv is not None and set(eng.kv.held()) == {"a"}
    assert eng.kept() == {"a": len(a) + 3} and eng.take_evicted() == []
    (oa2,), stats = serve(eng, [req("a", a + oa.token_ids, 4, generated=4)], 4)
    assert (stats.prefill_tokens, stats.reused_tokens, copies.load) == (0, len(a) + 3, 1)
    assert oa.token_ids + oa2.token_ids == one_pass(hf, [a], 8)[0]


def test_a_spill_the_store_cannot_keep_is_reported_evicted(hf) -> None:
    eng = make(static_share=0.5, mem_budget=80 * DELTA, kv_retain_bytes=0, kv_host_bytes=0)
    a, b = contexts(2, 20, 21, seed=11)
    (oa,), _ = serve(eng, [req("a", a, 8)], 4)
    assert oa.kv_tokens == len(a) + 3 and eng.kept() == {"a": len(a) + 3}  # paused in place
    serve(eng, [req("b", b, 4)], 4)
    assert eng.take_evicted() == ["a"] and eng.kept() == {}
    (oa2,), stats = serve(eng, [req("a", a + oa.token_ids, 4, generated=4)], 4)
    assert (stats.prefill_tokens, stats.reused_tokens) == (len(a) + 4, 0)
    assert oa.token_ids + oa2.token_ids == one_pass(hf, [a], 8)[0]


def test_a_spill_with_no_device_memory_drops_the_kv_and_the_newcomer_still_runs(hf, monkeypatch) -> None:
    """The store's copies may find no device memory (the arena takes most of it): the paused
    row's KV is dropped and reported evicted, the joining row takes its slot and runs, the
    account says so, and the paused request's next grant prefills again, with the one-pass
    tokens. Nothing fails."""
    eng = make(static_share=0.5, mem_budget=80 * DELTA)

    def no_memory(*_a: Any, **_k: Any) -> Any:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")

    a, b = contexts(2, 20, 21, seed=11)
    (oa,), _ = serve(eng, [req("a", a, 8)], 4)
    assert set(eng.rows.paused) == {"a"}
    monkeypatch.setattr(eng.rows.runner, "cut", no_memory)
    (ob,), _ = serve(eng, [req("b", b, 4)], 4)  # needs a's room
    assert ob.error is None and ob.token_ids == one_pass(hf, [b], 4)[0]
    assert eng.take_evicted() == ["a"] and eng.kept() == {} and eng.rows.paused == {}
    assert eng.rows.counts["spill_oom"] == 1 and "1 spills dropped for want of device memory" in eng.rows.account()
    monkeypatch.undo()
    (oa2,), stats = serve(eng, [req("a", a + oa.token_ids, 4, generated=4)], 4)
    assert (stats.prefill_tokens, stats.reused_tokens) == (len(a) + 4, 0)
    assert oa.token_ids + oa2.token_ids == one_pass(hf, [a], 8)[0]


def test_release_and_cancel_of_a_paused_row_free_its_slot(hf) -> None:
    eng = make(static_share=0.5, mem_budget=80 * DELTA)  # 40 token slots: a paused row leaves no room for another
    a, b, c = contexts(3, 20, 21, seed=12)
    (oa,), _ = serve(eng, [req("a", a, 8)], 4)
    eng.release(["a"])
    assert eng.kept() == {}  # at once, for the daemon; the slot is free at the next turn
    serve(eng, [req("b", b, 8)], 4)
    assert eng.rows.counts["spilled"] == 0 and set(eng.rows.paused) == {"b"} and eng.kv is not None
    assert eng.kv.held() == {}
    # b's next grant is cancelled while it waits: it ends cancelled and b's paused KV is gone.
    nxt = BatchMsg(batch_id=next(_bids), slice_len=4, requests=[req("b", b + [5, 6, 7, 8], 4, generated=4)])
    eng.submit(nxt)
    eng.cancel([(nxt.batch_id, "b")])
    (end,) = done_of(run_until(eng, done_of, limit=3))
    assert end.outputs[0].finish_reason == "cancelled" and end.outputs[0].token_ids == []
    assert eng.kept() == {} and eng.rows.paused == {}
    (oc,), _ = serve(eng, [req("c", c, 8)], 4)
    assert eng.rows.counts["spilled"] == 0 and oc.token_ids == one_pass(hf, [c], 4)[0]
    eng.release(None)
    eng.poll(0.0)
    assert eng.kept() == {} and eng.rows.paused == {}


def test_returning_rows_join_ahead_of_newcomers_prefill_turns(hf) -> None:
    """One prefill turn holds one newcomer (``prefill_chunk_tokens`` 8): a request returning
    to its paused KV, queued after two newcomers, still takes the first step."""
    eng = make(prefill_chunk_tokens=8)
    r, n1, n2 = contexts(3, 20, 21, seed=13)
    (o,), _ = serve(eng, [req("r", r, 8)], 4)
    eng.submit(BatchMsg(batch_id=next(_bids), slice_len=4, requests=[req("n1", n1, 4)]))
    eng.submit(BatchMsg(batch_id=next(_bids), slice_len=4, requests=[req("n2", n2, 4)]))
    eng.submit(BatchMsg(batch_id=next(_bids), slice_len=4, requests=[req("r", r + o.token_ids, 4, generated=4)]))
    first = eng.poll(0.0)
    assert len(tokens_of(first, "r")) == 1 and len(tokens_of(first, "n1")) == 1 and tokens_of(first, "n2") == []
    seen = first + run_until(eng, lambda s: len(done_of(s)) == 3)
    assert o.token_ids + tokens_of(seen, "r") == one_pass(hf, [r], 8)[0]
    assert tokens_of(seen, "n2") == one_pass(hf, [n2], 4)[0]


def test_a_row_ending_beside_others_does_not_drain_the_pipeline(hf, monkeypatch) -> None:
    """Rows in a bucket of 8: one ends (paused) while the other runs on; the step's rows stay
    as they are (no regroup, the ended row a ghost whose tokens are dropped) until the bucket
    or the columns change; its grant still ends as soon as its last token is read."""
    eng = make(static_buckets=True, graph_batch_sizes="8", graph_cache_tokens="64", prefill_chunk_tokens=64)
    eng.read_behind = True
    regroups = [0]
    real = eng.rows.regroup

    def counted() -> None:
        regroups[0] += 1
        real()

    monkeypatch.setattr(eng.rows, "regroup", counted)
    short, long = contexts(2, 10, 11, seed=14)
    eng.submit(BatchMsg(batch_id=1, slice_len=3, requests=[req("s", short, 9)]))
    eng.submit(BatchMsg(batch_id=2, slice_len=20, requests=[req("l", long, 20)]))
    seen = run_until(eng, lambda s: len(done_of(s)) == 1)
    assert done_of(seen)[0].batch.batch_id == 1 and len(tokens_of(seen, "l")) < 20
    assert regroups[0] == 1 and set(eng.kept()) == {"s"}
    seen += run_until(eng, done_of)
    assert regroups[0] == 1  # the long row ran to its end beside the ghost
    assert tokens_of(seen, "l") == one_pass(hf, [long], 20)[0]
    (o,), _ = serve(eng, [req("s", short + tokens_of(seen, "s"), 6, generated=3)], 6)
    assert tokens_of(seen, "s") + o.token_ids == one_pass(hf, [short], 9)[0]


# --------------------------------------------------------------------------- slots and copies


def apply(ops: list[Any], slots: list[Any]) -> list[Any]:
    """``order_moves``' ops on a list of slot contents (whole rows)."""
    spare = None
    out = list(slots)
    for op in ops:
        if op.kind == "move":
            out[op.dst] = out[op.src]
        elif op.kind == "save":
            spare = out[op.src]
        else:
            out[op.dst] = spare
    return out


@pytest.mark.parametrize("seed", range(40))
def test_placement_keeps_rows_in_range_and_its_copies_never_lose_a_row(seed: int) -> None:
    rng = random.Random(seed)
    cap = rng.randrange(4, 20)
    occupied = rng.sample(range(cap), rng.randrange(1, cap + 1))
    kinds = [rng.choice("rpz") for _ in occupied]  # running, to prefill, paused
    fresh = rng.randrange(0, 3)
    run_ = [(s, 5) for s, k in zip(occupied, kinds, strict=True) if k == "r"]
    pre = [(s, 5) for s, k in zip(occupied, kinds, strict=True) if k == "p"]
    par = [(s, 5) for s, k in zip(occupied, kinds, strict=True) if k == "z"]
    run_ += [(-1, 0)] * fresh
    if len(run_) + len(pre) + len(par) > cap:
        with pytest.raises(ValueError):
            place(run_, pre, par, cap)
        return
    pl = place(run_, pre, par, cap)
    k = len(run_) + len(pre)
    assert sorted(pl.running) == list(range(k)) and pl.running[len(run_):] == list(range(len(run_), k))
    assert all(k <= s < cap for s in pl.paused) and len(set(pl.paused)) == len(pl.paused)
    for (s, _), d in zip(run_, pl.running, strict=False):  # a running row already below len(run_) stays
        assert d == s or not 0 <= s < len(run_)
    for (s, _), d in zip(par, pl.paused, strict=True):  # a paused row already in [k, cap) stays
        assert d == s or not k <= s < cap
    before = list(range(cap))  # slot i holds row i
    after = apply(order_moves(pl.moves), before)
    for (s, _), d in zip(run_ + pre + par, pl.running + pl.paused, strict=True):
        if s >= 0:
            assert after[d] == s


def test_cycles_are_broken_with_one_saved_row() -> None:
    ops = order_moves([Move(0, 1, 3), Move(1, 2, 3), Move(2, 0, 3), Move(5, 4, 2), Move(4, 5, 2)])
    assert [op.kind for op in ops].count("save") == 2
    assert apply(ops, list(range(6))) == [2, 0, 1, 3, 5, 4]
    # Never two saved rows at once: a restore follows each save before the next save.
    kinds = [op.kind for op in ops if op.kind != "move"]
    assert kinds == ["save", "restore", "save", "restore"]


def test_the_runner_permutes_rows_of_the_arena() -> None:
    r = runner()
    gen = torch.Generator().manual_seed(0)
    for k, v in r.slot_views(0, 6, 16):
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
    before = [[(k[i, :, :9].clone(), v[i, :, :9].clone()) for k, v in r.slot_views(0, 6, 16)] for i in range(6)]
    moves = [Move(0, 3, 9), Move(3, 0, 9), Move(5, 1, 9), Move(1, 4, 9)]
    r.permute(order_moves(moves), 16)
    views = r.slot_views(0, 6, 16)
    for m in moves:
        for (k, v), (wk, wv) in zip(views, before[m.src], strict=True):
            assert torch.equal(k[m.dst, :, :9], wk) and torch.equal(v[m.dst, :, :9], wv)
    for (k, v), (wk, wv) in zip(views, before[2], strict=True):  # untouched
        assert torch.equal(k[2, :, :9], wk) and torch.equal(v[2, :, :9], wv)


def test_new_tokens_come_before_the_grant_ends() -> None:
    """A paused row's grant ends at the read of its last token, after that token's stream."""
    eng = make()
    eng.submit(BatchMsg(batch_id=next(_bids), slice_len=3, requests=[req("x", [5, 6, 7], 9)]))
    seen = run_until(eng, done_of)
    last = max(i for i, ev in enumerate(seen) if isinstance(ev, NewTokens))
    assert seen.index(done_of(seen)[0]) > last and len(tokens_of(seen, "x")) == 3
    assert done_of(seen)[0].outputs[0].kv_tokens == 5 and not eng.busy()


def test_without_chunks_a_turn_prefills_one_grant_and_returning_rows_come_with_it(hf) -> None:
    """No ``prefill_chunk_tokens`` (the CPU): a turn prefills the newcomers of one grant only, so
    a burst of grants is not one long stall; a returning row needs no prefill and joins at once."""
    eng = make()
    r, n1, n2 = contexts(3, 20, 21, seed=15)
    (o,), _ = serve(eng, [req("r", r, 8)], 4)
    for rows in ([req("n1", n1, 4), req("n1b", n2, 4)], [req("n2", n2, 4)],
                 [req("r", r + o.token_ids, 4, generated=4)]):
        eng.submit(BatchMsg(batch_id=next(_bids), slice_len=4, requests=rows))
    first = eng.poll(0.0)
    assert [len(tokens_of(first, x)) for x in ("r", "n1", "n1b", "n2")] == [1, 1, 1, 0]
    seen = first + run_until(eng, lambda s: len(done_of(s)) == 3)
    assert tokens_of(seen, "n2") == one_pass(hf, [n2], 4)[0]
    assert o.token_ids + tokens_of(seen, "r") == one_pass(hf, [r], 8)[0]


def test_a_lone_row_too_large_for_the_arena_ends_on_an_idle_engine() -> None:
    eng = make(static_share=0.5, mem_budget=80 * DELTA)  # 40 token slots
    eng.submit(BatchMsg(batch_id=next(_bids), slice_len=8, requests=[req("big", [7] * 60, 8)]))
    (end,) = done_of(run_until(eng, done_of, limit=3))
    assert end.outputs[0].error is not None and "arena holds 40" in end.outputs[0].error and not eng.busy()


def test_the_account_counts_the_steps_kv_reads_the_rows_own_and_relayouts(caplog) -> None:
    """Each decode step reads its bucket's rows × the columns per slot; the rows' own columns
    are each one's KV up to its current token; a row that needs wider slots while another
    runs moves both (one relayout). The account at close says all three."""
    eng = make(static_buckets=True, graph_batch_sizes="2,8", graph_cache_tokens="32,64")
    eng.read_behind = False
    a, b = contexts(2, 12, 13, seed=5)
    (out,), _ = serve(eng, [req("a", a, 5)], 5)
    assert len(out.token_ids) == 5
    # Context 12, 5 tokens: rows of 12 + 5 columns take the 32-column bucket, 2 rows (1 a dummy).
    t = eng.rows.tally
    assert (t.steps, t.cols_read, t.cols_own) == (5, 5 * 2 * 32, 12 + 13 + 14 + 15 + 16)
    # The rest, by why: the bucket's dummy row, the bucket above the row's need of 17 columns,
    # and the columns of its slice not written yet at each step (17 - 12, ..., 17 - 16).
    assert t.pad == {"dummy rows": 5 * 32, "ended rows": 0, "above the widest row": 5 * (32 - 17),
                     "the widest row over the others": 0, "slices not yet written": 5 + 4 + 3 + 2 + 1}
    assert t.shapes == {(2, 32): 5}
    assert eng.rows.counts["relayouts"] == 0
    eng.submit(BatchMsg(batch_id=next(_bids), slice_len=8, requests=[req("a2", a, 8)], kv_reuse=False))
    seen = run_until(eng, lambda s: len(tokens_of(s, "a2")) >= 2)
    # b needs 36 + 8 columns: both rows move to 64-column slots.
    eng.submit(BatchMsg(batch_id=next(_bids), slice_len=8, requests=[req("b", b + a + a, 8)], kv_reuse=False))
    seen += run_until(eng, lambda s: len(done_of(s)) == 2)
    assert tokens_of(seen, "b") and eng.rows.counts["relayouts"] == 1
    with caplog.at_level("INFO", logger="worker.engines.hf_static_cb"):
        eng.close()
    read, own = t.cols_read / t.steps, 100 * t.cols_own / t.cols_read
    assert f"{read:.0f} KV columns read per step, {own:.0f} % of them the rows' own; 1 relayouts" in caplog.text
    # a2 (20 columns) beside b (44) read as wide as b; every column read is the rows' own or counted once.
    assert t.pad["the widest row over the others"] > 0 and sum(t.pad.values()) == t.cols_read - t.cols_own
    assert f"padding read per step: dummy rows {t.pad['dummy rows'] / t.steps:.0f}, ended rows " in caplog.text
    # Which buckets the steps ran in, the busiest first: the relayout took them to 64 columns.
    assert sum(t.shapes.values()) == t.steps and {c for _, c in t.shapes} == {32, 64}
    assert f"; steps by shape: {t.busiest()}" in caplog.text and t.busiest().startswith("2×")
    # The turns that had work took time, and more of it than their prefills.
    ms = 1000 * (t.turns_s - t.prefill_s) / t.steps
    assert t.turns_s > t.prefill_s > 0 and f"s in turns: {ms:.1f} ms a step besides prefill" in caplog.text


def test_rows_the_arena_holds_between_two_buckets_step_in_a_bucket(hf) -> None:
    """320 token slots: at 64 columns the arena holds 5 rows, not the next bucket's 8, so 3 rows
    of 64 columns step in a bucket of 5 (2 dummies) rather than in a shape of their own (eager
    on CUDA), with ``hf``'s tokens; a row wider than every cache bucket steps outside them, and
    the account says how often that happened."""
    eng = make(static_buckets=True, graph_batch_sizes="2,8", graph_cache_tokens="32,64", static_share=0.5, mem_budget=640 * DELTA)
    eng.read_behind = False
    assert eng.static.arena.tokens == 320 and (5, 64) in eng.static.buckets()
    ctx = contexts(3, 40, 48, seed=11)
    outs, _ = serve(eng, [req(f"r{i}", c, 8) for i, c in enumerate(ctx)], 8)
    assert [o.token_ids for o in outs] == one_pass(hf, ctx, 8)
    t = eng.rows.tally
    assert (t.steps, t.loose, t.cols_read) == (8, 0, 8 * 5 * 64)
    wide = contexts(1, 70, 71, seed=12)
    (out,), _ = serve(eng, [req("w", wide[0], 4)], 4)
    assert out.token_ids == one_pass(hf, wide, 4)[0] and (t.steps, t.loose) == (12, 4)
    # A regroup per grant: the rows join (the second's also sends the first's ghosts away).
    assert "4 steps outside the buckets, 2 regroups" in eng.rows.account()


def test_rows_in_a_bucket_take_no_row_that_would_make_them_step_outside_one(hf) -> None:
    """320 token slots hold 5 rows of 64 columns in a bucket; a 6th row of the same grant would
    fit only in the rows' own shape (6 × 48 columns, eager on CUDA), so it waits for room in a
    bucket and runs once the others end, every row with ``hf``'s tokens."""
    eng = make(static_buckets=True, graph_batch_sizes="2,8", graph_cache_tokens="32,64", static_share=0.5, mem_budget=640 * DELTA)
    eng.read_behind = False
    ctx = contexts(6, 38, 41, seed=13)
    outs, _ = serve(eng, [req(f"r{i}", c, 8) for i, c in enumerate(ctx)], 8)
    assert [o.token_ids for o in outs] == one_pass(hf, ctx, 8)
    t = eng.rows.tally
    assert t.loose == 0 and eng.rows.waited_rows == 1
    assert (t.steps, t.cols_read) == (16, 8 * 5 * 64 + 8 * 2 * 64)
