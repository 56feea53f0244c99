"""Structured output on the daemon's side: a request's :class:`~sclsd.protocol.Structured`
turned into llguidance's grammar text (what batch rows carry to the workers, which enforce
it as a token mask: :mod:`worker.engines.grammar`), and checked at admission.

This runs in the grammar children only (:mod:`sclsd.daemon.grammar` starts them with
:func:`child_main`), never in the daemon's own process: a hostile grammar can crash
llguidance (a ``$ref`` chain a thousand deep overflows its stack) or make it allocate
without bound (an ``allOf`` of patterns), and there that costs the request, not the daemon.

JSON comes out compact (no free whitespace between tokens, ``", "`` and ``": "`` as
separators): a model left free to add whitespace may spend its whole budget on it.
"""

from __future__ import annotations

import functools
import json
import os
import re
import resource
import signal
from collections.abc import Mapping
from multiprocessing.connection import Connection
from typing import Any

import msgspec

from .protocol import Structured

__all__ = ["CHILD_MAX_REPLY", "cause_of", "check", "child_main", "compile_grammar", "grammar_text"]

#: llguidance's JSON layout settings added to every JSON schema (unless it sets its own).
COMPACT = {"whitespace_flexible": False}
#: Largest reply a grammar child sends (a grammar text); the daemon reads no more.
CHILD_MAX_REPLY = 64 * 1024**2


def _schema(s: Structured) -> dict[str, Any] | bool:
    if s.kind == "json_object":
        return {"type": "object"}
    schema = json.loads(s.value)
    if not isinstance(schema, (dict, bool)):
        raise ValueError("a JSON schema must be an object (or true/false)")
    return schema


@functools.lru_cache(maxsize=256)
def _grammar(kind: str, value: str) -> str:
    import llguidance

    s = Structured(kind=kind, value=value)  # type: ignore[arg-type]
    if kind in ("json_object", "json_schema"):
        schema = _schema(s)
        if isinstance(schema, dict):
            schema = {**schema, "x-guidance": {**COMPACT, **schema.get("x-guidance", {})}}
        return str(llguidance.grammar_from("json_schema", json.dumps(schema)))
    return str(llguidance.grammar_from(kind, value))  # type: ignore[arg-type]  # a Structured kind


def grammar_text(s: Structured) -> str:
    """llguidance's grammar text for ``s`` (cached: the same schema is converted once)."""
    return _grammar(s.kind, s.value)


def compile_grammar(s: Structured, limits: Mapping[str, int] | None = None) -> tuple[str | None, str | None]:
    """(grammar text, None) for ``s``, or (None, why it cannot be enforced: a schema that is
    not JSON, a regex or grammar that does not parse, a construct llguidance does not
    support, a limit of ``limits`` (``LLParserLimits`` keywords) passed)."""
    import llguidance

    try:
        text = grammar_text(s)
    except (ValueError, TypeError, RecursionError) as exc:  # json.JSONDecodeError is a ValueError
        return None, f"{s.kind}: {exc}"
    lim = llguidance.LLParserLimits(**limits) if limits else None  # type: ignore[arg-type]  # all ints
    err = llguidance.LLMatcher.validate_grammar(text, None, limits=lim)
    if err:
        return None, f"{s.kind}: {err.strip().splitlines()[0] if err.strip() else 'invalid'}"
    return text, None


def check(s: Structured, limits: Mapping[str, int] | None = None) -> str | None:
    """Why ``s`` cannot be enforced (:func:`compile_grammar`), or None."""
    return compile_grammar(s, limits)[1]


#: How llguidance says a grammar passed one of its limits (``LLParserLimits``): "grammar
#: size ... too big (limit for this grammar: N)", "Too many items (limit N)", "... fuel ...".
_LIMIT_WORDS = re.compile(r"limit for this grammar|\(limit \d|fuel|too many (states|items|expressions)",
                          re.IGNORECASE)


def cause_of(why: str) -> str:
    """Why :func:`compile_grammar` refused, in a word: ``limit`` when one of llguidance's
    limits was passed, else ``invalid``."""
    return "limit" if _LIMIT_WORDS.search(why) else "invalid"


# ---------------------------------------------------------------------- the grammar child

_JOB = msgspec.msgpack.Decoder(tuple[str, str])
_ENC = msgspec.msgpack.Encoder()


def _die_with_parent() -> None:
    """SIGKILL this process when the daemon's thread that started it ends (Linux)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # elsewhere: the closed socket ends it once it is idle


def _vm_size() -> int:
    """This process's address space in bytes (0 if unknown)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def child_main(fd: int, memory_bytes: int, limits: Mapping[str, int]) -> None:
    """A grammar child: answers jobs ``(kind, value)`` from the daemon on the socket ``fd``
    with ``("ok", grammar text)`` or ``(cause, why)`` (``invalid``, ``limit``: :func:`cause_of`;
    ``memory``), one at a time, until the daemon closes it. Its address space may grow by ``memory_bytes`` beyond what it holds once
    llguidance is loaded (``RLIMIT_AS``): past that an allocation fails and llguidance
    aborts the child, which the daemon reports as that limit."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C is for the daemon
    import llguidance  # noqa: F401 - loaded before the cap, which is on the work beyond it

    conn = Connection(fd)
    cap = _vm_size() + memory_bytes
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    conn.send_bytes(_ENC.encode(("ready", "")))
    while True:
        try:
            kind, value = _JOB.decode(conn.recv_bytes())
        except (EOFError, OSError):
            return
        try:
            text, why = compile_grammar(Structured(kind=kind, value=value), limits)  # type: ignore[arg-type]
            reply = ("ok", text) if text is not None else (cause_of(why or ""), why or "invalid")
        except MemoryError:
            reply = ("memory", f"the grammar did not compile within grammar.memory_bytes = {memory_bytes}")
        except Exception as exc:  # noqa: BLE001 - anything else is this grammar's fault
            reply = ("invalid", f"{kind}: {type(exc).__name__}: {exc}")
        conn.send_bytes(_ENC.encode(reply))

