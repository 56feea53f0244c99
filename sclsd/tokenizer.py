"""Tokenizers as the daemon uses them: encode prompts, render chats, detokenize streams.

The daemon calls these from a thread pool, never on the event loop.
"""

from __future__ import annotations

import copy
import json
import os
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Protocol


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


def decode_many(tok: Tokenizer, seqs: list[list[int]], keep_special: list[bool]) -> list[str]:
    """Each of ``seqs`` decoded (``keep_special[i]``: its special tokens kept): in one call to
    the tokenizer's own batch decode where it has one (a streamed message's windows cost one
    call, not two per request)."""
    many = getattr(tok, "decode_batch", None)
    if many is not None:
        out: list[str] = many(seqs, keep_special)
        return out
    return [tok.decode(s, skip_special_tokens=not k) for s, k in zip(seqs, keep_special, strict=True)]


class ByteTokenizer:
    """UTF-8 bytes as token ids: the tokenizer of the ``fake`` model (no files needed)."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode("".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        del skip_special_tokens  # bytes have no special tokens
        if max(ids, default=0) > 255:  # a fake vocabulary larger than the bytes
            ids = [i & 255 for i in ids]
        return bytes(ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A transformers tokenizer loaded through :mod:`sclsd.models` (a GGUF's from the model
    cache under ``cache_dir``: :mod:`sclsd.modelcache`).

    In a chat, only the template's own markers are special tokens: text the messages (or
    tools) carry is tokenized with special-token text kept as text (transformers'
    ``split_special_tokens``), so a user cannot forge ``<|im_end|><|im_start|>system``.
    """

    def __init__(self, spec: str, cache_dir: str | os.PathLike[str] | None = None) -> None:
        from .models import load_tokenizer

        self.spec = spec
        self.tok: Any = load_tokenizer(spec, cache_dir=cache_dir)
        self.vocab_size = len(self.tok)
        # A second instance that always splits special-token text: transformers switches a
        # flag on the shared backend per call, which threads tokenizing at once would race on.
        self._text_tok: Any = copy.deepcopy(self.tok)
        self._text_tok.split_special_tokens = True
        added: dict[str, int] = self.tok.get_added_vocab() if hasattr(self.tok, "get_added_vocab") else {}
        self._added = added
        self._added_re = re.compile("|".join(re.escape(t) for t in sorted(added, key=len, reverse=True))
                                    ) if added else None

    @property
    def directory(self) -> str | None:
        """The directory ``transformers.AutoTokenizer.from_pretrained`` loads this tokenizer
        from (a GGUF's: its converted copy in the model cache), for tools that count tokens
        themselves (load generators' ``--tokenizer``); None when it was built in memory."""
        path = str(getattr(self.tok, "name_or_path", "") or "")
        if path and any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
            return os.path.abspath(path)
        return None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=add_special_tokens))

    def encode_text(self, text: str) -> list[int]:
        """``text`` as text: special-token strings in it are not special tokens."""
        return list(self._text_tok.encode(text, add_special_tokens=False))

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        if getattr(self.tok, "chat_template", None):
            return self.render_chat(messages)
        # No template: the whole text is the messages' (no marker of ours is special).
        return self.encode_text("".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: ")

    def special_text(self, value: Any) -> str | None:
        """The first special token's text found in a string of ``value`` (a JSON-like value),
        None if there is none."""
        if isinstance(value, str):
            m = self._added_re.search(value) if self._added_re is not None else None
            return m.group() if m is not None else None
        items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        for v in items:
            found = self.special_text(v)
            if found is not None:
                return found
        return None

    def render_chat(self, messages: list[dict[str, Any]], settings: dict[str, Any] | None = None,
                    **template: Any) -> list[int]:
        """``messages`` through the chat template with the generation prompt (``template``:
        its other variables, e.g. ``tools``); every string the messages and variables carry
        is tokenized as text (:func:`chat_pieces`). ``settings`` are variables the template
        branches on (``chat_template_kwargs``: ``enable_thinking``, a mode's name): they
        reach the template as they are, and text they make it write is the template's (the
        caller keeps special-token text out of them, :meth:`special_text`)."""
        # Tokenized in one pass between the template's own added tokens (as the tokenizer
        # itself splits there), so text on either side of a message's edge merges as it
        # would in the whole rendering: a chat without special text gets the same ids.
        out: list[int] = []
        text: list[str] = []
        for piece in chat_pieces(self.tok, messages, template, settings or {}):
            if not isinstance(piece, Verbatim):
                text.append(piece)
                continue
            pos = 0
            for m in self._added_re.finditer(piece.text) if self._added_re is not None else ():
                text.append(piece.text[pos:m.start()])
                out += self.encode_text("".join(text))
                out.append(self._added[m.group()])
                text, pos = [], m.end()
            text.append(piece.text[pos:])
        return out + self.encode_text("".join(text))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_batch(self, seqs: list[list[int]], keep_special: list[bool]) -> list[str]:
        """:meth:`decode` of each of ``seqs``: straight through the Rust tokenizer's batch
        decode (about a quarter of the cost of transformers' per-call wrapper, and off the
        GIL), where that gives the same text: no clean-up of tokenization spaces."""
        backend = getattr(self.tok, "backend_tokenizer", None)
        if backend is None or getattr(self.tok, "clean_up_tokenization_spaces", False):
            return [self.decode(s, skip_special_tokens=not k) for s, k in zip(seqs, keep_special, strict=True)]
        if all(keep_special) or not any(keep_special):
            return list(backend.decode_batch(seqs, skip_special_tokens=not keep_special[0] if seqs else True))
        return [backend.decode(s, skip_special_tokens=not k) for s, k in zip(seqs, keep_special, strict=True)]


@dataclass(frozen=True)
class Verbatim:
    """Text the chat template itself wrote: its markers are special tokens."""

    text: str


def chat_pieces(tok: Any, messages: list[dict[str, Any]], template: dict[str, Any],
                settings: dict[str, Any] | None = None) -> list[Verbatim | str]:
    """The rendered chat as the template's own text (:class:`Verbatim`) and the text the
    caller gave (plain ``str``), in order.

    Every string in the messages (but roles and types) and in ``template``'s values is
    replaced by a placeholder no one can guess, the template rendered, and the rendering
    cut at the placeholders. Each placeholder stands for what the template made of its
    string: as given, JSON-escaped (``tojson``) or trimmed, as the real rendering shows;
    where that cannot be told, the string as given (never template text). ``settings``
    go to the template unhidden in both renderings: it compares them (``mode == "low"``),
    and a placeholder would take another branch."""
    tag = secrets.token_hex(8)
    values: list[str] = []

    def hide(x: Any, key: str = "") -> Any:
        if isinstance(x, str) and key not in ("role", "type"):
            values.append(x)
            return f"SCLSD{tag}P{len(values) - 1}E"
        if isinstance(x, dict):
            return {k: hide(v, k) for k, v in x.items()}
        if isinstance(x, list):
            return [hide(v) for v in x]
        return x

    settings = settings or {}
    hidden = hide({"messages": messages, **template})
    marked = _render(tok, hidden.pop("messages"), {**settings, **hidden})
    real = _render(tok, messages, {**settings, **template})
    parts = re.split(f"SCLSD{tag}P(\\d+)E", marked)
    texts, slots = parts[0::2], [values[int(i)] for i in parts[1::2]]
    shown = _as_rendered(real, texts, slots)
    out: list[Verbatim | str] = []
    for i, text in enumerate(texts):
        if text:
            out.append(Verbatim(text))
        if i < len(slots):
            out.append(shown[i] if shown is not None else slots[i])
    return out


def _render(tok: Any, messages: list[dict[str, Any]], template: dict[str, Any]) -> str:
    return str(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **template))


def _as_rendered(real: str, texts: list[str], slots: list[str]) -> list[str] | None:
    """What the template wrote for each slot, given the real rendering and the template's
    text around the slots; None when the two cannot be matched exactly."""
    pos, shown = 0, []
    if not real.startswith(texts[0]):
        return None
    pos = len(texts[0])
    for i, value in enumerate(slots):
        after = texts[i + 1]
        for form in (value, json.dumps(value)[1:-1], json.dumps(value, ensure_ascii=False)[1:-1],
                     value.strip()):
            if real.startswith(form, pos) and real.startswith(after, pos + len(form)):
                shown.append(form)
                pos += len(form) + len(after)
                break
        else:
            return None
    return shown if pos == len(real) else None


def max_token_chars(tok: Tokenizer) -> int:
    """The most characters one token of ``tok`` can stand for (an upper bound)."""
    inner: Any = getattr(tok, "tok", None)
    if inner is None or not hasattr(inner, "get_vocab"):
        return 1  # the byte tokenizer: a character is at least one byte, one token
    # Byte-level BPE and sentencepiece vocab strings spell a token with at least as many
    # characters as it decodes to (one per byte, or "▁" for a space).
    return max((len(s) for s in inner.get_vocab()), default=1) or 1


def max_prompt_chars(tok: Tokenizer, max_input: int) -> int:
    """The most characters a prompt of at most ``max_input`` tokens of ``tok`` can have: a
    longer one cannot fit whatever the tokenizer does, and is refused without tokenizing
    (the daemon's admission, ``sclsd-http``'s tokenizer routes)."""
    return max_input * max_token_chars(tok)


def load(spec: str, cache_dir: str | os.PathLike[str] | None = None) -> Tokenizer:
    """Tokenizer for a model spec (``fake`` gets the byte tokenizer)."""
    if spec == "fake":
        return ByteTokenizer()
    return HFTokenizer(spec, cache_dir)


@dataclass
class Detokenizer:
    """Incremental detokenization of one request's output, at a cost per call that does not
    grow with the output (as vLLM's and SGLang's detokenizers do it).

    Each call decodes a window of the output, not all of it: the tokens since the last
    committed read offset ``r``, after a few tokens of left context from ``p`` (the read
    offset before that). Decoding ``ids[p:]`` and ``ids[p:r]`` with the same left context
    and taking the difference gives the text of ``ids[r:]`` as the whole output would
    decode it (a SentencePiece word's leading space, a UTF-8 character split over tokens).
    :meth:`window` says what to decode; :meth:`apply_window` takes the two texts. The text
    of ``ids[:r]`` is ``text[:t_r]``: offsets advance only when everything decoded was
    emitted. A trailing replacement character (an incomplete multi-byte sequence) is held
    back until the next tokens complete it, and so is a tail that may begin a stop string;
    stop strings end the text where they start (where they end, with ``keep_stop``).
    """

    stop: list[str] = field(default_factory=list)
    keep_stop: bool = False
    """The stop string that ends the text stays in it (at its end)."""
    text: str = ""
    stopped: bool = False
    p: int = 0
    """Left context of the next window: tokens from here on are decoded."""
    r: int = 0
    """Read offset: the text of the tokens before it is ``text[:t_r]``."""
    t_r: int = 0

    def window(self, ids: list[int]) -> tuple[list[int], list[int], tuple[int, int, int, int]]:
        """What to decode for the output ``ids``: the window, its left context alone, and the
        offsets to hand back to :meth:`apply_window` with their texts."""
        return ids[self.p:], ids[self.p:self.r], (self.p, self.r, self.t_r, len(ids))

    def apply_window(self, snap: tuple[int, int, int, int], full: str, prefix: str,
                     final: bool = False) -> str:
        """The texts of a :meth:`window` (``full`` of the window, ``prefix`` of its left
        context alone); returns what is new. Windows must come back in the order made."""
        p, r, t_r, n = snap
        if not full.startswith(prefix):
            # The tokenizer joined the context with what follows it differently: decode from
            # the start next time (the old way), which always agrees with itself.
            self.p = 0
            return ""
        tail = full[len(prefix):]
        new = self.apply_tail(t_r, tail, final)
        if len(self.text) == t_r + len(tail) and n > self.r:
            self.p, self.r, self.t_r = r, n, len(self.text)  # all of it out: move on
        return new

    def apply(self, full: str, final: bool = False) -> str:
        """Take the decoded text of the whole output so far; return what is new."""
        return self.apply_tail(0, full, final)

    def apply_tail(self, base: int, tail: str, final: bool = False) -> str:
        """Take the text after ``text[:base]`` (the whole output's text is ``text[:base] +
        tail``); return what is new. Sets ``stopped`` when a stop string appeared (the
        text ends before it)."""
        if self.stopped:
            return ""
        if base > len(self.text) or not tail.startswith(self.text[base:]):
            # A tokenizer may rewrite earlier text (space clean-up): emit nothing rather
            # than a wrong diff; the next consistent decode catches up.
            return ""
        new = tail[len(self.text) - base:]
        if not final and new.endswith("\ufffd"):
            new = new.rstrip("\ufffd")
        if self.stop:
            # Search from a little before the emitted end so a stop string spanning calls is seen.
            start = max(0, len(self.text) - max(len(s) for s in self.stop))
            seen = self.text[start:] + new
            cut, found = min(((i, s) for s in self.stop if (i := seen.find(s)) >= 0), default=(-1, ""))
            if cut >= 0:
                self.stopped = True
                new = seen[:cut + (len(found) if self.keep_stop else 0)][len(self.text) - start:]
            elif not final:
                # Hold back a tail that may be the start of a stop string: once sent, text
                # cannot be taken back.
                hold = max((k for s in self.stop for k in range(1, len(s)) if seen.endswith(s[:k])),
                           default=0)
                new = new[: max(0, len(new) - hold)]
        self.text += new
        return new
