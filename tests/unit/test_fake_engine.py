"""FakeEngine: deterministic tokens, natural stops, slicing equivalence, stats."""

from __future__ import annotations

import pytest

from sclsd.protocol import BatchMsg, BatchRequest
from worker.engines import create_engine
from worker.engines.fake import EOS_ID, FakeEngine

PROMPTS = [[5, 6, 7], [9] * 11, [42], list(range(3, 40)), [1], [4]]


def req(rid: object, ids: list[int], max_new: int = 200, **kw: object) -> BatchRequest:
    kw.setdefault("temperature", 0.0)
    return BatchRequest(rid=str(rid), token_ids=list(ids), max_new_tokens=max_new, **kw)


def serve(eng: FakeEngine, s: int, reqs: list[BatchRequest]):
    return eng.serve(BatchMsg(batch_id=3, slice_len=s, requests=reqs))


def run_sliced(eng: FakeEngine, prompts, s: int, max_new: int = 200, **kw):
    """Serve like the daemon: re-submit prompt + generated until each row finishes."""
    gen: list[list[int]] = [[] for _ in prompts]
    reasons: list[str | None] = [None] * len(prompts)
    while any(r is None for r in reasons):
        live = [i for i, r in enumerate(reasons) if r is None]
        reqs = [
            req(i, prompts[i] + gen[i], max_new - len(gen[i]), generated=len(gen[i]), **kw)
            for i in live
        ]
        outs, stats = serve(eng, s, reqs)
        assert stats.iterations <= s
        for i, out in zip(live, outs, strict=True):
            gen[i] += out.token_ids
            reasons[i] = out.finish_reason
    return gen, reasons


@pytest.fixture
def eng() -> FakeEngine:
    e = create_engine("fake")
    assert isinstance(e, FakeEngine)
    return e


@pytest.mark.parametrize("s", [1, 3, 7])
def test_sliced_equals_one_pass(eng, s):
    ref, ref_reasons = run_sliced(eng, PROMPTS, 1000)
    assert all(r == "stop" for r in ref_reasons)
    assert run_sliced(eng, PROMPTS, s) == (ref, ref_reasons)


def test_natural_stop_and_ignore_eos(eng):
    for p in PROMPTS:
        n = eng.natural_length(p)
        assert 1 <= n <= 64
        outs, _ = serve(eng, 100, [req("a", p), req("b", p, 80, ignore_eos=True)])
        assert len(outs[0].token_ids) == n
        assert outs[0].token_ids[-1] == EOS_ID
        assert EOS_ID not in outs[0].token_ids[:-1]
        assert outs[0].finish_reason == "stop"
        assert len(outs[1].token_ids) == 80 and outs[1].finish_reason == "length"
        assert EOS_ID not in outs[1].token_ids
        # The tokens before EOS are the same either way: a function of the context.
        assert outs[1].token_ids[: n - 1] == outs[0].token_ids[:-1]


def test_tokens_depend_on_context_and_stay_in_vocab(eng):
    outs, _ = serve(eng, 30, [req(i, p, 30, ignore_eos=True) for i, p in enumerate(PROMPTS)])
    seqs = [tuple(o.token_ids) for o in outs]
    assert len(set(seqs)) == len(seqs)
    assert all(3 <= t < eng.vocab for s in seqs for t in s)


def test_max_new_tokens_and_slice_len(eng):
    outs, stats = serve(
        eng, 5, [req("a", [7, 8], 3, ignore_eos=True), req("b", [7], 50, ignore_eos=True)]
    )
    assert len(outs[0].token_ids) == 3 and outs[0].finish_reason == "length"
    assert len(outs[1].token_ids) == 5 and outs[1].finish_reason is None
    assert stats.iterations == 5
    assert stats.invalid_tokens == 2  # "a" is computed in iterations 4 and 5


def test_stop_token_ids(eng):
    ref, _ = serve(eng, 20, [req("a", [3, 4], 20, ignore_eos=True)])
    stop = ref[0].token_ids[4]
    outs, _ = serve(eng, 20, [req("a", [3, 4], 20, ignore_eos=True, stop_token_ids=[stop])])
    assert outs[0].token_ids == ref[0].token_ids[: ref[0].token_ids.index(stop) + 1]
    assert outs[0].finish_reason == "stop"


def test_seeded_sampling(eng):
    greedy = serve(eng, 20, [req("a", [3], 20, ignore_eos=True)])[0][0].token_ids
    a = serve(eng, 20, [req("a", [3], 20, ignore_eos=True, temperature=1.0, seed=5)])[0][0]
    b = serve(eng, 20, [req("a", [3], 20, ignore_eos=True, temperature=1.0, seed=5)])[0][0]
    c = serve(eng, 20, [req("a", [3], 20, ignore_eos=True, temperature=1.0, seed=6)])[0][0]
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids and a.token_ids != greedy


def test_stats_and_simulated_time():
    eng = FakeEngine(decode_s=0.002, prefill_s_per_token=0.0001, kv_bytes_per_token=100)
    outs, stats = serve(
        eng, 4, [req("a", [3] * 10, 50, ignore_eos=True), req("b", [3] * 4, 2, ignore_eos=True)]
    )
    assert [len(o.token_ids) for o in outs] == [4, 2]
    assert stats.batch_size == 2 and stats.input_len == 10 and stats.pad_tokens == 6
    assert stats.iterations == 4 and stats.invalid_tokens == 2
    assert stats.peak_memory == (10 + 4) * 2 * 100
    # Lower bounds only: sleeping never takes less than asked.
    assert stats.prefill_s >= 0.0001 * 2 * 10
    assert stats.decode_s >= 0.002 * 4


def test_info():
    info = FakeEngine(model="m", mem_budget=1000, kv_bytes_per_token=7).info()
    assert (info.engine, info.model, info.kv_bytes_per_token, info.mem_available) == (
        "fake",
        "m",
        7,
        1000,
    )
    assert info.eos_token_ids == [EOS_ID]
    assert info.vocab_size == 1000
    assert FakeEngine(vocab=77).info().vocab_size == 77


def test_errors(eng):
    with pytest.raises(ValueError, match="outside vocab"):
        serve(eng, 4, [req("a", [3, 10**6])])
    with pytest.raises(ValueError, match="empty context"):
        serve(eng, 4, [req("a", [])])
    assert serve(eng, 4, []) == ([], serve(eng, 4, [])[1])


def test_unknown_engine_lists_choices():
    with pytest.raises(ValueError, match="fake.*hf"):
        create_engine("nope")


def test_fake_profile_predicts_its_own_serving_time() -> None:
    from sclsd.core.profiles import Profile

    eng = FakeEngine(decode_s=0.01, prefill_s_per_token=0.001)
    est = Profile.from_dict(eng.profile()).estimator
    # A batch of 3 padded to 10 tokens, 4 iterations: 3·10·1 ms + 4·10 ms.
    assert est.t_serve(3, 10, 4) == pytest.approx(0.03 + 0.04)


def test_emits_each_iteration_after_its_sleep():
    import time

    eng = FakeEngine(decode_s=0.01)
    t0 = time.perf_counter()
    calls: list[tuple[float, list]] = []
    outs, stats = eng.serve(
        BatchMsg(batch_id=1, slice_len=5, requests=[req("a", [5, 6], 3, ignore_eos=True),
                                                    req("b", [7], 8, ignore_eos=True)]),
        lambda o: calls.append((time.perf_counter() - t0, o)),
    )
    assert len(calls) == stats.iterations == 5
    # The first tokens exist after one step, long before the slice's five.
    assert 0.01 <= calls[0][0] < stats.decode_s
    streamed = {o.rid: [] for o in outs}
    for _, c in calls:
        for o in c:
            streamed[o.rid] += o.token_ids
    assert streamed == {o.rid: o.token_ids for o in outs}
    assert [o.rid for o in calls[3][1]] == ["b"]  # a finished after 3


def test_modelled_kv_reuse_prefills_only_what_is_new():
    eng = FakeEngine(prefill_s_per_token=0.0)
    plain = FakeEngine(kv_reuse=False)
    gen, _ = run_sliced(eng, PROMPTS, 4, max_new=12, ignore_eos=True)
    assert gen == run_sliced(plain, PROMPTS, 4, max_new=12, ignore_eos=True)[0]
    outs, _ = serve(eng, 4, [req("x", PROMPTS[3], 10, ignore_eos=True)])
    assert outs[0].kv_tokens == len(PROMPTS[3]) + 3
    cont = req("x", PROMPTS[3] + outs[0].token_ids, 6, generated=4, ignore_eos=True)
    outs2, stats = serve(eng, 4, [cont, req("y", [8, 9], 6, ignore_eos=True)])
    assert stats.reused_tokens == len(PROMPTS[3]) + 3 and stats.prefill_tokens == 1 + 2
    assert serve(plain, 4, [req("x", PROMPTS[3], 10, ignore_eos=True)])[0][0].kv_tokens == 0
    eng.release(["x", "y"])
    assert eng.kv is not None and eng.kv.store.held() == {}


def test_min_tokens_delays_the_natural_end_in_slices_too() -> None:
    eng = FakeEngine(max_natural=4)
    natural = [eng.natural_length(p) for p in PROMPTS]
    gen, reasons = run_sliced(eng, PROMPTS, 3, max_new=50, min_tokens=10)
    for g, nat, why in zip(gen, natural, reasons, strict=True):
        assert len(g) == max(nat, 10) and g[-1] == EOS_ID and why == "stop"
        assert EOS_ID not in g[:-1]


def test_logit_bias_extremes_force_or_ban_a_token() -> None:
    eng = FakeEngine()
    (plain,), _ = serve(eng, 6, [req("p", [5, 6], 6, ignore_eos=True)])
    (banned,), _ = serve(eng, 6, [req("p", [5, 6], 6, ignore_eos=True, logit_bias={plain.token_ids[0]: -100.0})])
    assert banned.token_ids[0] != plain.token_ids[0]
    (forced,), _ = serve(eng, 6, [req("p", [5, 6], 6, ignore_eos=True, logit_bias={77: 100.0})])
    assert forced.token_ids == [77] * 6
