"""``hf-static-cb`` with ``share_prefixes``: a finished row's KV kept as a cached prefix where
another recent row began alike, and a later row of another request that begins with it starting
from a copy (tiny random Llama on the CPU, held to ``hf``'s tokens in one pass)."""

from __future__ import annotations

import queue
import random
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from sclsd.protocol import BatchMsg  # noqa: E402
from unit.arena_common import hf_engine, make, next_batch_id, one_pass, req, serve  # noqa: E402
from unit.engine_loop import queue_take, run  # noqa: E402
from worker.engines.hf_static_cb import HFStaticCBEngine  # noqa: E402

GEN = 12


@pytest.fixture(scope="module")
def hf() -> Any:
    return hf_engine()


@pytest.fixture(scope="module")
def sharing() -> HFStaticCBEngine:
    return make()  # share_prefixes is on by default


@pytest.fixture
def clean(sharing: HFStaticCBEngine) -> HFStaticCBEngine:
    if sharing.rows.slots and not sharing.rows.live():
        sharing.rows.regroup()  # another test's rows that ended leave their slots (and are cached)
    sharing.release()  # no prefix or kept KV from another test
    sharing.rows.apply_releases()
    assert sharing.kv is not None and sharing.kv.prefixes() == []
    return sharing


def ctx(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


def test_a_context_that_begins_with_another_requests_starts_from_its_kv(hf, clean) -> None:
    """Finished requests leave their KV (prompt and what they generated and fed) once their
    slots are reused; a later request whose context begins with one copies the longest,
    prefills only the rest, counts it as reused (the daemon's ``usage.cached_tokens``) and gives
    ``hf``'s tokens of the whole context in one pass. A batch without kv_reuse, or a row that
    scores its prompt, takes none."""
    eng = clean
    assert eng.kv is not None
    prompt = ctx(1, 40)
    (lone,), _ = serve(eng, [req("lone", ctx(2, 30), GEN)], GEN)
    first, stats = serve(eng, [req("first", prompt, GEN), req("twin", prompt[:20] + ctx(3, 10), GEN)], GEN)
    assert [o.reused_tokens for o in first] == [0, 0] and stats.reused_tokens == 0
    assert eng.kv.prefixes() == [30 + GEN - 1]  # "lone", cached when these rows took its slot
    longer = prompt + first[0].token_ids[:3] + ctx(4, 5)
    (got,), stats = serve(eng, [req("second", longer, GEN)], GEN)
    # Rows that ended are cached when the next rows regroup, before their slots are reused.
    assert sorted(eng.kv.prefixes()) == [30 + GEN - 1, 20 + 10 + GEN - 1, 40 + GEN - 1]
    assert got.reused_tokens == stats.reused_tokens == 43  # the prompt and 3 tokens it fed
    assert stats.prefill_tokens == len(longer) - 43
    assert got.token_ids == one_pass(hf, [longer], GEN)[0]
    assert eng.rows.counts["shared"] >= 1 and eng.kv.prefix_counts["tokens"] >= 43
    (plain,), _ = serve(eng, [req("plain", longer, GEN)], GEN, kv_reuse=False)
    assert plain.reused_tokens == 0 and plain.token_ids == got.token_ids
    (scored,), _ = serve(eng, [req("scored", longer, 2, prompt_logprobs=0)], 2)
    assert scored.reused_tokens == 0 and len(scored.prompt_logprobs) == len(longer) - 1


def test_a_prompt_sent_again_prefills_nothing(hf, clean) -> None:
    """The same prompt again (its row's KV cached once two rows began so) takes every token but
    the last from the cached prefix, as a request's own kept KV would, and gives ``hf``'s tokens;
    rows of one grant that begin alike each take it, beside rows that take none."""
    eng = clean
    prompt = ctx(5, 33)
    serve(eng, [req("a", prompt, GEN), req("b", prompt, GEN)], GEN)
    outs, stats = serve(eng, [req(f"again{i}", prompt, GEN) for i in range(3)] + [req("other", ctx(6, 25), GEN)], GEN)
    assert [o.reused_tokens for o in outs] == [32, 32, 32, 0]
    assert stats.prefill_tokens == 25
    want = one_pass(hf, [prompt, ctx(6, 25)], GEN)
    assert [o.token_ids for o in outs] == [want[0]] * 3 + [want[1]]
    # Seeded sampling draws what it draws from a full prefill of the same context.
    seeded = {"temperature": 1.0, "top_p": 0.9, "seed": 7}
    (shared,), _ = serve(eng, [req("seeded", prompt, GEN, **seeded)], GEN)
    (fresh,), _ = serve(eng, [req("fresh", prompt, GEN, **seeded)], GEN, kv_reuse=False)
    assert shared.reused_tokens == 32 and fresh.reused_tokens == 0 and shared.token_ids == fresh.token_ids


def test_rows_joining_mid_run_take_prefixes_and_kept_kv_is_untouched(hf, clean) -> None:
    """Through the worker's loop, grants arriving while others run: a chat's next turn starts
    from its cached turn before, a request in slices keeps its own KV between them (its paused
    row is never cached; its grants after the first prefill nothing), and every row gives
    ``hf``'s tokens of its whole context."""
    eng = clean
    assert eng.kv is not None
    system = ctx(7, 24)
    turns = [system + ctx(10 + i, 8) for i in range(4)]
    firsts, _ = serve(eng, [req(f"t{i}", t, GEN) for i, t in enumerate(turns)], GEN)  # four chats' first turns
    nexts = [t + o.token_ids + ctx(20 + i, 6) for i, (t, o) in enumerate(zip(turns, firsts, strict=True))]
    long_ctx, total, s = system + ctx(30, 9), 30, 10
    got: dict[str, list[int]] = {"long": []}
    outs: dict[str, Any] = {}
    q: queue.Queue[Any] = queue.Queue()

    def grant(reqs: list[Any], slice_len: int = GEN) -> None:
        q.put(BatchMsg(batch_id=next_batch_id(), slice_len=slice_len, requests=reqs))

    def put_long() -> None:
        n = len(got["long"])
        grant([req("long", long_ctx + got["long"], total - n, generated=n)], s)

    def done(batch: BatchMsg, res: Any, stats: Any, error: str | None) -> None:
        assert error is None
        for o in res:
            outs[o.rid] = (o, stats)
        if "long" in batch.requests[0].rid:
            (o,) = res
            if got["long"]:
                assert stats.prefill_tokens == 0  # its own KV, resumed
            else:
                assert (stats.reused_tokens, stats.prefill_tokens) == (len(system), 9)  # the chats' system prompt
            got["long"] += o.token_ids
            if o.finish_reason is None:
                assert eng.kept() == {"long": len(long_ctx) + len(got["long"]) - 1}
                put_long()
        if len(got["long"]) == total and all(f"n{i}" in outs for i in range(4)):
            q.put(None)

    grant([req(f"n{i}", c, GEN) for i, c in enumerate(nexts[:2])])
    put_long()
    take = queue_take(q)
    later = [True]

    def take_and_admit(timeout: float | None) -> Any:
        item = take(timeout)
        if later[0]:
            later[0] = False
            grant([req(f"n{i}", c, GEN) for i, c in enumerate(nexts[2:], 2)])
        return item

    run(eng, take_and_admit, done)
    want = one_pass(hf, [*nexts, long_ctx], max(GEN, total))
    for i in range(4):
        o, _ = outs[f"n{i}"]
        assert o.token_ids == want[i][:GEN]
        assert o.reused_tokens == len(turns[i]) + GEN - 1  # the turn before: prompt and answer
    assert got["long"] == want[4][:total]
    assert eng.kept() == {}


def test_turned_off_nothing_is_cached(sharing) -> None:
    assert sharing.caps().shared_prefixes  # on by default
    eng = make(share_prefixes=False)
    try:
        prompt = ctx(8, 30)
        serve(eng, [req("a", prompt, 4), req("b", prompt, 4)], 4)
        (again,), _ = serve(eng, [req("c", prompt, 4)], 4)
        assert again.reused_tokens == 0 and eng.kv is not None and eng.kv.prefixes() == []
        assert not eng.caps().shared_prefixes
    finally:
        eng.close()


def test_cut_rows_own_their_memory(clean) -> None:
    """A row cut out to the store holds its own copy: dropping the others' entries gives their
    memory back, and the bytes the store counts are the bytes held (a gather for several rows
    with the rows as its views held them all until the last went)."""
    eng = clean
    runner = eng.static
    cuts = runner.cut([0, 2], [20, 7], 3, 32)
    for (kv, nbytes), n in zip(cuts, [20, 7], strict=True):
        held = sum(k.untyped_storage().nbytes() + v.untyped_storage().nbytes() for k, v in kv)
        assert held == nbytes == n * eng.delta
        assert all(k.shape[2] == n for k, _ in kv)


def test_prefixes_are_cut_only_into_room_the_store_has(clean, monkeypatch) -> None:
    """The copies are made before the store takes them, so room is made first (older prefixes
    go) and only what fits beside the kept KV is cut: the device never holds more than the
    store's budget, which is what a prefill's activations are sized beside."""
    eng = clean
    kv = eng.kv
    assert kv is not None
    monkeypatch.setattr(kv, "budget", 50 * eng.delta)  # room for two 20-token prefixes, not three
    real_cut = eng.static.cut
    seen: list[int] = []

    def cut(slots: Any, lens: Any, rows: int, c: int) -> Any:
        seen.append(kv.nbytes + sum(lens) * eng.delta)
        return real_cut(slots, lens, rows, c)

    monkeypatch.setattr(eng.static, "cut", cut)
    for i in range(3):
        serve(eng, [req(f"p{i}a", ctx(20 + i, 17), 4), req(f"p{i}b", ctx(30 + i, 17), 4),
                    req(f"p{i}c", ctx(40 + i, 17), 4)], 4)
    assert seen and max(seen) <= kv.budget
    assert kv.nbytes <= kv.budget and len(kv.prefixes()) == 2


def test_a_turn_out_of_device_memory_drops_the_cached_prefixes(hf, clean, monkeypatch, caplog) -> None:
    """A turn that runs out of device memory fails the grants in flight (as any failing turn),
    and the cached prefixes give their memory back and may hold half of it from then on, so
    the next turns have room again and a cache filling up leaves room free; after a quiet
    while (PREFIX_REGROW_S, the engine's clock) they may hold more again."""
    from worker.engines import arena_share
    from worker.engines.kvstore import PREFIX_REGROW_S

    clock = {"now": 1000.0}
    monkeypatch.setattr(arena_share, "monotonic", lambda: clock["now"])  # the prefixes' clock alone
    eng = clean
    kv = eng.kv
    assert kv is not None
    serve(eng, [req("x", ctx(50, 30), 4)], 4)
    serve(eng, [req("y", ctx(51, 30), 4)], 4)  # "x" is cached as this one joins
    assert kv.prefixes()
    real = eng.static.prefill
    calls = {"n": 0}

    def prefill(*args: Any, **kw: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            calls["held"] = kv.prefix_bytes  # "y" too, cached as "z" joined
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        real(*args, **kw)

    monkeypatch.setattr(eng.static, "prefill", prefill)
    before = eng.rows.counts["oom_turns"]
    with pytest.raises(torch.OutOfMemoryError):
        serve(eng, [req("z", ctx(52, 30), 4)], 4)
    assert kv.prefixes() == [] and eng.rows.counts["oom_turns"] == before + 1
    assert calls["held"] > 0 and kv.prefix_limit == calls["held"] // 2 < kv.budget
    assert "turns out of device memory, cached prefixes held to 0.00 GiB since" in eng.rows.account()
    prompt = ctx(53, 30)
    (again,), _ = serve(eng, [req("w", prompt, 4)], 4)
    assert again.token_ids == one_pass(hf, [prompt], 4)[0]
    serve(eng, [req("v", ctx(54, 30), 4)], 4)  # "w" is cached as this one joins, within the limit
    assert kv.prefixes() and kv.prefix_bytes <= kv.prefix_limit
    limit = kv.prefix_limit
    clock["now"] += PREFIX_REGROW_S
    with caplog.at_level("INFO", logger="worker"):
        serve(eng, [req("u", ctx(55, 30), 4)], 4)  # "v" is cached as this one joins: the limit grew first
    assert kv.prefix_limit == min(kv.budget, max(2 * limit, limit + kv.budget // 8)) > limit
    assert "no turn out of device memory for 600 s: cached prefixes may hold" in caplog.text
