"""Chat requests: ``messages`` (with tool calls and tool results) and ``tools`` /
``tool_choice``, checked into the forms the rest of the front end uses.

A plain chat (system, user and assistant text) goes to the daemon as ``messages``
and the daemon renders it with the model's chat template. A chat that offers
``tools``, or that carries tool calls or tool results from earlier turns, is
rendered here instead (:mod:`.tokens`, the same template with its ``tools``
variable) and sent as token ids: the daemon's ``messages`` hold text turns only.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from .calls import Mode
from .errors import bad

#: Most messages in one chat request, and most tools offered.
MAX_MESSAGES = 4096
MAX_TOOLS = 128
#: OpenAI's rule for function names.
_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
#: Roles as clients send them -> roles as the chat template sees them.
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool"}
#: Fields a message may carry besides ``role`` and ``content``, by role.
_EXTRA = {"assistant": {"name", "tool_calls"}, "tool": {"tool_call_id", "name"}}


@dataclass
class Chat:
    """A checked chat request."""

    messages: list[dict[str, Any]]
    """Turns as the template sees them: ``role``, ``content`` (text) and, for tool turns,
    ``tool_calls`` (arguments decoded to objects, as templates expect) / ``tool_call_id``."""
    tools: list[dict[str, Any]] | None
    """The tools to render into the prompt (None: none, or ``tool_choice`` = ``none``)."""
    mode: Mode | None = None
    """How tool calls come out of the answer (None: they do not; ``tool_choice`` none)."""
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    """``chat_template_kwargs``: more variables for the chat template (rendered here)."""

    @property
    def parse_tools(self) -> bool:
        """Tool calls are read out of the answer."""
        return self.mode is not None

    @property
    def parallel(self) -> bool:
        """``parallel_tool_calls`` (False: one call at most)."""
        return self.mode is None or self.mode.parallel

    @property
    def plain(self) -> bool:
        """Text turns only, no tools, no template variables: the daemon can render it."""
        return self.tools is None and not self.template_kwargs and all(
            set(m) == {"role", "content"} and m["role"] != "tool" for m in self.messages)

    def daemon_messages(self) -> list[dict[str, str]]:
        """The ``generate`` ``messages`` (text turns; only for a :attr:`plain` chat)."""
        return [{"role": m["role"], "content": m["content"]} for m in self.messages]

    def structured(self) -> dict[str, str] | None:
        """The daemon's ``structured`` that forces a tool call (``required`` or named)."""
        if self.mode is None or self.tools is None:
            return None
        return self.mode.structured(self.tools)


def _text(c: Any, where: str, role: str) -> str:
    """A message's text: a string, or a list of ``{"type": "text", "text": ...}`` parts."""
    if isinstance(c, str):
        return c
    if c is None and role in ("assistant", "tool"):
        return ""
    if isinstance(c, list) and all(isinstance(x, dict) and x.get("type") == "text"
                                   and isinstance(x.get("text"), str) for x in c):
        return "".join(x["text"] for x in c)
    raise bad("messages", f"{where}.content: must be a string or a list of text parts "
              "(no images, audio or files)")


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant turn's earlier ``tool_calls``, arguments decoded (templates render them
    with ``tojson``; vLLM does the same)."""
    if not isinstance(calls, list) or len(calls) > MAX_TOOLS:
        raise bad("messages", f"{where}.tool_calls: must be a list of at most {MAX_TOOLS} calls")
    out = []
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise bad("messages", f"{where}.tool_calls[{j}]: must be "
                      '{"id", "type": "function", "function": {"name", "arguments"}}')
        args = f.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise bad("messages", f"{where}.tool_calls[{j}].function.arguments: "
                          "not valid JSON") from None
        out.append({"id": c.get("id") or f"call_{j}", "type": "function",
                    "function": {"name": f["name"], "arguments": args}})
    return out


def messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """``messages``, checked (see :class:`Chat`)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "messages: must be a non-empty list", "missing_parameter"
                  if msgs is None else "invalid_parameter")
    if len(msgs) > MAX_MESSAGES:
        raise bad("messages", f"messages: at most {MAX_MESSAGES} turns")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad("messages", f"{where}: must be an object with role and content")
        role = ROLES.get(m.get("role"))  # type: ignore[arg-type]
        if role is None:
            raise bad("messages", f"{where}.role: must be one of {', '.join(ROLES)}")
        given = {k for k, v in m.items() if v is not None}
        extra = given - {"role", "content", "name"} - _EXTRA.get(role, set())
        if extra:
            raise bad("messages", f"{where}: unsupported field(s) {', '.join(sorted(extra))} "
                      f"for role {m['role']}")
        turn: dict[str, Any] = {"role": role, "content": _text(m.get("content"), where, role)}
        if role == "assistant" and m.get("tool_calls"):
            turn["tool_calls"] = _tool_calls(m["tool_calls"], where)
        if role == "tool":
            tid = m.get("tool_call_id")
            if not isinstance(tid, str) or not tid:
                raise bad("messages", f"{where}.tool_call_id: required for a tool result")
            turn["tool_call_id"] = tid
        out.append(turn)
    return out


def _tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not 1 <= len(tools) <= MAX_TOOLS:
        raise bad("tools", f"tools: must be a list of 1 to {MAX_TOOLS} tools")
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict):
            raise bad("tools", f'tools[{i}]: must be {{"type": "function", "function": {{...}}}}')
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise bad("tools", f"tools[{i}].function.name: must be 1-64 letters, digits, _ . : -")
        params = f.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad("tools", f"tools[{i}].function.parameters: must be a JSON schema object")
    return tools


#: Variables of the template this server sets itself; ``chat_template_kwargs`` may not.
_OWN_VARS = frozenset({"messages", "tools", "add_generation_prompt", "tokenize"})
MAX_TEMPLATE_KWARGS = 64


def _template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``chat_template_kwargs``: extra variables for the chat template
    (``enable_thinking`` for Qwen 3, ...)."""
    kw = body.get("chat_template_kwargs")
    if kw is None:
        return {}
    if not isinstance(kw, dict) or len(kw) > MAX_TEMPLATE_KWARGS or not all(
            isinstance(k, str) and k.isidentifier() for k in kw):
        raise bad("chat_template_kwargs", "chat_template_kwargs: must be an object of at most "
                  f"{MAX_TEMPLATE_KWARGS} template variables")
    own = sorted(set(kw) & _OWN_VARS)
    if own:
        raise bad("chat_template_kwargs", f"chat_template_kwargs: {own[0]} is set by the "
                  "request itself")
    return {k: v for k, v in kw.items() if v is not None}


def _mode(body: dict[str, Any], tools: list[dict[str, Any]] | None, parallel: bool) -> Mode | None:
    """``tool_choice`` -> how calls come out of the answer (None: ``none``)."""
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none" or (choice == "auto" and tools is None):
        return None
    if choice not in ("auto", "required"):
        f = choice.get("function") if isinstance(choice, dict) else None
        name = f.get("name") if isinstance(f, dict) else None
        if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(name, str)):
            raise bad("tool_choice", "tool_choice: must be none, auto, required or "
                      '{"type": "function", "function": {"name": ...}}')
    if tools is None:
        raise bad("tool_choice", "tool_choice: needs tools")
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        if name not in {t["function"]["name"] for t in tools}:
            raise bad("tool_choice", f"tool_choice: {name!r} is not one of the tools")
        return Mode("named", parallel, name)
    return Mode("required" if choice == "required" else "auto", parallel)


def chat(body: dict[str, Any]) -> Chat:
    """``messages``, ``tools``, ``tool_choice``, ``parallel_tool_calls`` and
    ``chat_template_kwargs`` of a chat body."""
    msgs = messages(body)
    tools = _tools(body)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad("parallel_tool_calls", "parallel_tool_calls: must be true or false")
    mode = _mode(body, tools, parallel)
    return Chat(msgs, tools if mode is not None else None, mode, _template_kwargs(body))
