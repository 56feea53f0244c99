"""An OpenAI request body -> the daemon's ``generate`` messages.

Every parameter is checked here or by the protocol's own schema (the message is
built with :func:`msgspec.convert`, which validates types and ranges), and a
failure becomes an :class:`ApiError` naming the parameter as the client spelt
it. A parameter it does not know is accepted and left out, as vLLM does (routers in
front of several servers add their own fields to every body): :attr:`Parsed.ignored`
names them for the caller to log and count. A parameter it knows but cannot serve at
the value given is refused by name, never ignored. ``null`` counts as not given, for
every key (as in OpenAI's API and vLLM's).

Fan-out: each prompt (``prompt`` may be a list) is asked ``n`` times (``best_of``
times with ``best_of``); choice ``i`` of a seeded request gets seed ``seed + i``
so the choices differ and stay reproducible. ``max_tokens`` (chat:
``max_completion_tokens`` first) above the daemon's ``model.max_gen`` is refused
with 400 (the daemon checks; vLLM does the same); without it, generation may run
to that limit.

Some prompt forms need the model's tokenizer in this process (:mod:`.tokens`):
``{"render": ...}`` (a chat with tools or tool turns) and ``{"fim": ...}``
(``suffix``); :func:`sclsd.http.tokens.resolve` turns them into ``prompt_ids``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from .. import protocol as P
from .chat import Chat, chat
from .errors import ApiError, bad, unsupported

Kind = Literal["chat", "completion"]

#: Parameters both endpoints take (vLLM's extras included: top_k, min_p,
#: repetition_penalty, stop_token_ids, ignore_eos, min_tokens, skip_special_tokens,
#: include_stop_str_in_output).
_COMMON = frozenset({
    "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
    "stop_token_ids", "n", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "ignore_eos", "user", "stream", "stream_options", "logprobs", "min_tokens", "logit_bias",
    "skip_special_tokens", "echo", "response_format", "structured_outputs", "guided_json",
    "guided_regex", "guided_choice", "guided_grammar", "include_stop_str_in_output",
    "prompt_logprobs",
})
#: Accepted and ignored: fields OpenAI's SDKs and agent frameworks send, which vLLM accepts
#: too, and which mean nothing to this server (storage and billing on OpenAI's side, cache
#: routing hints, request ids, a reasoning model's effort).
IGNORED = frozenset({
    "store", "metadata", "service_tier", "prompt_cache_key", "prompt_cache_retention",
    "safety_identifier", "reasoning_effort", "verbosity", "prediction", "request_id",
    "cache_salt", "spaces_between_special_tokens",
})
#: Accepted with one value only (what this server does anyway); any other: 400 saying why.
#: ``return_hidden_states``, ``continue_final_message`` and ``include_reasoning`` are fields
#: SGLang's and vLLM's routers add to every body at these values.
_ONLY: dict[str, tuple[Any, str]] = {
    "modalities": (["text"], "only text output"),
    "use_beam_search": (False, "beam search is not served"),
    "return_hidden_states": (False, "hidden states are not returned"),
    "continue_final_message": (False, "a final assistant turn is answered after, not continued"),
    "include_reasoning": (True, "no reasoning parser here: a model's reasoning stays in the text"),
}
#: SGLang's switches for a reasoning parser, which this server does not run: either value
#: serves the text as the model wrote it (as SGLang without ``--reasoning-parser`` does).
_REASONING_SWITCHES = ("separate_reasoning", "stream_reasoning")
ALLOWED: dict[Kind, frozenset[str]] = {
    "completion": _COMMON | IGNORED | set(_ONLY) | {"prompt", "suffix", "best_of", "no_stop_trim"},
    "chat": _COMMON | IGNORED | set(_ONLY) | set(_REASONING_SWITCHES) | {
        "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
        "parallel_tool_calls", "chat_template_kwargs", "no_stop_trim"},
}
#: The longest parameter name :attr:`Parsed.ignored` keeps whole (a client's key is its own).
MAX_IGNORED_NAME = 64
#: Protocol field -> the HTTP parameter to name when the daemon's schema refuses it.
_PARAM_OF = {"prompt_ids": "prompt", "top_logprobs": "top_logprobs", "max_tokens": "max_tokens"}
#: Seeds travel as signed 64-bit integers; leave room for ``seed + i``.
_SEED_MAX = 2**63 - 1 - 1024
_INT_MAX = 2**31 - 1
#: At most this many stop strings.
MAX_STOP = 16


@dataclass
class Parsed:
    """A checked request: what to send the daemon and how to answer."""

    kind: Kind
    model: str | None
    stream: bool
    include_usage: bool
    n: int
    prompts: list[dict[str, Any]]
    """One prompt form per prompt: ``{"prompt": ...}``, ``{"prompt_ids": ...}``,
    ``{"messages": ...}`` or, until :mod:`.tokens` resolves them, ``{"render": Chat}`` and
    ``{"fim": (prefix, suffix)}``."""
    params: dict[str, Any] = field(default_factory=dict)
    """The ``generate`` fields every choice shares."""
    top_logprobs: int | None = None
    """None: no logprobs in the answer; else how many alternatives per token."""
    continuous_usage: bool = False
    """``stream_options.continuous_usage_stats``: usage in every chunk."""
    best_of: int | None = None
    """Completions: generate this many per prompt and answer the ``n`` likeliest."""
    echo: bool = False
    echo_texts: list[str] = field(default_factory=list)
    """With ``echo``: the text put before each prompt's output (filled by :mod:`.tokens`)."""
    chat: Chat | None = None
    prompt_logprobs: int | None = None
    """vLLM's ``prompt_logprobs``: each completion choice (a chat: the response) carries the
    prompt's log-probabilities with this many alternatives per token (None: not asked)."""
    echo_logprobs: bool = False
    """A completion with ``echo`` and ``logprobs``: its choices' ``logprobs`` cover the prompt's
    tokens before the generated ones (the prompt is tokenized here, :mod:`.tokens`)."""
    echo_only: bool = False
    """A completion's ``max_tokens: 0`` with ``echo``: each choice is its prompt alone (its text,
    and with ``logprobs`` its log-probabilities); the token the daemon generates is left out,
    and not counted in the usage."""
    prompt_heads: list[str] = field(default_factory=list)
    """With :attr:`echo_logprobs`: the text of each prompt's first token (filled by :mod:`.tokens`),
    which the daemon's ``prompt_logprobs`` leave out (they begin at the second)."""
    features: frozenset[str] = frozenset()
    """The optional daemon features (``Pong.features``) this request needs."""
    end_user: str | None = None
    """Who sent it, where the API key tells (several keys: one per end user)."""
    ignored: tuple[str, ...] = ()
    """Parameters this server does not know, left out of the request (sorted; names cut at
    :data:`MAX_IGNORED_NAME` characters)."""

    @property
    def per_prompt(self) -> int:
        """Daemon requests per prompt: ``best_of``, else ``n``."""
        return self.best_of or self.n

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.per_prompt

    @property
    def ask_prompt(self) -> int | None:
        """The daemon's ``prompt_logprobs`` to ask of each prompt's first choice (the other
        choices of the prompt share them); None: none."""
        if self.echo_logprobs:
            return max(self.top_logprobs or 0, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    @property
    def parse_tools(self) -> bool:
        return self.chat is not None and self.chat.parse_tools

    def messages(self, rid: str) -> list[P.Generate]:
        """The ``generate`` messages, choice ``index`` = prompt × per_prompt + i, ids
        ``rid-index`` (just ``rid`` for a single choice)."""
        out = []
        seed = self.params.get("seed")
        ask = self.ask_prompt
        for p, form in enumerate(self.prompts):
            for i in range(self.per_prompt):
                index = p * self.per_prompt + i
                g = dict(self.params, **form)
                g["id"] = rid if self.choices == 1 else f"{rid}-{index}"
                # Fair turns in the daemon (its line, its grammar checks): each end user's
                # requests are one group (sclsd-http's users share its connections): the one
                # their API key names, else their ``user``; else this HTTP request's choices.
                g["group"] = self.end_user or g.get("user") or rid
                if seed is not None:
                    g["seed"] = seed + i
                if ask is not None and i == 0:
                    g["prompt_logprobs"] = ask  # computed once per prompt, shown on each choice
                out.append(_convert(g))
        return out


def _convert(g: dict[str, Any]) -> P.Generate:
    try:
        return msgspec.convert(g, P.Generate)
    except msgspec.ValidationError as exc:
        text = str(exc)
        path = text.rpartition("at `$.")[2].rstrip("`")
        name = path.split(".")[0].split("[")[0] if path != text else None
        raise bad(_PARAM_OF.get(name or "", name), f"{name}: {text}" if name else text) from None


def _number(body: dict[str, Any], name: str) -> None:
    v = body.get(name)
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
        raise bad(name, f"{name}: must be a number")


def _int(body: dict[str, Any], name: str, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise bad(name, f"{name}: must be an integer in {lo}..{hi}")
    return v


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    v = body.get(name, default)
    if not isinstance(v, bool):
        raise bad(name, f"{name}: must be true or false")
    return v


def _stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP:
        raise bad("stop", f"stop: must be a non-empty string or a list of at most {MAX_STOP} of them")
    return stop


def _token_ids(body: dict[str, Any], name: str) -> list[int] | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, list) or len(v) > P.MAX_TOKEN_LIST or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= _INT_MAX for t in v):
        raise bad(name, f"{name}: must be a list of at most {P.MAX_TOKEN_LIST} token ids")
    return v


def _logit_bias(body: dict[str, Any]) -> dict[int, float]:
    """OpenAI's ``{"token id": bias}``, biases in [-100, 100]."""
    lb = body.get("logit_bias")
    if lb is None:
        return {}
    if not isinstance(lb, dict) or len(lb) > P.MAX_TOKEN_LIST:
        raise bad("logit_bias", f"logit_bias: must map at most {P.MAX_TOKEN_LIST} token ids to biases")
    out: dict[int, float] = {}
    for k, v in lb.items():
        if not (isinstance(k, str) and k.isdigit() and int(k) <= _INT_MAX):
            raise bad("logit_bias", f"logit_bias: {k!r} is not a token id")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise bad("logit_bias", f"logit_bias[{k}]: must be a number in -100..100")
        out[int(k)] = float(v)
    return out


def _prompts(body: dict[str, Any], max_choices: int) -> list[dict[str, Any]]:
    p = body.get("prompt")
    if p is None:
        raise bad("prompt", "prompt: required", "missing_parameter")
    if isinstance(p, str):
        return [{"prompt": p}]
    if isinstance(p, list) and p:
        # One prompt of token ids is as long as the model allows (the daemon bounds it);
        # ``max_choices`` bounds how many prompts a list holds.
        if all(isinstance(x, int) and not isinstance(x, bool) for x in p):
            return [{"prompt_ids": p}]
        if len(p) <= max_choices and all(isinstance(x, str) for x in p):
            return [{"prompt": x} for x in p]
        if len(p) <= max_choices and all(
                isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
                for x in p):
            return [{"prompt_ids": x} for x in p]
    raise bad("prompt", "prompt: must be a string, a list of strings, a list of token ids "
              f"or a list of such lists (none empty, at most {max_choices} prompts)")


def _logprobs(kind: Kind, body: dict[str, Any]) -> int | None:
    """How many alternatives per token (None: no logprobs)."""
    lp = body.get("logprobs")
    if kind == "completion":
        # Legacy completions: ``logprobs`` is the number of alternatives (0 = chosen only).
        return _int(body, "logprobs", 0, 20)
    if lp is not None and not isinstance(lp, bool):
        raise bad("logprobs", "logprobs: must be true or false")
    top = _int(body, "top_logprobs", 0, 20)
    if top is not None and not lp:
        raise bad("top_logprobs", "top_logprobs: needs logprobs = true")
    return (top or 0) if lp else None


def _stream_options(body: dict[str, Any], stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats)."""
    opts = body.get("stream_options")
    if opts is None:
        return False, False
    if not isinstance(opts, dict):
        raise bad("stream_options", "stream_options: must be an object")
    extra = sorted(k for k, v in opts.items() if v is not None
                   and k not in ("include_usage", "continuous_usage_stats"))
    if extra:
        raise bad("stream_options", f"stream_options: unsupported field(s) {', '.join(extra)} "
                  "(include_usage, continuous_usage_stats)")
    if not stream:
        raise bad("stream_options", "stream_options: only with stream = true")
    include = _bool(opts, "include_usage", False) if opts.get("include_usage") is not None else False
    cont = (_bool(opts, "continuous_usage_stats", False)
            if opts.get("continuous_usage_stats") is not None else False)
    # vLLM's rule: per-chunk usage is a refinement of include_usage.
    return include, include and cont


def _response_format(body: dict[str, Any]) -> dict[str, str] | None:
    """The daemon's ``structured`` for OpenAI's ``response_format`` (None: plain text):
    ``{"type": "json_object"}``, or ``{"type": "json_schema", "json_schema": {"name": ...,
    "schema": {...}, "strict": ...}}``; the daemon checks the schema itself."""
    rf = body.get("response_format")
    if rf is None:
        return None
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"kind": "json_object"}
    if kind == "json_schema":
        spec = rf.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, (dict, bool)):
            raise bad("response_format", "response_format: json_schema.schema must be a JSON schema object")
        return {"kind": "json_schema", "value": json.dumps(schema)}
    raise bad("response_format", 'response_format: must be {"type": "text" | "json_object" | '
              '"json_schema", ...}')


#: vLLM's ``structured_outputs`` keys (and its older ``guided_*`` parameters) -> the daemon's kind.
_VLLM_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "lark"}


def _vllm_structured(body: dict[str, Any]) -> tuple[str, dict[str, str]] | None:
    """vLLM's own structured-output parameters, as the daemon's ``structured``, with the
    parameter that gave it: ``structured_outputs: {"json" | "regex" | "choice" | "grammar":
    ..., or "json_object": true}`` and the older ``guided_json``, ``guided_regex``,
    ``guided_choice``, ``guided_grammar``."""
    given: list[tuple[str, str, Any]] = []  # (parameter, vLLM key, value)
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise bad("structured_outputs", "structured_outputs: must be an object")
        so = {k: v for k, v in so.items() if v is not None and v is not False}
        unknown = sorted(set(so) - set(_VLLM_KINDS) - {"json_object"})
        if unknown:
            raise bad("structured_outputs", f"structured_outputs: {unknown[0]} is not supported "
                      f"(json, regex, choice, grammar or json_object)", "unsupported_parameter")
        given += [("structured_outputs", k, v) for k, v in so.items()]
    given += [(f"guided_{k}", k, body[f"guided_{k}"]) for k in _VLLM_KINDS if f"guided_{k}" in body]
    if not given:
        return None
    if len(given) > 1:
        raise bad(given[1][0], f"{given[0][0]}: give one kind of structured output, not "
                  f"{', '.join(sorted({k for _, k, _ in given}))}")
    param, key, value = given[0]
    if key == "json_object":
        return param, {"kind": "json_object"}
    if key == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise bad(param, f"{param}: not a JSON schema (invalid JSON)") from None
        if not isinstance(value, (dict, bool)):
            raise bad(param, f"{param}: must be a JSON schema object")
        return param, {"kind": "json_schema", "value": json.dumps(value)}
    if key == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) for c in value)):
            raise bad(param, f"{param}: must be a non-empty list of strings")
        return param, {"kind": "choice", "value": json.dumps(value)}
    if not isinstance(value, str) or not value:
        raise bad(param, f"{param}: must be a non-empty string")
    return param, {"kind": _VLLM_KINDS[key], "value": value}


def _structured(body: dict[str, Any]) -> dict[str, str] | None:
    """The request's structured output from ``response_format`` or vLLM's parameters (one of them)."""
    openai = _response_format(body)
    vllm = _vllm_structured(body)
    if openai is not None and vllm is not None:
        raise bad(vllm[0], f"{vllm[0]}: not with a response_format of type {openai['kind']}")
    return openai if vllm is None else vllm[1]


def _completion_extras(body: dict[str, Any], parsed: Parsed, max_choices: int) -> None:
    """``best_of``, ``suffix`` and ``echo`` of a completion."""
    best_of = _int(body, "best_of", 1, max_choices)
    if best_of is not None and best_of > 1:
        if best_of < parsed.n:
            raise bad("best_of", f"best_of: must be at least n ({parsed.n})")
        if parsed.stream:
            raise bad("best_of", "best_of: cannot be streamed (the best choices are known only "
                      "once all are done)")
        parsed.best_of = best_of
    suffix = body.get("suffix")
    if suffix is not None:
        if not isinstance(suffix, str):
            raise bad("suffix", "suffix: must be a string")
        if any("prompt" not in form for form in parsed.prompts):
            raise bad("suffix", "suffix: needs a text prompt (fill-in-the-middle)")
        if parsed.echo:
            raise bad("suffix", "suffix: not with echo")
        if suffix:
            parsed.prompts = [{"fim": (form["prompt"], suffix)} for form in parsed.prompts]


def parse(kind: Kind, body: Any, max_choices: int) -> Parsed:
    """Check an OpenAI request body (already JSON-decoded)."""
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    body = {k: v for k, v in body.items() if v is not None}  # null: not given
    ignored = tuple(sorted({k[:MAX_IGNORED_NAME] for k in body if k not in ALLOWED[kind]}))
    for name, (only, why) in _ONLY.items():
        if name in body and (body[name] != only or type(body[name]) is not type(only)):
            raise unsupported(name, f"{why} (only {json.dumps(only)})")
    for name in _REASONING_SWITCHES:
        if name in body:
            _bool(body, name, True)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "model: must be a string")
    stream = _bool(body, "stream", False)
    include_usage, continuous = _stream_options(body, stream)
    structured = _structured(body)
    n = _int(body, "n", 1, max_choices) or 1
    the_chat = chat(body) if kind == "chat" else None
    forced = the_chat.structured() if the_chat is not None else None
    if forced is not None:
        if structured is not None:
            raise bad("tool_choice", "tool_choice: a forced tool call (required or a named "
                      "function) is structured output itself: not with response_format or "
                      "structured_outputs")
        structured = forced
    if the_chat is not None:
        prompts = [{"messages": the_chat.daemon_messages()} if the_chat.plain else {"render": the_chat}]
    else:
        prompts = _prompts(body, max_choices)
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        _number(body, name)
    max_tokens = _int(body, "max_completion_tokens", 1, _INT_MAX) if kind == "chat" else None
    if max_tokens is None:
        # A completion's 0 with echo: the prompt alone (OpenAI's legacy completions, vLLM's).
        max_tokens = _int(body, "max_tokens", 0 if kind == "completion" else 1, _INT_MAX)
    min_tokens = _int(body, "min_tokens", 0, _INT_MAX) or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad("min_tokens", f"min_tokens: {min_tokens} is more than max_tokens ({max_tokens})")
    echo_only = max_tokens == 0
    if echo_only:
        if not _bool(body, "echo", False):
            raise bad("max_tokens", "max_tokens: 0 generates nothing; it needs echo (the prompt alone, with "
                      "its log-probabilities where logprobs asks for them)")
        max_tokens = 1  # the daemon generates one token, which the answer leaves out
    seed = _int(body, "seed", -_SEED_MAX, _SEED_MAX)
    user = body.get("user")
    if user is not None and (not isinstance(user, str) or len(user) > 256):
        raise bad("user", "user: must be a string of at most 256 characters")
    top = _logprobs(kind, body)
    echo = _bool(body, "echo", False)
    prompt_lps = _int(body, "prompt_logprobs", 0, 20)
    if prompt_lps is not None and stream:
        raise unsupported("prompt_logprobs", "not with stream = true (as vLLM); echo with "
                          "logprobs streams the prompt's log-probabilities in a completion's first chunk")
    # A completion's echo with logprobs covers the prompt's tokens too (a chat's echo, the
    # final assistant turn, is text only: its logprobs are the answer's, as vLLM's).
    echo_lps = kind == "completion" and echo and top is not None
    skip_special = _bool(body, "skip_special_tokens", True)
    logit_bias = _logit_bias(body)
    params: dict[str, Any] = {
        "max_tokens": max_tokens, "cap_max_tokens": False, "stream": stream, "stop": _stop(body),
        "seed": seed, "user": user, "logprobs": top is not None, "top_logprobs": top or 0,
        "min_tokens": min_tokens, "logit_bias": logit_bias, "skip_special_tokens": skip_special,
    }
    # SGLang's ``no_stop_trim`` is vLLM's ``include_stop_str_in_output``.
    keep_stop = _bool(body, "include_stop_str_in_output", False) | _bool(body, "no_stop_trim", False)
    include_stop = keep_stop and bool(params["stop"])
    if include_stop:
        params["include_stop_str"] = True  # the daemon keeps the stop string that ended the text
    if structured is not None:
        params["structured"] = structured
    stop_ids = _token_ids(body, "stop_token_ids")
    if stop_ids is not None:
        params["stop_token_ids"] = stop_ids
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "ignore_eos"):
        if body.get(name) is not None:
            params[name] = body[name]
    if "temperature" not in params:
        params["temperature"] = 1.0  # OpenAI's default (the daemon's too)
    features = frozenset(name for name, on in (("min_tokens", min_tokens > 0),
                                               ("logit_bias", bool(logit_bias)),
                                               ("skip_special_tokens", not skip_special),
                                               ("structured", structured is not None),
                                               ("include_stop_str", include_stop),
                                               ("prompt_logprobs", echo_lps or prompt_lps is not None))
                       if on)
    parsed = Parsed(kind, model, stream, include_usage, n, prompts, params, top,
                    continuous_usage=continuous, echo=echo, chat=the_chat, prompt_logprobs=prompt_lps,
                    echo_logprobs=echo_lps, echo_only=echo_only, features=features, ignored=ignored)
    if kind == "completion":
        _completion_extras(body, parsed, max_choices)
    if parsed.best_of:
        # Ranking needs each choice's log-probabilities, asked for whether shown or not.
        params.update(logprobs=True, top_logprobs=top or 0)
    if parsed.choices > max_choices:
        raise bad("best_of" if parsed.best_of else "n",
                  f"{'best_of' if parsed.best_of else 'n'}: {len(prompts)} prompts x "
                  f"{parsed.per_prompt} = {parsed.choices} completions, more than {max_choices} "
                  "(http.max_choices)")
    # Check everything the protocol's schema checks (ranges, types) before any fan-out.
    form = prompts[0] if set(prompts[0]) & {"prompt", "prompt_ids", "messages"} else {"prompt": ""}
    _convert(dict(params, **form, id="check"))
    return parsed


__all__ = ["ALLOWED", "ApiError", "Kind", "Parsed", "bad", "parse"]
