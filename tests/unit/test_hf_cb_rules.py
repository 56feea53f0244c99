"""hf-cb applies each row's ``min_tokens``, ``logit_bias`` and grammar per request inside
transformers' continuous batching, greedy or sampled, and across grants (tiny random Llama)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from sclsd import protocol as P
from sclsd.structured import grammar_text

torch = pytest.importorskip("torch")
llguidance = pytest.importorskip("llguidance")

PROMPT = [5, 6, 7, 8, 9]
FORCED = 77  # an ordinary token the random model does not choose by itself
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
          "required": ["ok", "n"], "additionalProperties": False,
          "x-guidance": {"whitespace_flexible": False}}  # compact: as sclsd.structured makes it


def make_cb(**kw: Any) -> Any:
    from worker.engines import create_engine

    # A small cache: allocating transformers' default one takes tens of seconds on a CPU.
    return create_engine("hf-cb", "tiny-random", threads=1, num_blocks=64, **kw)


@pytest.fixture(scope="module")
def engines():
    from worker.engines import create_engine

    greedy, sampled = make_cb(sampling=False), make_cb(sampling=True)  # whatever the default
    yield greedy, sampled, create_engine("hf", "tiny-random", threads=1, kv_reuse=False)
    greedy.close()
    sampled.close()


@pytest.fixture(params=["greedy", "sampled"])
def cb(request, engines) -> Any:
    return engines[0] if request.param == "greedy" else engines[1]


_bids = iter(range(1, 10**6))


def serve(engine: Any, *rows: P.BatchRequest, s: int = 64, kv_reuse: bool = False) -> list[P.RequestOutput]:
    outs, _ = engine.serve(P.BatchMsg(batch_id=next(_bids), slice_len=s, requests=list(rows), kv_reuse=kv_reuse))
    return outs


def row(rid: str, ctx: list[int], n: int, **kw: Any) -> P.BatchRequest:
    kw.setdefault("temperature", 0.0)
    return P.BatchRequest(rid=rid, token_ids=list(ctx), max_new_tokens=n, **kw)


def grammar(kind: str = "json_schema", value: Any = SCHEMA) -> str:
    return llguidance.grammar_from(kind, value if isinstance(value, str) else json.dumps(value))


def text(ids: list[int]) -> str:
    from sclsd import models

    return models.load_tokenizer(models.resolve("tiny-random")).decode(ids, skip_special_tokens=True)


def test_caps_say_all_three_are_applied(engines) -> None:
    caps = engines[0].info().caps
    assert caps.min_tokens and caps.logit_bias and caps.grammar


# ---------------------------------------------------------------------- min_tokens, logit_bias

def test_min_tokens_holds_a_heavily_biased_eos_back(cb) -> None:
    eos = cb.eos[0]
    held, free, hot = serve(
        cb,
        row("held", PROMPT, 12, logit_bias={eos: 100.0}, min_tokens=5),
        row("free", PROMPT, 12, logit_bias={eos: 100.0}),
        # A stop token of the row's own, and (on the sampling engine) a sampled row.
        row("hot", PROMPT, 12, logit_bias={FORCED: 100.0}, min_tokens=3, stop_token_ids=[FORCED],
            ignore_eos=True, temperature=1.0 if cb.sampling else 0.0))
    assert len(held.token_ids) == 6 and held.token_ids[-1] == eos and eos not in held.token_ids[:5]
    assert held.finish_reason == "stop"
    assert free.token_ids == [eos] and free.finish_reason == "stop"  # the bias alone stops at once
    assert len(hot.token_ids) == 4 and hot.token_ids[-1] == FORCED and FORCED not in hot.token_ids[:3]


def test_min_tokens_counts_the_whole_request_across_grants(engines) -> None:
    greedy, sampled, _ = engines
    eos = greedy.eos[0]

    def r(ctx: list[int], got: list[int]) -> P.BatchRequest:
        return row("mt", ctx + got, 12 - len(got), generated=len(got), logit_bias={eos: 100.0}, min_tokens=5)

    (whole,) = serve(greedy, r(PROMPT, []))
    assert len(whole.token_ids) == 6
    got: list[int] = []
    engine = greedy
    for _ in range(8):
        if got and got[-1] == eos:
            break
        (out,) = serve(engine, r(PROMPT, got), s=2, kv_reuse=True)
        got += out.token_ids
        if len(got) == 4:  # moved to another worker: its rules start from the row's generated
            greedy.release(["mt"])
            engine = sampled
    assert got == whole.token_ids


def test_a_large_logit_bias_forces_its_token_and_only_in_its_row(cb, engines) -> None:
    hf = engines[2]
    (want,) = serve(hf, row("p", PROMPT, 6, ignore_eos=True))
    forced, plain, hot = serve(cb, row("f", PROMPT, 6, logit_bias={FORCED: 100.0, 3: -100.0}, ignore_eos=True),
                               row("p", PROMPT, 6, ignore_eos=True),
                               row("h", PROMPT, 6, logit_bias={FORCED: 100.0}, ignore_eos=True,
                                   temperature=1.0 if cb.sampling else 0.0))
    assert forced.token_ids == [FORCED] * 6 and hot.token_ids == [FORCED] * 6
    assert plain.token_ids == want.token_ids
    # Ids outside the vocabulary are ignored, as the static engines do.
    (out,) = serve(cb, row("o", PROMPT, 6, logit_bias={10**6: 100.0}, ignore_eos=True))
    assert out.token_ids == want.token_ids


# ---------------------------------------------------------------------- grammars

def test_a_grammar_row_follows_it_greedy_or_sampled(cb, engines) -> None:
    hf = engines[2]
    g = row("g", PROMPT, 40, grammar=grammar())
    # As the daemon makes it from a request's response_format / structured.
    choice = row("c", [3, 4], 20, grammar=grammar_text(P.Structured(kind="choice", value='["yes", "no", "maybe"]')))
    plain = row("p", PROMPT, 12, ignore_eos=True)
    out, ch, p = serve(cb, g, choice, plain)
    value = json.loads(text(out.token_ids))
    assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and value["n"] in (1, 2, 3)
    assert out.finish_reason == "stop" and out.token_ids[-1] in cb.eos
    assert text(ch.token_ids) in ("yes", "no", "maybe") and ch.finish_reason == "stop"
    want = serve(hf, g, choice, plain)
    assert [o.token_ids for o in (out, ch, p)] == [o.token_ids for o in want]  # greedy rows: hf's tokens
    with pytest.raises(ValueError):  # the random model alone writes no JSON
        json.loads(text(p.token_ids))
    if cb.sampling:
        hot = [row(str(i), [3 + i], 40, temperature=1.0, grammar=grammar()) for i in range(4)]
        for o in serve(cb, *hot):
            assert set(json.loads(text(o.token_ids))) == {"ok", "n"}


def test_the_grammar_state_travels_across_grants(engines) -> None:
    greedy, sampled, _ = engines

    def r(got: list[int]) -> P.BatchRequest:
        return row("gs", PROMPT + got, 40 - len(got), generated=len(got), grammar=grammar())

    (whole,) = serve(greedy, r([]))
    assert set(json.loads(text(whole.token_ids))) == {"ok", "n"}
    for moves in (False, True):
        got: list[int] = []
        engine, reused = greedy, 0
        for _ in range(40):
            if got and got[-1] in greedy.eos:
                break
            outs, stats = engine.serve(P.BatchMsg(batch_id=next(_bids), slice_len=3, requests=[r(got)],
                                                  kv_reuse=True))
            got += outs[0].token_ids
            reused += stats.reused_tokens > 0
            if moves:  # every grant on the other worker: a fresh request, its grammar replayed
                engine.release(["gs"])
                engine = sampled if engine is greedy else greedy
        assert got == whole.token_ids
        assert (reused == 0) if moves else (reused >= 2)  # kept and resumed: its matcher kept


def test_a_bad_grammar_fails_its_row_alone_with_the_reason(engines) -> None:
    cb = engines[0]
    bad = row("b", [5], 4, grammar='{"grammars": [{"json_schema": 7}]}')
    limited = row("lim", [5], 4, grammar=grammar(), grammar_limits=P.GrammarLimits(max_grammar_size=5))
    by = {o.rid: o for o in serve(cb, bad, row("ok", [5], 4, ignore_eos=True), limited)}
    assert by["b"].token_ids == [] and "could not be built" in (by["b"].error or "")
    assert by["lim"].token_ids == [] and "grammar size" in (by["lim"].error or "")
    assert len(by["ok"].token_ids) == 4 and by["ok"].error is None  # the batch did not fail
    (out,) = serve(cb, bad)  # a batch of one failed row ends at once
    assert out.error
    (out,) = serve(cb, row("ok", [5], 4, ignore_eos=True))  # the engine goes on
    assert len(out.token_ids) == 4


def test_rows_without_rules_cost_no_processing(engines) -> None:
    cb = engines[0]
    serve(cb, row("r", PROMPT, 4, min_tokens=2), row("p", PROMPT, 4))
    serve(cb, row("p", PROMPT, 4))
    # Greedy with no rules left: transformers' processor list is off for the step, and
    # what ended was forgotten.
    assert cb._mgr.logit_processor.do_processing is False
    assert cb._rules.rules == {}
    (out,) = serve(cb, row("k", PROMPT, 8, min_tokens=2), s=3, kv_reuse=True)
    assert len(cb._rules.rules) == 1  # kept with its request between grants
    cb.release(["k"])
    assert cb._rules.rules == {}


# ---------------------------------------------------------------------- the processor itself

def _state(rid: str, prompt: list[int], generated: list[int], true_initial: int = 0) -> Any:
    return SimpleNamespace(request_id=rid, initial_tokens=prompt, generated_tokens=generated,
                           _true_initial_tokens=true_initial)


def test_the_captured_path_masks_as_the_eager_one_and_leaves_other_rows_alone(engines) -> None:
    """CUDA graphs need static buffers applied at every step; on the CPU both paths must agree
    (padded rows and rows without rules untouched), also over rows that change between steps."""
    from worker.engines.cb_constraints import RequestRules, RowRules
    from worker.engines.grammar import grammar_for

    cb = engines[0]
    vocab = int(cb.config.vocab_size)
    tokenizer = grammar_for(cb.spec, vocab, cb.eos)
    eos = tuple(cb.eos)

    def rules_of(r: P.BatchRequest) -> RowRules:
        built = RowRules.build(r, eos, vocab, tokenizer)
        assert built is not None
        return built

    eager, captured = RequestRules(vocab, "cpu"), RequestRules(vocab, "cpu", captured=True, rows=6)
    rows = [row("b", PROMPT, 9, logit_bias={FORCED: 5.0, 9: -3.0}),
            row("m", PROMPT, 9, min_tokens=4, generated=1),
            row("g", PROMPT, 9, grammar=grammar("regex", "(yes|no)+")),
            row("all", PROMPT, 9, logit_bias={4: 1.5}, min_tokens=9, grammar=grammar("regex", "[a-z]+"))]
    for proc in (eager, captured):
        for r in rows:
            proc.add(r.rid, rules_of(r))
    gen: dict[str, list[int]] = {r.rid: [] for r in rows}
    # Steps of changing rows; "soft" was soft-reset by transformers (generated moved into its prompt).
    plans = [["b", "x", "m", "g", "all"], ["g", "b", "all"], ["x", "x", "m"], ["all", "g", "b", "m", "x"]]
    g = torch.Generator().manual_seed(0)
    for step, plan in enumerate(plans):
        fs = [SimpleNamespace(state=_state(rid, PROMPT, gen.get(rid, []))) for rid in plan]
        scores = torch.randn((len(plan) + 1, vocab), generator=g)  # + a padded row
        for proc in (eager, captured):
            proc.prepare_tensor_args(fs)
        a = eager(scores[: len(plan)].clone(), torch.empty(0))
        b = captured(scores.clone(), torch.empty(0))
        assert torch.equal(a, b[: len(plan)]) and torch.equal(b[-1], scores[-1]), step
        for i, rid in enumerate(plan):
            if rid == "x":
                assert torch.equal(a[i], scores[i])
            elif rid in gen:
                gen[rid].append(int(a[i].argmax()))
        if step == 0:
            assert a[0, FORCED] == scores[0, FORCED] + 5.0 and a[0, 9] == scores[0, 9] - 3.0
            assert a[2, eos[0]] == float("-inf")  # min_tokens 4, 1 generated before
    # Only the grammar's tokens were picked for the grammar rows.
    assert text(gen["g"]).replace("yes", "").replace("no", "") == ""
    # A soft reset (generated tokens moved into the prompt) keeps the count and the matcher's place.
    rr = captured.get("g")
    assert rr is not None
    soft = _state("g", PROMPT + gen["g"][:2], gen["g"][2:], true_initial=len(PROMPT))
    from worker.engines.cb_constraints import generated_count, generated_since

    assert generated_count(soft) == len(gen["g"]) and generated_since(soft, 1) == gen["g"][1:]


def test_an_engine_on_the_captured_path_gives_the_same_tokens(engines, monkeypatch) -> None:
    """The static buffers CUDA graphs need, driven by transformers' own loop (on the CPU)."""
    from worker.engines import cb_constraints

    class Captured(cb_constraints.RequestRules):
        def __init__(self, vocab: int, device: Any, captured: bool = False, rows: int = 0) -> None:
            super().__init__(vocab, device, captured=True, rows=16)

    monkeypatch.setattr(cb_constraints, "RequestRules", Captured)  # what the manager's start builds
    cb = make_cb()
    try:
        eos = cb.eos[0]
        batch = [row("g", PROMPT, 40, grammar=grammar()),
                 row("m", PROMPT, 12, logit_bias={eos: 100.0, FORCED: 3.0}, min_tokens=5),
                 row("p", PROMPT, 8, ignore_eos=True),
                 row("c", [3, 4], 20, grammar=grammar("regex", "(yes|no|maybe)"), min_tokens=2)]
        got = serve(cb, *batch)
        assert cb._rules.captured
        assert [o.token_ids for o in got] == [o.token_ids for o in serve(engines[0], *batch)]
        (later,) = serve(cb, row("p", PROMPT, 8, ignore_eos=True))  # rows left neutral after
        assert later.token_ids == got[2].token_ids
    finally:
        cb.close()
