"""The static-cache path on CUDA: decode steps captured as graphs at warm-up, the same tokens
as the eager loop, one pass and in slices with kept KV; hf-cb starting with its defaults.

Skipped without CUDA (conftest.py). The CPU checks of the same path are in
tests/unit/test_hf_static.py (every step run eagerly over the same arena and buffers).
"""

from __future__ import annotations

import pytest

from tests.gpu.test_cuda import GEN, prompts, serve, sliced

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_captured_graphs_give_the_eager_tokens(dtype: str) -> None:
    from worker.engines import create_engine

    eager = create_engine("hf", "tiny-random", device="cuda:0", dtype=dtype, static_cache=False, kv_reuse=False)
    ref = serve(eager, prompts())
    eager.close()
    eng = create_engine("hf", "tiny-random", device="cuda:0", dtype=dtype,
                        graph_batch_sizes="1,2,4,8", graph_cache_tokens="64,128")
    steps: list[str] = []
    eng.warm_up(steps.append)
    assert eng.static is not None and eng.static.graphs_on
    assert eng.static.captured() == [(n, c) for n in (1, 2, 4, 8) for c in (64, 128)]
    caps = eng.info().caps
    assert caps.graph_batch_sizes == [1, 2, 4, 8] and caps.graph_cache_tokens == [64, 128]
    assert any("captured" in s for s in steps)
    assert serve(eng, prompts()) == ref  # 4 rows in the (4, 64) bucket
    assert sliced(eng, prompts(), 5) == ref  # kept KV copied into the arena each slice
    plan = eng.static.plan(3, 40)
    assert plan is not None and (plan.n, plan.c, plan.graph) == (4, 64, True)
    eng.close()


def test_a_batch_outside_the_buckets_runs_eagerly_over_the_arena() -> None:
    from worker.engines import create_engine

    eng = create_engine("hf", "tiny-random", device="cuda:0", dtype="float32",
                        graph_batch_sizes="1", graph_cache_tokens="32")
    eng.warm_up()
    plan = eng.static.plan(4, 40)
    assert plan is not None and not plan.graph
    eager = create_engine("hf", "tiny-random", device="cuda:0", dtype="float32", static_cache=False)
    assert serve(eng, prompts()) == serve(eager, prompts())
    eng.close()
    eager.close()


def test_hf_cb_starts_on_cuda_with_its_defaults() -> None:
    """No num_blocks by hand: transformers sizes the cache from the free memory, its graphs
    are on, and M_ava is what the cache holds."""
    from sclsd.protocol import BatchMsg, BatchRequest
    from worker.engines import create_engine

    cb = create_engine("hf-cb", "tiny-random", device="cuda:0", dtype="float16")
    try:
        cb.warm_up()
        assert cb.cache_tokens > 0 and cb.info().mem_available == cb.cache_tokens * cb.delta
        assert cb._mgr.continuous_batching_config.use_cuda_graph in (True, (True, True))
        reqs = [BatchRequest(rid=str(i), token_ids=p, max_new_tokens=GEN, temperature=0.0, ignore_eos=True)
                for i, p in enumerate(prompts())]
        outs, _ = cb.serve(BatchMsg(batch_id=1, slice_len=GEN, requests=reqs))
        assert [len(o.token_ids) for o in outs] == [GEN] * len(reqs)
    finally:
        cb.close()
