"""The subset of JSON schema the recorded tool definitions use, for checking answers
against them (``tests/data/tool-clients.json``); shared by the unit and integration tests."""

from __future__ import annotations

from typing import Any


def follows(value: Any, schema: dict[str, Any]) -> bool:
    """``value`` follows ``schema`` (objects with properties, required and
    additionalProperties; strings; integers; anything where no type is given)."""
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        return (isinstance(value, dict) and set(schema.get("required", [])) <= set(value)
                and (schema.get("additionalProperties", True) is not False or set(value) <= set(props))
                and all(follows(v, props[k]) for k, v in value.items() if k in props))
    if kind == "string":
        return isinstance(value, str)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    return kind is None
