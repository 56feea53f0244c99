"""The daemon's events -> OpenAI responses and errors (JSON via msgspec).

Shapes follow OpenAI's API as vLLM serves it: ``text_completion`` and
``chat.completion`` objects with ``created`` (the request's arrival) and
``system_fingerprint``. Usage counts each prompt once however many choices it
has, and every generated token (``best_of``'s unshown choices too);
``prompt_tokens_details.cached_tokens`` is there when the daemon counts it.
Stream chunks are :mod:`.stream`'s.
"""

from __future__ import annotations

from typing import Any

import msgspec

from .. import protocol as P
from .calls import Mode
from .errors import ApiError, bad
from .params import Kind

_json = msgspec.json.Encoder()
DONE_EVENT = b"data: [DONE]\n\n"

#: The daemon's error codes -> HTTP status (OpenAI's clients map these to their exceptions).
STATUS_OF: dict[str, int] = {
    "bad_request": 400, "prompt_too_long": 400, "frame_too_large": 413, "overloaded": 429,
    "draining": 503, "shutdown": 503, "no_workers": 503, "starting": 503, "timeout": 504,
    "forbidden": 503, "engine_error": 500,
}
#: OpenAI's ``type`` for each status.
_TYPE_OF = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
            408: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
            431: "invalid_request_error", 503: "service_unavailable_error", 504: "timeout_error"}


def from_daemon(err: P.Error) -> ApiError:
    """The daemon refused or failed a request: the matching HTTP error."""
    status = STATUS_OF.get(err.code, 500)
    param = None
    if status == 400:
        # The daemon names the field first ("max_tokens: ...", "messages: ..."); the prompt
        # checks name no field but are about the prompt.
        head, sep, _ = err.message.partition(":")
        param = head if sep and head.isidentifier() else "prompt"
        param = "prompt" if param == "prompt_ids" else param
    if err.code == "forbidden":
        message = f"sclsd-http may not use the daemon's socket: {err.message}"
    else:
        message = err.message
    return ApiError(status, message, param, err.code)


def error_body(e: ApiError) -> bytes:
    return _json.encode({"error": {"message": e.message, "type": _TYPE_OF.get(e.status, "server_error"),
                                   "param": e.param, "code": e.code}})


def error_event(e: ApiError) -> bytes:
    """A stream that failed after it started: one event with the error (then ``[DONE]``)."""
    return b"data: " + error_body(e) + b"\n\n"


def finish_reason(done: P.Done) -> str:
    """OpenAI's finish reasons are ``stop`` and ``length``; anything else is an error."""
    if done.finish_reason in ("stop", "length"):
        return done.finish_reason
    if done.finish_reason == "cancelled":
        raise ApiError(503, "the request was cancelled in the daemon (an admin, or a drain)",
                       None, "cancelled")
    if done.finish_reason == "timeout":
        raise ApiError(504, "the request timed out in the daemon", None, "timeout")
    raise ApiError(500, "the daemon could not serve the request (its batch failed repeatedly)",
                   None, "internal")


def usage(prompt_tokens: int, completion_tokens: int, cached: int | None = None) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": None if cached is None else {"cached_tokens": cached}}


def total_usage(dones: list[P.Done], per_prompt: int) -> dict[str, Any]:
    """Each prompt's tokens once (choices ``k·m .. k·m+m-1`` share prompt ``k``)."""
    firsts = dones[::per_prompt]
    cached = [d.usage.cached_tokens for d in firsts]
    return usage(sum(d.usage.prompt_tokens for d in firsts),
                 sum(d.usage.completion_tokens for d in dones),
                 None if any(c is None for c in cached) else sum(c for c in cached if c is not None))


# ---------------------------------------------------------------------- logprobs


def _bytes(s: str) -> list[int]:
    return list(s.encode("utf-8", "surrogatepass"))


def chat_logprobs(lps: list[P.TokenLogprobs]) -> dict[str, Any]:
    """``choices[].logprobs`` of a chat completion: ``{"content": [...]}``."""
    return {"content": [
        {"token": e.chosen.token, "logprob": e.chosen.logprob, "bytes": _bytes(e.chosen.token),
         "top_logprobs": [{"token": a.token, "logprob": a.logprob, "bytes": _bytes(a.token)}
                          for a in e.top]}
        for e in lps
    ]}


def completion_logprobs(lps: list[P.TokenLogprobs], offset: int = 0) -> dict[str, Any]:
    """The legacy completions format; ``text_offset`` counts from ``offset``."""
    offsets = []
    pos = offset
    for e in lps:
        offsets.append(pos)
        pos += len(e.chosen.token)
    return {
        "tokens": [e.chosen.token for e in lps],
        "token_logprobs": [e.chosen.logprob for e in lps],
        "top_logprobs": [{a.token: a.logprob for a in e.top} for e in lps],
        "text_offset": offsets,
    }


def best(dones: list[P.Done], best_of: int, n: int) -> list[P.Done]:
    """``best_of``: of each prompt's ``best_of`` choices, the ``n`` with the highest sum of
    log-probabilities (ties: the earlier), in that order."""
    out = []
    for k in range(0, len(dones), best_of):
        group = dones[k:k + best_of]
        score = [sum(e.chosen.logprob for e in d.logprobs or []) for d in group]
        order = sorted(range(len(group)), key=lambda i: (-score[i], i))
        out += [group[i] for i in order[:n]]
    return out


# ---------------------------------------------------------------------- whole responses


def response(kind: Kind, head: dict[str, Any], dones: list[P.Done], shown: list[P.Done],
             per_prompt: int, logprobs: bool, echo: list[str] | None = None,
             tool_mode: Mode | None = None) -> bytes:
    """A non-streaming completion: one choice per ``shown`` ``Done``, in order; usage over
    all of ``dones``. ``echo``: text before each prompt's choices (indexed by prompt);
    ``tool_mode``: how tool calls come out of a chat's answer (:mod:`.calls`)."""
    choices = []
    per_shown = len(shown) // max(1, len(echo)) if echo else 1
    for i, d in enumerate(shown):
        lp = None
        if logprobs:
            lps = d.logprobs or []
            lp = chat_logprobs(lps) if kind == "chat" else completion_logprobs(lps)
        reason = finish_reason(d)
        text = (echo[i // per_shown] if echo else "") + (d.text or "")
        if kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if tool_mode is not None:
                content, calls = tool_mode.parse(text)
                if calls:
                    message = {"role": "assistant", "content": content, "tool_calls": calls}
                    reason = "tool_calls" if reason == "stop" or tool_mode.choice == "auto" else reason
            choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": reason})
        else:
            choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": reason})
    return _json.encode({
        **head, "object": "chat.completion" if kind == "chat" else "text_completion",
        "choices": choices, "usage": total_usage(dones, per_prompt),
    })


def models(name: str, created: int, max_model_len: int | None = None) -> dict[str, Any]:
    """One model card (``/v1/models`` lists it, ``/v1/models/{id}`` answers it)."""
    card: dict[str, Any] = {"id": name, "object": "model", "created": created, "owned_by": "sclsd",
                            "root": name, "parent": None}
    if max_model_len:
        card["max_model_len"] = max_model_len
    return card


def encode(obj: Any) -> bytes:
    return _json.encode(obj)


def not_found(model: str) -> ApiError:
    return ApiError(404, f"The model `{model}` does not exist.", "model", "model_not_found")


__all__ = ["ApiError", "DONE_EVENT", "bad", "best", "encode", "error_body", "error_event",
           "from_daemon", "models", "not_found", "response"]
