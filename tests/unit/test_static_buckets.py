"""The ``hf`` engine's static path, forced on the CPU, at the edges of its buckets: batches of
more rows than the largest bucket, the cache buckets an arena of a real card's size gets, the
check of captured decode steps (graphs stood in for by replays of the same step), eager
attention's additive mask, and what ``close`` lets go of."""

from __future__ import annotations

import random
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from sclsd.protocol import BatchMsg, BatchRequest  # noqa: E402
from worker.engines import create_engine  # noqa: E402
from worker.engines.graph_check import GRAPH_LOGIT_TOLERANCE, check_graphs, verify  # noqa: E402
from worker.engines.hf import HFEngine  # noqa: E402
from worker.engines.static_cache import DecodeStep, StaticOptions  # noqa: E402
from worker.engines.static_grid import DEFAULT_BATCH_SIZES, DEFAULT_CACHE_TOKENS  # noqa: E402

BUDGET = 64 * 1024**2
GEN = 12
#: Llama-2-7B in fp16: 32 layers · 32 KV heads · 128 dims · 2 (K and V) · 2 bytes.
DELTA_7B = 524288
#: The arena of 7B on an 80 GB H100 (half of the KV memory left after the weights).
H100_ARENA_TOKENS = 65290


def make(**opts: Any) -> HFEngine:
    opts.setdefault("mem_budget", BUDGET)
    eng = create_engine("hf", "tiny-random", threads=1, **opts)
    assert isinstance(eng, HFEngine)
    eng.warm_up()
    return eng


def bucketed(**opts: Any) -> HFEngine:
    return make(static_cache=True, static_buckets=True, kv_reuse=False, graph_batch_sizes="2,8",
                graph_cache_tokens="32,64", **opts)


def prompts(n: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randrange(1, 20))] for _ in range(n)]


def tokens(engine: HFEngine, ps: list[list[int]], s: int = GEN) -> list[list[int]]:
    reqs = [BatchRequest(rid=f"r{i}", token_ids=p, max_new_tokens=s, temperature=0.0, ignore_eos=True)
            for i, p in enumerate(ps)]
    outs, _ = engine.serve(BatchMsg(batch_id=1, slice_len=s, requests=reqs, kv_reuse=False))
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def eager() -> HFEngine:
    return make(kv_reuse=False)


@pytest.mark.parametrize("rows", [9, 40])
def test_a_batch_of_more_rows_than_the_largest_bucket_is_served(eager, rows):
    """Buckets of 2 and 8 rows; 9 and 40 rows run eagerly in their own shape over buffers the
    size of what the arena admits, and give the eager loop's tokens."""
    static = bucketed()
    runner = static.static
    assert runner is not None and max(runner.batch_buckets) == 8
    plan = runner.plan(rows, 30)
    assert plan is not None and (plan.n, plan.graph) == (rows, False)
    ps = prompts(rows)
    assert tokens(static, ps) == tokens(eager, ps)


def test_buffers_cover_every_batch_the_arena_admits():
    """However many rows the arena admits (a row takes a slot at least), the step buffers hold
    them: a step of that many rows gets views of its full size."""
    static = bucketed(mem_budget=2 * 300 * 512)  # 300 token slots
    runner = static.static
    assert runner is not None and runner.arena.tokens == 300
    plan = runner.plan(300, 1)
    assert plan is not None and plan.n == 300
    step = runner.step_for(plan)
    assert step.ids.shape[0] == step.pos.shape[0] == 300
    assert runner.plan(301, 1) is None


def test_common_7b_shapes_on_an_h100_find_a_bucket():
    """The arena of 7B on an 80 GB H100 (65,290 slots) misses (32, 2048) by 246 slots: 32 rows
    of 1024-token contexts and a 64-token slice need a cache of 1087 and must still find a
    bucket; so must every default batch bucket at half its rows' share of the arena."""
    from transformers import LlamaConfig

    opts = StaticOptions.parse("cpu", True, True, False, 0.5, None, None, None, True)
    tiny = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       vocab_size=100)
    runner = opts.runner(None, tiny, torch.device("cpu"), torch.float32, 2 * H100_ARENA_TOKENS * DELTA_7B,
                         DELTA_7B, 0, max_context=4096)
    runner.warm_up()
    assert runner.arena.tokens == H100_ARENA_TOKENS
    assert not runner.arena.fits(32, 2048)
    plan = runner.plan(32, 1024 + 64 - 1)
    assert plan is not None and (plan.n, plan.c) == (32, 1536)
    for n in runner.batch_buckets:
        share = H100_ARENA_TOKENS // n
        largest = max(c for m, c in runner.buckets() if m == n)
        assert largest * 3 >= 2 * min(share, 4096), (n, largest, share)
    assert set(runner.batch_buckets) == {n for n in DEFAULT_BATCH_SIZES if n * 256 <= H100_ARENA_TOKENS}
    assert max(runner.cache_buckets) == 4096 and set(runner.cache_buckets) <= set(DEFAULT_CACHE_TOKENS)
    assert opts.reserve_rows >= 512


def test_every_cache_bucket_has_a_bucket_of_as_many_rows_as_the_arena_holds_there():
    """Where the next batch bucket does not fit the arena at a cache bucket, the most rows that
    do are a bucket too: on the H100's arena 48 rows of 1,536 columns do not fit, so 33 to 42
    such rows (which the engine admits, ``tokens // c``) would step in no bucket, eagerly. A
    list of sizes that ends below what the arena holds gets no such bucket."""
    from transformers import LlamaConfig

    tiny = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       vocab_size=100)
    opts = StaticOptions.parse("cpu", True, True, False, 0.5, None, None, None, True)
    runner = opts.runner(None, tiny, torch.device("cpu"), torch.float32, 2 * H100_ARENA_TOKENS * DELTA_7B,
                         DELTA_7B, 0, max_context=4096)
    runner.warm_up()
    shapes = runner.buckets()
    assert shapes == runner.bucket_shapes()
    for c in runner.cache_buckets:
        most = H100_ARENA_TOKENS // c
        assert max(n for n, bc in shapes if bc == c) == min(most, max(DEFAULT_BATCH_SIZES)), c
        listed = [n for n, bc in shapes if bc == c and n in DEFAULT_BATCH_SIZES]
        assert listed == [n for n in DEFAULT_BATCH_SIZES if n * c <= H100_ARENA_TOKENS], c
    assert (42, 1536) in shapes and (63, 1024) in shapes and (48, 1536) not in shapes
    for rows in (33, 40, 42):
        plan = runner.plan(rows, 1024 + 128)
        assert plan is not None and (plan.n, plan.c) == (42, 1536)
    # A fill bucket is no cheaper home for short rows: 33 rows of 300 columns take 48 × 384.
    plan = runner.plan(33, 300)
    assert plan is not None and (plan.n, plan.c) == (48, 384)
    short = StaticOptions.parse("cpu", True, True, False, 0.5, "2,8", "32,64", None, True)
    small = short.runner(None, tiny, torch.device("cpu"), torch.float32, 2 * 1000 * DELTA_7B, DELTA_7B, 0, max_context=4096)
    small.warm_up()
    assert small.buckets() == [(2, 32), (2, 64), (8, 32), (8, 64)]
    listed = StaticOptions.parse("cpu", True, True, False, 0.5, "2,8,32", "32,64", None, True)
    fill = listed.runner(None, tiny, torch.device("cpu"), torch.float32, 2 * 1000 * DELTA_7B, DELTA_7B, 0, max_context=4096)
    fill.warm_up()
    assert fill.buckets() == [(2, 32), (2, 64), (8, 32), (8, 64), (15, 64), (31, 32)]


class Replay:
    """A captured step stood in for on the CPU: the step's own body, its logits then changed by
    ``change`` (as a graph's replay returns them)."""

    def __init__(self, step: DecodeStep, change: Any) -> None:
        self.step = step
        self.change = change

    def replay(self) -> None:
        self.step.logits = self.change(self.step.body())


def nudge_ties(logits: Any) -> Any:
    """Reduction-order noise at its most harmful: every runner-up within 0.15 of the top (1 %
    of these logits' scale) overtakes it."""
    top = logits.topk(2, dim=-1)
    out = logits.clone()
    near = (top.values[:, 0] - top.values[:, 1]) < 0.15
    rows = near.nonzero().squeeze(-1)
    out[rows, top.indices[rows, 1]] = top.values[rows, 0] + 0.01
    return out


def fake_graphs(engine: HFEngine, change: Any, broken: tuple[int, int] | None = None) -> None:
    runner = engine.static
    assert runner is not None
    for key in runner.buckets():
        step = runner.steps[key]
        step.graph = Replay(step, (lambda lg: torch.zeros_like(lg)) if key == broken else change)


def test_graph_check_keeps_steps_within_tolerance_even_where_greedy_tokens_flip(eager):
    """The replay differs from the eager step by less than the tolerance, enough to flip
    near-tied greedy tokens: the graphs are kept (a check on tokens would drop them all)."""
    static = bucketed()
    fake_graphs(static, nudge_ties)
    ps = prompts(4, seed=11)
    assert tokens(static, ps) != tokens(eager, ps)  # the nudges do flip greedy tokens
    assert check_graphs(static) is True
    assert static.static is not None and static.static.captured() == static.static.buckets()
    caps = static.caps()
    assert caps.graph_batch_sizes == [2, 8] and caps.graph_cache_tokens == [32, 64]


def test_graph_check_drops_only_the_steps_whose_replay_is_wrong():
    static = bucketed()
    fake_graphs(static, lambda lg: lg, broken=(8, 32))
    runner = static.static
    assert runner is not None
    errors = verify(runner, static.vocab_size)
    assert errors[(8, 32)] > GRAPH_LOGIT_TOLERANCE and errors[(2, 32)] == 0.0
    assert runner.captured() == [(2, 32), (2, 64), (8, 64)]
    caps = static.caps()
    assert caps.graph_batch_sizes == [2, 8] and caps.graph_cache_tokens == [32, 64]
    plan = runner.plan(5, 20)
    assert plan is not None and (plan.n, plan.c, plan.graph) == (8, 64, True)  # not the dropped (8, 32)


def test_graph_check_reports_none_kept_when_every_replay_is_wrong():
    static = bucketed()
    fake_graphs(static, lambda lg: lg + float("nan"))
    assert check_graphs(static) is False
    caps = static.caps()
    assert caps.graph_batch_sizes == [] and caps.graph_cache_tokens == []


def test_eager_attention_gets_an_additive_mask(eager):
    """Eager attention adds a 4-D mask to its scores: the static path hands it 0 or the lowest
    value, and serves the eager loop's tokens, one pass and bucketed."""
    ps = prompts(5, seed=5)
    ref = tokens(eager, ps)
    for opts in ({}, {"static_buckets": True, "graph_batch_sizes": "8", "graph_cache_tokens": "64"}):
        eng = create_engine("hf", "tiny-random", threads=1, mem_budget=BUDGET, kv_reuse=False,
                            static_cache=True, **opts)
        assert isinstance(eng, HFEngine)
        eng.model.config._attn_implementation = "eager"
        eng.static = StaticOptions.parse("cpu", True, True, False, 0.5, opts.get("graph_batch_sizes"),
                                         opts.get("graph_cache_tokens"), None,
                                         opts.get("static_buckets")).runner(
            eng.model, eng.config, eng.device, eng.dtype, eng.kv_limit, eng.delta, eng.pad_id, eng.max_context)
        eng.warm_up()
        assert tokens(eng, ps) == ref
        assert eng.static.additive


def test_flash_attention_takes_no_static_path(monkeypatch):
    from worker.engines import static_cache as static_mod

    monkeypatch.setattr(static_mod, "attention_kind", lambda config: "flash_attention_2")
    monkeypatch.setattr("worker.engines.hf.attention_kind", lambda config: "flash_attention_2")
    eng = create_engine("hf", "tiny-random", threads=1, mem_budget=BUDGET, static_cache=True)
    assert isinstance(eng, HFEngine) and eng.static is None


def test_close_lets_go_of_the_arena_and_the_kept_kv():
    eng = make(static_cache=True)
    assert eng.static is not None and eng.kv is not None
    store = eng.kv.store
    ps = prompts(2)
    reqs = [BatchRequest(rid=f"k{i}", token_ids=p, max_new_tokens=20, temperature=0.0, ignore_eos=True)
            for i, p in enumerate(ps)]
    outs, _ = eng.serve(BatchMsg(batch_id=1, slice_len=4, requests=reqs))
    assert all(o.kv_tokens > 0 for o in outs) and store.nbytes > 0
    eng.close()
    assert eng.static is None and eng.kv is None and store.nbytes == 0 and store.held() == {}


def test_captures_stop_at_their_budget_and_the_smaller_shapes_leave_the_grid(monkeypatch, caplog, tmp_path):
    """``graph_capture_s``: warm-up captures from the most rows down until the budget is spent
    (here 0.17 s a capture, as on an H100, against 5 s, counted after the first two, which
    carry the one-time costs such as compiles). Each width's bucket of the most rows goes
    first, so every width keeps one and the shapes left out are smaller batch buckets; every
    batch still plans into a captured bucket (none steps outside them, eager on CUDA). The log
    says how many were left out."""
    from transformers import LlamaConfig

    from worker.engines import static_cache

    now = {"t": 0.0}

    def capture(step: Any, pool: Any) -> None:
        del pool
        now["t"] += 0.17
        step.graph = object()  # stands in for a CUDA graph: only the bookkeeping is checked

    monkeypatch.setattr(static_cache, "clock", lambda: now["t"])
    monkeypatch.setattr(DecodeStep, "capture", capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    tiny = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       vocab_size=100)

    def warmed(budget: Any) -> Any:
        opts = StaticOptions.parse("cpu", True, True, False, 0.5, None, None, None, True, budget)
        runner = opts.runner(None, tiny, torch.device("cpu"), torch.float32, 2 * H100_ARENA_TOKENS * DELTA_7B,
                             DELTA_7B, 0, max_context=4096)
        monkeypatch.setattr(runner, "capturing", lambda: True)
        runner.warm_up()
        return runner

    every = warmed(0)  # no limit: every shape
    assert every.captured() == every.bucket_shapes() and every.uncaptured == 0
    with caplog.at_level("WARNING", logger="worker"):
        cut = warmed("5")
    kept = cut.captured()
    # The budget counts from the second capture's end: 30 more (30 × 0.17 s passes 5 s).
    assert len(kept) == 32 and cut.uncaptured == len(every.captured()) - 32
    # Each width keeps its bucket of the most rows (those went first), the rest the most rows.
    widths = set(every.cache_buckets)
    heads = {(max(n for n, bc in every.captured() if bc == c), c) for c in widths}
    assert heads <= set(kept) and set(cut.cache_buckets) == widths
    rest = [s for s in kept if s not in heads]
    least = min(n for n, _ in rest)
    assert all((n, c) in kept for n, c in every.captured() if n > least)
    assert set(cut.batch_buckets) == {n for n, _ in kept if n in every.batch_buckets}
    for rows, need in ((1, 200), (least, 1000), (40, 1500), (63, 1000), (1, 4000), (15, 4000)):
        plan = cut.plan(rows, need)
        assert plan is not None and plan.graph and (plan.n, plan.c) in kept, (rows, need, plan)
    assert f"{cut.uncaptured} smaller bucket shapes of {len(every.captured())} left out" in caplog.text
    # gpu-check reads the same line from a worker's log.
    from sclsd.bench.gpu_stages import log_facts

    log = tmp_path / "worker.log"
    log.write_text(caplog.text)
    assert log_facts(log)["captures_cut"] == {"s": 5.1, "left_out": cut.uncaptured, "shapes": len(every.captured())}
    with pytest.raises(ValueError, match="graph_capture_s"):
        StaticOptions.parse("cpu", True, True, False, 0.5, None, None, None, True, -1)


def test_both_arena_engines_take_the_capture_budget() -> None:
    """``graph_capture_s`` reaches the runner of ``hf`` and of ``hf-static-cb`` (30 s unless set)."""
    from unit.arena_common import make as make_cb

    assert make(static_cache=True).static.capture_budget_s == 30.0
    assert make(static_cache=True, graph_capture_s="7.5").static.capture_budget_s == 7.5
    assert make_cb(graph_capture_s=0).static.capture_budget_s == 0.0


def test_the_kv_memory_leaves_room_for_the_decode_graphs_logits():
    """Each captured step keeps its ``[n, vocab]`` logits: the KV memory is taken down by their
    sum over the grid of the arena it would size (the 7B's in fp16 over the default grid in an
    H200's arena: about 0.35 GiB); the smaller arena's own grid never holds more. None without
    graphs."""
    import dataclasses

    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                      vocab_size=32000)
    plain = StaticOptions.parse("cpu", True, True, False, 0.9, None, None, None, True)
    kv = int(220_620 / 0.9) * DELTA_7B + DELTA_7B  # the H200's arena at 0.9
    assert plain.graph_outputs(cfg, torch.float16, kv, DELTA_7B, 4096) == 0
    opts = dataclasses.replace(plain, graphs=True)
    logits = opts.graph_outputs(cfg, torch.float16, kv, DELTA_7B, 4096)
    runner = opts.runner(None, cfg, torch.device("cpu"), torch.float32, kv, DELTA_7B, 0, max_context=4096)
    assert runner.arena.tokens == 220_620 and len(runner.bucket_shapes()) == 116
    assert logits == sum(n for n, _ in runner.bucket_shapes()) * 32000 * 2
    assert 0.3 * 2**30 < logits < 0.4 * 2**30
    smaller = opts.runner(None, cfg, torch.device("cpu"), torch.float32, kv - logits, DELTA_7B, 0, max_context=4096)
    assert sum(n for n, _ in smaller.bucket_shapes()) * 32000 * 2 <= logits
    # A finer grid keeps more of them.
    fine = dataclasses.replace(opts, batch_sizes=(*opts.batch_sizes, 40, 56, 80, 112, 160))
    assert fine.graph_outputs(cfg, torch.float16, kv, DELTA_7B, 4096) > logits
