"""``POST /v1/responses``: OpenAI's Responses API (as vLLM serves it) over the chat path.

A request is rewritten into a chat completion request (:func:`chat_body`) and served
by the same code, then its answer rewritten into a ``response`` object, or its chunks
into the Responses stream's events (:class:`Events`):

* ``input``: a string (one user turn) or a list of items: messages (``role``, content
  a string or ``input_text`` / ``output_text`` parts), ``function_call`` and
  ``function_call_output`` items (earlier calls and their results);
* ``instructions`` (a system turn first), ``max_output_tokens``, ``temperature``,
  ``top_p``, ``text.format`` (``text``, ``json_object``, ``json_schema``), ``tools``
  (function tools), ``tool_choice``, ``parallel_tool_calls``, ``stream``;
* accepted and ignored as on the chat path: ``store``, ``metadata``, ``user``,
  ``service_tier``, ``reasoning``, ``include``, ``prompt_cache_key``, ... ; a
  ``previous_response_id`` is refused (nothing is stored here);
* a chat parameter that is not a Responses one (``n``, ``messages``) is refused by name;
  a name unknown to both is accepted, logged once and counted, as on the chat path.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from . import render
from .errors import ApiError, bad, unsupported
from .params import ALLOWED

#: Responses parameters -> how each reaches the chat request (None: as is).
_AS_CHAT = {"max_output_tokens": "max_tokens", "temperature": None, "top_p": None, "stream": None,
            "parallel_tool_calls": None, "model": None, "user": None, "store": None,
            "metadata": None, "service_tier": None, "prompt_cache_key": None,
            "safety_identifier": None, "top_logprobs": None}
#: Accepted and dropped: meaningless here (reasoning summaries, stored state, what to include).
_DROPPED = frozenset({"reasoning", "include", "truncation", "max_tool_calls", "background",
                      "prompt_cache_retention", "stream_options"})
_OWN = frozenset({"input", "instructions", "text", "tools", "tool_choice", "previous_response_id"})
#: Chat parameter names in errors -> the Responses names the client used.
_PARAM = {"max_tokens": "max_output_tokens", "response_format": "text", "messages": "input"}


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
            and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise bad("input", f"{where}.content: must be a string or text parts (no images or files)")


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    inp = body.get("input")
    out: list[dict[str, Any]] = []
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise bad("instructions", "instructions: must be a string")
        out.append({"role": "system", "content": body["instructions"]})
    if isinstance(inp, str):
        return [*out, {"role": "user", "content": inp}]
    if not isinstance(inp, list) or not inp:
        raise bad("input", "input: must be a string or a non-empty list of items",
                  "missing_parameter" if inp is None else "invalid_parameter")
    for i, item in enumerate(inp):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and isinstance(item.get("role"), str):
            out.append({"role": item["role"], "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls of one turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str) else json.dumps(output)})
        else:
            raise bad("input", f"{where}: must be a message, function_call or function_call_output")
    return out


def _format(body: dict[str, Any]) -> dict[str, Any] | None:
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if text is not None and not isinstance(text, dict):
        raise bad("text", "text: must be an object")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        assert isinstance(fmt, dict)
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"),
                                                       "schema": fmt.get("schema")}}
    raise bad("text", 'text.format: must be {"type": "text" | "json_object" | "json_schema", ...}')


def _tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, Any]:
    tools = body.get("tools")
    out = None
    if tools is not None:
        if not isinstance(tools, list):
            raise bad("tools", "tools: must be a list")
        out = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") != "function":
                raise unsupported("tools", f"tools[{i}]: only function tools are served (no "
                                  "built-in tools such as web or file search)")
            out.append({"type": "function", "function": {
                k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}})
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    return out, choice


def chat_body(body: Any) -> dict[str, Any]:
    """The chat completion request that serves a Responses request."""
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    body = {k: v for k, v in body.items() if v is not None}
    unknown = sorted(set(body) - set(_AS_CHAT) - _DROPPED - _OWN)
    # A chat parameter that the Responses API spells otherwise or lacks: the client meant
    # something this request does not say, so it is named rather than ignored.
    misplaced = [k for k in unknown if k in ALLOWED["chat"]]
    if misplaced:
        raise bad(misplaced[0], f"unsupported parameter(s) for /v1/responses: {', '.join(misplaced)}",
                  "unsupported_parameter")
    if "previous_response_id" in body:
        raise unsupported("previous_response_id", "responses are not stored here; send the "
                          "earlier turns in input")
    if body.get("background") not in (None, False):
        raise unsupported("background", "responses are served in the foreground only")
    # Anything else is unknown to both: the chat path accepts it, and reports it as ignored.
    out: dict[str, Any] = {"messages": _messages(body), **{k: body[k] for k in unknown}}
    for k, v in body.items():
        if k in _AS_CHAT:
            out[_AS_CHAT[k] or k] = v
    fmt = _format(body)
    if fmt is not None:
        out["response_format"] = fmt
    tools, choice = _tools(body)
    if tools:
        out["tools"] = tools
    if choice is not None:
        out["tool_choice"] = choice
    if body.get("stream"):
        out["stream_options"] = {"include_usage": True}
    return out


def rename(exc: ApiError) -> ApiError:
    """A chat-path error, naming the parameter as the Responses request spelt it."""
    old = exc.param
    if old in _PARAM:
        exc.param = _PARAM[old]
        exc.message = exc.message.replace(f"{old}:", f"{exc.param}:")
    return exc


def _usage(u: dict[str, Any] | None) -> dict[str, Any] | None:
    if u is None:
        return None
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"input_tokens": u["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": u["total_tokens"]}


def _message(rid: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": f"msg_{rid}", "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call(call: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"fc_{call['id']}", "type": "function_call", "status": "completed",
            "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"]}


class Shell:
    """What every ``response`` object of one request shares."""

    def __init__(self, rid: str, body: dict[str, Any], model: str) -> None:
        self.rid = rid
        self.created = int(time.time())
        fmt = (body.get("text") or {}).get("format") or {"type": "text"}
        self.base = {
            "id": rid, "object": "response", "created_at": self.created, "model": model,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "text": {"format": fmt}, "metadata": body.get("metadata") or {},
            "store": False, "truncation": "disabled", "previous_response_id": None, "reasoning": None,
            "error": None, "user": body.get("user"), "background": False,
        }

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
                 finish: str | None = None) -> dict[str, Any]:
        if finish == "length":
            status = "incomplete"
        return dict(self.base, status=status, output=output, usage=_usage(usage),
                    incomplete_details={"reason": "max_output_tokens"} if status == "incomplete" else None)

    def whole(self, completion: dict[str, Any]) -> dict[str, Any]:
        """A chat completion -> the ``response``."""
        choice = completion["choices"][0]
        msg = choice["message"]
        output = []
        if msg.get("content") or not msg.get("tool_calls"):
            output.append(_message(self.rid, msg.get("content") or ""))
        output += [_call(c) for c in msg.get("tool_calls") or []]
        return self.response("completed", output, completion.get("usage"), choice["finish_reason"])


class Events:
    """Chat completion chunks -> the Responses stream's events."""

    def __init__(self, shell: Shell) -> None:
        self.shell = shell
        self.seq = 0
        self.text: str | None = None
        """The message's text so far (None: no message item opened yet)."""
        self.calls: dict[int, dict[str, Any]] = {}
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None

    def _event(self, kind: str, **fields: Any) -> bytes:
        obj = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + render.encode(obj) + b"\n\n"

    def start(self) -> bytes:
        r = self.shell.response("in_progress", [], None)
        return self._event("response.created", response=r) + self._event("response.in_progress", response=r)

    def _where(self) -> dict[str, Any]:
        return {"item_id": f"msg_{self.shell.rid}", "output_index": 0, "content_index": 0}

    def chunk(self, obj: dict[str, Any]) -> bytes:
        """One chat chunk (an ``error`` chunk is raised, for the stream's error event)."""
        if obj.get("error"):
            e = obj["error"]
            raise ApiError(500, e.get("message", "error"), e.get("param"), e.get("code"))
        if obj.get("usage") and not obj.get("choices"):
            self.usage = obj["usage"]
            return b""
        out = b""
        for ch in obj.get("choices") or []:
            delta = ch.get("delta") or {}
            text = delta.get("content") or ""
            if text:
                if self.text is None:
                    self.text = ""
                    out += self._event("response.output_item.added", output_index=0,
                                       item=_message(self.shell.rid, "", "in_progress") | {"content": []})
                    out += self._event("response.content_part.added", **self._where(),
                                       part={"type": "output_text", "text": "", "annotations": []})
                self.text += text
                out += self._event("response.output_text.delta", **self._where(), delta=text, logprobs=[])
            for tc in delta.get("tool_calls") or []:
                call = self.calls.setdefault(tc["index"], {"id": tc.get("id"), "function": {
                    "name": "", "arguments": ""}})
                f = tc.get("function") or {}
                call["function"]["name"] += f.get("name") or ""
                call["function"]["arguments"] += f.get("arguments") or ""
            self.finish = ch.get("finish_reason") or self.finish
        return out

    def end(self) -> bytes:
        out = b""
        output: list[dict[str, Any]] = []
        if self.text is not None:
            item = _message(self.shell.rid, self.text)
            part = item["content"][0]
            out += self._event("response.output_text.done", **self._where(), text=self.text, logprobs=[])
            out += self._event("response.content_part.done", **self._where(), part=part)
            out += self._event("response.output_item.done", output_index=0, item=item)
            output.append(item)
        for k in sorted(self.calls):
            item = _call(self.calls[k])
            index = len(output)
            added = dict(item, status="in_progress", arguments="")
            out += self._event("response.output_item.added", output_index=index, item=added)
            out += self._event("response.function_call_arguments.delta", item_id=item["id"],
                               output_index=index, delta=item["arguments"])
            out += self._event("response.function_call_arguments.done", item_id=item["id"],
                               output_index=index, arguments=item["arguments"])
            out += self._event("response.output_item.done", output_index=index, item=item)
            output.append(item)
        r = self.shell.response("completed", output, self.usage, self.finish)
        kind = "response.completed" if r["status"] == "completed" else "response.incomplete"
        return out + self._event(kind, response=r)

    async def convert(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """The chat stream's bytes -> the Responses events (closing it when done)."""
        yield self.start()
        try:
            async for raw in chunks:
                for line in raw.split(b"\n"):
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    out = self.chunk(json.loads(line[len(b"data: "):]))
                    if out:
                        yield out
            yield self.end()
        except ApiError as e:
            yield self._event("error", code=e.code, message=e.message, param=e.param)
        finally:
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()
