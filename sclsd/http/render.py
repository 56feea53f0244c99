"""The daemon's events -> OpenAI responses, stream chunks and errors (JSON via msgspec).

Shapes follow OpenAI's API as vLLM serves it: ``text_completion`` and
``chat.completion`` objects; stream chunks (``text_completion`` /
``chat.completion.chunk``) as server-sent events ending with ``data: [DONE]``;
with ``stream_options.include_usage`` every chunk has ``usage: null`` and a last
chunk with no choices carries the totals. Usage counts each prompt once however
many choices it has, and every choice's completion tokens.
"""

from __future__ import annotations

from typing import Any

import msgspec

from .. import protocol as P
from .params import ApiError, Kind, bad

_json = msgspec.json.Encoder()
DONE_EVENT = b"data: [DONE]\n\n"

#: The daemon's error codes -> HTTP status (OpenAI's clients map these to their exceptions).
STATUS_OF: dict[str, int] = {
    "bad_request": 400, "prompt_too_long": 400, "overloaded": 429, "draining": 503,
    "shutdown": 503, "no_workers": 503, "starting": 503, "timeout": 504, "forbidden": 503,
}
#: OpenAI's ``type`` for each status.
_TYPE_OF = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
            429: "rate_limit_error", 503: "service_unavailable_error", 504: "timeout_error"}


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


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def total_usage(dones: list[P.Done], n: int) -> dict[str, int]:
    """Each prompt's tokens once (choices ``k·n .. k·n+n-1`` share prompt ``k``)."""
    return usage(sum(d.usage.prompt_tokens for d in dones[::n]),
                 sum(d.usage.completion_tokens for d in dones))


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


# ---------------------------------------------------------------------- whole responses


def response(kind: Kind, rid: str, created: int, model: str, dones: list[P.Done], n: int,
             logprobs: bool) -> bytes:
    """A non-streaming completion with one choice per ``Done``, in order."""
    choices = []
    for i, d in enumerate(dones):
        lp = None
        if logprobs:
            lps = d.logprobs or []
            lp = chat_logprobs(lps) if kind == "chat" else completion_logprobs(lps)
        reason = finish_reason(d)
        if kind == "chat":
            choices.append({"index": i, "message": {"role": "assistant", "content": d.text or ""},
                            "logprobs": lp, "finish_reason": reason})
        else:
            choices.append({"index": i, "text": d.text or "", "logprobs": lp, "finish_reason": reason})
    return _json.encode({
        "id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": created, "model": model, "choices": choices, "usage": total_usage(dones, n),
    })


class Chunks:
    """Stream chunks of one response (see the module docstring)."""

    def __init__(self, kind: Kind, rid: str, created: int, model: str, choices: int, n: int,
                 include_usage: bool, logprobs: bool) -> None:
        self.kind = kind
        self.head = {"id": rid, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                     "created": created, "model": model}
        self.n = n
        self.include_usage = include_usage
        self.logprobs = logprobs
        self.offsets = [0] * choices
        self.dones: list[P.Done | None] = [None] * choices

    def _event(self, choice: dict[str, Any]) -> bytes:
        obj: dict[str, Any] = dict(self.head, choices=[choice])
        if self.include_usage:
            obj["usage"] = None
        return b"data: " + _json.encode(obj) + b"\n\n"

    def start(self, index: int) -> bytes:
        """A chat choice opens with the assistant's role (completions need nothing)."""
        if self.kind != "chat":
            return b""
        return self._event({"index": index, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None})

    def delta(self, index: int, text: str, lps: list[P.TokenLogprobs] | None,
              reason: str | None = None) -> bytes:
        if not text and not lps and reason is None:
            return b""
        lp = None
        if self.logprobs and lps:
            lp = (chat_logprobs(lps) if self.kind == "chat"
                  else completion_logprobs(lps, self.offsets[index]))
        self.offsets[index] += len(text)
        if self.kind == "chat":
            delta = {"content": text} if text else {}
            return self._event({"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason})
        return self._event({"index": index, "text": text, "logprobs": lp, "finish_reason": reason})

    def done(self, index: int, d: P.Done) -> bytes:
        """The choice's last chunk, with its finish reason (raises for a failed choice)."""
        self.dones[index] = d
        return self.delta(index, "", None, finish_reason(d))

    def usage(self) -> bytes:
        """The final usage chunk (``include_usage``), once every choice is done."""
        if not self.include_usage:
            return b""
        dones = [d for d in self.dones if d is not None]
        obj: dict[str, Any] = dict(self.head, choices=[], usage=total_usage(dones, self.n))
        return b"data: " + _json.encode(obj) + b"\n\n"


def models(name: str, created: int, max_model_len: int | None = None) -> bytes:
    card: dict[str, Any] = {"id": name, "object": "model", "created": created, "owned_by": "sclsd",
                            "root": name, "parent": None}
    if max_model_len:
        card["max_model_len"] = max_model_len
    return _json.encode({"object": "list", "data": [card]})


def not_found(model: str) -> ApiError:
    return ApiError(404, f"The model `{model}` does not exist.", "model", "model_not_found")


__all__ = ["ApiError", "Chunks", "DONE_EVENT", "bad", "error_body", "error_event", "from_daemon",
           "models", "not_found", "response"]
