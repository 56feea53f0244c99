"""``hf-static-cb`` on CUDA: its decode steps captured as graphs at warm-up, rows writing their
own columns, the next step queued before a step's tokens are read; the tokens of ``hf``'s
eager loop in one pass, in grants that keep KV, and with rows leaving at different steps.

Skipped without CUDA (conftest.py). The CPU checks of the same engine are in
tests/unit/test_hf_static_cb.py and tests/unit/test_arena_rows.py.
"""

from __future__ import annotations

import pytest

from sclsd.protocol import BatchMsg, BatchRequest
from tests.gpu.test_cuda import GEN, prompts, serve, sliced

pytestmark = pytest.mark.gpu


def test_captured_row_steps_give_the_eager_tokens() -> None:
    from worker.engines import create_engine

    eager = create_engine("hf", "tiny-random", device="cuda:0", dtype="float32", static_cache=False, kv_reuse=False)
    ref = serve(eager, prompts())
    lens = [3, GEN, 7, 11]  # rows leave at different steps: slots freed, the last row moved
    reqs = [BatchRequest(rid=f"m{i}", token_ids=p, max_new_tokens=n, temperature=0.0, ignore_eos=True)
            for i, (p, n) in enumerate(zip(prompts(), lens, strict=True))]
    mixed_ref, _ = eager.serve(BatchMsg(batch_id=2, slice_len=GEN, requests=reqs, kv_reuse=False))
    eager.close()
    eng = create_engine("hf-static-cb", "tiny-random", device="cuda:0", dtype="float32",
                        graph_batch_sizes="1,2,4,8", graph_cache_tokens="64,128")
    try:
        steps: list[str] = []
        eng.warm_up(steps.append)
        assert eng.static.graphs_on and eng.read_behind
        assert eng.static.captured() == [(n, c) for n in (1, 2, 4, 8) for c in (64, 128)]
        caps = eng.info().caps
        assert caps.batching == "continuous" and caps.graph_batch_sizes == [1, 2, 4, 8]
        assert any("captured" in s for s in steps)
        geo = eng.static.geometry(3, 40)
        assert geo is not None and (geo.plan.n, geo.c, geo.plan.graph) == (4, 64, True)
        assert serve(eng, prompts()) == ref
        assert sliced(eng, prompts(), 5) == ref  # kept KV copied back into the arena each grant
        outs, _ = eng.serve(BatchMsg(batch_id=3, slice_len=GEN, requests=reqs, kv_reuse=False))
        assert [o.token_ids for o in outs] == [o.token_ids for o in mixed_ref]
    finally:
        eng.close()


def test_captured_flex_steps_give_the_eager_tokens() -> None:
    """``decode_attention = "flex"``: FlexAttention's compiled kernel inside the captured steps
    (its block mask rewritten from the rows' positions within each replay) gives the eager
    loop's tokens, with rows leaving at different steps; every bucket keeps its graph."""
    from worker.engines import create_engine

    eager = create_engine("hf", "tiny-random", device="cuda:0", dtype="float32", static_cache=False, kv_reuse=False)
    lens = [3, GEN, 7, 11]
    reqs = [BatchRequest(rid=f"f{i}", token_ids=p, max_new_tokens=n, temperature=0.0, ignore_eos=True)
            for i, (p, n) in enumerate(zip(prompts(), lens, strict=True))]
    ref, _ = eager.serve(BatchMsg(batch_id=4, slice_len=GEN, requests=reqs, kv_reuse=False))
    eager.close()
    eng = create_engine("hf-static-cb", "tiny-random", device="cuda:0", dtype="float32",
                        graph_batch_sizes="1,2,4,8", graph_cache_tokens="128,256", decode_attention="flex")
    try:
        eng.warm_up()
        assert eng.static.captured() == [(n, c) for n in (1, 2, 4, 8) for c in (128, 256)]
        assert all(s.blocks is not None for s in eng.static.steps.values())
        outs, _ = eng.serve(BatchMsg(batch_id=5, slice_len=GEN, requests=reqs, kv_reuse=False))
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    finally:
        eng.close()


def test_a_bucket_of_as_many_rows_as_the_arena_holds_is_captured_and_gives_the_eager_tokens() -> None:
    """An arena of a few hundred token slots: at each cache bucket where 16 rows do not fit, the
    most rows that do are a captured bucket too, and that many rows step in its graph with the
    eager loop's tokens, none outside the buckets."""
    import random

    from worker.engines import create_engine

    eng = create_engine("hf-static-cb", "tiny-random", device="cuda:0", dtype="float32",
                        graph_batch_sizes="2,16", graph_cache_tokens="32,64", static_share=2.5e-6)
    try:
        eng.warm_up()
        tokens = eng.static.arena.tokens
        most = tokens // 64
        assert 2 < most < 16, tokens  # the free memory sets the arena: it must be of this size
        assert eng.static.captured() == eng.static.bucket_shapes() and (most, 64) in eng.static.captured()
        rng = random.Random(7)
        ctx = [[rng.randrange(3, 49152) for _ in range(rng.randrange(36, 44))] for _ in range(most)]
        eager = create_engine("hf", "tiny-random", device="cuda:0", dtype="float32", static_cache=False,
                              kv_reuse=False)
        reqs = [BatchRequest(rid=f"b{i}", token_ids=c, max_new_tokens=8, temperature=0.0, ignore_eos=True)
                for i, c in enumerate(ctx)]
        ref, _ = eager.serve(BatchMsg(batch_id=6, slice_len=8, requests=reqs, kv_reuse=False))
        eager.close()
        outs, _ = eng.serve(BatchMsg(batch_id=7, slice_len=8, requests=reqs, kv_reuse=False))
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
        assert eng.rows.tally.loose == 0
    finally:
        eng.close()


@pytest.mark.parametrize("dtype, tol", [("float32", 2e-3), ("float16", 0.05)])
def test_arena_prompt_logprobs_on_cuda_match_a_full_forward(dtype: str, tol: float) -> None:
    """``prompt_logprobs`` on CUDA with the decode graphs captured: the start-up probe passes in
    the dtype, and each asking row's entries are the model's log-softmax of one full forward at
    the positions before its prompt tokens (in the dtype's precision); its tokens do not change."""
    import torch

    from worker.engines import create_engine

    eng = create_engine("hf-static-cb", "tiny-random", device="cuda:0", dtype=dtype,
                        graph_batch_sizes="1,2,4,8", graph_cache_tokens="64,128")
    try:
        eng.warm_up()
        assert eng.info().caps.prompt_logprobs and eng.static.graphs_on
        reqs = [BatchRequest(rid=f"p{i}", token_ids=p, max_new_tokens=4, temperature=0.0, ignore_eos=True,
                             prompt_logprobs=3 if i % 2 == 0 else None) for i, p in enumerate(prompts())]
        outs, _ = eng.serve(BatchMsg(batch_id=8, slice_len=4, requests=reqs, kv_reuse=False))
        plain = [BatchRequest(rid=f"q{i}", token_ids=p, max_new_tokens=4, temperature=0.0, ignore_eos=True)
                 for i, p in enumerate(prompts())]
        again, _ = eng.serve(BatchMsg(batch_id=9, slice_len=4, requests=plain, kv_reuse=False))
        assert [o.token_ids for o in outs] == [o.token_ids for o in again]
        for r, o in zip(reqs, outs, strict=True):
            if r.prompt_logprobs is None:
                assert o.prompt_logprobs == []
                continue
            with torch.inference_mode():
                ids = torch.tensor([r.token_ids], device="cuda:0")
                lp = torch.log_softmax(eng.model(input_ids=ids).logits[0].float(), dim=-1)[:-1].cpu()
            assert [e.chosen.id for e in o.prompt_logprobs] == r.token_ids[1:]
            for p, e in enumerate(o.prompt_logprobs):
                assert abs(e.chosen.logprob - lp[p, r.token_ids[p + 1]].item()) < tol
                assert all(abs(t.logprob - lp[p, t.id].item()) < tol for t in e.top) and len(e.top) == 3
    finally:
        eng.close()
