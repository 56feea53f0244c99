"""OpenAI request bodies -> ``generate`` messages, without a daemon."""

from __future__ import annotations

import json

import pytest

from sclsd import protocol as P
from sclsd.http.params import ALLOWED, ApiError, parse

USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


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
    assert err("chat", {"messages": [{"role": "user", "content": "x", "tool_calls": [{}]}]}).param == "messages"
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


def test_unknown_parameters_are_ignored_by_name_and_unservable_ones_say_why() -> None:
    p = parse("completion", {"prompt": "a", "typo": 1, "guided_decoding_backend": "x", "an_unset": None,
                             "x" * 100: 1}, 64)
    assert p.ignored == ("guided_decoding_backend", "typo", "x" * 64)
    assert p.messages("r") == parse("completion", {"prompt": "a"}, 64).messages("r")
    assert parse("completion", {"prompt": "a"}, 64).ignored == ()
    e = err("completion", {"prompt": "a", "use_beam_search": 1})
    assert e.status == 400 and e.param == "use_beam_search" and "use_beam_search" in e.message
    assert e.code == "unsupported_parameter"
    assert "top_logprobs" not in ALLOWED["completion"] and "prompt" not in ALLOWED["chat"]
    for body, param, why in (
        ({"modalities": ["text", "audio"]}, "modalities", "only text"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "not with stream"),
    ):
        e = err("chat", {"messages": USER, **body})
        assert (e.status, e.param, e.code) == (400, param, "unsupported_parameter"), e.message
        assert why in e.message
    # A chat's echo (a final assistant turn) with logprobs: the answer's, as vLLM's.
    c = parse("chat", {"messages": USER, "echo": True, "logprobs": True}, 64)
    assert not c.echo_logprobs and c.ask_prompt is None and "prompt_logprobs" not in c.features
    e = err("chat", {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})
    assert (e.status, e.param) == (400, "response_format") and "schema" in e.message
    assert err("completion", {"prompt": "a", "best_of": 2, "stream": True}).param == "best_of"
    assert err("completion", {"prompt": "a", "best_of": 2, "n": 3}).param == "best_of"
    assert err("completion", {"prompt": "a", "best_of": 40, "n": 1}, max_choices=32).param == "best_of"
    assert err("completion", {"prompt": [1, 2], "suffix": "x"}).param == "suffix"


def test_null_counts_as_not_given_for_every_key() -> None:
    """Clients (guidellm: "stop": null) send null for keys they leave unset."""
    for kind, base in (("completion", {"prompt": "a"}), ("chat", {"messages": USER})):
        nulls = {k: None for k in ALLOWED[kind] if k not in base}
        nulls["an_unknown_key"] = None
        (m,) = parse(kind, {**base, **nulls}, 64).messages("r")  # type: ignore[arg-type]
        assert m.temperature == 1.0 and m.max_tokens is None and m.stop == []
    (m,) = parse("chat", {"messages": USER, "stream": True,
                          "stream_options": {"include_usage": None, "continuous_usage_stats": None},
                          "tools": None, "tool_choice": None, "logit_bias": None,
                          "parallel_tool_calls": None, "response_format": None}, 64).messages("r")
    assert m.logit_bias == {} and m.messages is not None
    msgs = [{"role": "user", "content": "a", "name": None, "tool_calls": None}]
    assert parse("chat", {"messages": msgs}, 64).chat.plain  # type: ignore[union-attr]


def test_stream_options_as_guidellm_and_aiperf_send_them() -> None:
    p = parse("completion", {"prompt": "a", "stream": True,
                             "stream_options": {"include_usage": True, "continuous_usage_stats": True}}, 64)
    assert (p.include_usage, p.continuous_usage) == (True, True)
    for opts in ({"continuous_usage_stats": False, "include_usage": False}, {}, None):
        p = parse("completion", {"prompt": "a", "stream": True, "stream_options": opts}, 64)
        assert (p.include_usage, p.continuous_usage) == (False, False)
    # Per-chunk usage refines include_usage (vLLM's rule).
    p = parse("chat", {"messages": USER, "stream": True, "stream_options": {"continuous_usage_stats": True}}, 64)
    assert (p.include_usage, p.continuous_usage) == (False, False)
    assert err("completion", {"prompt": "a", "stream": True,
                              "stream_options": {"include_usage": True, "other": 1}}).param == "stream_options"
    assert err("completion", {"prompt": "a", "stream": True,
                              "stream_options": {"include_usage": "yes"}}).param == "include_usage"


def test_engine_features_travel_and_are_named_as_needed() -> None:
    p = parse("completion", {"prompt": "a", "min_tokens": 3, "max_tokens": 9,
                             "logit_bias": {"17": -100, "5": 2.5}, "skip_special_tokens": False}, 64)
    (m,) = p.messages("r")
    assert (m.min_tokens, m.logit_bias, m.skip_special_tokens) == (3, {17: -100.0, 5: 2.5}, False)
    assert p.features == {"min_tokens", "logit_bias", "skip_special_tokens"}
    plain = parse("completion", {"prompt": "a", "min_tokens": 0, "logit_bias": {},
                                 "skip_special_tokens": True}, 64)
    assert plain.features == frozenset()
    for body, param in (({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
                        ({"min_tokens": -1}, "min_tokens"),
                        ({"logit_bias": {"x": 1}}, "logit_bias"),
                        ({"logit_bias": {"3": 101}}, "logit_bias"),
                        ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
                        ({"skip_special_tokens": 1}, "skip_special_tokens")):
        assert err("completion", {"prompt": "a", **body}).param == param, body


def test_lists_have_stated_bounds() -> None:
    """Issue 21: 100,000 stop_token_ids were accepted."""
    e = err("completion", {"prompt": "a", "stop_token_ids": list(range(100_000))})
    assert e.param == "stop_token_ids" and "1024" in e.message
    assert parse("completion", {"prompt": "a", "stop_token_ids": list(range(1024))}, 64)
    assert err("completion", {"prompt": "a", "stop": ["x"] * 17}).param == "stop"
    assert err("chat", {"messages": USER * 4097}).param == "messages"
    assert err("chat", {"messages": USER, "tools": [TOOL] * 129}).param == "tools"


def test_chat_tool_turns_and_tools_need_rendering_here() -> None:
    turns = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "-3 C"}]
    p = parse("chat", {"messages": turns, "tools": [TOOL]}, 64)
    (form,) = p.prompts
    chat = form["render"]
    assert chat.parse_tools and chat.tools == [TOOL]
    assert chat.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert chat.messages[2] == {"role": "tool", "content": "-3 C", "tool_call_id": "c1"}
    none = parse("chat", {"messages": USER, "tools": [TOOL], "tool_choice": "none"}, 64)
    assert none.chat.tools is None and not none.parse_tools  # type: ignore[union-attr]
    assert "messages" in none.prompts[0]  # plain: the daemon renders it
    assert err("chat", {"messages": [{"role": "tool", "content": "x"}]}).param == "messages"
    assert err("chat", {"messages": USER, "tools": [{"type": "function", "function": {"name": "a b"}}]}).param == "tools"
    assert err("chat", {"messages": USER, "tool_choice": "sometimes"}).param == "tool_choice"
    assert err("chat", {"messages": USER, "parallel_tool_calls": "no"}).param == "parallel_tool_calls"


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


def test_response_format_becomes_the_daemons_structured_output() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    p = parse("chat", {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "thing", "schema": schema, "strict": True}}}, 64)
    (g,) = p.messages("r")
    assert g.structured == P.Structured(kind="json_schema", value=json.dumps(schema))
    assert "structured" in p.features
    (g,) = parse("chat", {"messages": USER, "response_format": {"type": "json_object"}}, 64).messages("r")
    assert g.structured == P.Structured(kind="json_object")
    (g,) = parse("chat", {"messages": USER, "response_format": {"type": "text"}}, 64).messages("r")
    assert g.structured is None


def test_vllms_structured_output_parameters_become_the_daemons_structured_output() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}

    def one(kind: str, **extra: object) -> P.Structured | None:
        body = {"messages": USER} if kind == "chat" else {"prompt": "a"}
        (g,) = parse(kind, {**body, **extra}, 64).messages("r")  # type: ignore[arg-type]
        return g.structured

    assert one("chat", structured_outputs={"json": schema}) == P.Structured(
        kind="json_schema", value=json.dumps(schema))
    assert one("completion", guided_json=json.dumps(schema)) == P.Structured(
        kind="json_schema", value=json.dumps(schema))
    assert one("chat", structured_outputs={"regex": "[0-9]+"}) == P.Structured(kind="regex", value="[0-9]+")
    assert one("completion", guided_choice=["yes", "no"]) == P.Structured(kind="choice", value='["yes", "no"]')
    assert one("chat", guided_grammar='start: "a"') == P.Structured(kind="lark", value='start: "a"')
    assert one("chat", structured_outputs={"json_object": True}) == P.Structured(kind="json_object")
    assert one("chat", structured_outputs={"regex": None, "choice": ["x"]}) == P.Structured(
        kind="choice", value='["x"]')  # null keys are not given, as everywhere
    assert "structured" in parse("chat", {"messages": USER, "guided_regex": "a"}, 64).features
    # One kind at a time, from one source; bad values name the parameter.
    assert err("chat", {"messages": USER, "guided_regex": "a", "guided_choice": ["b"]}).param == "guided_choice"
    assert err("chat", {"messages": USER, "structured_outputs": {"regex": "a"},
                        "response_format": {"type": "json_object"}}).param == "structured_outputs"
    assert err("chat", {"messages": USER, "structured_outputs": {"structural_tag": "x"}}).code == (
        "unsupported_parameter")
    assert err("chat", {"messages": USER, "guided_choice": []}).param == "guided_choice"
    assert err("chat", {"messages": USER, "guided_json": "{not json"}).param == "guided_json"
    assert err("chat", {"messages": USER, "guided_regex": ""}).param == "guided_regex"
