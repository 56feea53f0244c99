"""Hermes-style tool calls parsed out of model output, whole and streamed."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from sclsd.http.tools import ToolStream, as_openai, parse

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
CALL2 = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'


def test_whole_output() -> None:
    assert parse("no calls here") == ("no calls here", [])
    content, calls = parse("Let me look." + CALL + "\n" + CALL2)
    assert content == "Let me look."
    assert [c["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "unit": "C"}
    assert parse(CALL)[0] is None  # only calls: no content
    assert [c["name"] for c in parse(CALL + CALL2, parallel=False)[1]] == ["get_weather"]
    # An unclosed last block (the output ended inside it) is parsed as far as it goes.
    assert parse('<tool_call>{"name": "f", "arguments": {"x": 1}}')[1] == [
        {"name": "f", "arguments": '{"x": 1}'}]
    # A block that is no call: no calls at all, the whole text is the content (vLLM's rule).
    broken = "Hi " + CALL + "<tool_call>{not json</tool_call>"
    assert parse(broken) == (broken, [])
    assert parse('<tool_call>["f"]</tool_call>') == ('<tool_call>["f"]</tool_call>', [])
    out = as_openai(parse(CALL)[1])
    assert out[0]["type"] == "function" and out[0]["id"].startswith("chatcmpl-tool-")
    assert out[0]["function"]["name"] == "get_weather"


def _streamed(text: str, cuts: list[int], parallel: bool = True) -> tuple[str, list[dict]]:
    ts = ToolStream(parallel=parallel)
    content, calls = "", []
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    for p in pieces:
        c, done = ts.feed(p)
        content += c
        calls += done
    c, done = ts.finish()
    return content + c, calls + done


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([
    "plain text, no calls <tool", "Sure." + CALL, CALL + " " + CALL2, "x<tool_cal" + CALL,
    '<tool_call>{"name": "f", "arguments": {"a": "</tool"}}</tool_call>', "a <tool_call>{bad}</tool_call> b",
    '<tool_call>{"name": "g", "arguments": {"k": [1, 2]}}',
]), st.lists(st.integers(min_value=0, max_value=200), max_size=8), st.booleans())
def test_streaming_finds_what_the_whole_parse_finds(text: str, cuts: list[int], parallel: bool) -> None:
    cuts = sorted({c for c in cuts if 0 < c < len(text)})
    content, calls = _streamed(text, cuts, parallel)
    whole_content, whole_calls = parse(text, parallel)
    assert calls == whole_calls
    if whole_calls:
        assert content == (whole_content or "")
    else:
        assert content == text  # nothing held back or lost


def test_stream_holds_back_only_a_possible_tag_start() -> None:
    ts = ToolStream()
    assert ts.feed("Hello <tool") == ("Hello ", [])
    assert ts.feed("s are fun") == ("<tools are fun", [])
    assert ts.feed(" <tool_call>{\"name\": \"f\"") == (" ", [])
    assert ts.feed(', "arguments": {}}</tool_call>') == ("", [{"name": "f", "arguments": "{}"}])
    assert ts.feed(" trailing") == ("", [])  # after a call, text between calls is dropped
    assert ts.finish() == ("", [])
