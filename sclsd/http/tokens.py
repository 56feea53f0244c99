"""The served model's tokenizer inside ``sclsd-http``, for what the daemon does not do.

The daemon tokenizes prompts and renders plain chats itself. This process needs
the tokenizer only for ``/tokenize`` and ``/detokenize``, chats with tools or
tool turns (rendered with the template's ``tools``), ``suffix``
(fill-in-the-middle) and ``echo`` of a token-id prompt. It is loaded on the first
such request, in a thread, through :func:`sclsd.tokenizer.load` with the model
name the daemon reports: the same tokenizer object the daemon uses, so counts agree.
A deployment that never uses these never loads it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from .. import tokenizer as sclsd_tokenizer
from . import fallback
from .chat import Chat
from .errors import ApiError, bad, unsupported
from .params import Parsed

log = logging.getLogger("sclsd.http")

#: Fill-in-the-middle token triples (prefix, suffix, middle) in prefix-suffix-middle
#: order: StarCoder's, Qwen2.5-Coder's, DeepSeek-Coder's.
FIM_TOKENS = (
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
)


def _template_vars(template: str) -> set[str]:
    import jinja2
    from jinja2 import meta

    try:
        return set(meta.find_undeclared_variables(jinja2.Environment().parse(template)))
    except jinja2.TemplateError:
        return set()


class View:
    """One tokenizer as this process uses it (wraps :mod:`sclsd.tokenizer`'s)."""

    def __init__(self, tokenizer: Any) -> None:
        self.t = tokenizer
        self.hf = getattr(tokenizer, "tok", None)
        """The transformers tokenizer; None for the byte tokenizer of the ``fake`` model."""
        template = getattr(self.hf, "chat_template", None)
        if isinstance(template, dict):  # named templates: the tool one if there is one
            template = template.get("tool_use") or template.get("default")
        self.template: str | None = template if isinstance(template, str) else None
        self.has_tools = bool(self.template) and "tools" in _template_vars(self.template or "")
        self.hermes = self.has_tools and "<tool_call>" in (self.template or "")

    # -------------------------------------------------------------------- as the daemon

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if add_special_tokens and self.hf is not None:
            return list(self.t.encode(text, add_special_tokens=True))
        return self.t.encode(text)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return self.t.encode_chat(messages)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.hf is not None and not skip_special_tokens:
            return str(self.hf.decode(ids, skip_special_tokens=False))
        return self.t.decode(ids)

    def token_strs(self, ids: list[int]) -> list[str]:
        if self.hf is not None:
            return [str(s) for s in self.hf.convert_ids_to_tokens(ids)]
        return [bytes([i % 256]).decode("latin-1") for i in ids]

    @property
    def vocab_size(self) -> int:
        return int(self.t.vocab_size)

    # -------------------------------------------------------------------- beyond it

    def render(self, chat: Chat) -> list[int]:
        """A chat with tools, tool turns or template variables, through the template, with
        the generation prompt. A template without ``tools`` gets them the Hermes way
        (:mod:`.fallback`), inside its own turns."""
        native = self.has_tools or (chat.tools is None and not any(
            m["role"] == "tool" or m.get("tool_calls") for m in chat.messages))
        if native and chat.mode is not None and chat.mode.choice == "auto" and not self.hermes:
            raise unsupported("tools", "the model's chat template formats tool calls in a way this "
                              "server does not parse (only Hermes-style <tool_call> blocks)")
        settings = chat.template_kwargs
        special = self.t.special_text(settings) if settings and self.hf is not None else None
        if special is not None:
            raise bad("chat_template_kwargs", f"chat_template_kwargs: {special!r} is a special "
                      "token of the model; template variables may not carry one")
        try:
            if not native:
                turns = fallback.text_turns(chat.messages, chat.tools)
                if self.hf is None or not self.template:
                    return [int(i) for i in self.t.encode_chat(turns)]
                return [int(i) for i in self.t.render_chat(turns, settings)]
            if self.hf is None or not self.template:
                raise bad("chat_template_kwargs", "chat_template_kwargs: the model has no chat template")
            extra = {"tools": chat.tools} if chat.tools is not None else {}
            # As the daemon renders plain chats: only the template's markers are special.
            return [int(i) for i in self.t.render_chat(chat.messages, settings, **extra)]
        except ApiError:
            raise
        except Exception as exc:  # noqa: BLE001 - the template's own refusal (raise_exception)
            raise bad("messages", f"messages: the chat template refused them: {exc}") from None

    def fim(self, prefix: str, suffix: str) -> list[int]:
        """Fill-in-the-middle prompt ids, prefix-suffix-middle, with the model's FIM tokens."""
        triple = self._fim_ids()
        if triple is None:
            raise unsupported("suffix", "the model's tokenizer has no fill-in-the-middle tokens "
                              "(<fim_prefix>/<fim_suffix>/<fim_middle> or a known variant)")
        p, s, m = triple
        return [p, *self.encode(prefix), s, *self.encode(suffix), m]

    def _fim_ids(self) -> tuple[int, int, int] | None:
        if self.hf is None:
            return None
        added = self.hf.get_added_vocab() if hasattr(self.hf, "get_added_vocab") else {}
        for names in FIM_TOKENS:
            if all(n in added for n in names):
                return added[names[0]], added[names[1]], added[names[2]]
        return None


def needs_view(parsed: Parsed) -> bool:
    """Whether :func:`resolve` needs the tokenizer for this request."""
    return any("render" in f or "fim" in f for f in parsed.prompts) or (
        parsed.echo and any("prompt_ids" in f for f in parsed.prompts))


def resolve(parsed: Parsed, view: View | None) -> None:
    """Turn the ``render`` and ``fim`` prompt forms into ``prompt_ids`` and fill
    ``echo_texts`` (runs in a thread: templates and tokenizers take CPU time)."""
    echo: list[str] = []
    forms = []
    for form in parsed.prompts:
        if "render" in form:
            assert view is not None
            form = {"prompt_ids": view.render(form["render"])}
        elif "fim" in form:
            assert view is not None
            form = {"prompt_ids": view.fim(*form["fim"])}
        if parsed.echo:
            if "prompt" in form:
                echo.append(form["prompt"])
            elif parsed.chat is not None:
                last = parsed.chat.messages[-1]
                echo.append(last["content"] if last["role"] == "assistant" else "")
            else:
                assert view is not None
                echo.append(view.decode(form["prompt_ids"]))
        forms.append(form)
    parsed.prompts = forms
    parsed.echo_texts = echo


class Tokens:
    """Loads the tokenizer of the model the daemon serves on first use (see the module
    docstring); ``given``: a tokenizer to use instead (tests, embedding)."""

    def __init__(self, model: Callable[[], Awaitable[str]], cache_dir: str = "",
                 given: Any = None) -> None:
        self._model = model
        self._cache_dir = cache_dir or None
        self._view = View(given) if given is not None else None
        self._lock = asyncio.Lock()

    async def view(self) -> View:
        if self._view is not None:
            return self._view
        async with self._lock:
            if self._view is None:
                name = await self._model()
                log.info("loading the tokenizer of %s (for tokenize, tools, suffix, echo)", name)
                try:
                    tok = await asyncio.to_thread(sclsd_tokenizer.load, name, self._cache_dir)
                except Exception as exc:  # noqa: BLE001 - any failure to load is a 503 here
                    raise ApiError(503, f"sclsd-http cannot load the tokenizer of {name}: {exc}",
                                   None, "tokenizer_unavailable") from None
                self._view = View(tok)
        return self._view


def tokenize_ids(view: View, body: dict[str, Any]) -> list[int]:
    """The ids of ``/tokenize``'s ``prompt`` or ``messages`` (nulls already dropped)."""
    from .chat import chat

    if ("prompt" in body) == ("messages" in body):
        raise bad("prompt", "tokenize takes one of prompt or messages")
    special = body.get("add_special_tokens", False)
    if not isinstance(special, bool):
        raise bad("add_special_tokens", "add_special_tokens: must be true or false")
    if "prompt" in body:
        if not isinstance(body["prompt"], str):
            raise bad("prompt", "prompt: must be a string")
        return view.encode(body["prompt"], add_special_tokens=special)
    if body.get("add_generation_prompt", True) is not True:
        raise bad("add_generation_prompt", "add_generation_prompt: only true (as the daemon "
                  "renders chats)")
    c = chat(body)
    return view.encode_chat(c.daemon_messages()) if c.plain else view.render(c)
