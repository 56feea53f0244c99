"""Tool calls in a model's output, Hermes style (as vLLM's ``hermes`` parser reads them).

A Hermes-style chat template (Hermes, Qwen 2.5 and 3, ...) tells the model to answer
a call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. The text
before the first ``<tool_call>`` is the message's content; each block is one call,
its ``arguments`` re-encoded as a JSON string (OpenAI's shape); a last block the
output ended inside (no ``</tool_call>``) is parsed as far as it goes. If a block
is not such an object, nothing is taken for a call: the whole output is the
content, as vLLM does.

:class:`ToolStream` does the same on a stream: content is passed on as it comes,
except a tail that may be the start of ``<tool_call>``; a call is sent, whole, once
its block closed (OpenAI's stream shape allows a call's arguments in one delta).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)


def call_id() -> str:
    """A tool call's id, in vLLM's form."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _call(block: str) -> dict[str, Any] | None:
    """One block -> ``{"name", "arguments"}`` (arguments a JSON string), or None."""
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}


def as_openai(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``{"name", "arguments"}`` -> OpenAI's ``tool_calls`` entries."""
    return [{"id": call_id(), "type": "function", "function": c} for c in calls]


def parse(text: str, parallel: bool = True) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, calls) of a whole output; content None when only calls were made."""
    start = text.find(OPEN)
    if start < 0:
        return text, []
    calls = []
    for m in _BLOCK.finditer(text, start):
        c = _call(m.group(1) if m.group(1) is not None else m.group(2))
        if c is None:
            return text, []
        calls.append(c)
    if not parallel:
        calls = calls[:1]
    content = text[:start]
    return (content if content.strip() else None), calls


def _partial_open(text: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``<tool_call>``."""
    return max((k for k in range(1, len(OPEN)) if text.endswith(OPEN[:k])), default=0)


@dataclass
class ToolStream:
    """Tool-call parsing of one streamed choice (see the module docstring)."""

    parallel: bool = True
    buffer: str = ""
    """Text not passed on yet: a possible ``<tool_call>`` start, or an open block."""
    in_call: bool = False
    calls: list[dict[str, Any]] = field(default_factory=list)
    failed: bool = False
    """A block was not a call: everything from it on is passed on as content."""

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """New output text -> (content to send, calls completed by it)."""
        if self.failed:
            return text, []
        self.buffer += text
        content: str = ""
        done: list[dict[str, Any]] = []
        while True:
            if not self.in_call:
                i = self.buffer.find(OPEN)
                if i < 0:
                    keep = _partial_open(self.buffer)
                    if not self.calls:  # after the first call, text between calls is dropped
                        content += self.buffer[: len(self.buffer) - keep]
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return content, done
                if not self.calls:
                    content += self.buffer[:i]
                self.buffer, self.in_call = self.buffer[i:], True
            j = self.buffer.find(CLOSE)
            if j < 0:
                return content, done
            block = self.buffer[len(OPEN): j]
            c = _call(block)
            if c is None:
                self.failed = True
                content += self.buffer
                self.buffer = ""
                return content, done
            self.buffer, self.in_call = self.buffer[j + len(CLOSE):], False
            if self.parallel or not self.calls:
                self.calls.append(c)
                done.append(c)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The output ended: what is left (an unclosed block is parsed as far as it goes)."""
        rest, self.buffer = self.buffer, ""
        if self.failed or not rest:
            return rest, []
        if not self.in_call:
            return ("" if self.calls else rest), []
        c = _call(rest[len(OPEN):])
        if c is None:
            return rest, []
        if self.parallel or not self.calls:
            self.calls.append(c)
            return "", [c]
        return "", []
