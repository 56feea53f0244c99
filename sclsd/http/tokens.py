"""The served model's tokenizer inside ``sclsd-http``, for what the daemon does not do.

The daemon tokenizes prompts and renders plain chats itself. This process needs
the tokenizer only for ``/tokenize`` and ``/detokenize``, chats with tools or
tool turns (rendered with the template's ``tools``), ``suffix``
(fill-in-the-middle), ``echo`` of a token-id prompt and a completion's ``echo`` with
``logprobs`` (its prompts are tokenized here: the first token's text is shown, and the
daemon's ``prompt_logprobs`` begin at the second). It is loaded on the first
such request, in a thread, through :func:`sclsd.tokenizer.load` with the model
name the daemon reports: the same tokenizer object the daemon uses, so counts agree.
A deployment that never uses these never loads it.

What a request may make it hold is bounded: a prompt (or chat) whose characters cannot
fit the daemon's ``model.max_input`` tokens is refused with ``prompt_too_long`` before
it is tokenized, as the daemon refuses it (:func:`sclsd.tokenizer.max_prompt_chars`);
at most :data:`MAX_TOKENIZING` tokenizer calls run at once, a call whose client went
away keeping its place until it ends; and after a large one the memory it freed is
given back to the operating system (glibc's ``malloc_trim``, where there is one).
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from .. import tokenizer as sclsd_tokenizer
from . import fallback
from .chat import Chat
from .errors import ApiError, bad, unsupported
from .params import Parsed

log = logging.getLogger("sclsd.http")

T = TypeVar("T")

#: Tokenizer calls (``/tokenize``, ``/detokenize``, tool chats, ``suffix``) running at
#: once; more wait for a place. Four 4 MB prompts at once grew this process by 3 GB.
MAX_TOKENIZING = 2
#: After tokenizer work on at least this many characters (or ids), the heap memory it
#: freed goes back to the operating system.
TRIM_AT = 1 << 16


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``; None where the C library has none (musl, macOS)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def give_back_memory() -> bool:
    """Return the heap's free memory to the operating system, as far as the C library can
    (every arena of glibc's malloc); False where it cannot."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True

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


_SKIP = object()


def _json_value(v: Any) -> Any:
    """``v`` as JSON for ``/tokenizer_info`` (an added token as its text; numbers past a
    double's exact integers, such as transformers' "no limit" lengths, as None), or
    :data:`_SKIP` for what JSON cannot hold."""
    content = getattr(v, "content", None)
    if isinstance(content, str):
        return content
    if v is None or isinstance(v, (str, bool, float)):
        return v
    if isinstance(v, int):
        return v if abs(v) < 2**53 else None
    if isinstance(v, (list, tuple)):
        items = [_json_value(x) for x in v]
        return _SKIP if any(x is _SKIP for x in items) else items
    if isinstance(v, dict):
        pairs = {str(k): _json_value(x) for k, x in v.items()}
        return {k: x for k, x in pairs.items() if x is not _SKIP}
    return _SKIP


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

    def info(self) -> dict[str, Any]:
        """vLLM's ``/tokenizer_info``: the tokenizer's init arguments (but file paths; special
        tokens as their text), ``tokenizer_class``, its special tokens and ``chat_template``."""
        hf = self.hf
        if hf is None:  # the fake model's byte tokenizer: no special tokens by text
            return {"tokenizer_class": type(self.t).__name__, "vocab_size": self.vocab_size}
        out = {k: v for k, v in ((k, _json_value(v)) for k, v in (getattr(hf, "init_kwargs", None) or {}).items())
               if v is not _SKIP and not k.endswith("_file") and k != "name_or_path"}
        for k in ("bos_token", "eos_token", "unk_token", "pad_token"):
            out[k] = _json_value(getattr(hf, k, None))
        out["tokenizer_class"] = type(hf).__name__
        out["vocab_size"] = self.vocab_size
        if self.template:
            out["chat_template"] = self.template
        return out

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token stands for (:func:`sclsd.tokenizer.max_token_chars`,
        as the daemon bounds prompts: :func:`sclsd.tokenizer.max_prompt_chars`)."""
        return sclsd_tokenizer.max_token_chars(self.t)

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
        parsed.echo and any("prompt_ids" in f for f in parsed.prompts)) or parsed.echo_logprobs


@dataclass(frozen=True)
class PromptBound:
    """The longest prompt, in characters, that may fit ``max_input`` tokens of a tokenizer."""

    max_input: int
    max_chars: int

    def check(self, chars: int, param: str) -> None:
        """Refuse (``prompt_too_long``, naming ``param``) ``chars`` characters that cannot fit."""
        if chars > self.max_chars:
            raise ApiError(400, f"{param}: {chars} characters, more than {self.max_input} tokens "
                           "(the model's max_input) whatever the tokenizer does", param,
                           "prompt_too_long")


def chat_chars(c: Chat) -> int:
    """The characters of a chat's turns: its rendering has at least as many."""
    return sum(len(m["content"]) for m in c.messages if isinstance(m.get("content"), str))


def _text_chars(form: dict[str, Any], parsed: Parsed) -> int:
    """The characters :func:`resolve` tokenizes for one prompt form."""
    if "render" in form:
        return chat_chars(form["render"])
    if "fim" in form:
        return len(form["fim"][0]) + len(form["fim"][1])
    if "prompt" in form and parsed.echo_logprobs:
        return len(form["prompt"])
    return 0


def view_chars(parsed: Parsed) -> int:
    """The characters :func:`resolve` tokenizes for ``parsed``."""
    return sum(_text_chars(f, parsed) for f in parsed.prompts)


def check_bound(parsed: Parsed, bound: PromptBound | None) -> None:
    """Refuse a chat, ``suffix`` or echoed text prompt of ``parsed`` too long for ``bound``,
    untokenized."""
    if bound is None:
        return
    for form in parsed.prompts:
        chars = _text_chars(form, parsed)
        if chars:
            bound.check(chars, "messages" if "render" in form else "prompt")


def resolve(parsed: Parsed, view: View | None) -> None:
    """Turn the ``render`` and ``fim`` prompt forms (and, for :attr:`Parsed.echo_logprobs`,
    text prompts) into ``prompt_ids`` and fill ``echo_texts`` and ``prompt_heads`` (runs in a
    thread: templates and tokenizers take CPU time)."""
    echo: list[str] = []
    heads: list[str] = []
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
        if parsed.echo_logprobs:
            # Tokenized as the daemon tokenizes a text prompt, and sent as ids; the first
            # token's text as the daemon names a token (its own decode).
            assert view is not None
            if "prompt" in form:
                form = {"prompt_ids": view.encode(form["prompt"])}
            ids = form["prompt_ids"]
            heads.append(view.decode(ids[:1]) if ids else "")
        forms.append(form)
    parsed.prompts = forms
    parsed.echo_texts = echo
    parsed.prompt_heads = heads


class TokenizerAccess:
    """Loads the tokenizer of the model the daemon serves on first use (see the module
    docstring), and runs the calls made to it, :data:`MAX_TOKENIZING` at once. ``given``:
    a tokenizer to use instead (tests, embedding); ``max_input``: the daemon's
    ``model.max_input`` (None: unknown, prompts then bounded by the body limit alone)."""

    def __init__(self, model: Callable[[], Awaitable[str]], cache_dir: str = "",
                 given: Any = None, max_input: Callable[[], Awaitable[int | None]] | None = None,
                 places: int = MAX_TOKENIZING) -> None:
        self._model = model
        self._cache_dir = cache_dir or None
        self._view = View(given) if given is not None else None
        self._lock = asyncio.Lock()
        self._max_input = max_input
        self._places = asyncio.Semaphore(places)
        self.waiting = 0
        """Calls waiting for a place."""
        self.running = 0
        """Calls running in a thread (a cancelled caller's call counts until it ends)."""

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

    async def bound(self, view: View) -> PromptBound | None:
        """The longest prompt ``view`` may tokenize for the daemon (None: not known)."""
        n = await self._max_input() if self._max_input is not None else None
        return PromptBound(n, n * view.max_token_chars) if n else None

    async def run(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a thread once one of the places is free. A caller cancelled
        meanwhile leaves the call to end in its place (a thread cannot be stopped), so
        clients that hang up cannot stack calls. ``size``: the characters (or ids) it
        works on; from :data:`TRIM_AT` on, the memory it freed is given back after it."""
        def call() -> T:
            try:
                return fn(*args)
            finally:
                if size >= TRIM_AT:
                    give_back_memory()

        self.waiting += 1
        try:
            await self._places.acquire()
        finally:
            self.waiting -= 1
        self.running += 1

        def ended(_: Any) -> None:
            self.running -= 1
            self._places.release()

        try:
            fut = asyncio.get_running_loop().run_in_executor(None, call)
        except BaseException:
            ended(None)
            raise
        fut.add_done_callback(ended)
        return await asyncio.shield(fut)


@dataclass(frozen=True)
class ToTokenize:
    """What ``/tokenize`` was asked to tokenize, checked (:func:`to_tokenize`)."""

    prompt: str | None
    chat: Chat | None
    special: bool

    @property
    def param(self) -> str:
        return "prompt" if self.chat is None else "messages"

    @property
    def chars(self) -> int:
        return len(self.prompt) if self.prompt is not None else chat_chars(self.chat) if self.chat else 0

    def ids(self, view: View) -> list[int]:
        """The ids, as the daemon would count them (blocking: in a thread)."""
        if self.prompt is not None:
            return view.encode(self.prompt, add_special_tokens=self.special)
        assert self.chat is not None
        c = self.chat
        return view.encode_chat(c.daemon_messages()) if c.plain else view.render(c)


def to_tokenize(body: dict[str, Any]) -> ToTokenize:
    """``/tokenize``'s ``prompt`` or ``messages`` (nulls already dropped), checked."""
    from .chat import chat

    if ("prompt" in body) == ("messages" in body):
        raise bad("prompt", "tokenize takes one of prompt or messages")
    special = body.get("add_special_tokens", False)
    if not isinstance(special, bool):
        raise bad("add_special_tokens", "add_special_tokens: must be true or false")
    if "prompt" in body:
        if not isinstance(body["prompt"], str):
            raise bad("prompt", "prompt: must be a string")
        return ToTokenize(body["prompt"], None, special)
    if body.get("add_generation_prompt", True) is not True:
        raise bad("add_generation_prompt", "add_generation_prompt: only true (as the daemon "
                  "renders chats)")
    return ToTokenize(None, chat(body), special)
