"""Structured output on the daemon's side: a request's :class:`~sclsd.protocol.Structured`
turned into llguidance's grammar text (what batch rows carry to the workers, which enforce
it as a token mask: :mod:`worker.engines.grammar`), and checked at admission.

JSON comes out compact (no free whitespace between tokens, ``", "`` and ``": "`` as
separators): a model left free to add whitespace may spend its whole budget on it.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from .protocol import Structured

__all__ = ["check", "grammar_text"]

#: llguidance's JSON layout settings added to every JSON schema (unless it sets its own).
COMPACT = {"whitespace_flexible": False}


def _schema(s: Structured) -> dict[str, Any] | bool:
    if s.kind == "json_object":
        return {"type": "object"}
    schema = json.loads(s.value)
    if not isinstance(schema, (dict, bool)):
        raise ValueError("a JSON schema must be an object (or true/false)")
    return schema


@functools.lru_cache(maxsize=256)
def _grammar(kind: str, value: str) -> str:
    import llguidance

    s = Structured(kind=kind, value=value)  # type: ignore[arg-type]
    if kind in ("json_object", "json_schema"):
        schema = _schema(s)
        if isinstance(schema, dict):
            schema = {**schema, "x-guidance": {**COMPACT, **schema.get("x-guidance", {})}}
        return str(llguidance.grammar_from("json_schema", json.dumps(schema)))
    return str(llguidance.grammar_from(kind, value))  # type: ignore[arg-type]  # a Structured kind


def grammar_text(s: Structured) -> str:
    """llguidance's grammar text for ``s`` (cached: the same schema is converted once)."""
    return _grammar(s.kind, s.value)


def check(s: Structured) -> str | None:
    """Why ``s`` cannot be enforced (a schema that is not JSON, a regex or grammar that does
    not parse, a construct llguidance does not support), or None."""
    import llguidance

    try:
        text = grammar_text(s)
    except (ValueError, TypeError) as exc:  # json.JSONDecodeError is a ValueError
        return f"{s.kind}: {exc}"
    err = llguidance.LLMatcher.validate_grammar(text, None)
    return f"{s.kind}: {err.strip().splitlines()[0] if err.strip() else 'invalid'}" if err else None
