"""``/openapi.json`` (and ``/docs``): FastAPI's schema plus the routes this server
serves as plain Starlette routes for speed (the completions and tokenizer routes),
their request bodies described from :data:`PARAMS`, the one table of every
parameter they take (a test holds it to :data:`.params.ALLOWED` and the README)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

_NUM: dict[str, Any] = {"type": "number"}
_INT: dict[str, Any] = {"type": "integer"}
_BOOL: dict[str, Any] = {"type": "boolean"}
_STR: dict[str, Any] = {"type": "string"}
_OBJ: dict[str, Any] = {"type": "object"}
_IDS: dict[str, Any] = {"type": "array", "items": _INT}

#: name -> (JSON schema, what it does). Shared by both endpoints unless marked.
PARAMS: dict[str, tuple[dict[str, Any], str]] = {
    "model": (_STR, "the served model's name (404 for another); may be omitted"),
    "prompt": ({"anyOf": [_STR, {"type": "array", "items": _STR}, _IDS,
                          {"type": "array", "items": _IDS}]},
               "completions: text, texts, token ids or lists of token ids"),
    "messages": ({"type": "array", "items": _OBJ}, "chat: the turns"),
    "max_tokens": (_INT, "most tokens to generate (default: the daemon's model.default_max_tokens)"),
    "max_completion_tokens": (_INT, "chat: as max_tokens, and wins over it"),
    "min_tokens": (_INT, "tokens to generate before EOS or a stop token may end the answer"),
    "temperature": (_NUM, "0: greedy; default 1"),
    "top_p": (_NUM, "nucleus sampling mass (0, 1]"),
    "top_k": (_INT, "0: off"),
    "min_p": (_NUM, "0: off"),
    "seed": (_INT, "reproducible sampling; choice i uses seed + i"),
    "stop": ({"anyOf": [_STR, {"type": "array", "items": _STR}]}, "up to 16 stop strings"),
    "stop_token_ids": (_IDS, "up to 1024 extra token ids that end generation"),
    "ignore_eos": (_BOOL, "do not stop at EOS"),
    "n": (_INT, "choices per prompt"),
    "best_of": (_INT, "completions: generate this many per prompt, answer the n likeliest"),
    "logprobs": ({"anyOf": [_BOOL, _INT]}, "chat: true; completions: alternatives per token"),
    "top_logprobs": (_INT, "chat: alternatives per token (0-20)"),
    "prompt_logprobs": (_INT, "vLLM's: the prompt's log-probabilities with this many alternatives "
                              "per token (0-20), in each completion choice (chat: the response); "
                              "not with stream"),
    "logit_bias": (_OBJ, "token id -> bias in [-100, 100] (up to 1024)"),
    "presence_penalty": (_NUM, "-2 to 2"),
    "frequency_penalty": (_NUM, "-2 to 2"),
    "repetition_penalty": (_NUM, "> 0, 1: off"),
    "skip_special_tokens": (_BOOL, "leave special tokens out of the text (default true)"),
    "echo": (_BOOL, "put the prompt (chat: a final assistant turn) before the answer; "
                    "completions with logprobs: the prompt's tokens' log-probabilities first"),
    "suffix": (_STR, "completions: text after the gap (fill-in-the-middle models)"),
    "tools": ({"type": "array", "items": _OBJ}, "chat: functions the model may call"),
    "tool_choice": ({"anyOf": [_STR, _OBJ]}, "chat: auto, none, required, or "
                    '{"type": "function", "function": {"name"}}: required and named force a call'),
    "parallel_tool_calls": (_BOOL, "chat: false keeps the first call only"),
    "response_format": (_OBJ, '{"type": "text" | "json_object" | "json_schema", "json_schema": '
                               '{"name", "schema"}}: the output follows the JSON schema'),
    "structured_outputs": (_OBJ, 'vLLM\'s: one of {"json": schema, "regex": str, "choice": [str], '
                                 '"grammar": Lark text, "json_object": true}'),
    "guided_json": ({"anyOf": [_OBJ, _STR]}, "vLLM's older form of structured_outputs.json"),
    "guided_regex": (_STR, "vLLM's older form of structured_outputs.regex"),
    "guided_choice": ({"type": "array", "items": _STR}, "vLLM's older form of structured_outputs.choice"),
    "guided_grammar": (_STR, "vLLM's older form of structured_outputs.grammar (Lark)"),
    "stream": (_BOOL, "server-sent events"),
    "stream_options": (_OBJ, "include_usage, continuous_usage_stats"),
    "user": (_STR, "logged by the daemon"),
    "include_stop_str_in_output": (_BOOL, "vLLM's: the stop string that ended the text stays in it"),
    "chat_template_kwargs": (_OBJ, "chat: more variables for the chat template (vLLM's)"),
    "modalities": ({"type": "array", "items": _STR}, 'only ["text"]'),
    "use_beam_search": (_BOOL, "vLLM's: only false"),
    "return_hidden_states": (_BOOL, "SGLang's: only false"),
    "continue_final_message": (_BOOL, "vLLM's: only false (a final assistant turn is answered)"),
    "include_reasoning": (_BOOL, "only true (a model's reasoning stays in its text)"),
    "no_stop_trim": (_BOOL, "SGLang's include_stop_str_in_output"),
    "separate_reasoning": (_BOOL, "SGLang's: no reasoning parser here, either value serves the text as is"),
    "stream_reasoning": (_BOOL, "SGLang's: no reasoning parser here, either value serves the text as is"),
    **{name: ({}, "accepted and ignored (no meaning here)") for name in (
        "store", "metadata", "service_tier", "prompt_cache_key", "prompt_cache_retention",
        "safety_identifier", "reasoning_effort", "verbosity", "prediction", "request_id",
        "cache_salt", "spaces_between_special_tokens")},
}
_TOKENIZE = {
    "model": _STR, "prompt": _STR, "messages": {"type": "array", "items": _OBJ},
    "tools": {"type": "array", "items": _OBJ},
    "add_special_tokens": _BOOL, "add_generation_prompt": _BOOL, "return_token_strs": _BOOL,
}


def body_schema(names: frozenset[str]) -> dict[str, Any]:
    return {"type": "object", "properties": {
        k: {**schema, "description": text} for k, (schema, text) in PARAMS.items() if k in names}}


def _post(summary: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
        "responses": {"200": {"description": "the answer (server-sent events with stream)"},
                      "400": {"description": "a bad or unsupported parameter, named in error.param"}},
    }}


def install(app: FastAPI) -> None:
    """Extend ``app``'s OpenAPI schema with the plain routes."""
    from .params import ALLOWED

    base = app.openapi

    def schema() -> dict[str, Any]:
        if app.openapi_schema is None:
            out = base()
            out.setdefault("paths", {}).update({
                "/v1/completions": _post("Completions", body_schema(ALLOWED["completion"])),
                "/v1/chat/completions": _post("Chat completions", body_schema(ALLOWED["chat"])),
                "/tokenize": _post("Token ids of a prompt or chat, as the daemon counts them",
                                   {"type": "object", "properties": _TOKENIZE}),
                "/detokenize": _post("Text of token ids", {"type": "object", "properties": {
                    "model": _STR, "tokens": _IDS}}),
            })
            app.openapi_schema = out
        return app.openapi_schema

    app.openapi = schema  # type: ignore[method-assign]
