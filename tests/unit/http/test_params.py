"""OpenAI request bodies -> ``generate`` messages, without a daemon."""

from __future__ import annotations

import pytest

from sclsd.http.params import ALLOWED, ApiError, parse


def err(kind: str, body: dict, max_choices: int = 64) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse(kind, body, max_choices)  # type: ignore[arg-type]
    return e.value


def test_fan_out_ids_and_seeds() -> None:
    p = parse("completion", {"prompt": ["a", "b"], "n": 2, "seed": 10, "temperature": 0.7}, 64)
    msgs = p.messages("cmpl-x")
    assert [m.id for m in msgs] == ["cmpl-x-0", "cmpl-x-1", "cmpl-x-2", "cmpl-x-3"]
    assert [m.prompt for m in msgs] == ["a", "a", "b", "b"]
    assert [m.seed for m in msgs] == [10, 11, 10, 11]  # choice i of every prompt: seed + i
    (one,) = parse("completion", {"prompt": "a"}, 64).messages("cmpl-y")
    assert one.id == "cmpl-y" and one.seed is None and one.temperature == 1.0


def test_prompt_forms() -> None:
    ids = parse("completion", {"prompt": [5, 6, 7]}, 64).messages("r")
    assert [m.prompt_ids for m in ids] == [[5, 6, 7]]
    two = parse("completion", {"prompt": [[5], [6, 7]]}, 64).messages("r")
    assert [m.prompt_ids for m in two] == [[5], [6, 7]]
    for bad in ([], [[]], [1, "a"], {"a": 1}, [True]):
        assert err("completion", {"prompt": bad}).param == "prompt"


def test_chat_messages_parts_roles_and_limits() -> None:
    (m,) = parse("chat", {"messages": [
        {"role": "developer", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
    ], "max_tokens": 3, "max_completion_tokens": 8}, 64).messages("r")
    assert [(x.role, x.content) for x in m.messages or []] == [("system", "sys"), ("user", "ab"),
                                                                 ("assistant", "")]
    assert m.max_tokens == 8 and m.cap_max_tokens is False  # max_completion_tokens wins
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
    assert err("chat", {"messages": [image]}).param == "messages"
    assert err("chat", {"messages": [{"role": "user", "content": "x", "tool_calls": []}]}).param == "messages"
    assert err("chat", {}).code == "missing_parameter"


def test_null_means_not_given_and_stop_may_be_a_string() -> None:
    (m,) = parse("completion", {"prompt": "a", "stop": "\n", "temperature": None, "max_tokens": None,
                                "seed": None, "user": None}, 64).messages("r")
    assert m.stop == ["\n"] and m.temperature == 1.0 and m.max_tokens is None


def test_logprobs_forms() -> None:
    (c,) = parse("completion", {"prompt": "a", "logprobs": 0}, 64).messages("r")
    assert c.logprobs and c.top_logprobs == 0
    (c,) = parse("chat", {"messages": [{"role": "user", "content": "a"}], "logprobs": True,
                          "top_logprobs": 5}, 64).messages("r")
    assert c.logprobs and c.top_logprobs == 5
    assert err("chat", {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}).param == (
        "top_logprobs")
    assert err("completion", {"prompt": "a", "logprobs": True}).param == "logprobs"
    assert err("chat", {"messages": [{"role": "user", "content": "a"}], "logprobs": 3}).param == "logprobs"


def test_every_unknown_or_unimplemented_parameter_is_named() -> None:
    for name in ("best_of", "echo", "suffix", "logit_bias", "tools", "response_format", "typo"):
        e = err("completion", {"prompt": "a", name: 1})
        assert e.status == 400 and e.param == name and name in e.message
    assert "top_logprobs" not in ALLOWED["completion"] and "prompt" not in ALLOWED["chat"]


def test_ranges_come_from_the_protocol_schema_and_name_the_parameter() -> None:
    for field, value in (("temperature", -1), ("top_p", 1.5), ("min_p", 2), ("presence_penalty", 3),
                         ("frequency_penalty", -2.5), ("repetition_penalty", 0), ("top_k", -1),
                         ("stop_token_ids", [-1]), ("ignore_eos", "yes"), ("max_tokens", 0),
                         ("n", 0), ("seed", 2**64), ("user", 5), ("stream", "yes")):
        e = err("completion", {"prompt": "a", field: value})
        assert (e.status, e.param) == (400, field), (field, e.message)
    assert err("completion", {"prompt": ["a"] * 5, "n": 20}, max_choices=64).param == "n"
    assert err("completion", {"prompt": "a", "stream_options": {"include_usage": True}}).param == (
        "stream_options")
