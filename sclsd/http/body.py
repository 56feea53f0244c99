"""Reading a request's JSON body within bounds: size (413), valid UTF-8 and JSON (400),
nesting depth (400). Every failure is an :class:`ApiError`, never a traceback. (The
time a body may take is the server's to bound: :mod:`.server`.)"""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import ClientDisconnect, Request

from .door import too_large
from .errors import ApiError, bad

#: Deepest nesting of arrays and objects a request body may have (a tool's JSON schema
#: is the deepest thing a client sends; 64 leaves room for about 30 nested properties).
MAX_JSON_DEPTH = 64


async def read(request: Request, limit: int) -> bytes:
    """The body, at most ``limit`` bytes (413 past it, without reading further). How long
    it may take is bounded by the server (``body_timeout_s``, :mod:`.server`)."""
    parts: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            parts.append(chunk)
    except ClientDisconnect:
        raise ApiError(400, "the client went away while sending the body", None,
                       "client_disconnected") from None
    return b"".join(parts)


def depth(obj: Any, limit: int) -> bool:
    """Whether ``obj`` nests arrays and objects deeper than ``limit`` (iterative: no
    recursion however deep)."""
    stack = [(obj, 1)]
    while stack:
        x, d = stack.pop()
        if d > limit:
            return True
        if isinstance(x, dict):
            stack.extend((v, d + 1) for v in x.values() if isinstance(v, (dict, list)))
        elif isinstance(x, list):
            stack.extend((v, d + 1) for v in x if isinstance(v, (dict, list)))
    return False


def decode(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """JSON bytes -> Python objects, or a 400 that says what is wrong."""
    try:
        obj = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise bad(None, f"the request body is not valid JSON: {exc}", "invalid_json") from None
    except UnicodeDecodeError as exc:
        raise bad(None, f"the request body is not valid UTF-8 (byte {exc.start})",
                  "invalid_json") from None
    except RecursionError:
        raise bad(None, f"the request body nests deeper than {max_depth} levels",
                  "invalid_json") from None
    # Cheap first: fewer brackets in all than the bound cannot nest past it.
    if raw.count(b"[") + raw.count(b"{") > max_depth and depth(obj, max_depth):
        raise bad(None, f"the request body nests deeper than {max_depth} levels", "invalid_json")
    return obj


async def read_json(request: Request, limit: int) -> Any:
    """:func:`read` then :func:`decode`."""
    return decode(await read(request, limit))
