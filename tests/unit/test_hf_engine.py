"""HFEngine on the tiny random Llama: slicing invariant, sampling, stops, stats."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from sclsd.protocol import BatchMsg, BatchRequest  # noqa: E402
from worker.engines import create_engine  # noqa: E402
from worker.engines.hf import HFEngine  # noqa: E402

GEN = 20
BUDGET = 123 * 1024**2


@pytest.fixture(scope="module")
def engine() -> HFEngine:
    # Two CPU threads at most: the test machine is shared.
    eng = create_engine("hf", "tiny-random", threads=1, mem_budget=BUDGET)
    assert isinstance(eng, HFEngine)
    return eng


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in (5, 23, 1, 12, 40)]


def req(rid: object, ids: list[int], max_new: int = GEN, **kw: object) -> BatchRequest:
    kw.setdefault("temperature", 0.0)
    return BatchRequest(rid=str(rid), token_ids=list(ids), max_new_tokens=max_new, **kw)


def serve(engine: HFEngine, slice_len: int, reqs: list[BatchRequest]):
    return engine.serve(BatchMsg(batch_id=1, slice_len=slice_len, requests=reqs))


def one_pass(engine: HFEngine, prompts: list[list[int]], **kw: object) -> list[list[int]]:
    outs, _ = serve(engine, GEN, [req(i, p, ignore_eos=True, **kw) for i, p in enumerate(prompts)])
    return [o.token_ids for o in outs]


def sliced(engine: HFEngine, prompts: list[list[int]], s: int, **kw: object) -> list[list[int]]:
    """Serve in slices of ``s``: re-prefill prompt + generated ids, as the daemon does."""
    gen: list[list[int]] = [[] for _ in prompts]
    for _ in range(GEN):  # enough rounds for s >= 1
        live = [i for i in range(len(prompts)) if len(gen[i]) < GEN]
        if not live:
            break
        reqs = [
            req(
                i,
                prompts[i] + gen[i],
                GEN - len(gen[i]),
                generated=len(gen[i]),
                ignore_eos=True,
                **kw,
            )
            for i in live
        ]
        outs, stats = serve(engine, s, reqs)
        assert stats.iterations <= s
        for i, out in zip(live, outs, strict=True):
            assert len(out.token_ids) <= s
            gen[i] += out.token_ids
            assert out.finish_reason == ("length" if len(gen[i]) == GEN else None)
    return gen


@pytest.mark.parametrize("s", [1, 3, 7])
def test_greedy_sliced_equals_one_pass(engine, prompts, s):
    ref = one_pass(engine, prompts)
    assert all(len(r) == GEN for r in ref)
    assert sliced(engine, prompts, s) == ref


def test_batched_equals_unpadded_alone(engine, prompts):
    # Left padding must not change a row: each row alone (no padding) gives the same tokens.
    ref = one_pass(engine, prompts)
    for p, r in zip(prompts, ref, strict=True):
        assert one_pass(engine, [p]) == [r]
    # And the output actually depends on the prompt (the model is not degenerate).
    assert len({tuple(r) for r in ref}) == len(ref)


def test_seeded_sampling_sliced_equals_one_pass(engine, prompts):
    kw = {"temperature": 0.9, "top_p": 0.95, "top_k": 100, "seed": 42}
    ref = one_pass(engine, prompts, **kw)
    assert ref != one_pass(engine, prompts)  # sampling differs from greedy
    assert sliced(engine, prompts, 3, **kw) == ref
    assert one_pass(engine, prompts, **{**kw, "seed": 43}) != ref


def test_top_k_one_is_greedy(engine, prompts):
    kw = {"temperature": 1.5, "top_k": 1, "seed": 1}
    assert one_pass(engine, prompts, **kw) == one_pass(engine, prompts)


def test_stop_token_ids(engine, prompts):
    ref = one_pass(engine, prompts[:1])[0]
    stop = ref[3]
    cut = ref.index(stop)
    outs, _ = serve(engine, GEN, [req("a", prompts[0], stop_token_ids=[stop])])
    assert outs[0].token_ids == ref[: cut + 1]  # the stop token is included
    assert outs[0].finish_reason == "stop"


def test_eos_unless_ignore_eos(engine, prompts, monkeypatch):
    ref = one_pass(engine, prompts[:1])[0]
    monkeypatch.setattr(engine, "eos", [ref[2]])
    outs, _ = serve(engine, GEN, [req("a", prompts[0]), req("b", prompts[0], ignore_eos=True)])
    assert outs[0].token_ids == ref[: ref.index(ref[2]) + 1]
    assert outs[0].finish_reason == "stop"
    assert outs[1].token_ids == ref
    assert outs[1].finish_reason == "length"


def test_max_new_tokens_gives_length(engine, prompts):
    outs, stats = serve(engine, 50, [req("a", prompts[1], 4, ignore_eos=True)])
    assert len(outs[0].token_ids) == 4
    assert outs[0].finish_reason == "length"
    assert stats.iterations == 4


def test_slice_end_leaves_reason_none(engine, prompts):
    outs, stats = serve(engine, 3, [req("a", prompts[1], 10, ignore_eos=True)])
    assert len(outs[0].token_ids) == 3
    assert outs[0].finish_reason is None
    assert stats.iterations == 3


def test_early_stop_and_invalid_tokens(engine, prompts):
    reqs = [
        req("a", prompts[0], 2, ignore_eos=True),
        req("b", prompts[1], 5, ignore_eos=True),
        req("c", prompts[2], 1, ignore_eos=True),
    ]
    outs, stats = serve(engine, 50, reqs)
    assert [len(o.token_ids) for o in outs] == [2, 5, 1]
    assert [o.finish_reason for o in outs] == ["length"] * 3
    # Stops after 5 iterations, not 50. Decode passes 2..5 run "c" (done after 1):
    # 4 invalid; passes 3..5 run "a" (done after 2): 3 invalid.
    assert stats.iterations == 5
    assert stats.invalid_tokens == 4 + 3
    assert stats.batch_size == 3


def test_pad_tokens_and_input_len(engine, prompts):
    lens = [len(p) for p in prompts]
    _, stats = serve(engine, 2, [req(i, p, ignore_eos=True) for i, p in enumerate(prompts)])
    assert stats.input_len == max(lens)
    assert stats.pad_tokens == sum(max(lens) - x for x in lens)
    assert stats.prefill_s > 0 and stats.decode_s > 0
    assert stats.peak_memory > 0


def test_info(engine):
    info = engine.info()
    assert info.engine == "hf"
    assert info.model == "tiny-random"
    assert info.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    assert info.mem_available == BUDGET
    assert info.eos_token_ids == [2]


def test_empty_batch_and_empty_context(engine):
    outs, stats = serve(engine, 4, [])
    assert outs == [] and stats.iterations == 0
    with pytest.raises(ValueError, match="empty context"):
        serve(engine, 4, [req("a", [])])
