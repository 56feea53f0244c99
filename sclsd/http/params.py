"""An OpenAI request body -> the daemon's ``generate`` messages.

Every parameter is checked here or by the protocol's own schema (the message is
built with :func:`msgspec.convert`, which validates types and ranges), and a
failure becomes an :class:`ApiError` naming the parameter as the client spelt
it. A parameter this server does not implement is refused by name rather than
ignored. ``null`` counts as not given, as in OpenAI's API.

Fan-out: each prompt (``prompt`` may be a list) is asked ``n`` times; choice
``i`` of a seeded request gets seed ``seed + i`` so the choices differ and stay
reproducible. ``max_tokens`` (chat: ``max_completion_tokens`` first) above the
daemon's ``model.max_gen`` is refused with 400 (the daemon checks; vLLM does the
same); without it, generation may run to that limit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from .. import protocol as P

Kind = Literal["chat", "completion"]

#: Parameters both endpoints take (vLLM's extras included: top_k, min_p,
#: repetition_penalty, stop_token_ids, ignore_eos).
_COMMON = frozenset({
    "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
    "stop_token_ids", "n", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "ignore_eos", "user", "stream", "stream_options", "logprobs",
})
ALLOWED: dict[Kind, frozenset[str]] = {
    "completion": _COMMON | {"prompt"},
    "chat": _COMMON | {"messages", "max_completion_tokens", "top_logprobs"},
}
#: Protocol field -> the HTTP parameter to name when the daemon's schema refuses it.
_PARAM_OF = {"prompt_ids": "prompt", "top_logprobs": "top_logprobs", "max_tokens": "max_tokens"}
#: Seeds travel as signed 64-bit integers; leave room for ``seed + i``.
_SEED_MAX = 2**63 - 1 - 1024
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class ApiError(Exception):
    """An error answered as OpenAI's ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def bad(param: str | None, message: str, code: str = "invalid_parameter") -> ApiError:
    """A 400 naming ``param``."""
    return ApiError(400, message, param, code)


@dataclass
class Parsed:
    """A checked request: what to send the daemon and how to answer."""

    kind: Kind
    model: str | None
    stream: bool
    include_usage: bool
    n: int
    prompts: list[dict[str, Any]]
    """One prompt form per prompt: ``{"prompt": ...}``, ``{"prompt_ids": ...}`` or ``{"messages": ...}``."""
    params: dict[str, Any] = field(default_factory=dict)
    """The ``generate`` fields every choice shares."""
    top_logprobs: int | None = None
    """None: no logprobs; else how many alternatives per token."""

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.n

    def messages(self, rid: str) -> list[P.Generate]:
        """The ``generate`` messages, choice ``index`` = prompt × n + i, ids ``rid-index``
        (just ``rid`` for a single choice)."""
        out = []
        seed = self.params.get("seed")
        for p, form in enumerate(self.prompts):
            for i in range(self.n):
                index = p * self.n + i
                g = dict(self.params, **form)
                g["id"] = rid if self.choices == 1 else f"{rid}-{index}"
                if seed is not None:
                    g["seed"] = seed + i
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


def _stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 16:
        raise bad("stop", "stop: must be a non-empty string or a list of at most 16 of them")
    return stop


def _content(m: Any, i: int) -> str:
    """A message's text: a string, or a list of ``{"type": "text", "text": ...}`` parts."""
    c = m.get("content")
    if isinstance(c, str):
        return c
    if c is None and m.get("role") == "assistant":
        return ""
    if isinstance(c, list) and all(isinstance(x, dict) and x.get("type") == "text"
                                   and isinstance(x.get("text"), str) for x in c):
        return "".join(x["text"] for x in c)
    raise bad("messages", f"messages[{i}].content: must be a string or a list of text parts "
              "(no images, audio or files)")


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "messages: must be a non-empty list", "missing_parameter"
                  if msgs is None else "invalid_parameter")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad("messages", f"messages[{i}]: must be an object with role and content")
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise bad("messages", f"messages[{i}]: unsupported field(s) {', '.join(sorted(extra))} "
                      "(no tools or function calls)")
        role = _ROLES.get(m.get("role"))  # type: ignore[arg-type]
        if role is None:
            raise bad("messages", f"messages[{i}].role: must be one of {', '.join(_ROLES)}")
        out.append({"role": role, "content": _content(m, i)})
    return out


def _prompts(body: dict[str, Any]) -> list[dict[str, Any]]:
    p = body.get("prompt")
    if p is None:
        raise bad("prompt", "prompt: required", "missing_parameter")
    if isinstance(p, str):
        return [{"prompt": p}]
    if isinstance(p, list) and p:
        if all(isinstance(x, str) for x in p):
            return [{"prompt": x} for x in p]
        if all(isinstance(x, int) and not isinstance(x, bool) for x in p):
            return [{"prompt_ids": p}]
        if all(isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool)
                                                    for t in x) for x in p):
            return [{"prompt_ids": x} for x in p]
    raise bad("prompt", "prompt: must be a string, a list of strings, a list of token ids "
              "or a list of such lists (none empty)")


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


def parse(kind: Kind, body: Any, max_choices: int) -> Parsed:
    """Check an OpenAI request body (already JSON-decoded)."""
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    unknown = sorted(k for k in body if k not in ALLOWED[kind])
    if unknown:
        raise bad(unknown[0], f"unsupported parameter(s): {', '.join(unknown)}", "unsupported_parameter")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "model: must be a string")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise bad("stream", "stream: must be true or false")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
            raise bad("stream_options", "stream_options: only include_usage is supported")
        if not stream:
            raise bad("stream_options", "stream_options: only with stream = true")
        include_usage = opts.get("include_usage") is True
    n = _int(body, "n", 1, max_choices) or 1
    prompts = [{"messages": _messages(body)}] if kind == "chat" else _prompts(body)
    if len(prompts) * n > max_choices:
        raise bad("n", f"n: {len(prompts)} prompts x n = {len(prompts) * n} completions, "
                  f"more than {max_choices} (http.max_choices)")
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        _number(body, name)
    max_tokens = _int(body, "max_completion_tokens", 1, 2**31 - 1) if kind == "chat" else None
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1, 2**31 - 1)
    seed = _int(body, "seed", -_SEED_MAX, _SEED_MAX)
    user = body.get("user")
    if user is not None and (not isinstance(user, str) or len(user) > 256):
        raise bad("user", "user: must be a string of at most 256 characters")
    top = _logprobs(kind, body)
    params: dict[str, Any] = {
        "max_tokens": max_tokens, "cap_max_tokens": False, "stream": stream, "stop": _stop(body),
        "seed": seed, "user": user, "logprobs": top is not None, "top_logprobs": top or 0,
    }
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "stop_token_ids", "ignore_eos"):
        if body.get(name) is not None:
            params[name] = body[name]
    if "temperature" not in params:
        params["temperature"] = 1.0  # OpenAI's default (the daemon's too)
    parsed = Parsed(kind, model, stream, include_usage, n, prompts, params, top)
    # Check everything the protocol's schema checks (ranges, types) before any fan-out.
    _convert(dict(params, **prompts[0], id="check"))
    return parsed
