"""The ``hf`` engine's static-cache path, forced on the CPU: the same tokens as the eager
loop (greedy and seeded sampling, one pass and in slices with kept KV, chunked prefills,
batches padded to bucket shapes), what it reports, and its options.

On CUDA the same path captures its decode steps as graphs (tests/gpu); here every step
runs eagerly over the same arena, buffers and counters a replay uses.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from sclsd.protocol import BatchMsg, BatchRequest, RequestOutput  # noqa: E402
from worker.engines import create_engine  # noqa: E402
from worker.engines.hf import HFEngine  # noqa: E402
from worker.engines.static_cache import StaticOptions, activation_reserve  # noqa: E402
from worker.engines.static_grid import parse_sizes  # noqa: E402

GEN = 20
BUDGET = 64 * 1024**2
#: tiny-random: 2 layers · 2 KV heads · 16 dims · 2 (K and V) · 4 bytes.
DELTA = 512


def make(**opts: Any) -> HFEngine:
    opts.setdefault("mem_budget", BUDGET)
    eng = create_engine("hf", "tiny-random", threads=1, **opts)
    assert isinstance(eng, HFEngine)
    eng.warm_up()
    return eng


@pytest.fixture(scope="module")
def eager() -> HFEngine:
    return make(kv_reuse=False)


@pytest.fixture(scope="module")
def static() -> HFEngine:
    """Static path, prefill chunks of 16 tokens, batches padded to buckets (dummy rows)."""
    return make(static_cache=True, prefill_chunk_tokens=16, static_buckets=True,
                graph_batch_sizes="2,8", graph_cache_tokens="32,64,128")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in (5, 23, 1, 12, 40)]


def rows(prompts: list[list[int]], gen: list[list[int]] | None = None, prefix: str = "r",
         **kw: Any) -> list[BatchRequest]:
    gen = gen or [[] for _ in prompts]
    kw.setdefault("temperature", 0.0)
    return [BatchRequest(rid=f"{prefix}{i}", token_ids=p + g, max_new_tokens=GEN - len(g), generated=len(g),
                         ignore_eos=True, **kw) for i, (p, g) in enumerate(zip(prompts, gen, strict=True))]


def serve(engine: HFEngine, s: int, reqs: list[BatchRequest], emit: Any = None) -> tuple[list[Any], Any]:
    return engine.serve(BatchMsg(batch_id=1, slice_len=s, requests=reqs), emit)


def tokens(engine: HFEngine, prompts: list[list[int]], **kw: Any) -> list[list[int]]:
    outs, _ = serve(engine, GEN, rows(prompts, **kw))
    return [o.token_ids for o in outs]


def sliced(engine: HFEngine, prompts: list[list[int]], s: int, prefix: str) -> tuple[list[list[int]], list[Any]]:
    gen: list[list[int]] = [[] for _ in prompts]
    stats = []
    while any(len(g) < GEN for g in gen):
        live = [i for i in range(len(prompts)) if len(gen[i]) < GEN]
        reqs = [r for i, r in enumerate(rows(prompts, gen, prefix)) if i in live]
        outs, st = serve(engine, s, reqs)
        stats.append(st)
        for i, o in zip(live, outs, strict=True):
            gen[i] += o.token_ids
    return gen, stats


def test_greedy_one_pass_equals_the_eager_loop(eager, static, prompts):
    ref = tokens(eager, prompts)
    assert tokens(static, prompts) == ref
    assert tokens(make(static_cache=True), prompts) == ref  # exact shapes, one prefill pass


def test_seeded_sampling_with_every_parameter_equals_the_eager_loop(eager, static, prompts):
    kw = dict(seed=5, temperature=0.8, top_p=0.9, top_k=50, min_p=0.01, frequency_penalty=0.5,
              repetition_penalty=1.3, logprobs=True, top_logprobs=3)
    a, _ = serve(eager, GEN, rows(prompts, **kw))
    b, _ = serve(static, GEN, rows(prompts, **kw))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    for x, y in zip(a, b, strict=True):
        assert [e.chosen.id for e in x.logprobs] == [e.chosen.id for e in y.logprobs] == x.token_ids
        for ex, ey in zip(x.logprobs, y.logprobs, strict=True):
            assert ex.chosen.logprob == pytest.approx(ey.chosen.logprob, abs=1e-4)
            assert [t.id for t in ex.top] == [t.id for t in ey.top]


@pytest.mark.parametrize("s", [1, 4, 7])
def test_slices_with_kept_kv_equal_one_pass_and_prefill_the_same(eager, prompts, s):
    ref = tokens(eager, prompts)
    kept_eager = make()
    kept_static = make(static_cache=True, prefill_chunk_tokens=16, static_buckets=True,
                       graph_batch_sizes="2,8", graph_cache_tokens="32,64,128")
    ge, se = sliced(kept_eager, prompts, s, f"e{s}-")
    gs, ss = sliced(kept_static, prompts, s, f"s{s}-")
    assert ge == gs == ref
    assert [(x.prefill_tokens, x.reused_tokens) for x in ss] == [(x.prefill_tokens, x.reused_tokens) for x in se]
    assert sum(x.reused_tokens for x in ss) > 0


def test_batches_run_in_the_smallest_bucket_that_holds_them(static):
    r = static.static
    assert r.buckets() == [(2, 32), (2, 64), (2, 128), (8, 32), (8, 64), (8, 128)]
    p = r.plan(5, 60)
    assert (p.n, p.c, p.graph) == (8, 64, False)  # 3 dummy rows; no graphs on the CPU
    assert (r.plan(1, 10).n, r.plan(1, 10).c) == (2, 32)
    assert (r.plan(9, 10).n, r.plan(9, 10).c) == (9, 10)  # no bucket holds 9 rows: its own shape
    assert r.plan(2, r.arena.tokens) is None  # more than the arena


def test_a_batch_the_arena_cannot_hold_fails_with_the_reason(prompts):
    small = make(static_cache=True, mem_budget=400 * DELTA, static_share=0.5)  # 200 token slots
    assert small.info().mem_available == 200 * DELTA
    with pytest.raises(ValueError, match="does not fit the static cache"):
        serve(small, 8, rows([[5] * 60] * 4))
    assert tokens(small, prompts[:1]) == tokens(make(kv_reuse=False), prompts[:1])


def test_memory_report_and_capabilities(static):
    info = static.info()
    assert info.mem_available == static.static.arena.nbytes == static.static.arena.tokens * DELTA
    assert static.static.arena.tokens == BUDGET // 2 // DELTA  # static_share 0.5
    assert static.kv is not None and static.kv.store.budget == BUDGET - info.mem_available
    assert info.caps.batching == "static" and info.caps.sampling and info.caps.seeded
    assert info.caps.graph_batch_sizes == [] and info.caps.max_context == static.max_context


def test_streaming_emits_every_step(static, prompts):
    calls: list[list[RequestOutput]] = []
    reqs = rows(prompts[:2])
    reqs[0] = BatchRequest(rid="short", token_ids=prompts[0], max_new_tokens=3, temperature=0.0, ignore_eos=True)
    outs, st = serve(static, 8, reqs, calls.append)
    assert len(calls) == st.iterations == 8
    for o in outs:
        assert [t for c in calls for x in c if x.rid == o.rid for t in x.token_ids] == o.token_ids
    assert outs[0].finish_reason == "length" and len(outs[0].token_ids) == 3


def test_reading_one_step_behind_gives_the_same_tokens(eager, prompts, monkeypatch):
    """CUDA queues step k+1 before reading step k's tokens; forced here, the output is the same
    and a batch whose rows all end early still reports the iterations it used."""
    eng = make(static_cache=True, kv_reuse=False)
    monkeypatch.setattr(eng, "read_behind", True)
    assert tokens(eng, prompts) == tokens(eager, prompts)
    reqs = [BatchRequest(rid=str(i), token_ids=p, max_new_tokens=3, temperature=0.0, ignore_eos=True)
            for i, p in enumerate(prompts)]
    _, st = serve(eng, 10, reqs)
    assert st.iterations == 3


def test_options_are_checked():
    opts = StaticOptions.parse("cpu", True, "auto", "auto", 0.5, None, None, None)
    assert not opts.on and not opts.graphs and opts.prefill_chunk_tokens == 0
    opts = StaticOptions.parse("cuda", True, "auto", "auto", 0.5, "4,1,2", "512", None)
    assert opts.on and opts.graphs and opts.batch_sizes == (1, 2, 4) and opts.prefill_chunk_tokens == 8192
    assert not StaticOptions.parse("cuda", False, "auto", "auto", 0.5, None, None, None).on  # deepspeed
    for bad, match in [(dict(static_cache="maybe"), "static_cache"), (dict(share=0), "static_share"),
                       (dict(share="x"), "static_share"), (dict(sizes="1,a"), "graph_batch_sizes"),
                       (dict(sizes="0"), "graph_batch_sizes"), (dict(chunk=-1), "prefill_chunk_tokens"),
                       (dict(graphs=True), "need a CUDA device")]:
        kw = dict(static_cache=True, graphs="auto", share=0.5, sizes=None, chunk=None) | bad
        with pytest.raises(ValueError, match=match):
            StaticOptions.parse("cpu", True, kw["static_cache"], kw["graphs"], kw["share"], kw["sizes"],
                                None, kw["chunk"])
    assert parse_sizes([8, 2, 2], "graph_batch_sizes") == (2, 8)
    assert parse_sizes((4, 1), "graph_cache_tokens") == (1, 4)  # as sclsd-worker passes it


def test_activation_reserve_of_a_7b_model():
    """Llama-2-7B in fp16, 8192-token prefill chunks, 128 rows: about 2 GiB."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=11008, vocab_size=32000, num_hidden_layers=32,
                      num_attention_heads=32)
    reserve = activation_reserve(cfg, torch.float16, 8192, 128)
    assert 1.9 * 2**30 < reserve < 2.3 * 2**30


def test_kv_memory_on_cuda_keeps_back_activations_and_the_allocators_share(monkeypatch):
    """On CUDA the KV memory is the free memory less the activation reserve and
    ``FRAGMENTATION_SHARE`` of it (kept KV of every length coming and going fragments the
    allocator's blocks; a card ran out of memory in a prefill without it)."""
    from types import SimpleNamespace

    from transformers import LlamaConfig

    from worker.engines.hf_model import FRAGMENTATION_SHARE, TransformersModel

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=11008, vocab_size=32000, num_hidden_layers=32,
                      num_attention_heads=32)
    free = 126 * 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 140 * 2**30))
    fake = SimpleNamespace(device=torch.device("cuda:0"), config=cfg, dtype=torch.float16)
    got = TransformersModel.kv_memory(fake, 8192, 512)  # type: ignore[arg-type]
    assert got == free - activation_reserve(cfg, torch.float16, 8192, 512) - int(FRAGMENTATION_SHARE * free)
    assert 118 * 2**30 < got < 121 * 2**30


def test_hf_cb_never_takes_the_static_path():
    # It has no static path to take: the option is refused by name (the config check refuses
    # it before: test_config.py), and the engine has none of hf's serving.
    with pytest.raises(TypeError, match="static_cache"):
        create_engine("hf-cb", "tiny-random", threads=1, mem_budget=BUDGET, static_cache=True)
    cb = create_engine("hf-cb", "tiny-random", threads=1, mem_budget=BUDGET)
    try:
        assert not hasattr(cb, "static")
    finally:
        cb.close()


def _rss() -> int:
    """This process's resident bytes (Linux: /proc/self/statm, in pages)."""
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm"), reason="needs /proc (Linux)")
def test_a_cpu_arena_costs_the_memory_its_rows_wrote_not_all_of_it_at_start():
    """The arena in host memory is zeros that the kernel commits only when written: 1 GiB of
    it costs little until rows write, then about what they wrote; it reads as zeros and takes
    writes as any tensor."""
    from worker.engines.static_cache import zeros

    before = _rss()
    buf = zeros(2**28, torch.float32, "cpu")  # 1 GiB
    assert buf.numel() == 2**28 and buf.dtype == torch.float32
    assert _rss() - before < 64 * 2**20
    buf[: 2**24].fill_(1.5)  # 64 MiB written
    grown = _rss() - before
    assert 60 * 2**20 < grown < 160 * 2**20, grown
    assert float(buf[2**24 - 1]) == 1.5 and float(buf[2**24]) == 0.0 and float(buf[-1]) == 0.0
    half = zeros(8, torch.bfloat16, "cpu")
    assert half.dtype == torch.bfloat16 and half.tolist() == [0.0] * 8
