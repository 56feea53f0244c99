"""Tools for a model whose chat template has none (SmolLM2's, the built-in model's).

vLLM serves such models with a tool-capable template given on its command line
(``--chat-template examples/tool_chat_template_hermes.jinja``) and the ``hermes``
parser. This does the same inside the model's own template, so its turn markers stay
its own: the chat is rewritten into text turns the way that Hermes template writes
them, then rendered by the model's template as a plain chat:

* the tools, and how to call them (``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>``), go into the system turn (after the client's own system text);
* an assistant turn's earlier calls become ``<tool_call>`` blocks after its text;
* tool results become a user turn of ``<tool_response>`` blocks (consecutive results
  share one turn, as Hermes and Qwen templates do).

The answer is then read by the Hermes parser (:mod:`.tools`).
"""

from __future__ import annotations

import json
from typing import Any

#: vLLM's Hermes tool template's instructions, as its examples/tool_chat_template_hermes.jinja
#: words them (the tools' JSON between the two halves).
_INTRO = ("You are a function calling AI model. You are provided with function signatures "
          "within <tools></tools> XML tags. You may call one or more functions to assist with "
          "the user query. Don't make assumptions about what values to plug into functions. "
          "Here are the available tools: <tools>")
_HOW = ("</tools>\nFor each function call return a json object with function name and "
        "arguments within <tool_call></tool_call> XML tags as follows:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-dict>}\n</tool_call>')


def _dumps(x: Any) -> str:
    return json.dumps(x, ensure_ascii=False)


def system_text(tools: list[dict[str, Any]]) -> str:
    """The instructions and tool signatures put into the system turn."""
    return _INTRO + "".join(f"\n{_dumps(t)}" for t in tools) + "\n" + _HOW


def _call_block(call: dict[str, Any]) -> str:
    f = call["function"]
    return f"<tool_call>\n{_dumps({'name': f['name'], 'arguments': f['arguments']})}\n</tool_call>"


def text_turns(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, str]]:
    """``messages`` (as :class:`.chat.Chat` holds them) as system/user/assistant text turns,
    with ``tools`` (None: none offered) in the system turn."""
    out: list[dict[str, str]] = []
    for m in messages:
        role, content = m["role"], m["content"]
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool") == "1":
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool": "1"})
            continue
        if role == "assistant" and m.get("tool_calls"):
            blocks = "\n".join(_call_block(c) for c in m["tool_calls"])
            content = f"{content}\n{blocks}" if content else blocks
        out.append({"role": role, "content": content})
    if tools:
        text = system_text(tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{text}"
        else:
            out.insert(0, {"role": "system", "content": text})
    return [{"role": t["role"], "content": t["content"]} for t in out]
