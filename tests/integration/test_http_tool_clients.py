"""The exact requests instructor, pydantic-ai and langchain send for tool calls and
structured output (``tests/data/tool-clients.json``), replayed against a running
``sclsd-http`` in front of a daemon whose fake worker enforces grammars; and the
openai SDK's ``client.responses.create`` against the same processes.

The fake model writes random bytes wherever the grammar leaves it free, so a JSON
string (or an extra property the schema allows) runs to hundreds or thousands of
tokens: the replayed bodies get a larger ``max_tokens``, everything else is sent as
recorded, and an answer still cut short is held to the shape OpenAI gives one
(``length``; a named call's arguments so far). Whole answers are checked against the
schema here, and every time in tests/unit/http/test_forced_tools.py, whose engine
closes what it opens."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

httpx2 = pytest.importorskip("httpx2")
openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")

from schema_subset import follows  # noqa: E402

from sclsd.http.process import start_http, stop_http  # noqa: E402
from sclsd.launch import DaemonProcess, launch  # noqa: E402

CLIENTS = json.loads((Path(__file__).parents[1] / "data" / "tool-clients.json").read_text())
MAX = 3000


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    d: DaemonProcess = launch({"model": {"name": "fake", "max_gen": 4096}, "daemon": {"uid_share": 1.0},
                               "workers": {"engine": "fake", "spawn": 1, "threads": 1,
                                           "options": {"grammar": True}}},
                              wait_workers=1, timeout=120)
    try:
        proc, base = start_http(d.sock, d.status_sock)
        yield base
        assert stop_http(proc) == 0
    finally:
        assert d.stop() == 0, d.log_text()


def sse(text: str) -> list[Any]:
    return [json.loads(x) if x != "[DONE]" else x for x in
            (line[len("data: "):] for line in text.split("\n") if line.startswith("data: "))]


def check_call(call: dict[str, Any], body: dict[str, Any]) -> None:
    """A ``tool_calls`` entry: one of the tools (the named one when named), with arguments
    that parse as JSON and follow its parameters."""
    tools = {t["function"]["name"]: t["function"] for t in body["tools"]}
    assert call["type"] == "function" and call["id"] and call["function"]["name"] in tools, call
    if isinstance(body.get("tool_choice"), dict):
        assert call["function"]["name"] == body["tool_choice"]["function"]["name"]
    fn = tools[call["function"]["name"]]
    assert follows(json.loads(call["function"]["arguments"]), fn["parameters"]), call


def _bigger(body: dict[str, Any]) -> dict[str, Any]:
    key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    return {**body, "model": "fake", key: MAX}


@pytest.mark.parametrize("name", [r["name"] for r in CLIENTS["requests"]])
def test_recorded_tool_requests_are_answered_in_openais_shape(url: str, name: str) -> None:
    (req,) = [r for r in CLIENTS["requests"] if r["name"] == name]
    body = _bigger(req["body"])
    r = httpx2.post(url + req["path"], json=body, timeout=120)
    assert r.status_code == 200, r.text
    forced = body.get("tool_choice") not in (None, "auto")
    if not body.get("stream"):
        choice = r.json()["choices"][0]
        if forced and choice["finish_reason"] == "length":
            cut(choice["message"], body)
        elif forced:
            assert choice["finish_reason"] == "tool_calls", choice
            for call in choice["message"]["tool_calls"]:
                check_call(call, body)
        else:  # auto: the fake model writes no <tool_call> block; its text comes back
            assert choice["finish_reason"] in ("stop", "length") and choice["message"]["content"]
        return
    events = sse(r.text)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    pieces = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    calls: dict[int, dict[str, Any]] = {}
    for p in pieces:
        c = calls.setdefault(p["index"], {"id": p.get("id"), "type": p.get("type"),
                                          "function": {"name": p["function"].get("name"), "arguments": ""}})
        c["function"]["arguments"] += p["function"]["arguments"]
    reason = chunks[-1]["choices"][0]["finish_reason"]
    if reason == "length":
        content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        cut({"content": content or None, "tool_calls": list(calls.values()) or None}, body)
        return
    assert calls and reason == "tool_calls"
    for call in calls.values():
        check_call(call, body)


def cut(message: dict[str, Any], body: dict[str, Any]) -> None:
    """A forced answer cut by max_tokens: a named call keeps its arguments so far, a
    required array its items that closed, else it comes back as content."""
    if isinstance(body["tool_choice"], dict):
        (call,) = message["tool_calls"]
        assert call["function"]["name"] == body["tool_choice"]["function"]["name"] and call["id"]
        assert call["function"]["arguments"].startswith("{")
    elif message.get("tool_calls"):
        for call in message["tool_calls"]:
            check_call(call, body)
    else:
        assert message["content"].startswith("[{")


def test_the_openai_sdk_responses_api(url: str) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    r = client.responses.create(model="fake", instructions="Be brief.", input="Why is the sky blue?",
                                max_output_tokens=16)
    assert r.object == "response" and r.output_text and r.usage.output_tokens <= 16
    events = list(client.responses.create(model="fake", input="Why is the sky blue?", max_output_tokens=16,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text and events[-1].response.output_text == text
    # An unserved route: OpenAI's error shape, naming it.
    with pytest.raises(openai.NotFoundError) as e:
        client.embeddings.create(model="fake", input="x")
    assert "/v1/embeddings" in str(e.value)
