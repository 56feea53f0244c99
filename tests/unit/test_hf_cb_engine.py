"""hf-cb: transformers continuous batching as an engine (tiny random Llama)."""

from __future__ import annotations

import queue

import pytest

from sclsd import protocol as P
from unit.engine_loop import queue_take, run

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def engines():
    from worker.engines import create_engine

    # A small paged cache: transformers' default one (sized from free RAM) takes tens of
    # seconds to allocate on a CPU.
    cb = create_engine("hf-cb", "tiny-random", threads=1, num_blocks=64, sampling=False)
    yield cb, create_engine("hf", "tiny-random", threads=1)
    cb.close()


def rows(prompts: list[list[int]], n: int, **kw: object) -> list[P.BatchRequest]:
    return [P.BatchRequest(rid=f"r{i}", token_ids=p, max_new_tokens=n + i, temperature=0.0, **kw)  # type: ignore[arg-type]
            for i, p in enumerate(prompts)]


PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12] * 20]


def test_greedy_matches_static_engine(engines) -> None:
    cb, hf = engines
    batch = P.BatchMsg(batch_id=1, slice_len=64, requests=rows(PROMPTS, 5, ignore_eos=True))
    got, stats = cb.serve(batch)
    want, _ = hf.serve(batch)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == ["length"] * 3
    assert stats.pad_tokens == 0 and stats.invalid_tokens == 0 and stats.batch_size == 3


def test_it_shares_the_model_with_hf_not_its_serving(engines) -> None:
    from worker.engines.base import SliceEngine
    from worker.engines.hf import HFEngine
    from worker.engines.hf_model import TransformersModel

    cb, hf = engines
    assert isinstance(cb, TransformersModel) and not isinstance(cb, (HFEngine, SliceEngine))
    assert cb.info().vocab_size == hf.info().vocab_size and cb.info().kv_bytes_per_token == hf.delta
    assert cb.info().caps.batching == "continuous" and cb.has_room() and not cb.busy()


def test_slice_cap_leaves_request_unfinished(engines) -> None:
    cb, _ = engines
    batch = P.BatchMsg(batch_id=2, slice_len=3, requests=rows(PROMPTS[:1], 10, ignore_eos=True))
    (out,), _ = cb.serve(batch)
    assert len(out.token_ids) == 3 and out.finish_reason is None


def test_a_greedy_engine_refuses_sampling(engines) -> None:
    cb, _ = engines
    batch = P.BatchMsg(batch_id=3, slice_len=8,
                       requests=[P.BatchRequest(rid="s", token_ids=[1, 2], max_new_tokens=4, temperature=0.7)])
    with pytest.raises(RuntimeError, match="greedy"):
        cb.serve(batch)


def test_sampling_is_per_request_and_seeds_are_served(engines) -> None:
    from worker.engines import create_engine

    _, hf = engines
    cb = create_engine("hf-cb", "tiny-random", threads=1, num_blocks=64, sampling=True)
    greedy = rows(PROMPTS[:1], 8, ignore_eos=True)[0]
    (want,), _ = hf.serve(P.BatchMsg(batch_id=30, slice_len=8, requests=[greedy]))
    # top_k = 1 leaves only the argmax, whatever the temperature: greedy tokens, sampled.
    hot = P.BatchRequest(rid="k1", token_ids=greedy.token_ids, max_new_tokens=8, temperature=1.5,
                         top_k=1, ignore_eos=True)
    wide = P.BatchRequest(rid="w", token_ids=greedy.token_ids, max_new_tokens=8, temperature=1.5,
                          ignore_eos=True)
    (k1, w, g), _ = cb.serve(P.BatchMsg(batch_id=31, slice_len=8, requests=[hot, wide, greedy]))
    assert k1.token_ids == want.token_ids and g.token_ids == want.token_ids
    assert len(w.token_ids) == 8  # sampled from the whole vocabulary (random weights: not greedy's)
    assert w.token_ids != want.token_ids
    seeded = P.BatchRequest(rid="s", token_ids=[1, 2], max_new_tokens=4, temperature=0.7, seed=3,
                            ignore_eos=True)
    (first,), _ = cb.serve(P.BatchMsg(batch_id=32, slice_len=8, requests=[seeded]))
    (again,), _ = cb.serve(P.BatchMsg(batch_id=33, slice_len=8, requests=[seeded]))
    assert len(first.token_ids) == 4 and again.token_ids == first.token_ids  # the same seed, the same tokens
    cb.close()


def test_continuous_admits_batches_while_others_run(engines) -> None:
    cb, hf = engines
    q: queue.Queue = queue.Queue()
    long = P.BatchMsg(batch_id=10, slice_len=64, requests=rows([[3, 4, 5]], 40, ignore_eos=True))
    short = P.BatchMsg(batch_id=11, slice_len=64, requests=rows([[7, 7]], 2, ignore_eos=True))
    q.put(long)
    order: list[int] = []
    outs: dict[int, list[int]] = {}

    def emit(batch: P.BatchMsg, o: list[P.RequestOutput] | None, stats: object, error: str | None) -> None:
        assert error is None and o is not None
        order.append(batch.batch_id)
        outs[batch.batch_id] = o[0].token_ids
        if batch.batch_id == 10:
            q.put(None)

    take = queue_take(q)
    first = [True]

    def take_then_add(timeout: float | None):
        item = take(timeout)
        if first[0] and item is long:
            first[0] = False
            q.put(short)  # arrives while the long request generates
        return item

    run(cb, take_then_add, emit)
    assert order == [11, 10]  # the short request left before the long one finished
    want, _ = hf.serve(short)
    assert outs[11] == want[0].token_ids


def test_cpu_cache_holds_the_memory_budget_and_reports_it() -> None:
    from worker.engines import create_engine

    delta = 512  # tiny-random in fp32
    cb = create_engine("hf-cb", "tiny-random", threads=1, mem_budget=100 * delta)
    try:
        assert cb.cache_tokens == 112  # 100 tokens in whole pages of 16
        info = cb.info()
        assert info.mem_available == 100 * delta and info.caps.kv_page_tokens == 16
        (out,), _ = cb.serve(P.BatchMsg(batch_id=1, slice_len=4, requests=rows([[5, 6]], 4, ignore_eos=True)))
        assert len(out.token_ids) == 4
        cache = cb._mgr.batch_processor.cache
        assert cache.num_blocks * 16 >= 112 and cache.cache_allocators["full_attention"].tokens_per_page == 16
    finally:
        cb.close()


def test_cuda_leaves_the_cache_size_to_transformers_with_graphs_on() -> None:
    """On CUDA no page count is asked for (transformers sizes the cache from the free memory
    with the footprint formula it checks), its graphs are on and the cache takes 85 % of the
    free memory; what it built is read back as M_ava."""
    from types import SimpleNamespace

    from worker.engines.hf_cb import (
        GPU_GRAPHS_MEMORY_SHARE,
        cache_size,
        cache_tokens,
        manager_options,
    )

    assert cache_size("cuda", 60 * 2**30, 524288, None, None) == (256, None)
    assert cache_size("cuda", 60 * 2**30, 524288, None, 128) == (256, 128)  # by hand still wins
    assert cache_size("cpu", 100 * 512, 512, None, None) == (16, 7)
    opts = manager_options("cuda", 256, None, "auto", None, None)
    assert opts == {"page_size": 256, "num_blocks": None, "use_cuda_graph": True,
                    "max_memory_percent": GPU_GRAPHS_MEMORY_SHARE}
    opts = manager_options("cuda", 256, None, False, None, 4096)
    assert opts["use_cuda_graph"] is False and "max_memory_percent" not in opts  # transformers' default
    assert opts["max_batch_tokens"] == 4096
    assert manager_options("cuda", 256, None, True, 0.7, None)["max_memory_percent"] == 0.7
    assert "use_cuda_graph" not in manager_options("cpu", 16, 7, "auto", None, None)
    for bad, match in [(dict(cuda_graphs=True), "need a CUDA device"), (dict(memory_share=1.5), "memory_share"),
                       (dict(max_batch_tokens=0), "max_batch_tokens"), (dict(cuda_graphs="x"), "cuda_graphs")]:
        kw = dict(cuda_graphs="auto", memory_share=None, max_batch_tokens=None) | bad
        with pytest.raises(ValueError, match=match):
            manager_options("cpu", 16, 7, kw["cuda_graphs"], kw["memory_share"], kw["max_batch_tokens"])
    mgr = SimpleNamespace(batch_processor=SimpleNamespace(cache=SimpleNamespace(num_blocks=300)),
                          continuous_batching_config=SimpleNamespace(page_size=256))
    assert cache_tokens(mgr) == 76800


def test_warm_up_starts_the_manager_before_registering() -> None:
    from worker.engines import create_engine

    cb = create_engine("hf-cb", "tiny-random", threads=1, mem_budget=100 * 512)
    try:
        assert cb._mgr is None
        steps: list[str] = []
        cb.warm_up(steps.append)
        assert cb._mgr is not None and cb._mgr.is_running() and steps
        assert cb.info().mem_available == 100 * 512  # the CPU cache: the budget, as before
    finally:
        cb.close()


def test_min_tokens_and_logit_bias_are_served(engines) -> None:
    # Applied per request (tests/unit/test_hf_cb_rules.py); here: no longer refused.
    cb = engines[0]
    assert cb.info().caps.min_tokens and cb.info().caps.logit_bias
    for extra in (dict(min_tokens=3), dict(logit_bias={5: 1.0})):
        (out,), _ = cb.serve(P.BatchMsg(batch_id=9, slice_len=4, requests=rows([[5, 6]], 4, **extra)))
        assert out.token_ids


def test_a_dead_generation_thread_fails_the_poll_not_the_batch(engines) -> None:
    """The engine itself broke: poll raises (the worker exits and the daemon serves the batch
    elsewhere) instead of ending the batch as if its rows had failed. The next batch starts a
    new manager."""
    cb, hf = engines
    cb.submit(P.BatchMsg(batch_id=40, slice_len=64, requests=rows([[3, 4, 5]], 60, ignore_eos=True)))
    assert cb.busy()
    cb._mgr.stop(block=True, timeout=30, hard_stop=True)
    with pytest.raises(RuntimeError, match="stopped unexpectedly"):
        for _ in range(1000):
            cb.poll(0.01)
    assert not cb.busy() and cb._mgr is None
    batch = P.BatchMsg(batch_id=41, slice_len=4, requests=rows(PROMPTS[:1], 4, ignore_eos=True))
    assert cb.serve(batch)[0][0].token_ids == hf.serve(batch)[0][0].token_ids


def test_starting_the_manager_leaves_no_reseed_behind() -> None:
    """transformers builds the manager's batch processor in its own thread, and that reseeds
    torch's global RNG: the engine returns only once it has, so a model drawn from a fixed seed
    right after (tiny-random, another engine's) gets the same weights as before. It got others
    when the reseed landed in the middle of the draw."""
    from sclsd.models import load_model
    from worker.engines import create_engine

    def weights() -> float:
        return float(sum(p.double().sum() for p in load_model("tiny-random").parameters()))

    before = weights()
    cb = create_engine("hf-cb", "tiny-random", threads=1, num_blocks=64, sampling=False)
    try:
        refused = P.BatchMsg(batch_id=1, slice_len=4, requests=[
            P.BatchRequest(rid="s", token_ids=[1, 2], max_new_tokens=4, temperature=0.7)])
        with pytest.raises(RuntimeError, match="greedy"):
            cb.serve(refused)  # starts the manager, and returns at once
        assert weights() == before
    finally:
        cb.close()


def test_the_wait_for_the_processor_ends_when_built_dead_or_kept() -> None:
    import threading

    from worker.engines.cb_setup import wait_for_processor

    class Mgr:
        def __init__(self, processor: object, thread: threading.Thread) -> None:
            self.batch_processor = processor
            self._generation_thread = thread

    stop = threading.Event()
    alive = threading.Thread(target=stop.wait, daemon=True)
    alive.start()
    try:
        warm = object()
        # Built: a processor other than the warm-up's is there.
        wait_for_processor(Mgr(object(), alive), warm, timeout_s=5.0)
        # Kept: a transformers that keeps the warm-up's processor ends the wait without an error.
        wait_for_processor(Mgr(warm, alive), warm, timeout_s=0.05)
        # None built and no warm-up: that is an error, named.
        with pytest.raises(RuntimeError, match="built no batch processor"):
            wait_for_processor(Mgr(None, alive), None, timeout_s=0.05)
    finally:
        stop.set()
        alive.join()
    # Dead: its error reaches the first request; the wait does not hang on it.
    wait_for_processor(Mgr(None, alive), None, timeout_s=5.0)
