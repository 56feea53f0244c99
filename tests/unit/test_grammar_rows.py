"""A row whose grammar cannot be built fails alone, in every engine: its output carries the
error (``RequestOutput.error``), the rest of its batch is served as if it had not been there,
and the batch itself does not fail (so the daemon neither retries it nor drops the worker)."""

from __future__ import annotations

import json
from typing import Any

import pytest

llguidance = pytest.importorskip("llguidance")

from sclsd import protocol as P  # noqa: E402
from sclsd.structured import grammar_text  # noqa: E402
from unit.engine_loop import run_batches  # noqa: E402
from worker.engines import grammar as G  # noqa: E402
from worker.engines.fake import FakeEngine  # noqa: E402

SCHEMA = {"type": "object", "properties": {"a": {"enum": [1, 2]}, "b": {"type": "string", "maxLength": 5}},
          "required": ["a", "b"], "additionalProperties": False}


def schema_grammar() -> str:
    return grammar_text(P.Structured(kind="json_schema", value=json.dumps(SCHEMA)))


def rows() -> list[P.BatchRequest]:
    g = schema_grammar()
    return [
        P.BatchRequest(rid="json", token_ids=[5, 6, 7], max_new_tokens=60, grammar=g, temperature=0.0),
        P.BatchRequest(rid="plain", token_ids=[8, 9], max_new_tokens=10, ignore_eos=True, temperature=0.0),
        # Past a limit the daemon's [grammar] sets (a grammar this small has more symbols).
        P.BatchRequest(rid="limit", token_ids=[5, 6, 7], max_new_tokens=10, grammar=g,
                       grammar_limits=P.GrammarLimits(max_grammar_size=5)),
        P.BatchRequest(rid="broken", token_ids=[5, 6, 7], max_new_tokens=10, grammar="start: %%%"),
    ]


def run_one(engine: Any, batch: P.BatchMsg) -> tuple[list[P.RequestOutput] | None, str | None]:
    """``batch`` through the engine's own loop (what the worker runs): (outputs, error)."""
    ((_, outs, _, err),) = run_batches(engine, [batch])
    return outs, err


def test_fake_engine_enforces_a_grammar() -> None:
    eng = FakeEngine(grammar=True)
    assert eng.info().caps.grammar
    (out,), _ = eng.serve(P.BatchMsg(batch_id=1, slice_len=60, requests=rows()[:1]))
    value = json.loads(bytes(t % 256 for t in out.token_ids[:-1]).decode("utf-8", errors="replace"))
    assert value["a"] in (1, 2) and len(value["b"]) <= 5 and out.finish_reason == "stop"


def make_engine(name: str) -> Any:
    if name == "fake":
        return FakeEngine(grammar=True)
    pytest.importorskip("torch")
    from worker.engines import create_engine

    return create_engine("hf", "tiny-random", threads=1, mem_budget=64 * 1024**2, kv_reuse=False)


@pytest.mark.parametrize("engine_name", ["fake", "hf"])
def test_a_static_batch_serves_the_other_rows_and_fails_the_bad_ones_alone(engine_name: str) -> None:
    eng = make_engine(engine_name)
    outs, err = run_one(eng, P.BatchMsg(batch_id=1, slice_len=60, requests=rows()))
    assert err is None and outs is not None  # the batch did not fail
    by = {o.rid: o for o in outs}
    assert set(by) == {"json", "plain", "limit", "broken"}
    assert "grammar size" in (by["limit"].error or "") and "limit" in (by["limit"].error or "")
    assert by["broken"].error and by["broken"].token_ids == [] == by["limit"].token_ids
    assert by["json"].error is None and by["plain"].error is None
    assert len(by["plain"].token_ids) == 10 and by["json"].finish_reason == "stop"
    if engine_name == "fake":  # the others come out exactly as in a batch without the bad rows
        alone, _ = make_engine("fake").serve(P.BatchMsg(batch_id=2, slice_len=60, requests=rows()[:2]))
        assert [by["json"].token_ids, by["plain"].token_ids] == [o.token_ids for o in alone]


def test_a_panic_building_the_matcher_is_a_grammar_error(monkeypatch: pytest.MonkeyPatch) -> None:
    class PanicException(BaseException):  # what pyo3 raises for a Rust panic
        pass

    def panics(*args: Any, **kw: Any) -> Any:
        raise PanicException("assertion failed: grammar.symbols.len() < u16::MAX as usize - 10")

    monkeypatch.setattr(llguidance, "LLMatcher", panics)
    with pytest.raises(G.GrammarError) as info:
        G.row_matcher(rows()[0], G.byte_grammar_tokenizer(1000, 2, 3))
    assert info.value.rid == "json" and "PanicException" in str(info.value)
    outs, err = run_one(FakeEngine(grammar=True), P.BatchMsg(batch_id=3, slice_len=8, requests=rows()[:2]))
    assert err is None and outs is not None
    assert {o.rid: o.error is not None for o in outs} == {"json": True, "plain": False}

    def interrupted(*args: Any, **kw: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(llguidance, "LLMatcher", interrupted)
    with pytest.raises(KeyboardInterrupt):
        G.row_matcher(rows()[0], G.byte_grammar_tokenizer(1000, 2, 3))


def test_replayed_tokens_that_do_not_follow_the_grammar_fail_the_row() -> None:
    r = P.BatchRequest(rid="x", token_ids=[5, ord("z"), ord("z")], generated=2, max_new_tokens=5,
                       grammar=schema_grammar())
    with pytest.raises(G.GrammarError, match="do not follow"):
        G.row_matcher(r, G.byte_grammar_tokenizer(1000, 2, 3))
