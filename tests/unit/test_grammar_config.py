"""``[grammar]`` keys: each one checked at load, a bad value named with its key; the limits
reach every batch row with a grammar."""

from __future__ import annotations

import pytest

from sclsd import config as C
from sclsd import protocol as P


@pytest.mark.parametrize(("key", "value"), [
    ("processes", 0), ("processes", 65), ("timeout_s", 0.0), ("timeout_s", 601.0),
    ("memory_bytes", 1024), ("max_grammar_size", 0), ("max_items_in_row", -1),
    ("initial_lexer_fuel", 0), ("step_lexer_fuel", 0), ("step_max_items", 0), ("max_lexer_states", 0),
    ("timeout_s", "5"), ("processes", True), ("quick_s", 0.0), ("quick_s", 6.0), ("cache_entries", -1),
    ("cache_bytes", -1), ("cache_entries", 1.5),
])
def test_a_bad_grammar_value_is_refused_naming_key_and_value(key: str, value: object) -> None:
    with pytest.raises(C.ConfigError) as info:
        C.from_dict({"grammar": {key: value}})
    assert info.value.key == f"grammar.{key}" and info.value.value == value
    assert f"grammar.{key} = {value!r}" in str(info.value)


def test_the_defaults_are_llguidances_and_travel_as_the_rows_limits() -> None:
    llguidance = pytest.importorskip("llguidance")
    g = C.load(None).grammar
    lib = llguidance.LLParserLimits()
    assert g.limits() == {k: getattr(lib, k) for k in g.limits()}
    assert P.GrammarLimits(**g.limits()) == P.GrammarLimits()
    over = C.override(C.load(None), grammar__timeout_s=2, grammar__max_grammar_size=1000)
    assert over.grammar.timeout_s == 2.0 and over.grammar.limits()["max_grammar_size"] == 1000
