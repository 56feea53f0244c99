"""The fields OpenAI's SDKs and agent frameworks send that vLLM accepts: ignored where
they mean nothing here, applied where they do (``include_stop_str_in_output``,
``chat_template_kwargs``); unknown ones keep their 400."""

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


def test_fields_vllm_accepts_are_accepted_and_unknown_ones_refused(front) -> None:
    async def body(f: Front) -> None:
        r = await f.http.post("/v1/chat/completions", json={**CHAT, **SENT})
        assert r.status_code == 200, r.text
        plain = await f.http.post("/v1/chat/completions", json=CHAT)
        assert r.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
        assert set(SENT) - {"modalities", "user", "parallel_tool_calls", "use_beam_search"} <= IGNORED
        c = await f.http.post("/v1/completions", json={"model": "fake", "prompt": "a", "max_tokens": 2,
                                                       "store": True, "metadata": {"a": "b"}})
        assert c.status_code == 200, c.text
        for extra, param in (({"store_it": True}, "store_it"), ({"modalities": ["text", "audio"]}, "modalities"),
                             ({"use_beam_search": True}, "use_beam_search"),
                             ({"web_search_options": {}}, "web_search_options")):
            r = await f.http.post("/v1/chat/completions", json={**CHAT, **extra})
            err = r.json()["error"]
            assert (r.status_code, err["param"], err["code"]) == (400, param, "unsupported_parameter"), err

    front(body)


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
