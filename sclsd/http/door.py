"""The ASGI layer every HTTP request passes first (outside FastAPI's routing).

For each request it assigns the request id (``scope["state"]["request_id"]``, sent back
as ``X-Request-Id`` unless the client chose one), refuses a declared body over
``max_body_bytes`` with 413 before reading any of it, bounds the requests in flight
per API key or client address on the routes that do work (429 beyond), and, when the
answer is complete, counts it (:class:`~.observe.HttpMetrics`) and writes the access
log line. A pure ASGI middleware: no per-request task or body copy.
"""

from __future__ import annotations

import itertools
import logging
import re
import secrets
import time
from collections import defaultdict
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import render
from .errors import ApiError
from .observe import HttpMetrics, access_log, escape, route_of
from .settings import Limits

#: Routes whose requests count against ``max_requests_per_client``.
_BOUNDED = frozenset({"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"})
#: A client's ``X-Request-Id`` is echoed and logged only if it looks like an id.
_CLIENT_ID = re.compile(rb"[A-Za-z0-9._:/+=-]{1,128}")


async def send_error(send: Send, err: ApiError, extra: list[tuple[bytes, bytes]] | None = None,
                     close: bool = False) -> None:
    """Answer ``err`` as OpenAI's JSON error (``close``: and end the connection)."""
    body = render.error_body(err)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": err.status, "headers": headers + (extra or [])})
    await send({"type": "http.response.body", "body": body})


#: The headers the door reads, found in one pass over the request's.
_WANTED = frozenset({b"content-length", b"x-request-id", b"authorization"})


def _headers(scope: Scope) -> dict[bytes, bytes]:
    return {k: bytes(v) for k, v in scope["headers"] if k in _WANTED}


def request_ids() -> Any:
    """Request ids unique across processes and restarts: a random per-process prefix and a
    counter (cheaper than a random id per request)."""
    prefix = secrets.token_hex(8)
    return (f"{prefix}{n:08x}" for n in itertools.count())


class Door:
    """The middleware (see the module docstring)."""

    def __init__(self, app: ASGIApp, limits: Limits, metrics: HttpMetrics, log: bool = True) -> None:
        self.app = app
        self.limits = limits
        self.metrics = metrics
        self.log = log
        self.inflight: dict[bytes | str, int] = defaultdict(int)
        self._ids = request_ids()
        self._counted: dict[tuple[str, str, int], Any] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.monotonic()
        rid = next(self._ids)
        scope.setdefault("state", {})["request_id"] = rid
        headers = _headers(scope)
        client_id = headers.get(b"x-request-id")
        if client_id is not None and not _CLIENT_ID.fullmatch(client_id):
            client_id = None
        status = 0

        async def sending(msg: Message) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
                msg["headers"] = [*msg.get("headers", []), (b"x-request-id", client_id or rid.encode())]
            await send(msg)

        route = route_of(scope["path"])
        key = None
        try:
            refusal = self._check(headers)
            if refusal is not None:
                self.metrics.refuse(refusal.code)
                await send_error(sending, refusal, close=refusal.status == 413)
                return
            if route in _BOUNDED and self.limits.max_requests_per_client:
                key = self._client_key(scope, headers)
                if self.inflight[key] >= self.limits.max_requests_per_client:
                    err = ApiError(429, f"more than {self.limits.max_requests_per_client} requests "
                                   "in flight from this client (http.max_requests_per_client)",
                                   None, "too_many_requests")
                    key = None
                    self.metrics.refuse(err.code)
                    await send_error(sending, err)
                    return
                self.inflight[key] += 1
            await self.app(scope, receive, sending)
        except Exception:
            if not status:  # a bug, not the client's doing: still a JSON answer
                self.metrics.refuse("internal")
                await send_error(sending, ApiError(500, "internal error in sclsd-http (logged)",
                                                   None, "internal"))
            raise
        finally:
            if key is not None:
                self.inflight[key] -= 1
                if not self.inflight[key]:
                    del self.inflight[key]
            self._done(scope, route, status, time.monotonic() - t0, scope["state"], client_id)

    def _check(self, headers: dict[bytes, bytes]) -> ApiError | None:
        length = headers.get(b"content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                return ApiError(400, "Content-Length is not a number", None, "invalid_request")
            if n > self.limits.max_body_bytes:
                return too_large(self.limits.max_body_bytes)
        return None

    @staticmethod
    def _client_key(scope: Scope, headers: dict[bytes, bytes]) -> bytes | str:
        auth = headers.get(b"authorization")
        if auth:
            return auth
        client = scope.get("client")
        return client[0] if client else "?"

    def _done(self, scope: Scope, route: str, status: int, seconds: float, state: dict[str, Any],
              client_id: bytes | None) -> None:
        method = scope["method"]
        shown = status or 499  # the client went away before any answer
        counted = self._counted.get((method, route, shown))
        if counted is None:  # label lookups once per (method, route, status), not per request
            counted = (self.metrics.requests.labels(method, route, str(shown)),
                       self.metrics.duration.labels(route))
            self._counted[(method, route, shown)] = counted
        counted[0].inc()
        counted[1].observe(seconds)
        if self.log:
            client = scope.get("client")
            who = f"{client[0]}:{client[1]}" if client else "-"
            path = scope["path"]
            line = (f'{who} "{method} {escape(path) if not path.isprintable() else path}" {shown} {seconds:.3f}s '
                    f"id={state.get('response_id') or state['request_id']}")
            if client_id is not None:
                line += f" x_request_id={client_id.decode()}"
            if access_log.isEnabledFor(logging.INFO):
                # The record made directly: Logger.info would look up the caller's frame
                # first, a third of the cost of the line.
                access_log.handle(access_log.makeRecord(access_log.name, logging.INFO, __file__, 0,
                                                        line, (), None))


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {limit} bytes (http.max_body_bytes)",
                    None, "body_too_large")
