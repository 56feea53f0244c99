"""``sclsd-http``'s HTTP server: uvicorn with httptools, and the limits uvicorn lacks.

uvicorn gives the keep-alive timeout (``timeout_keep_alive``). What it does not give
for the httptools parser is added at the protocol level, in :func:`guarded_protocol`:

* a **header deadline**: a connection must deliver a request's line and headers within
  ``header_timeout_s`` of opening (or of the first byte of a later request on it),
  else it gets 408 and is closed (uvicorn has no such timer: a slowloris client held
  its connection for ever);
* a **body deadline**: once a request's headers are in, its whole body must arrive
  within ``body_timeout_s``, else 408 and the connection is closed (here rather than
  in the app, so that it costs a request nothing but a timer, and holds for routes
  that never read their body);
* a **header size bound**: a request line and headers of more than ``max_header_bytes``
  in all, or more than :data:`MAX_HEADERS` headers, get 431 and the connection is
  closed before the app sees the request: counted header by header as the parser
  finds them (a head that arrives whole in one read included), and, for a head not
  finished yet, by the bytes received (httptools buffers a header without bound; h11's
  ``h11_max_incomplete_event_size`` exists only for the slower h11 parser; that bound
  holds within one socket read, at most 256 KiB more);
* a **connection cap**: a connection beyond ``max_connections`` gets 503 and is closed
  at once. uvicorn's ``limit_concurrency`` is not enough: it answers only once a
  request's headers are complete, so connections that never finish them (slowloris)
  were never counted and exhausted the file descriptors;
* bytes that are not HTTP get a JSON 400 (uvicorn's answer is plain text).

Every refusal is OpenAI's JSON error shape and is counted in
``sclsd:http_refused_total{reason}``.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from typing import Any

from . import render
from .errors import ApiError
from .observe import HttpMetrics
from .settings import Limits

log = logging.getLogger("sclsd.http")
#: File descriptors kept for everything but HTTP connections (daemon sockets, logs, ...).
SPARE_FDS = 64

#: Most headers one request may have (as Tomcat's ``maxHeaderCount``); 431 beyond.
MAX_HEADERS = 256
#: What a header costs beyond its name and value: ": " and CRLF.
_HEADER_OVERHEAD = 4

_PHRASE = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large",
           503: b"Service Unavailable"}


def raw_error(status: int, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 error response that closes the connection."""
    body = render.error_body(ApiError(status, message, None, code))
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n" % (status, _PHRASE.get(status, b""), len(body))) + body


class HeadTooLarge(Exception):
    """Raised from a parser callback to stop parsing a head already refused with 431."""


def guarded_protocol(limits: Limits, metrics: HttpMetrics) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with the header deadline, header bound and connection
    cap of the module docstring."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class Guarded(HttpToolsProtocol):
        _timer: asyncio.TimerHandle | None = None
        _body_timer: asyncio.TimerHandle | None = None
        _in_head = True
        _head_bytes = 0
        _head_size = 0
        """Request line and headers of the current head, as parsed."""
        _head_count = 0
        _head_refused = False

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            metrics.connections.set(len(self.connections))
            if len(self.connections) > limits.max_connections:
                self._refuse(503, f"more than {limits.max_connections} open connections "
                             "(http.max_connections)", "too_many_connections")
                return
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None
            super().connection_lost(exc)
            metrics.connections.set(len(self.connections))

        def _arm(self) -> None:
            self._timer = self.loop.call_later(limits.header_timeout_s, self._head_timeout)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _head_timeout(self) -> None:
            self._timer = None
            if self._in_head:
                self._refuse(408, f"the request's headers did not arrive within "
                             f"{limits.header_timeout_s:g} s (http.header_timeout_s)", "header_timeout")

        def _body_timeout(self) -> None:
            self._body_timer = None
            cycle = self.cycle
            if cycle is None or cycle.response_started:
                # The app answered already (413 ...): just stop waiting for the rest.
                if not self.transport.is_closing():
                    metrics.refuse("body_timeout")
                    self.transport.close()
                return
            cycle.response_complete = True  # the app's answer, if any, goes nowhere now
            self._refuse(408, f"the request's body did not arrive within "
                         f"{limits.body_timeout_s:g} s (http.body_timeout_s)", "body_timeout")

        def send_400_response(self, msg: str) -> None:
            if self._head_refused:
                return  # parsing stopped on purpose (HeadTooLarge): answered already
            # uvicorn answers a request httptools cannot parse in plain text: JSON here too.
            self._refuse(400, f"not a valid HTTP/1.1 request: {msg}", "invalid_http")

        def _refuse(self, status: int, message: str, code: str) -> None:
            if self.transport.is_closing():
                return
            metrics.refuse(code)
            self.transport.write(raw_error(status, message, code))
            self.transport.close()

        def data_received(self, data: bytes) -> None:
            # Count what arrives while a head is unfinished (a head that completes in this
            # read resets the count in on_headers_complete).
            counting = self._in_head
            if counting:
                self._head_bytes += len(data)
            super().data_received(data)
            if counting and self._in_head and self._head_bytes > limits.max_header_bytes:
                self._refuse(431, f"the request's line and headers exceed {limits.max_header_bytes} "
                             "bytes (http.max_header_bytes)", "header_too_large")

        def on_url(self, url: bytes) -> None:
            self._count_head(len(url), 0)
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count_head(len(name) + len(value) + _HEADER_OVERHEAD, 1)
            super().on_header(name, value)

        def _count_head(self, size: int, headers: int) -> None:
            self._head_size += size
            self._head_count += headers
            if self._head_size > limits.max_header_bytes or self._head_count > MAX_HEADERS:
                what = (f"more than {MAX_HEADERS} headers" if self._head_count > MAX_HEADERS else
                        f"the request's line and headers exceed {limits.max_header_bytes} bytes "
                        "(http.max_header_bytes)")
                self._refuse(431, what, "header_too_large")
                self._head_refused = True
                raise HeadTooLarge(what)  # the parser stops: the app never sees this request

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head_size = self._head_count = 0
            self._in_head = True
            if self._timer is None:  # a later request on a kept-alive connection
                self._arm()

        def on_headers_complete(self) -> None:
            self._in_head = False
            self._head_bytes = 0
            self._disarm()
            self._body_timer = self.loop.call_later(limits.body_timeout_s, self._body_timeout)
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            if self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None
            super().on_message_complete()

    return Guarded


def raise_open_files(want: int) -> int:
    """Raise the soft open-file limit towards ``want`` (within the hard limit); the
    resulting soft limit. A refusal (a sandbox without ``setrlimit``) keeps the old one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (OSError, ValueError) as exc:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, exc)
    return soft if soft != resource.RLIM_INFINITY else want


def effective_limits(limits: Limits) -> Limits:
    """``limits`` with ``max_connections`` lowered to what the open-file limit allows."""
    from dataclasses import replace

    soft = raise_open_files(limits.max_connections + SPARE_FDS)
    room = soft - SPARE_FDS
    if room < limits.max_connections:
        log.warning("http.max_connections = %d, but only %d files may be open: at most %d "
                    "connections", limits.max_connections, soft, max(1, room))
        return replace(limits, max_connections=max(1, room))
    return limits
