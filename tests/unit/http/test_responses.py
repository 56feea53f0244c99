"""``POST /v1/responses`` driven with the openai SDK's ``client.responses.create`` (plain and
streamed), and the 404 of routes not served."""

from __future__ import annotations

import json
from typing import Any

import httpx2
import openai

from .conftest import Front
from .test_forced_tools import REQUESTS, check_call
from .test_forced_tools import run as run_with_grammar


def sdk(http: httpx2.AsyncClient) -> Any:
    return openai.AsyncOpenAI(base_url="http://sclsd/v1", api_key="x", http_client=http, max_retries=0)


def test_responses_plain_and_streamed(front) -> None:
    async def body(f: Front) -> None:
        client = f.openai()
        chat = await client.chat.completions.create(
            model="fake", messages=[{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Why is the sky blue?"}],
            max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        r = await client.responses.create(model="fake", instructions="Be brief.", input="Why is the sky blue?",
                                          max_output_tokens=8, temperature=0,
                                          extra_body={"store": False, "metadata": {"a": "b"}})
        assert r.object == "response" and r.id.startswith("resp_") and r.model == "fake"
        # The same prompt and sampling as the chat: the same text, counted the same way.
        assert r.output_text and r.usage is not None
        assert r.usage.input_tokens == chat.usage.prompt_tokens
        assert r.output[0].type == "message" and r.output[0].role == "assistant"
        assert r.status in ("completed", "incomplete")
        if r.status == "incomplete":
            assert r.incomplete_details.reason == "max_output_tokens" and r.usage.output_tokens == 8
        items = [{"role": "system", "content": "Be brief."},
                 {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Why is the sky blue?"}]}]
        same = await client.responses.create(model="fake", input=items, max_output_tokens=8, temperature=0)
        assert same.output_text == r.output_text
        stream = await client.responses.create(model="fake", input=items, max_output_tokens=8, temperature=0,
                                               stream=True)
        kinds, deltas, final = [], [], None
        async for ev in stream:
            kinds.append(ev.type)
            if ev.type == "response.output_text.delta":
                deltas.append(ev.delta)
            if ev.type in ("response.completed", "response.incomplete"):
                final = ev.response
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
        assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done",
                                "response.output_item.done"]
        assert "".join(deltas) == r.output_text and len(deltas) >= 1
        assert final is not None and final.output_text == r.output_text
        assert final.usage.output_tokens == r.usage.output_tokens

    front(body)


def test_responses_refusals_name_the_responses_parameter(front) -> None:
    async def body(f: Front) -> None:
        for req, param in (({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
                           ({"input": []}, "input"), ({"input": "x", "previous_response_id": "r1"},
                                                      "previous_response_id"),
                           ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
                           ({"input": "x", "n": 2}, "n")):
            r = await f.http.post("/v1/responses", json=req)
            assert (r.status_code, r.json()["error"]["param"]) == (400, param), r.text

    front(body)


def test_unserved_routes_are_404_naming_the_route(front) -> None:
    async def body(f: Front) -> None:
        r = await f.http.post("/v1/embeddings", json={"input": "x"})
        err = r.json()["error"]
        assert r.status_code == 404 and err["code"] == "not_found"
        assert "POST /v1/embeddings" in err["message"] and "/v1/responses" in err["message"]

    front(body)


def test_responses_structured_text_and_forced_function_calls() -> None:
    user = REQUESTS["instructor-TOOLS"]["tools"][0]["function"]

    async def body(http: httpx2.AsyncClient) -> None:
        client = sdk(http)
        r = await client.responses.create(model="fake", input="Ann is 30.", max_output_tokens=200,
                                          text={"format": {"type": "json_schema", "name": "User",
                                                           "schema": user["parameters"]}})
        # (the fake model's end-of-text token decodes to "\x02")
        assert set(json.loads(r.output_text.rstrip("\x02"))) == {"name", "age"}
        tools = [{"type": "function", "name": user["name"], "parameters": user["parameters"]}]
        for stream in (False, True):
            kw: dict[str, Any] = dict(model="fake", input="Ann is 30.", max_output_tokens=200, tools=tools,
                                      tool_choice={"type": "function", "name": "User"})
            if stream:
                events = [ev async for ev in await client.responses.create(**kw, stream=True)]
                assert events[-1].type == "response.completed"
                out = events[-1].response.output
                assert "response.function_call_arguments.done" in [e.type for e in events]
            else:
                out = (await client.responses.create(**kw)).output
            (call,) = out
            assert call.type == "function_call" and call.name == "User"
            check_call({"id": "chatcmpl-tool-" + call.call_id.removeprefix("chatcmpl-tool-"), "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments}},
                       REQUESTS["instructor-TOOLS"])

    run_with_grammar(body)
