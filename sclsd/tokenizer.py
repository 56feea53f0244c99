"""Tokenizers as the daemon uses them: encode prompts, render chats, detokenize streams.

The daemon calls these from a thread pool, never on the event loop.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Protocol


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids: the tokenizer of the ``fake`` model (no files needed)."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode("".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        del skip_special_tokens  # bytes have no special tokens
        return bytes(i % 256 for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A transformers tokenizer loaded through :mod:`sclsd.models` (a GGUF's from the model
    cache under ``cache_dir``: :mod:`sclsd.modelcache`)."""

    def __init__(self, spec: str, cache_dir: str | os.PathLike[str] | None = None) -> None:
        from .models import load_tokenizer

        self.spec = spec
        self.tok: Any = load_tokenizer(spec, cache_dir=cache_dir)
        self.vocab_size = len(self.tok)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        if getattr(self.tok, "chat_template", None):
            out = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if isinstance(out, dict) or hasattr(out, "input_ids"):
                out = out["input_ids"]
            return [int(i) for i in out]
        return self.encode("".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: ")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def load(spec: str, cache_dir: str | os.PathLike[str] | None = None) -> Tokenizer:
    """Tokenizer for a model spec (``fake`` gets the byte tokenizer)."""
    if spec == "fake":
        return ByteTokenizer()
    return HFTokenizer(spec, cache_dir)


@dataclass
class Detokenizer:
    """Incremental detokenization of one request's output.

    Decodes the whole output each time and emits only the new suffix, holding
    back a trailing replacement character (an incomplete multi-byte sequence)
    until the next tokens complete it. Stop strings end the text where they start.
    """

    stop: list[str] = field(default_factory=list)
    text: str = ""
    stopped: bool = False

    def apply(self, full: str, final: bool = False) -> str:
        """Take the decoded text of the whole output so far; return what is new.

        Sets ``stopped`` when a stop string appeared (the text ends before it).
        """
        if self.stopped:
            return ""
        if not final and full.endswith("\ufffd"):
            full = full.rstrip("\ufffd")
        if self.stop:
            # Search from a little before the emitted end so a stop string spanning slices is seen.
            start = max(0, len(self.text) - max(len(s) for s in self.stop))
            cut = min((i for s in self.stop if (i := full.find(s, start)) >= 0), default=-1)
            if cut >= 0:
                full = full[:cut]
                self.stopped = True
            elif not final:
                # Hold back a tail that may be the start of a stop string: once sent, text
                # cannot be taken back.
                hold = max((k for s in self.stop for k in range(1, len(s)) if full.endswith(s[:k])),
                           default=0)
                full = full[: len(full) - hold]
        if not full.startswith(self.text):
            # A tokenizer may rewrite earlier text (space clean-up): emit nothing rather
            # than a wrong diff; the next consistent decode catches up.
            return ""
        new = full[len(self.text) :]
        self.text = full
        return new
