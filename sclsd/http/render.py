"""The daemon's events -> OpenAI responses and errors (JSON via msgspec).

Shapes follow OpenAI's API as vLLM serves it: ``text_completion`` and
``chat.completion`` objects with ``created`` (the request's arrival) and
``system_fingerprint``. Usage counts each prompt once however many choices it
has, and every generated token (``best_of``'s unshown choices too);
``prompt_tokens_details.cached_tokens`` is there when the daemon counts it.
Stream chunks are :mod:`.stream`'s.

The prompt's log-probabilities (the daemon's ``prompt_logprobs``, from its second token on)
come as vLLM serves them: before the generated tokens' in a completion's ``logprobs`` with
``echo`` (the first token's entries ``null``), and as vLLM's ``prompt_logprobs`` field (a
completion's choices; a chat's response): ``[null, {"<token id>": {"logprob", "rank",
"decoded_token"}, ...}, ...]``, the prompt's own token first. Log-probabilities below
-9999 (``-inf``) are -9999, as vLLM clamps them.
"""

from __future__ import annotations

from dataclasses import dataclass
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


#: vLLM's floor for a log-probability (``-inf`` is not JSON).
LOGPROB_FLOOR = -9999.0


def _lp(x: float) -> float:
    return max(x, LOGPROB_FLOOR)


def _top(e: P.TokenLogprobs, n: int | None) -> dict[str, float]:
    """One position's ``top_logprobs``: the chosen token and the ``n`` (None: all given) most
    likely, as vLLM's dict (chosen first; where two tokens have one text, the first kept)."""
    out = {e.chosen.token: _lp(e.chosen.logprob)}
    for a in e.top[:n]:
        if a.id != e.chosen.id:
            out.setdefault(a.token, _lp(a.logprob))
    return out


def completion_logprobs(lps: list[P.TokenLogprobs], offset: int = 0, top: int | None = None,
                        prompt: tuple[str, list[P.TokenLogprobs]] | None = None) -> dict[str, Any]:
    """The legacy completions format; ``text_offset`` counts from ``offset``; ``top``: the
    alternatives per position (None: all given). ``prompt``: (the prompt's first token's
    text, the prompt's log-probabilities from its second token on), put first (``echo``):
    the first token has no log-probability (``null``s)."""
    tokens: list[str] = []
    token_lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    entries = lps
    if prompt is not None:
        head, plps = prompt
        tokens.append(head)
        token_lps.append(None)
        tops.append(None)
        entries = [*plps, *lps]
    tokens += [e.chosen.token for e in entries]
    token_lps += [_lp(e.chosen.logprob) for e in entries]
    tops += [_top(e, top) for e in entries]
    offsets = []
    pos = offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs(plps: list[P.TokenLogprobs], k: int) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs`` field: ``null`` for the first token, then per token a dict
    token id -> ``{"logprob", "rank", "decoded_token"}`` of the prompt's token (its rank where
    it is among the alternatives the daemon gave, else ``null``) and the ``k`` most likely
    (rank 1 first)."""
    out: list[dict[str, Any] | None] = [None]
    for e in plps:
        c = e.chosen
        rank = next((j + 1 for j, a in enumerate(e.top) if a.id == c.id), None)
        d = {str(c.id): {"logprob": _lp(c.logprob), "rank": rank, "decoded_token": c.token}}
        for j, a in enumerate(e.top[:k]):
            d.setdefault(str(a.id), {"logprob": _lp(a.logprob), "rank": j + 1, "decoded_token": a.token})
        out.append(d)
    return out


@dataclass(frozen=True)
class PromptLogprobs:
    """What a response shows of its prompts' log-probabilities (one entry per prompt)."""

    entries: list[list[P.TokenLogprobs]]
    """Each prompt's, from its second token on (the daemon's ``prompt_logprobs``)."""
    heads: list[str] | None = None
    """``echo`` with ``logprobs`` (completions): each prompt's first token's text, and its
    log-probabilities go before the generated tokens' (None: they do not)."""
    top: int = 0
    """With :attr:`heads`: the alternatives per prompt token in ``logprobs``."""
    field: int | None = None
    """vLLM's ``prompt_logprobs`` field, with this many alternatives (None: no field)."""

    def echoed(self, p: int) -> tuple[str, list[P.TokenLogprobs]] | None:
        """:func:`completion_logprobs`'s ``prompt`` for prompt ``p``."""
        return None if self.heads is None else (self.heads[p], self.entries[p])


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
             tool_mode: Mode | None = None, prompts: PromptLogprobs | None = None) -> bytes:
    """A non-streaming completion: one choice per ``shown`` ``Done``, in order; usage over
    all of ``dones``. ``echo``: text before each prompt's choices (indexed by prompt);
    ``tool_mode``: how tool calls come out of a chat's answer (:mod:`.calls`); ``prompts``:
    the prompts' log-probabilities to show."""
    choices = []
    per_shown = len(shown) // max(1, len(echo)) if echo else 1
    per_prompt_shown = len(shown) // max(1, len(prompts.entries)) if prompts else 1
    for i, d in enumerate(shown):
        reason = finish_reason(d)
        p = i // per_prompt_shown
        lp = None
        if logprobs:
            lps = d.logprobs or []
            lp = (chat_logprobs(lps) if kind == "chat" else
                  completion_logprobs(lps, top=prompts.top, prompt=prompts.echoed(p)) if prompts
                  else completion_logprobs(lps))
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
            choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": reason}
            if prompts is not None and prompts.field is not None:
                choice["prompt_logprobs"] = prompt_logprobs(prompts.entries[p], prompts.field)
            choices.append(choice)
    out = {**head, "object": "chat.completion" if kind == "chat" else "text_completion",
           "choices": choices, "usage": total_usage(dones, per_prompt)}
    if kind == "chat" and prompts is not None and prompts.field is not None:
        out["prompt_logprobs"] = prompt_logprobs(prompts.entries[0], prompts.field)  # vLLM's place
    return _json.encode(out)


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


__all__ = ["ApiError", "DONE_EVENT", "PromptLogprobs", "bad", "best", "encode", "error_body",
           "error_event", "from_daemon", "models", "not_found", "prompt_logprobs", "response"]
