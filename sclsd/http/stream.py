"""Stream chunks of one response, as server-sent events ending with ``data: [DONE]``.

``text_completion`` / ``chat.completion.chunk`` objects, each with the response's
``id``, ``created`` (arrival) and ``system_fingerprint``. A chat choice opens with
the assistant's role. With ``stream_options.include_usage`` every chunk has
``usage: null`` and a last chunk with no choices carries the totals; with
``continuous_usage_stats`` as well, every chunk carries its choice's usage so far
(vLLM's shape). With ``echo`` a choice's first chunk is the echoed text. With
tool parsing (chat with ``tools``), calls leave as ``delta.tool_calls`` once each
is complete (:class:`.tools.ToolStream`), and the choice ends with ``tool_calls``.

A completion's ``echo`` with ``logprobs`` streams as vLLM's: a choice's first chunk is the
echoed prompt and its first generated text, with the log-probabilities of the prompt's
tokens then the generated ones. The daemon sends the prompt's with the first delta after the
prefill of the prompt's first choice (the one that asks for them); the prompt's other
choices wait for them (their events held, in order).
"""

from __future__ import annotations

from typing import Any

from .. import protocol as P
from . import render
from .calls import CallStream, HermesStream, Mode
from .errors import ApiError
from .params import Kind


class Chunks:
    """Stream chunks of one response (see the module docstring)."""

    def __init__(self, kind: Kind, head: dict[str, Any], choices: int, per_prompt: int, *,
                 include_usage: bool = False, continuous: bool = False, logprobs: bool = False,
                 echo: list[str] | None = None, tool_mode: Mode | None = None,
                 prompt_heads: list[str] | None = None) -> None:
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
        self.prompt_heads = prompt_heads
        """Echo with logprobs: each prompt's first token's text (None: no such echo)."""
        prompts = len(prompt_heads) if prompt_heads is not None else 0
        self.prompt_lps: list[list[P.TokenLogprobs] | None] = [None] * prompts
        """Each prompt's log-probabilities, once its first choice brought them."""
        self.held: list[list[Any]] = [[] for _ in range(prompts)]
        """Events of a prompt's choices that wait for its log-probabilities."""
        self.echoed = [prompt_heads is None] * choices
        """The choice's echo was sent (echo with logprobs: with its first text)."""

    def event(self, index: int, ev: Any) -> bytes:
        """The chunks of one daemon event (``accepted``, ``delta``, ``done``) of choice ``index``."""
        if isinstance(ev, P.Accepted):
            out = self.start(index, ev)
            if self.prompt_heads is not None and ev.prompt_tokens <= 1 and index % self.per_prompt == 0:
                out += self._prompt(index, [])  # one token: the daemon sends none
            return out
        if self.prompt_heads is None:
            return self._event_of(index, ev)
        p = index // self.per_prompt
        if ev.prompt_logprobs is not None and self.prompt_lps[p] is None:
            return self._prompt(index, ev.prompt_logprobs, ev)
        if self.prompt_lps[p] is None:
            if index % self.per_prompt == 0 and isinstance(ev, P.Done):
                render.finish_reason(ev)  # a failed choice says why
                raise ApiError(500, "the daemon sent no prompt log-probabilities", None, "internal")
            self.held[p].append((index, ev))
            return b""
        return self._event_of(index, ev)

    def _prompt(self, index: int, lps: list[P.TokenLogprobs], ev: Any = None) -> bytes:
        """Prompt ``index // per_prompt``'s log-probabilities came (with ``ev``): its held
        events go now, after ``ev``."""
        p = index // self.per_prompt
        self.prompt_lps[p] = lps
        out = self._event_of(index, ev) if ev is not None else b""
        held, self.held[p] = self.held[p], []
        for i, e in held:
            out += self._event_of(i, e)
        return out

    def _event_of(self, index: int, ev: Any) -> bytes:
        if isinstance(ev, P.Delta):
            return self.delta(index, ev.text, ev.logprobs, ev.token_ids)
        return self.done(index, ev)

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
        if not self.echoed[index]:
            return b""  # the echo goes with the first text and the prompt's log-probabilities
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
        prompt = None
        if not self.echoed[index]:
            self.echoed[index] = True
            p = index // self.per_prompt
            assert self.echo is not None and self.prompt_heads is not None
            lps = lps or []
            prompt = (self.prompt_heads[p], self.prompt_lps[p] or [])
            text = self.echo[p] + text
        if not text and not lps and reason is None and not calls and prompt is None:
            return out
        lp = None
        if self.logprobs and (lps or prompt is not None):
            lp = (render.chat_logprobs(lps or []) if self.kind == "chat"
                  else render.completion_logprobs(lps or [], self.offsets[index], prompt=prompt))
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
