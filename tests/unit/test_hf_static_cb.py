"""``hf-static-cb`` on the CPU (the static arena without graphs, tiny random Llama): the tokens
of ``hf`` in one pass, in grants that keep KV, with rows joining and leaving mid-slice,
with every sampling parameter, constraints and grammars; and what it reports.

On CUDA the same steps are captured as graphs; here each runs eagerly over the same arena,
buffers and per-row columns a replay uses (buckets with dummy rows included).
"""

from __future__ import annotations

import itertools
import queue
import random
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from sclsd.protocol import BatchMsg, BatchRequest  # noqa: E402
from unit.arena_common import BUDGET, hf_engine, make, next_batch_id  # noqa: E402
from unit.arena_common import serve as serve_in  # noqa: E402
from unit.engine_loop import queue_take, run  # noqa: E402
from worker.engines.hf_static_cb import HFStaticCBEngine  # noqa: E402

GEN = 20


@pytest.fixture(scope="module")
def hf() -> Any:
    return hf_engine()


@pytest.fixture(scope="module")
def cb() -> HFStaticCBEngine:
    return make()


@pytest.fixture(scope="module")
def bucketed() -> HFStaticCBEngine:
    """Rows padded to buckets of 2 and 8 (dummy rows), cache buckets of 32, 64 and 128 columns."""
    return make(static_buckets=True, graph_batch_sizes="2,8", graph_cache_tokens="32,64,128")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in (5, 23, 1, 12, 40)]


def rows(prompts: list[list[int]], n: int = GEN, prefix: str = "r", **kw: Any) -> list[BatchRequest]:
    kw.setdefault("temperature", 0.0)
    kw.setdefault("ignore_eos", True)
    return [BatchRequest(rid=f"{prefix}{i}", token_ids=p, max_new_tokens=n, **kw) for i, p in enumerate(prompts)]


def serve(engine: Any, reqs: list[BatchRequest], s: int = GEN, kv_reuse: bool = True) -> tuple[list[Any], Any]:
    return serve_in(engine, reqs, s, kv_reuse)


def tokens(engine: Any, prompts: list[list[int]], **kw: Any) -> list[list[int]]:
    outs, _ = serve(engine, rows(prompts, prefix=f"t{next_batch_id()}-", **kw), kv_reuse=False)
    return [o.token_ids for o in outs]


def in_grants(engine: Any, rid: str, ctx: list[int], total: int, s: int,
              **kw: Any) -> tuple[list[int], list[tuple[Any, Any]]]:
    """``total`` tokens of one request in grants of ``s``, each resuming the last."""
    got: list[int] = []
    results = []
    kw.setdefault("temperature", 0.0)
    kw.setdefault("ignore_eos", True)
    while len(got) < total:
        r = BatchRequest(rid=rid, token_ids=ctx + got, max_new_tokens=total - len(got), generated=len(got), **kw)
        (out,), stats = serve(engine, [r], s)
        results.append((out, stats))
        got += out.token_ids
        if out.finish_reason is not None:
            break
        assert out.kv_tokens == len(ctx) + len(got) - 1 and engine.kept()[rid] == out.kv_tokens
    return got, results


def test_greedy_tokens_equal_hf_in_one_pass(hf, cb, bucketed, prompts) -> None:
    want = tokens(hf, prompts)
    assert tokens(cb, prompts) == want
    assert tokens(bucketed, prompts) == want  # 5 rows in the bucket of 8: three dummy rows


def test_seeded_sampling_with_every_parameter_equals_hf(hf, cb, prompts) -> None:
    kw = dict(seed=5, temperature=0.8, top_p=0.9, top_k=50, min_p=0.01, frequency_penalty=0.5,
              repetition_penalty=1.3, logprobs=True, top_logprobs=3)
    a, _ = serve(hf, rows(prompts, prefix="sa", **kw), kv_reuse=False)
    b, _ = serve(cb, rows(prompts, prefix="sb", **kw), kv_reuse=False)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    for x, y in zip(a, b, strict=True):
        assert [e.chosen.id for e in y.logprobs] == y.token_ids
        for ex, ey in zip(x.logprobs, y.logprobs, strict=True):
            assert ex.chosen.logprob == pytest.approx(ey.chosen.logprob, abs=1e-4)
            assert [t.id for t in ex.top] == [t.id for t in ey.top]


@pytest.mark.parametrize("s", [1, 4, 7])
def test_grants_keep_kv_and_give_the_one_pass_tokens(hf, bucketed, prompts, s) -> None:
    """Each grant resumes the KV its predecessor kept (no prefill); seeded sampling and its
    penalties continue across grants as in one pass."""
    # top_k: over the whole vocabulary, float noise between two ways of computing the same
    # logits can move a seeded draw to a neighbouring id (test_hf_cb_logprobs' penalties).
    for kw in ({}, {"seed": 3, "temperature": 0.9, "top_k": 50, "frequency_penalty": 0.4}):
        (want,) = tokens(hf, [prompts[1]], **kw)
        got, results = in_grants(bucketed, f"g{s}-{len(kw)}", prompts[1], GEN, s, **kw)
        assert got == want
        first = results[0][1]
        # A full prefill, or (the same prompt served before, shared prefixes on by default)
        # all of it but the last token from a cached prefix.
        assert (first.prefill_tokens, first.reused_tokens) in ((len(prompts[1]), 0), (0, len(prompts[1]) - 1))
        ctx = len(prompts[1])
        for (prev, _), (_, stats) in itertools.pairwise(results):
            ctx += len(prev.token_ids)
            assert (stats.prefill_tokens, stats.reused_tokens) == (0, ctx - 1)
        last = results[-1][0]
        assert last.finish_reason == "length" and last.kv_tokens == 0
        assert f"g{s}-{len(kw)}" not in bucketed.kept()


def test_rows_join_and_leave_mid_slice(hf, bucketed) -> None:
    """Grants of several slice lengths arrive while others generate (the worker's loop): each
    request gets its one-pass tokens, grants after the first resume their KV, and rows of a
    later grant stream while an earlier grant is still running."""
    plan = {"x": ([3, 4, 5], 14, 2), "y": ([7, 7, 9, 11], 9, 3), "z": ([20] * 12, 11, 5), "w": ([8] * 30, 6, 4)}
    want = {rid: tokens(hf, [p], n=n)[0] for rid, (p, n, _) in plan.items()}
    got: dict[str, list[int]] = {rid: [] for rid in plan}
    reused: list[int] = []
    q: queue.Queue[Any] = queue.Queue()
    order: list[tuple[str, int]] = []

    def put(rid: str) -> None:
        prompt, n, s = plan[rid]
        r = BatchRequest(rid=rid, token_ids=prompt + got[rid], max_new_tokens=n - len(got[rid]),
                         generated=len(got[rid]), temperature=0.0, ignore_eos=True)
        q.put(BatchMsg(batch_id=next_batch_id(), slice_len=s, requests=[r]))

    def done(batch: BatchMsg, outs: Any, stats: Any, error: str | None) -> None:
        assert error is None
        (out,) = outs
        order.append(("done", batch.batch_id))
        got[out.rid] += out.token_ids
        if stats.reused_tokens:
            assert stats.prefill_tokens == 0
            reused.append(stats.reused_tokens)
        if out.finish_reason is None:
            put(out.rid)  # the next grant arrives while the others still generate
        elif all(len(got[r]) == plan[r][1] for r in plan):
            q.put(None)

    def stream(batch_id: int, outs: Any) -> None:
        order.append(("tokens", batch_id))

    put("x")
    take = queue_take(q)
    started = [False]

    def take_and_admit(timeout: float | None) -> Any:
        item = take(timeout)
        if not started[0]:
            started[0] = True
            for rid in ("y", "z", "w"):
                put(rid)
        return item

    run(bucketed, take_and_admit, done, stream)
    assert got == want
    assert len(reused) == sum(-(-n // s) - 1 for _, n, s in plan.values())
    # Some grant's first tokens came while another grant was running (between its first
    # tokens and its end): rows joined a running set.
    spans: dict[int, list[int]] = {}
    for i, (_, bid) in enumerate(order):
        spans.setdefault(bid, [i, i])[1] = i
    assert any(a < spans[b][0] < z for b in spans for c, (a, z) in spans.items() if c != b)


def test_stop_tokens_min_tokens_and_logit_bias_equal_hf(hf, cb, prompts) -> None:
    (full,) = tokens(hf, [prompts[0]])
    stop = full[5]
    cases = [dict(stop_token_ids=[stop]), dict(min_tokens=9, logit_bias={full[2]: 100.0}, ignore_eos=False,
                                                  stop_token_ids=[full[2]]),
             dict(logit_bias={77: 100.0, 78: -100.0})]
    for kw in cases:
        want = tokens(hf, prompts, **kw)
        assert tokens(cb, prompts, **kw) == want, kw
        got, results = in_grants(cb, f"c{len(kw)}-{next_batch_id()}", prompts[0], GEN, 3, **kw)
        assert got == want[0], kw
    held = tokens(cb, [prompts[0]], min_tokens=9, logit_bias={full[2]: 100.0}, ignore_eos=False,
                  stop_token_ids=[full[2]])[0]
    assert len(held) == 10 and held[-1] == full[2]  # the forced stop token held back for 9 tokens


def test_grammar_rows_beside_plain_rows_and_across_grants(hf, bucketed) -> None:
    llguidance = pytest.importorskip("llguidance")
    import json

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}
    grammar = llguidance.grammar_from("json_schema", json.dumps(schema))
    ps = [[9, 10], [5, 6, 7], [11] * 9]
    reqs = [BatchRequest(rid=f"j{i}", token_ids=p, max_new_tokens=40, temperature=0.0, grammar=grammar if i != 1 else None)
            for i, p in enumerate(ps)]
    want, _ = serve(hf, reqs, 40, kv_reuse=False)
    got, _ = serve(bucketed, reqs, 40, kv_reuse=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert got[0].finish_reason == "stop" and got[0].token_ids[-1] in bucketed.eos
    # In grants of 3 tokens: the matcher is rebuilt from the row's tokens at each grant.
    sliced, results = in_grants(bucketed, "js", ps[0], 40, 3, grammar=grammar, ignore_eos=False)
    assert sliced == want[0].token_ids and len(results) > 2
    bad = BatchRequest(rid="bad", token_ids=[5], max_new_tokens=4, grammar='{"grammars": [{"json_schema": 7}]}')
    good = BatchRequest(rid="good", token_ids=[6], max_new_tokens=4, ignore_eos=True, temperature=0.0)
    outs, _ = serve(bucketed, [bad, good], 4)
    assert outs[0].error is not None and "grammar" in outs[0].error and outs[0].token_ids == []
    assert len(outs[1].token_ids) == 4


def test_read_behind_gives_the_same_tokens(hf, prompts) -> None:
    """The CUDA pipeline (the next step queued before a step's tokens are read), run on the CPU:
    rows that ended are computed once more and their extra token dropped."""
    eng = make(static_buckets=True, graph_batch_sizes="2,8", graph_cache_tokens="32,64,128")
    eng.read_behind = True
    kw = dict(stop_token_ids=[tokens(hf, [prompts[3]])[0][4]])
    want = tokens(hf, prompts, **kw)
    assert tokens(eng, prompts, **kw) == want
    got, _ = in_grants(eng, "rb", prompts[1], GEN, 6)
    assert got == tokens(hf, [prompts[1]])[0]


def test_streamed_tokens_are_the_outputs(cb, prompts) -> None:
    streamed: dict[str, list[int]] = {}

    def emit(outs: list[Any]) -> None:
        for o in outs:
            streamed.setdefault(o.rid, []).extend(o.token_ids)

    # Full prefills (kv_reuse off: no cached prefix of the same prompts from the tests before).
    outs, stats = cb.serve(BatchMsg(batch_id=next_batch_id(), slice_len=GEN, requests=rows(prompts, prefix="st"),
                                    kv_reuse=False), emit)
    assert {o.rid: o.token_ids for o in outs} == streamed
    assert stats.batch_size == len(prompts) and stats.iterations == GEN and stats.pad_tokens == 0
    assert stats.prefill_tokens == sum(map(len, prompts)) and stats.preemptions == 0


def test_caps_and_memory_are_the_arena(cb) -> None:
    info = cb.info()
    caps = info.caps
    assert caps.batching == "continuous" and caps.kv_page_tokens == 1 and caps.sampling and caps.seeded
    assert caps.min_tokens and caps.logit_bias and caps.graph_batch_sizes == []
    assert caps.max_rows == 512 and make(max_rows=48).caps().max_rows == 48  # what one step may run
    assert info.engine == "hf-static-cb" and info.kv_bytes_per_token == 512
    # The arena takes 0.9 of the KV memory (M_ava), the store of spilled rows the rest.
    assert info.mem_available == cb.static.arena.nbytes == (int(0.9 * BUDGET) // 512) * 512
    assert cb.kv is not None and cb.kv.budget == BUDGET - cb.static.arena.nbytes
    assert cb.poll(0.0) == [] and not cb.busy()


def test_its_room_in_rows_follows_the_widest_row() -> None:
    """``rows_now`` (``Result.rows``): the slots the arena holds at the current columns per
    slot, so a long row paused in place lowers it for every row; 0 with nothing held."""
    eng = make(static_share=0.5, mem_budget=2 * 2048 * 512)  # an arena of 2,048 token slots
    tokens_ = eng.static.arena.tokens
    assert eng.rows_now() == 0
    rng = random.Random(3)
    short = [rng.randrange(3, 49152) for _ in range(30)]
    long = [rng.randrange(3, 49152) for _ in range(400)]
    serve(eng, [BatchRequest(rid="short", token_ids=short, max_new_tokens=8, ignore_eos=True)], 4)
    assert eng.kept() == {"short": 33}  # paused in place: its slot stays held
    assert eng.rows.c > 0 and eng.rows_now() == min(eng.static.max_rows, tokens_ // eng.rows.c)
    narrow = eng.rows_now()
    serve(eng, [BatchRequest(rid="long", token_ids=long, max_new_tokens=8, ignore_eos=True)], 4)
    assert set(eng.kept()) == {"short", "long"}
    wide = eng.rows_now()
    assert eng.rows.c >= 404 and wide == tokens_ // eng.rows.c < narrow
    eng.release()
    eng.poll(0.0)  # the next turn lets the released rows' slots go
    assert eng.kept() == {} and eng.rows_now() == wide  # idle: the room at the columns it last had


def test_in_bucket_shapes_its_room_in_rows_is_the_largest_bucket_at_its_columns() -> None:
    """Where batches run in bucket shapes, rows past the largest bucket at the rows' columns would
    wait in the engine (they would step outside the buckets: eagerly, on CUDA), so ``rows_now``
    says that bucket's rows, not what the arena holds: 8 of the 32 that fit at 64 columns."""
    eng = make(static_share=0.5, mem_budget=2 * 2048 * 512, static_buckets=True, graph_batch_sizes="2,8", graph_cache_tokens="32,64")
    rng = random.Random(4)
    ctx = [rng.randrange(3, 49152) for _ in range(40)]
    serve(eng, [BatchRequest(rid="r", token_ids=ctx, max_new_tokens=8, ignore_eos=True)], 8)
    assert eng.rows.c == 64 and eng.static.arena.tokens // 64 == 32 and eng.rows_now() == 8
