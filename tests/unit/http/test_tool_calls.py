"""Tool calling through sclsd-http: a Hermes-style chat template renders the tools
here, the daemon serves the prompt ids, and the output's ``<tool_call>`` blocks
come back as OpenAI ``tool_calls`` (streamed and not). The tokenizer is SmolLM2's
(real, offline) with a Hermes-style template; the worker is a scripted engine that
answers with a fixed token sequence, the one thing no small model does on cue."""

from __future__ import annotations

import copy
import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx2
import openai
import pytest

from sclsd.protocol import BatchMsg, BatchStats, RequestOutput
from worker.engines.base import Steps, TokenCursor
from worker.engines.fake import FakeEngine

from .conftest import Front, serve_front
from .test_app import sse

#: A Hermes-style template (the shape Hermes and Qwen use): tools listed in the system
#: turn, calls as <tool_call> JSON blocks, results as <tool_response> in a user turn.
HERMES = (
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "You may call functions. Their signatures are in <tools></tools>:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n"
    "Answer a call as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.<|im_end|>\n"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and tools %}"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{% for c in m.tool_calls %}<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ANSWER = ('I will check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
          '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>')
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
EOS = 2  # SmolLM2's <|im_end|>


class ScriptEngine(FakeEngine):
    """Answers every request with ``script`` (then EOS), token by token, across slices."""

    def __init__(self, script: list[int], vocab: int) -> None:
        super().__init__(vocab=vocab)
        self.script = [*script, EOS]

    def _steps(self, batch: BatchMsg, used: list[int], matchers: Any = None) -> Steps:
        reqs = batch.requests
        outs: list[list[int]] = [[] for _ in reqs]
        reasons: list[str | None] = [None] * len(reqs)
        cursor = TokenCursor([r.rid for r in reqs])
        for _ in range(batch.slice_len):
            for i, r in enumerate(reqs):
                if reasons[i] is not None:
                    continue
                tok = self.script[min(r.generated + len(outs[i]), len(self.script) - 1)]
                outs[i].append(tok)
                if tok == EOS:
                    reasons[i] = "stop"
                elif len(outs[i]) >= r.max_new_tokens:
                    reasons[i] = "length"
            yield cursor.new(outs, reasons)
            if all(x is not None for x in reasons):
                break
        return ([RequestOutput(rid=r.rid, token_ids=outs[i], finish_reason=reasons[i])  # type: ignore[arg-type]
                 for i, r in enumerate(reqs)], BatchStats(batch_size=len(reqs)))


@pytest.fixture(scope="module")
def hermes_tokenizer() -> Any:
    from sclsd.tokenizer import load

    t = copy.copy(load("tiny-random"))
    t.tok = copy.deepcopy(t.tok)  # the loaded one is shared: change a copy's template
    t.tok.chat_template = HERMES
    return t


def run(tok: Any, body: Callable[[httpx2.AsyncClient, Any], Awaitable[None]]) -> None:
    async def on_front(f: Front) -> None:
        await body(f.http, f.h.server)

    serve_front(on_front, engine=ScriptEngine(tok.encode(ANSWER), vocab=tok.vocab_size), tokenizer=tok,
                settings={"tokenizer": tok}, prefix="sclsd-tools", scheduler={"slice_len": 8})


MSGS = [{"role": "user", "content": "Weather and time in Paris?"}]


def test_tool_calls_parsed_from_the_answer(hermes_tokenizer) -> None:
    async def body(http: httpx2.AsyncClient, server: Any) -> None:
        client = openai.AsyncOpenAI(base_url="http://sclsd/v1", api_key="x", http_client=http, max_retries=0)
        r = await client.chat.completions.create(model="fake", messages=MSGS, tools=TOOLS, max_tokens=200)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.content == "I will check. "
        calls = ch.message.tool_calls
        assert [c.function.name for c in calls] == ["get_weather", "get_time"]
        assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
        # The prompt was rendered here with the tools, the way the template puts them.
        want = hermes_tokenizer.tok.apply_chat_template(MSGS, tools=TOOLS, add_generation_prompt=True)
        want = want["input_ids"] if hasattr(want, "keys") else want
        assert r.usage.prompt_tokens == len(want)
        one = await client.chat.completions.create(model="fake", messages=MSGS, tools=TOOLS,
                                                   max_tokens=200, parallel_tool_calls=False)
        assert [c.function.name for c in one.choices[0].message.tool_calls] == ["get_weather"]
        # tool_choice none: no tools in the prompt, no parsing: the text as it came.
        plain = await client.chat.completions.create(model="fake", messages=MSGS, tools=TOOLS,
                                                     tool_choice="none", max_tokens=200)
        assert plain.choices[0].message.content == ANSWER and plain.choices[0].finish_reason == "stop"
        # The next turn carries the calls and their results back.
        turns = [*MSGS, ch.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": calls[0].id, "content": "18 C"},
                 {"role": "tool", "tool_call_id": calls[1].id, "content": "14:00"}]
        again = await client.chat.completions.create(model="fake", messages=turns, tools=TOOLS, max_tokens=200)
        assert again.choices[0].finish_reason == "tool_calls"
        rendered = hermes_tokenizer.tok.apply_chat_template(
            [*MSGS, {"role": "assistant", "content": "I will check. ", "tool_calls": [
                {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"function": {"name": "get_time", "arguments": {"zone": "CET"}}}]},
             {"role": "tool", "content": "18 C"}, {"role": "tool", "content": "14:00"}],
            tools=TOOLS, add_generation_prompt=True)
        rendered = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
        assert again.usage.prompt_tokens == len(rendered)

    run(hermes_tokenizer, body)


def test_tool_calls_streamed(hermes_tokenizer) -> None:
    async def body(http: httpx2.AsyncClient, server: Any) -> None:
        r = await http.post("/v1/chat/completions", json={"messages": MSGS, "tools": TOOLS, "stream": True,
                                                          "max_tokens": 200})
        events = sse(r.text)
        assert events[-1] == "[DONE]"
        deltas = [e["choices"][0]["delta"] for e in events[:-1]]
        content = "".join(d.get("content") or "" for d in deltas)
        calls = [c for d in deltas for c in d.get("tool_calls", [])]
        assert content == "I will check. " and "<tool" not in content
        assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "get_weather"), (1, "get_time")]
        assert json.loads(calls[1]["function"]["arguments"]) == {"zone": "CET"}
        assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"

    run(hermes_tokenizer, body)


def test_a_model_without_a_chat_template_takes_tools(front) -> None:
    """The fake model's byte tokenizer has no chat template: the tools go into a system turn
    the Hermes way (:mod:`sclsd.http.fallback`) rather than a 400."""
    async def body(f: Any) -> None:
        r = await f.http.post("/v1/chat/completions", json={"messages": MSGS, "tools": TOOLS, "max_tokens": 2})
        assert r.status_code == 200, r.text
        plain = await f.http.post("/v1/chat/completions", json={"messages": MSGS, "tools": None, "max_tokens": 2})
        assert plain.status_code == 200
        assert r.json()["usage"]["prompt_tokens"] > plain.json()["usage"]["prompt_tokens"] + len(
            json.dumps(TOOLS))

    front(body)


def test_smollm2_template_gets_tools_the_hermes_way() -> None:
    """SmolLM2's template (the built-in model's) has no ``tools``: they are written into its
    own system turn, earlier calls as <tool_call> blocks, results as <tool_response> blocks."""
    from sclsd.http.calls import Mode
    from sclsd.http.chat import Chat
    from sclsd.http.tokens import View
    from sclsd.tokenizer import load

    view = View(load("tiny-random"))
    assert view.template and not view.has_tools
    turns = [*MSGS, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18 C", "tool_call_id": "c1"}]
    text = view.decode(view.render(Chat(turns, TOOLS, Mode("auto"))), skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nYou are a function calling AI model.")
    assert json.dumps(TOOLS[0]) in text and "<tool_call>" in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '\n</tool_call><|im_end|>') in text
    assert "<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    # Without tools the same chat renders as the daemon renders it: the model's own template.
    plain = Chat(MSGS, None, None)
    assert view.render(plain) == view.encode_chat(MSGS)
