"""The prompt's log-probabilities (``prompt_logprobs``) in the transformers engines, on the tiny
random Llama: ``hf`` (eager, and its static path with chunked prefills) and ``hf-static-cb``
(whole prefills, and chunked ones that spread newcomers over turns), each held to a direct
full forward of the same model (``model(ids).logits``: the log-softmax at positions 0..n-2
for the prompt tokens 1..n-1, with the k likeliest). Only rows that ask get them, only in
their request's first slice, on their first streamed part and their output; asking does not
change a row's tokens.
"""

from __future__ import annotations

import itertools
import queue
import random
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from sclsd.defaults import ENGINE_FEATURES  # noqa: E402
from sclsd.protocol import BatchMsg, BatchRequest, RequestOutput, TokenLogprobs  # noqa: E402
from unit.engine_loop import queue_take, run  # noqa: E402
from worker.engines import create_engine  # noqa: E402
from worker.engines.deepspeed import DeepSpeedEngine  # noqa: E402
from worker.engines.hf_model import prompt_head_ok  # noqa: E402

GEN = 6
BUDGET = 64 * 1024**2
TOL = 1e-4
_bids = itertools.count(9000)

#: name -> (engine, options): the ways a prefill runs.
ENGINES: dict[str, tuple[str, dict[str, Any]]] = {
    "hf": ("hf", {}),
    # hf's static path, prefills in chunks of 16 tokens over the batch's rows (3 columns a chunk for 5 rows).
    "hf-static": ("hf", dict(static_cache=True, prefill_chunk_tokens=16, static_buckets=True,
                             graph_batch_sizes="2,8", graph_cache_tokens="32,64,128")),
    # Shared prefixes off: the tests compare values bit for bit between batches of rows that
    # ask and rows that do not, and rows that take cached prefixes change which rows prefill
    # together, whose matmul shapes move the last bits (tests/unit/test_arena_prefixes.py
    # holds the tokens of rows that take them).
    "hf-static-cb": ("hf-static-cb", dict(share_prefixes=False)),
    # Newcomers' prefills in chunks of 8 tokens a turn: rows join over several turns, beside
    # rows already decoding, and a long prompt's prefill is cut in chunks.
    "hf-static-cb-chunked": ("hf-static-cb", dict(share_prefixes=False, prefill_chunk_tokens=8, static_buckets=True,
                                                  graph_batch_sizes="2,8", graph_cache_tokens="32,64,128")),
}


def build(name: str) -> Any:
    kind, opts = ENGINES[name]
    eng = create_engine(kind, "tiny-random", threads=1, mem_budget=BUDGET, **opts)
    eng.warm_up()
    return eng


@pytest.fixture(scope="module", params=list(ENGINES))
def engine(request: pytest.FixtureRequest) -> Any:
    return build(request.param)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in (5, 23, 1, 12, 40)]


def req(rid: str, ctx: list[int], n: int = GEN, **kw: Any) -> BatchRequest:
    kw.setdefault("temperature", 0.0)
    kw.setdefault("ignore_eos", True)
    return BatchRequest(rid=rid, token_ids=list(ctx), max_new_tokens=n, **kw)


def serve(engine: Any, reqs: list[BatchRequest], s: int = GEN,
          kv_reuse: bool = True) -> tuple[list[RequestOutput], dict[str, list[RequestOutput]]]:
    """One batch alone: its outputs, and each row's streamed parts in order."""
    parts: dict[str, list[RequestOutput]] = {}

    def emit(outs: list[RequestOutput]) -> None:
        for o in outs:
            parts.setdefault(o.rid, []).append(o)

    outs, _ = engine.serve(BatchMsg(batch_id=next(_bids), slice_len=s, requests=reqs, kv_reuse=kv_reuse), emit)
    return outs, parts


def reference(model: Any, prompt: list[int]) -> Any:
    """``[len - 1, vocab]``: the log-softmax of a direct full forward at positions 0..len-2."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt], dtype=torch.long)).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def check(model: Any, prompt: list[int], got: list[TokenLogprobs], k: int) -> None:
    """``got`` is ``prompt``'s entries as a full forward gives them (module docstring)."""
    ref = reference(model, prompt)
    assert len(got) == len(prompt) - 1
    for i, e in enumerate(got):
        assert e.chosen.id == prompt[i + 1]
        assert e.chosen.logprob == pytest.approx(float(ref[i, prompt[i + 1]]), abs=TOL), i
        assert len(e.top) == k
        if k:
            values, ids = ref[i].topk(k)
            assert [t.id for t in e.top] == ids.tolist(), i
            assert [t.logprob for t in e.top] == pytest.approx(values.tolist(), abs=TOL)
            if e.chosen.id == e.top[0].id:  # the same log-softmax, the same number
                assert e.chosen.logprob == e.top[0].logprob


def check_stream(outs: list[RequestOutput], parts: dict[str, list[RequestOutput]]) -> None:
    """Each row's first streamed part carries its output's prompt log-probabilities, no later one does."""
    for o in outs:
        first, *later = parts[o.rid]
        assert first.prompt_logprobs == o.prompt_logprobs
        assert all(p.prompt_logprobs == [] for p in later)
        assert [t for p in parts[o.rid] for t in p.token_ids] == o.token_ids


def test_the_reference_tells_positions_apart(prompts: list[list[int]]) -> None:
    """The check below would see an off-by-one: neighbouring positions' log-probabilities of the
    same targets differ far beyond the tolerance."""
    model = build("hf").model
    p = prompts[4]
    ref = reference(model, p)
    shifted = [abs(float(ref[i + 1, p[i + 1]] - ref[i, p[i + 1]])) for i in range(len(p) - 2)]
    assert min(shifted) > 100 * TOL


@pytest.mark.parametrize("k", [0, 3])
def test_every_row_equals_a_full_forward(engine: Any, prompts: list[list[int]], k: int) -> None:
    outs, parts = serve(engine, [req(f"a{k}-{i}", p, prompt_logprobs=k) for i, p in enumerate(prompts)])
    for p, o in zip(prompts, outs, strict=True):
        check(engine.model, p, o.prompt_logprobs, k)
    check_stream(outs, parts)
    assert outs[2].prompt_logprobs == []  # a one-token prompt: no token after the first
    # Asking changes no token.
    plain, _ = serve(engine, [req(f"b{k}-{i}", p) for i, p in enumerate(prompts)])
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert all(o.prompt_logprobs == [] for o in plain)


def test_only_the_rows_that_ask_get_them(engine: Any, prompts: list[list[int]]) -> None:
    ks = [2, None, 0, None, 5]
    outs, parts = serve(engine, [req(f"m{i}", p, prompt_logprobs=k) for i, (p, k) in enumerate(zip(prompts, ks, strict=True))])
    plain, _ = serve(engine, [req(f"n{i}", p) for i, p in enumerate(prompts)])
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    check_stream(outs, parts)
    for p, k, o in zip(prompts, ks, outs, strict=True):
        if k is None:
            assert o.prompt_logprobs == []
        else:
            check(engine.model, p, o.prompt_logprobs, k)
    # Sampled rows, and rows asking for their tokens' log-probabilities too: the same draws.
    kw: dict[str, Any] = dict(temperature=0.9, seed=4, top_p=0.9, logprobs=True, top_logprobs=2)
    a, _ = serve(engine, [req(f"s{i}", p, prompt_logprobs=1, **kw) for i, p in enumerate(prompts)])
    b, _ = serve(engine, [req(f"t{i}", p, **kw) for i, p in enumerate(prompts)])
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.logprobs for o in a] == [o.logprobs for o in b]
    check(engine.model, prompts[1], a[1].prompt_logprobs, 1)


def test_a_later_slice_computes_none(engine: Any, prompts: list[list[int]]) -> None:
    """The request's second slice (``generated`` > 0, its KV kept or not) computes none, even
    asked; its first slice's tokens and the second's are the one-pass tokens."""
    p = prompts[3]
    (whole,), _ = serve(engine, [req("w", p, 2 * GEN)], 2 * GEN)
    for kv_reuse in (True, False):
        rid = f"l{kv_reuse}"
        (first,), _ = serve(engine, [req(rid, p, 2 * GEN, prompt_logprobs=3)], GEN, kv_reuse)
        check(engine.model, p, first.prompt_logprobs, 3)
        assert first.finish_reason is None and len(first.token_ids) == GEN
        second_req = req(rid, p + first.token_ids, GEN, generated=GEN, prompt_logprobs=3)
        (second,), parts = serve(engine, [second_req], GEN, kv_reuse)
        assert second.prompt_logprobs == [] and all(x.prompt_logprobs == [] for x in parts[rid])
        assert first.token_ids + second.token_ids == whole.token_ids
        assert (second.reused_tokens > 0) == kv_reuse


def test_a_first_slice_takes_no_kept_kv(engine: Any, prompts: list[list[int]]) -> None:
    """A row scoring its prompt prefills all of it, even with KV kept under its id (which the
    daemon never sends: a first slice has none): every position is scored."""
    p = prompts[1]
    (kept,), _ = serve(engine, [req("k", p, 2 * GEN)], GEN)
    assert kept.kv_tokens > 0
    ctx = p + kept.token_ids
    (out,), _ = serve(engine, [req("k", ctx, GEN, prompt_logprobs=2)], GEN)
    assert out.reused_tokens == 0
    check(engine.model, ctx, out.prompt_logprobs, 2)


def test_rows_joining_a_running_set_mid_run(prompts: list[list[int]]) -> None:
    """``hf-static-cb`` in the worker's loop: grants asking for their prompts' log-probabilities
    arrive while a grant decodes, join its running set (chunked prefills), and each gets its
    own, on its first streamed part; the running row gets none."""
    eng = build("hf-static-cb-chunked")
    plan = {"x": (prompts[1], None, 30), "y": (prompts[4], 3, GEN), "z": (prompts[0], 0, GEN),
            "v": (prompts[3], None, GEN)}
    outs: dict[str, RequestOutput] = {}
    parts: dict[str, list[RequestOutput]] = {}
    order: list[tuple[str, int]] = []
    bids: dict[str, int] = {}
    q: queue.Queue[Any] = queue.Queue()

    def put(rid: str) -> None:
        prompt, k, n = plan[rid]
        bids[rid] = next(_bids)
        q.put(BatchMsg(batch_id=bids[rid], slice_len=n, requests=[req(rid, prompt, n, prompt_logprobs=k)]))

    def done(batch: BatchMsg, got: Any, stats: Any, error: str | None) -> None:
        assert error is None
        (out,) = got
        outs[out.rid] = out
        order.append(("done", batch.batch_id))
        if len(outs) == len(plan):
            q.put(None)

    def stream(batch_id: int, got: list[RequestOutput]) -> None:
        order.append(("tokens", batch_id))
        for o in got:
            parts.setdefault(o.rid, []).append(o)

    put("x")
    take = queue_take(q)
    started = [0]

    def take_and_admit(timeout: float | None) -> Any:
        item = take(timeout)
        started[0] += 1
        if started[0] == 3:  # x has joined and decodes by now
            for rid in ("y", "z", "v"):
                put(rid)
        return item

    run(eng, take_and_admit, done, stream)
    check_stream(list(outs.values()), parts)
    for rid, (prompt, k, _) in plan.items():
        if k is None:
            assert outs[rid].prompt_logprobs == []
        else:
            check(eng.model, prompt, outs[rid].prompt_logprobs, k)
    want, _ = serve(build("hf"), [req(f"h{rid}", p, n) for rid, (p, _, n) in plan.items()], 30)
    assert [outs[rid].token_ids for rid in plan] == [o.token_ids for o in want]
    # x streamed tokens before y's first and ended after it: y joined a running set.
    first_y = order.index(("tokens", bids["y"]))
    assert order.index(("tokens", bids["x"])) < first_y < order.index(("done", bids["x"]))


def test_caps_and_features() -> None:
    for name in ("hf", "hf-static-cb"):
        assert build(name).caps().prompt_logprobs
        assert name in ENGINE_FEATURES["prompt_logprobs"]
    for name in ("hf-cb", "deepspeed"):
        assert name not in ENGINE_FEATURES["prompt_logprobs"]
    # deepspeed runs hf's loop over a wrapped model, which the check never saw: none.
    assert not DeepSpeedEngine.__new__(DeepSpeedEngine).scores_prompts()
    cb = create_engine("hf-cb", "tiny-random", threads=1, num_blocks=64, sampling=False)
    try:
        assert not cb.info().caps.prompt_logprobs
    finally:
        cb.close()


def test_a_head_it_does_not_know_turns_them_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check behind ``caps.prompt_logprobs``: the tap and the head give the model's own
    logits; a model whose head differs (here: a soft-capping the model does not apply, as a
    head the tap does not reproduce would) reports none."""
    eng = build("hf")
    assert prompt_head_ok(eng.model, eng.device)
    monkeypatch.setattr(eng.model.config, "final_logit_softcapping", 1e-3, raising=False)
    assert not prompt_head_ok(eng.model, eng.device)
