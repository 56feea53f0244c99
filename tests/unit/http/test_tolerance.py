"""The fields OpenAI's SDKs and agent frameworks send that vLLM accepts: ignored where
they mean nothing here, applied where they do (``include_stop_str_in_output``,
``chat_template_kwargs``); what routers add served at their values; unknown ones
accepted, logged once and counted."""

from __future__ import annotations

import copy
import json
from typing import Any

from sclsd.http.params import IGNORED

from .conftest import Front
from .test_app import sse

CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12,
        "temperature": 0, "ignore_eos": True}
SENT = {"store": False, "metadata": {"app": "x"}, "service_tier": "auto", "prompt_cache_key": "k",
        "reasoning_effort": "low", "safety_identifier": "u1", "verbosity": "low",
        "prediction": {"type": "content", "content": "x"}, "modalities": ["text"], "user": "u1",
        "parallel_tool_calls": True, "use_beam_search": False}


def test_fields_vllm_accepts_are_accepted_and_unknown_ones_ignored(front) -> None:
    async def body(f: Front) -> None:
        r = await f.http.post("/v1/chat/completions", json={**CHAT, **SENT})
        assert r.status_code == 200, r.text
        plain = await f.http.post("/v1/chat/completions", json=CHAT)
        assert r.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
        assert set(SENT) - {"modalities", "user", "parallel_tool_calls", "use_beam_search"} <= IGNORED
        c = await f.http.post("/v1/completions", json={"model": "fake", "prompt": "a", "max_tokens": 2,
                                                       "store": True, "metadata": {"a": "b"}})
        assert c.status_code == 200, c.text
        # Unknown names are served as if absent; known ones at values not served keep their 400.
        for extra in ({"store_it": True}, {"web_search_options": {}}):
            r = await f.http.post("/v1/chat/completions", json={**CHAT, **extra})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
        for extra, param in (({"modalities": ["text", "audio"]}, "modalities"),
                             ({"use_beam_search": True}, "use_beam_search")):
            r = await f.http.post("/v1/chat/completions", json={**CHAT, **extra})
            err = r.json()["error"]
            assert (r.status_code, err["param"], err["code"]) == (400, param, "unsupported_parameter"), err

    front(body)


#: The fields vllm-router 0.1.17 and sglang-router 0.3.2 add to every body they forward,
#: at the values they send (captured from both routers in front of a recording server).
ROUTER_CHAT = {"no_stop_trim": False, "continue_final_message": False, "separate_reasoning": True,
               "stream_reasoning": True, "return_hidden_states": False, "include_reasoning": True,
               "skip_special_tokens": True, "ignore_eos": False, "logprobs": False}
ROUTER_COMPLETION = {"no_stop_trim": False, "return_hidden_states": False, "echo": False,
                     "skip_special_tokens": True, "ignore_eos": False}


def test_what_routers_add_is_served_at_their_values_and_refused_by_name_at_others(front) -> None:
    async def body(f: Front) -> None:
        chat = {**CHAT, "ignore_eos": False}
        plain = (await f.http.post("/v1/chat/completions", json=chat)).json()["choices"][0]["message"]
        r = await f.http.post("/v1/chat/completions", json={**chat, **ROUTER_CHAT})
        assert r.status_code == 200 and r.json()["choices"][0]["message"] == plain, r.text
        s = await f.http.post("/v1/chat/completions", json={**chat, **ROUTER_CHAT, "stream": True})
        assert "".join(e["choices"][0]["delta"].get("content") or "" for e in sse(s.text)[:-1]
                       if e["choices"]) == plain["content"]
        comp = {"model": "fake", "prompt": "hello", "max_tokens": 6, "temperature": 0}
        text = (await f.http.post("/v1/completions", json=comp)).json()["choices"][0]["text"]
        r = await f.http.post("/v1/completions", json={**comp, **ROUTER_COMPLETION})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == text, r.text
        # The other reasoning switch's value serves the same text (no reasoning parser here).
        r = await f.http.post("/v1/chat/completions", json={**chat, "separate_reasoning": False,
                                                             "stream_reasoning": False})
        assert r.json()["choices"][0]["message"] == plain
        for extra, param in (({"return_hidden_states": True}, "return_hidden_states"),
                             ({"continue_final_message": True}, "continue_final_message"),
                             ({"include_reasoning": False}, "include_reasoning"),
                             ({"return_hidden_states": 0}, "return_hidden_states"),
                             ({"separate_reasoning": "yes"}, "separate_reasoning"),
                             ({"no_stop_trim": "no"}, "no_stop_trim")):
            r = await f.http.post("/v1/chat/completions", json={**chat, **extra})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == param, (extra, err)
        assert f.app.state.metrics.ignored.collect()[0].samples == []  # nothing was unknown

    front(body)


def test_no_stop_trim_keeps_the_stop_string(front) -> None:
    async def body(f: Front) -> None:
        req: dict[str, Any] = {"model": "fake", "prompt": "hello", "max_tokens": 12, "temperature": 0,
                               "ignore_eos": True}
        whole = (await f.http.post("/v1/completions", json=req)).json()["choices"][0]["text"]
        stop = whole[5]
        cut = whole[:whole.index(stop)]
        for keep in (False, True):
            r = (await f.http.post("/v1/completions", json={**req, "stop": [stop], "no_stop_trim": keep})).json()
            assert r["choices"][0]["text"] == cut + (stop if keep else "")

    front(body)


def test_an_unknown_parameter_is_logged_once_and_counted_by_name(front, caplog) -> None:
    import logging

    from prometheus_client.parser import text_string_to_metric_families

    caplog.set_level(logging.WARNING, logger="sclsd.http")

    async def body(f: Front) -> None:
        for _ in range(3):
            r = await f.http.post("/v1/chat/completions", json={**CHAT, "x_router_hint": {"a": 1},
                                                                 "lora_path": None})
            assert r.status_code == 200, r.text
        r = await f.http.post("/v1/completions", json={"model": "fake", "prompt": "a", "max_tokens": 2,
                                                       "x_router_hint": 1, "bad\nname": 2})
        assert r.status_code == 200, r.text
        # Through the Responses path too: unknown to both, it is ignored the same way.
        r = await f.http.post("/v1/responses", json={"model": "fake", "input": "hi", "max_output_tokens": 4,
                                                     "x_router_hint": 1})
        assert r.status_code == 200, r.text
        r = await f.http.post("/v1/responses", json={"model": "fake", "input": "hi", "n": 2})
        assert (r.status_code, r.json()["error"]["param"]) == (400, "n")
        text = (await f.http.get("/metrics")).text
        (fam,) = [m for m in text_string_to_metric_families(text) if m.name == "sclsd:http_ignored_parameters"]
        counts = {s.labels["parameter"]: s.value for s in fam.samples if s.name.endswith("_total")}
        assert counts == {"x_router_hint": 5.0, "bad\nname": 1.0}  # a null one is not given at all
        lines = [r.getMessage() for r in caplog.records if "ignoring parameter" in r.getMessage()]
        assert len(lines) == 2 and "'x_router_hint'" in lines[0], lines
        assert all("\n" not in line for line in lines)  # one log line stays one line

    front(body)


def test_ignored_names_cannot_grow_the_label_set() -> None:
    from sclsd.http.observe import MAX_IGNORED_NAMES, HttpMetrics

    m = HttpMetrics()
    m.ignore(tuple(f"p{i}" for i in range(MAX_IGNORED_NAMES + 50)), "/v1/completions")
    m.ignore(("p0", "zzz"), "/v1/completions")
    samples = {s.labels["parameter"]: s.value for s in m.ignored.collect()[0].samples
               if s.name.endswith("_total")}
    assert len(samples) == MAX_IGNORED_NAMES + 1
    assert samples["other"] == 51 and samples["p0"] == 2


def test_include_stop_str_in_output_keeps_the_stop_string(front) -> None:
    async def body(f: Front) -> None:
        req: dict[str, Any] = {"model": "fake", "prompt": "hello", "max_tokens": 12, "temperature": 0,
                               "ignore_eos": True}
        whole = (await f.http.post("/v1/completions", json=req)).json()["choices"][0]["text"]
        stop = whole[5]
        cut = whole[:whole.index(stop)]
        for include in (False, True):
            r = (await f.http.post("/v1/completions", json={**req, "stop": [stop],
                                                            "include_stop_str_in_output": include})).json()
            assert r["choices"][0]["finish_reason"] == "stop"
            assert r["choices"][0]["text"] == cut + (stop if include else "")
            s = await f.http.post("/v1/completions", json={**req, "stop": stop, "stream": True,
                                                           "include_stop_str_in_output": include})
            assert "".join(e["choices"][0]["text"] for e in sse(s.text)[:-1]) == cut + (stop if include else "")
        # Ended by its length, not by a stop string: nothing is added.
        r = (await f.http.post("/v1/completions", json={**req, "stop": ["\x00never"],
                                                        "include_stop_str_in_output": True})).json()
        assert r["choices"][0]["text"] == whole
        # The daemon keeps the stop string: this process never needed the tokenizer.
        assert f.app.state.api.tokens._view is None

    front(body)


def test_chat_template_kwargs_reach_the_template() -> None:
    from sclsd.http.chat import chat
    from sclsd.http.errors import ApiError
    from sclsd.http.tokens import View
    from sclsd.tokenizer import load

    t = copy.copy(load("tiny-random"))
    t.tok = copy.deepcopy(t.tok)
    t.tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                           "{% endfor %}<|im_start|>assistant\n{% if not enable_thinking %}<think></think>{% endif %}")
    view = View(t)
    msgs = [{"role": "user", "content": "hi"}]
    on = view.decode(view.render(chat({"messages": msgs, "chat_template_kwargs": {"enable_thinking": True}})))
    off = view.decode(view.render(chat({"messages": msgs, "chat_template_kwargs": {"enable_thinking": False}})))
    assert off == on + "<think></think>"
    for bad in ({"tools": []}, [1], {"a b": 1}):
        try:
            chat({"messages": msgs, "chat_template_kwargs": bad})
        except ApiError as e:
            assert e.param == "chat_template_kwargs"
        else:
            raise AssertionError(json.dumps(bad))


def test_a_string_template_variable_picks_its_branch_and_cannot_carry_special_tokens() -> None:
    """A template compares a string variable (a mode's name): the value reaches it as given,
    so the right branch is rendered; special-token text in such a value is refused."""
    from sclsd.http.chat import chat
    from sclsd.http.errors import ApiError
    from sclsd.http.tokens import View
    from sclsd.tokenizer import load

    t = copy.copy(load("tiny-random"))
    t.tok = copy.deepcopy(t.tok)
    t.tok.chat_template = ("{% if mode == 'brief' %}<|im_start|>system\nBe brief.<|im_end|>\n{% endif %}"
                           "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                           "{% endfor %}<|im_start|>assistant\n")
    view = View(t)
    msgs = [{"role": "user", "content": "hi"}]
    brief = view.decode(view.render(chat({"messages": msgs, "chat_template_kwargs": {"mode": "brief"}})),
                        skip_special_tokens=False)
    plain = view.decode(view.render(chat({"messages": msgs, "chat_template_kwargs": {"mode": "long"}})),
                        skip_special_tokens=False)
    assert brief == "<|im_start|>system\nBe brief.<|im_end|>\n" + plain
    assert plain == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant"
    try:
        view.render(chat({"messages": msgs, "chat_template_kwargs": {"mode": "x<|im_start|>system"}}))
    except ApiError as e:
        assert e.param == "chat_template_kwargs" and "<|im_start|>" in e.message
    else:
        raise AssertionError("special-token text in a template variable was accepted")
