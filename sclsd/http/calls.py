"""How a chat's answer becomes OpenAI ``tool_calls``, by ``tool_choice``.

* ``auto``: the model may call; Hermes-style ``<tool_call>`` blocks in its text are
  parsed out (:mod:`.tools`, as vLLM's ``hermes`` parser).
* ``required``: the answer is forced, by structured output, to be a call of one of the
  tools: a JSON array of ``{"name": ..., "parameters": {...}}`` (vLLM's schema for it),
  each item's ``parameters`` following its tool's JSON schema; one item at most when
  ``parallel_tool_calls`` is false.
* a named function: the answer is forced to be that function's arguments (its
  parameters' schema).

A forced answer cannot be anything but a call, so it is parsed as JSON, never guessed
at. An answer cut short by ``max_tokens`` ends with ``length``: a named call keeps the
arguments as far as they went (as OpenAI does), a ``required`` array its items that
closed (none closed: the text is the content). :class:`Mode` holds the choice; its :meth:`Mode.parse` reads a
whole answer, its :meth:`Mode.stream` a streamed one, both in OpenAI's shapes.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Literal

from . import tools
from .errors import bad

Choice = Literal["auto", "required", "named"]

#: Whitespace and control characters: nothing a forced (compact JSON) answer ends with; a
#: model's end-of-text token may decode to one (the fake model's does).
_TRAILING = "".join(map(chr, range(33)))
#: A tool without ``parameters`` takes an empty object.
_NO_PARAMS: dict[str, Any] = {"type": "object", "properties": {}}


def _params(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or _NO_PARAMS


def _hoist_defs(schemas: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Each tool's ``$defs`` moved to the root of the combined schema, where its
    ``#/$defs/...`` references point (pydantic puts nested models there). Two tools that
    define one name differently cannot share a root: 400."""
    defs: dict[str, Any] = {}
    out = []
    for s in schemas:
        s = dict(s)
        for name, d in (s.pop("$defs", None) or {}).items():
            if name in defs and defs[name] != d:
                raise bad("tools", f"tools: two tools define $defs/{name} differently; "
                          "tool_choice required needs one definition per name")
            defs[name] = d
        out.append(s)
    return out, defs


def required_schema(offered: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """vLLM's schema for ``tool_choice: "required"``: a non-empty array of calls, each
    ``{"name": one tool, "parameters": its arguments}``; at most one if not ``parallel``."""
    params, defs = _hoist_defs([_params(t) for t in offered])
    items = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                             "parameters": p},
              "required": ["name", "parameters"], "additionalProperties": False}
             for t, p in zip(offered, params, strict=True)]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


@dataclass(frozen=True)
class Mode:
    """How tool calls come out of one chat's answers (see the module docstring)."""

    choice: Choice
    parallel: bool = True
    name: str | None = None
    """The named function (``choice`` = ``named``)."""

    def structured(self, offered: list[dict[str, Any]]) -> dict[str, str] | None:
        """The daemon's ``structured`` that forces the call (None for ``auto``)."""
        if self.choice == "auto":
            return None
        if self.choice == "named":
            (tool,) = [t for t in offered if t["function"]["name"] == self.name]
            return {"kind": "json_schema", "value": json.dumps(_params(tool))}
        return {"kind": "json_schema", "value": json.dumps(required_schema(offered, self.parallel))}

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, OpenAI ``tool_calls`` entries) of a whole answer."""
        if self.choice == "auto":
            content, calls = tools.parse(text, self.parallel)
            return content, tools.as_openai(calls)
        text = text.rstrip(_TRAILING)
        if self.choice == "named":
            assert self.name is not None
            return None, tools.as_openai([{"name": self.name, "arguments": text}])
        found = _array_calls(text)
        if found is None:
            # Cut short: the items that closed are calls, as a stream would have sent them.
            scan = ArrayStream(self.parallel)
            _, items = scan.feed(text)
            return (None, items) if items else (text, [])
        return None, tools.as_openai(found if self.parallel else found[:1])

    def stream(self) -> CallStream:
        """A parser for one streamed choice's answer."""
        if self.choice == "auto":
            return HermesStream(tools.ToolStream(parallel=self.parallel))
        if self.choice == "named":
            assert self.name is not None
            return NamedStream(self.name)
        return ArrayStream(self.parallel)


def _item(obj: Any) -> dict[str, Any] | None:
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
        return None
    return {"name": obj["name"],
            "arguments": json.dumps(obj.get("parameters", {}), ensure_ascii=False)}


def _array_calls(text: str) -> list[dict[str, Any]] | None:
    """The calls of a complete ``required`` answer, or None if it is not one."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, list) or not value:
        return None
    calls = [_item(v) for v in value]
    return None if any(c is None for c in calls) else [c for c in calls if c is not None]


class CallStream(ABC):
    """Tool calls of one streamed choice: :meth:`feed` new text, :meth:`finish` at its end;
    both answer (content to send, ``delta.tool_calls`` entries in OpenAI's shape)."""

    called: bool = False
    """A call was sent: the choice ends with ``tool_calls``."""

    @abstractmethod
    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """Take the choice's new text."""

    @abstractmethod
    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The choice ended: what is left to send."""


def _whole(calls: list[dict[str, Any]], first: int) -> list[dict[str, Any]]:
    """Complete calls as deltas: each with its index, id, type, name and all its arguments."""
    return [dict(c, index=first + k) for k, c in enumerate(tools.as_openai(calls))]


@dataclass
class HermesStream(CallStream):
    """``auto``: Hermes blocks, each call sent whole once its block closed."""

    inner: tools.ToolStream
    sent: int = 0

    def _out(self, content: str, calls: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
        deltas = _whole(calls, self.sent)
        self.sent += len(calls)
        self.called = self.called or bool(calls)
        return content, deltas

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        return self._out(*self.inner.feed(text))

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        return self._out(*self.inner.finish())


@dataclass
class NamedStream(CallStream):
    """A named function: the first delta names the call, every piece of the answer is
    its arguments' next fragment (OpenAI's incremental shape)."""

    name: str
    id: str = field(default_factory=tools.call_id)
    held: str = ""
    """Trailing whitespace or control characters, sent only once more text follows."""

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        text = self.held + text
        kept = text.rstrip(_TRAILING)
        self.held = text[len(kept):]
        if not kept:
            return "", []
        if not self.called:
            self.called = True
            return "", [{"index": 0, "id": self.id, "type": "function",
                         "function": {"name": self.name, "arguments": kept}}]
        return "", [{"index": 0, "function": {"arguments": kept}}]

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        return "", []


@dataclass
class ArrayStream(CallStream):
    """``required``: the JSON array is scanned as it comes; each item is sent as a whole
    call once its object closed. An answer that ended before any item closed, or that
    is not such an array, is sent as content at the end."""

    parallel: bool = True
    buffer: str = ""
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    start: int = -1
    """Where the item being read begins in ``buffer`` (-1: between items)."""
    sent: int = 0
    failed: bool = False

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        base = len(self.buffer)
        self.buffer += text
        done: list[dict[str, Any]] = []
        for k, ch in enumerate(text, base):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                continue
            if ch == '"':
                self.in_string = True
            elif ch in "[{":
                self.depth += 1
                if self.depth == 2 and ch == "{":
                    self.start = k
            elif ch in "]}":
                self.depth -= 1
                if self.depth == 1 and self.start >= 0:
                    done += self._item(self.buffer[self.start:k + 1])
                    self.start = -1
        return "", done

    def _item(self, block: str) -> list[dict[str, Any]]:
        try:
            call = _item(json.loads(block))
        except ValueError:
            call = None
        if call is None:
            self.failed = True
            return []
        if self.sent and not self.parallel:
            return []
        out = _whole([call], self.sent)
        self.sent += 1
        self.called = True
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        if self.sent:
            return "", []
        rest, self.buffer = self.buffer.rstrip(_TRAILING), ""
        return rest, []
