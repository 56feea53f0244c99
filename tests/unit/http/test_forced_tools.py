"""Forced tool calls (``tool_choice`` required or a named function) on structured output,
and tools for a model whose chat template has none, through the real app in front of an
in-process daemon. The requests are the exact bodies instructor, pydantic-ai and
langchain send (``tests/data/tool-clients.json``).

The worker is the fake engine enforcing grammars, made terse: of the tokens the grammar
allows it takes a closing quote, brace or bracket, a digit or a comma before anything
else (and one letter after an opening quote), so a forced answer is short and whole
while the grammar alone decides what is allowed."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx2
import pytest
from schema_subset import follows

from sclsd.tokenizer import ByteTokenizer
from worker.engines.fake import EOS_ID, FakeEngine

from .conftest import Front, serve_front
from .test_app import sse

pytest.importorskip("llguidance")

CLIENTS = json.loads((Path(__file__).parents[2] / "data" / "tool-clients.json").read_text())
REQUESTS = {r["name"]: r["body"] for r in CLIENTS["requests"]}
_PREFER = [ord(c) for c in '"}]1,']


class TerseEngine(FakeEngine):
    """The fake engine with grammars, choosing the allowed token that ends things soonest."""

    def __init__(self) -> None:
        super().__init__(grammar=True)
        self._last: dict[int, int] = {}

    def _allowed(self, m: Any, tok: int) -> int:
        if m.is_stopped():
            return EOS_ID
        bits = int.from_bytes(m.compute_bitmask(), "little")
        first = [ord("a")] if self._last.get(id(m)) == ord('"') else []
        pick = next((t for t in [*first, *_PREFER] if bits >> t & 1), None)
        if pick is None:
            pick = super()._allowed(m, tok)
        self._last[id(m)] = pick
        return pick


def run(body: Callable[[httpx2.AsyncClient], Awaitable[None]]) -> None:
    async def on_front(f: Front) -> None:
        await body(f.http)

    serve_front(on_front, engine=TerseEngine(), prefix="sclsd-forced", model={"name": "fake", "max_gen": 2048})


def check_call(call: dict[str, Any], body: dict[str, Any]) -> None:
    """One ``tool_calls`` entry answers ``body``: one of its tools (the named one when named),
    arguments that parse as JSON and follow the tool's parameters."""
    tools = {t["function"]["name"]: t["function"] for t in body["tools"]}
    name = call["function"]["name"]
    assert name in tools, call
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        assert name == choice["function"]["name"]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    args = json.loads(call["function"]["arguments"])
    assert follows(args, tools[name]["parameters"]), (args, tools[name]["parameters"])


FORCED = [n for n, b in REQUESTS.items() if b.get("tool_choice") not in (None, "auto")]


def _body(name: str, **over: Any) -> dict[str, Any]:
    return {**REQUESTS[name], "model": "fake", **over}


@pytest.mark.parametrize("name", [n for n in FORCED if not REQUESTS[n].get("stream")])
def test_recorded_forced_calls_answer_with_a_call_that_follows_the_schema(name: str) -> None:
    async def body(http: httpx2.AsyncClient) -> None:
        req = _body(name)
        r = await http.post("/v1/chat/completions", json=req)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        msg = choice["message"]
        assert msg["content"] is None and len(msg["tool_calls"]) == 1
        check_call(msg["tool_calls"][0], req)

    run(body)


@pytest.mark.parametrize("name", [n for n in FORCED if REQUESTS[n].get("stream")])
def test_recorded_forced_calls_stream_as_tool_call_deltas(name: str) -> None:
    async def body(http: httpx2.AsyncClient) -> None:
        req = _body(name)
        r = await http.post("/v1/chat/completions", json=req)
        assert r.status_code == 200, r.text
        events = sse(r.text)
        assert events[-1] == "[DONE]"
        chunks = [e for e in events[:-1] if e["choices"]]
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert deltas[0]["role"] == "assistant"
        assert not any(d.get("content") for d in deltas)
        pieces = [tc for d in deltas for tc in d.get("tool_calls", [])]
        # OpenAI's delta shape: the first piece of a call has its id, type and name; the
        # arguments are the concatenation of every piece's fragment.
        assert pieces and pieces[0]["index"] == 0 and pieces[0]["id"] and pieces[0]["type"] == "function"
        assert all(p["index"] == 0 and "id" not in p and "name" not in p["function"] for p in pieces[1:])
        call = {**pieces[0], "function": {"name": pieces[0]["function"]["name"], "arguments": "".join(
            p["function"]["arguments"] for p in pieces)}}
        check_call(call, req)
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        if req.get("stream_options", {}).get("include_usage"):
            assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] > 0
        if isinstance(req.get("tool_choice"), dict):
            assert len(pieces) > 1  # a named call's arguments come as they are generated

    run(body)


def test_required_keeps_parallel_tool_calls_and_calls_can_be_one_of_several() -> None:
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    pydantic_ai = REQUESTS["pydantic-ai-output_type"]
    tools = [*pydantic_ai["tools"], weather]

    async def body(http: httpx2.AsyncClient) -> None:
        for parallel in (True, False):
            req = {**pydantic_ai, "model": "fake", "tools": tools, "parallel_tool_calls": parallel}
            r = await http.post("/v1/chat/completions", json=req)
            assert r.status_code == 200, r.text
            calls = r.json()["choices"][0]["message"]["tool_calls"]
            assert len(calls) >= 1 and (parallel or len(calls) == 1)
            for c in calls:
                check_call(c, req)
        # Streamed, each call of the array leaves whole once its object closed.
        r = await http.post("/v1/chat/completions", json={**pydantic_ai, "model": "fake", "tools": tools,
                                                          "stream": True})
        pieces = [tc for e in sse(r.text)[:-1] for tc in e["choices"][0]["delta"].get("tool_calls", [])]
        assert [p["index"] for p in pieces] == list(range(len(pieces))) and pieces
        for p in pieces:
            check_call(p, {**pydantic_ai, "tools": tools})

    run(body)


def test_forced_calls_cut_short_end_with_length() -> None:
    async def body(http: httpx2.AsyncClient) -> None:
        named = _body("instructor-TOOLS", max_tokens=5)
        ch = (await http.post("/v1/chat/completions", json=named)).json()["choices"][0]
        assert ch["finish_reason"] == "length"
        assert ch["message"]["tool_calls"][0]["function"]["arguments"] == '{"nam'
        required = _body("pydantic-ai-output_type", max_completion_tokens=5)
        ch = (await http.post("/v1/chat/completions", json=required)).json()["choices"][0]
        assert ch["finish_reason"] == "length" and "tool_calls" not in ch["message"]
        assert ch["message"]["content"] == '[{"na'

    run(body)


def test_tools_with_a_model_without_a_tool_template_are_served() -> None:
    """The fake model's byte tokenizer has no chat template at all: tools go in as vLLM's
    Hermes template writes them (a system turn), and auto answers as text."""
    async def body(http: httpx2.AsyncClient) -> None:
        req = _body("langchain-bind_tools")
        r = await http.post("/v1/chat/completions", json=req)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
        prompt = ByteTokenizer().encode_chat([
            {"role": "system", "content": "x"}, {"role": "user", "content": "Weather in Paris?"}])
        # The system turn holds the tools' signatures: the prompt is far longer than the chat.
        assert out["usage"]["prompt_tokens"] > len(prompt) + len(json.dumps(req["tools"]))

    run(body)


def test_bad_tool_choices_are_named() -> None:
    from sclsd.http.errors import ApiError
    from sclsd.http.params import parse

    base = REQUESTS["instructor-TOOLS"]
    for choice, why in (({"type": "function", "function": {"name": "Nope"}}, "not one of the tools"),
                        ({"type": "function"}, "must be"), ("always", "must be")):
        with pytest.raises(ApiError) as e:
            parse("chat", {**base, "tool_choice": choice}, 64)
        assert (e.value.param, e.value.status) == ("tool_choice", 400) and why in e.value.message
    with pytest.raises(ApiError) as e:
        parse("chat", {**base, "response_format": {"type": "json_object"}}, 64)
    assert e.value.param == "tool_choice"
    with pytest.raises(ApiError) as e:
        parse("chat", {"messages": base["messages"], "tool_choice": "required"}, 64)
    assert e.value.param == "tool_choice" and "needs tools" in e.value.message
    p = parse("chat", base, 64)
    forced = p.params["structured"]
    assert forced["kind"] == "json_schema"
    assert json.loads(forced["value"]) == base["tools"][0]["function"]["parameters"]
    assert "structured" in p.features
