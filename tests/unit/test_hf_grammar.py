"""Structured output in the torch engines: a row's grammar as a token mask, its state
replayed from the row's tokens at every slice, the same output in slices as in one pass."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
llguidance = pytest.importorskip("llguidance")

from sclsd.protocol import BatchMsg, BatchRequest  # noqa: E402
from worker.engines import create_engine  # noqa: E402

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
          "required": ["ok", "n"], "additionalProperties": False,
          # Compact JSON: a random model would otherwise fill its budget with whitespace.
          "x-guidance": {"whitespace_flexible": False}}


@pytest.fixture(scope="module")
def engine():
    return create_engine("hf", "tiny-random", threads=1, mem_budget=64 * 1024**2, kv_reuse=False)


def grammar() -> str:
    return llguidance.grammar_from("json_schema", json.dumps(SCHEMA))


def row(rid: str, ids: list[int], generated: int = 0, n: int = 40, **kw) -> BatchRequest:
    return BatchRequest(rid=rid, token_ids=ids, max_new_tokens=n - generated, generated=generated,
                        temperature=0.0, grammar=grammar(), **kw)


def text(ids: list[int]) -> str:
    from sclsd import models

    return models.load_tokenizer(models.resolve("tiny-random")).decode(ids, skip_special_tokens=True)


def test_a_grammar_row_gives_schema_valid_json_and_stops(engine) -> None:
    plain = BatchRequest(rid="plain", token_ids=[5, 6, 7], max_new_tokens=12, temperature=0.0)
    outs, _ = engine.serve(BatchMsg(batch_id=1, slice_len=40, requests=[row("g", [5, 6, 7]), plain]))
    g, p = outs
    value = json.loads(text(g.token_ids))
    assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and value["n"] in (1, 2, 3)
    assert g.finish_reason == "stop" and g.token_ids[-1] in engine.eos
    with pytest.raises(ValueError):  # the random model alone writes no JSON
        json.loads(text(p.token_ids))
    assert engine.info().caps.grammar


def test_the_grammar_state_travels_with_the_tokens_across_slices(engine) -> None:
    (whole,), _ = engine.serve(BatchMsg(batch_id=2, slice_len=40, requests=[row("w", [9, 10])]))
    got: list[int] = []
    while not got or got[-1] not in engine.eos:
        (out,), _ = engine.serve(BatchMsg(batch_id=3, slice_len=3, requests=[row("s", [9, 10] + got, len(got))]))
        got += out.token_ids
    assert got == whole.token_ids


def test_sampled_rows_follow_their_grammar_too(engine) -> None:
    reqs = [BatchRequest(rid=str(i), token_ids=[3 + i], max_new_tokens=40, temperature=1.0, seed=i,
                         grammar=grammar()) for i in range(4)]
    outs, _ = engine.serve(BatchMsg(batch_id=4, slice_len=40, requests=reqs))
    for o in outs:
        assert set(json.loads(text(o.token_ids))) == {"ok", "n"}


def test_a_bad_grammar_fails_its_row_with_the_reason(engine) -> None:
    bad = BatchRequest(rid="b", token_ids=[5], max_new_tokens=4, grammar='{"grammars": [{"json_schema": 7}]}')
    good = BatchRequest(rid="g", token_ids=[6], max_new_tokens=4, ignore_eos=True, temperature=0.0)
    outs, stats = engine.serve(BatchMsg(batch_id=5, slice_len=4, requests=[bad, good]))
    assert {o.rid for o in outs} == {"b", "g"} and stats.batch_size == 1
    (failed,) = [o for o in outs if o.rid == "b"]
    assert failed.error is not None and "grammar" in failed.error and failed.token_ids == []
    assert len(next(o for o in outs if o.rid == "g").token_ids) == 4
