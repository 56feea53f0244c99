"""The daemon's grammar children (:mod:`sclsd.daemon.grammar`): each limit refuses the grammar
that passes it with a message naming it, the child that crashed or overran is replaced, and
no other check is disturbed; nothing in the daemon's own process imports llguidance."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

pytest.importorskip("llguidance")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from sclsd import protocol as P  # noqa: E402
from sclsd.daemon.grammar import CAUSES, GrammarChecks  # noqa: E402
from sclsd.daemon.metrics import Metrics  # noqa: E402
from sclsd.grammar_config import GrammarConfig  # noqa: E402

OK = P.Structured(kind="json_schema", value=json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))


def deep_refs(n: int = 1000) -> P.Structured:
    defs: dict[str, object] = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}}
                               for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return P.Structured(kind="json_schema", value=json.dumps({"$defs": defs, "$ref": "#/$defs/d0"}))


def all_of(n: int = 200) -> P.Structured:
    pats = [{"pattern": f"^(a|b)*{'x' * (i % 7)}.*c{i}.*$"} for i in range(n)]
    return P.Structured(kind="json_schema", value=json.dumps({"type": "string", "allOf": pats}))


def run(cfg: GrammarConfig, *grammars: P.Structured, metrics: Metrics | None = None
        ) -> tuple[GrammarChecks, list[tuple[str | None, str | None]]]:
    async def go() -> list[tuple[str | None, str | None]]:
        return list(await asyncio.gather(*(checks.compile(g) for g in grammars)))

    checks = GrammarChecks(cfg, metrics.grammar_refused if metrics is not None else None)
    try:
        return checks, asyncio.run(go())
    finally:
        checks.close()


def refusals(metrics: Metrics) -> dict[str, float]:
    """``sclsd:grammar_refusals_total`` by cause, as a scrape reads it."""
    return {s.labels["cause"]: s.value for fam in text_string_to_metric_families(metrics.exposition())
            for s in fam.samples if s.name == "sclsd:grammar_refusals_total"}


def test_a_valid_grammar_comes_back_as_text_and_an_invalid_one_with_why() -> None:
    metrics = Metrics("m")
    assert refusals(metrics) == dict.fromkeys(CAUSES, 0.0)  # every cause exposed from the start
    _, [(text, why), (none, bad)] = run(GrammarConfig(processes=1),
                                        OK, P.Structured(kind="regex", value="[a-z"), metrics=metrics)
    assert why is None and text is not None and '"json_schema"' in text and "whitespace_flexible" in text
    assert none is None and bad is not None and bad.startswith("regex: ")
    assert refusals(metrics) == {**dict.fromkeys(CAUSES, 0.0), "invalid": 1.0}


def test_a_grammar_past_an_llguidance_limit_is_counted_as_limit() -> None:
    metrics = Metrics("m")
    checks, [(text, why)] = run(GrammarConfig(processes=1, max_grammar_size=5), OK, metrics=metrics)
    assert text is None and "limit for this grammar: 5" in (why or "")
    assert refusals(metrics) == {**dict.fromkeys(CAUSES, 0.0), "limit": 1.0}
    assert checks.refused == {**dict.fromkeys(CAUSES, 0), "limit": 1}


def test_a_crash_refuses_that_grammar_alone_and_the_next_check_gets_a_fresh_child() -> None:
    metrics = Metrics("m")
    checks, results = run(GrammarConfig(processes=1), OK, deep_refs(), OK, metrics=metrics)
    assert results[0][1] is None and results[2][1] is None and results[2][0] == results[0][0]
    assert results[1][0] is None and "SIGSEGV" in (results[1][1] or "")
    assert checks.refused["crash"] == 1
    assert refusals(metrics) == {**dict.fromkeys(CAUSES, 0.0), "crash": 1.0}


def test_memory_past_memory_bytes_refuses_naming_it() -> None:
    metrics = Metrics("m")
    checks, [(text, why)] = run(GrammarConfig(processes=1, timeout_s=60.0, memory_bytes=256 * 1024**2), all_of(),
                                metrics=metrics)
    assert text is None and "grammar.memory_bytes = 268435456" in (why or "")
    assert refusals(metrics) == {**dict.fromkeys(CAUSES, 0.0), "memory": 1.0}


def test_time_past_timeout_s_refuses_naming_it_and_kills_the_child() -> None:
    many = P.Structured(kind="choice", value=json.dumps([f"option {i}" for i in range(45_000)]))
    metrics = Metrics("m")
    checks = GrammarChecks(GrammarConfig(processes=2, timeout_s=0.3), metrics.grammar_refused)
    started = []
    start = checks.children._start  # type: ignore[attr-defined]

    def recorded() -> object:
        started.append(child := start())
        return child

    checks.children._start = recorded  # type: ignore[attr-defined]

    async def go() -> list[tuple[str | None, str | None]]:
        # A quick check beside the slow one is answered, by the other child.
        return list(await asyncio.gather(checks.compile(many), checks.compile(OK)))

    try:
        (slow, fast) = asyncio.run(go())
        assert slow == (None, "the grammar did not compile within grammar.timeout_s = 0.3 s")
        assert fast[1] is None and fast[0] is not None
        assert checks.refused["timeout"] == 1
        # The slow one's child is gone; the others wait for the next checks.
        assert [c.proc.poll() is None for c in started] == [c in checks.idle for c in started]
        assert sum(c.proc.poll() is not None for c in started) == 1
        assert refusals(metrics) == {**dict.fromkeys(CAUSES, 0.0), "timeout": 1.0}
    finally:
        checks.close()


def test_the_daemon_process_never_imports_llguidance() -> None:
    code = ("import sys, asyncio, json; from sclsd.daemon import server, admission, grammar; "
            "from sclsd.daemon.serving import dispatch; from sclsd import protocol as P; "
            "g = grammar.GrammarChecks(grammar.GrammarConfig(processes=1)); "
            "print(asyncio.run(g.compile(P.Structured(kind='json_object')))[1]); "
            "print('llguidance' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["None", "False"], out.stderr
