"""Stream chunks of one response, as server-sent events ending with ``data: [DONE]``.

``text_completion`` / ``chat.completion.chunk`` objects, each with the response's
``id``, ``created`` (arrival) and ``system_fingerprint``. A chat choice opens with
the assistant's role. With ``stream_options.include_usage`` every chunk has
``usage: null`` and a last chunk with no choices carries the totals; with
``continuous_usage_stats`` as well, every chunk carries its choice's usage so far
(vLLM's shape). With ``echo`` a choice's first chunk is the echoed text. With
tool parsing (chat with ``tools``), calls leave as ``delta.tool_calls`` once each
is complete (:class:`.tools.ToolStream`), and the choice ends with ``tool_calls``.
"""

from __future__ import annotations

from typing import Any

from .. import protocol as P
from . import render
from .calls import CallStream, HermesStream, Mode
from .params import Kind


class Chunks:
    """Stream chunks of one response (see the module docstring)."""

    def __init__(self, kind: Kind, head: dict[str, Any], choices: int, per_prompt: int, *,
                 include_usage: bool = False, continuous: bool = False, logprobs: bool = False,
                 echo: list[str] | None = None, tool_mode: Mode | None = None) -> None:
        self.kind = kind
        self.head = dict(head, object="chat.completion.chunk" if kind == "chat" else "text_completion")
        self.per_prompt = per_prompt
        self.include_usage = include_usage
        self.continuous = continuous
        self.logprobs = logprobs
        self.echo = echo
        self.offsets = [0] * choices
        self.prompt_tokens = [0] * choices
        self.completion_tokens = [0] * choices
        self.dones: list[P.Done | None] = [None] * choices
        self.tool_streams: list[CallStream] | None = (
            [tool_mode.stream() for _ in range(choices)] if tool_mode is not None else None)

    def _event(self, index: int, choice: dict[str, Any]) -> bytes:
        obj: dict[str, Any] = dict(self.head, choices=[choice])
        if self.continuous:
            obj["usage"] = render.usage(self.prompt_tokens[index], self.completion_tokens[index])
        elif self.include_usage:
            obj["usage"] = None
        return b"data: " + render.encode(obj) + b"\n\n"

    def _choice(self, index: int, text: str, lp: Any, reason: str | None,
                calls: list[dict[str, Any]] | None = None, role: bool = False) -> dict[str, Any]:
        if self.kind != "chat":
            return {"index": index, "text": text, "logprobs": lp, "finish_reason": reason}
        delta: dict[str, Any] = {"role": "assistant", "content": text} if role else (
            {"content": text} if text else {})
        if calls:
            delta["tool_calls"] = calls
        return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}

    def start(self, index: int, accepted: P.Accepted) -> bytes:
        """The choice was accepted: a chat's role chunk; the echoed text, if any."""
        self.prompt_tokens[index] = accepted.prompt_tokens
        echo = self.echo[index // self.per_prompt] if self.echo else ""
        self.offsets[index] += len(echo)
        if self.kind == "chat":
            return self._event(index, self._choice(index, echo, None, None, role=True))
        return self._event(index, self._choice(index, echo, None, None)) if echo else b""

    def delta(self, index: int, text: str, lps: list[P.TokenLogprobs] | None,
              token_ids: list[int] | None = None) -> bytes:
        """New text of a choice (from ``token_ids``)."""
        self.completion_tokens[index] += len(token_ids or ())
        calls: list[dict[str, Any]] = []
        if self.tool_streams is not None:
            text, calls = self.tool_streams[index].feed(text)
        return self._piece(index, text, lps, None, calls)

    def _piece(self, index: int, text: str, lps: list[P.TokenLogprobs] | None, reason: str | None,
               calls: list[dict[str, Any]]) -> bytes:
        out = b""
        if not text and not lps and reason is None and not calls:
            return out
        lp = None
        if self.logprobs and lps:
            lp = (render.chat_logprobs(lps) if self.kind == "chat"
                  else render.completion_logprobs(lps, self.offsets[index]))
        self.offsets[index] += len(text)
        return out + self._event(index, self._choice(index, text, lp, reason, calls))

    def done(self, index: int, d: P.Done) -> bytes:
        """The choice's last chunk, with its finish reason (raises for a failed choice)."""
        reason = render.finish_reason(d)
        self.dones[index] = d
        self.completion_tokens[index] = d.usage.completion_tokens
        text: str = ""
        calls: list[dict[str, Any]] = []
        if self.tool_streams is not None:
            ts = self.tool_streams[index]
            text, calls = ts.finish()
            if ts.called and (reason == "stop" or isinstance(ts, HermesStream)):
                reason = "tool_calls"
        return self._piece(index, text, None, reason, calls)

    def usage(self) -> bytes:
        """The final usage chunk (``include_usage``), once every choice is done."""
        if not self.include_usage:
            return b""
        dones = [d for d in self.dones if d is not None]
        obj: dict[str, Any] = dict(self.head, choices=[],
                                   usage=render.total_usage(dones, self.per_prompt))
        return b"data: " + render.encode(obj) + b"\n\n"
