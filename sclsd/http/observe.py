"""What ``sclsd-http`` reports about its own door: Prometheus counters (appended to the
daemon's on ``/metrics``) and the access log.

* ``sclsd:http_requests_total{method,route,status}``: every answered request; ``route``
  is the route's template (``/v1/models/{model}``), ``other`` for anything unrouted,
  so clients cannot grow the label set.
* ``sclsd:http_request_duration_seconds{route}``: arrival to the last byte sent.
* ``sclsd:http_refused_total{reason}``: requests and connections refused here, by the
  error code answered (``invalid_parameter``, ``body_too_large``, ``header_timeout``,
  ``too_many_connections``, ``overloaded``, ...).
* ``sclsd:http_ignored_parameters_total{parameter}``: request parameters this server does
  not know, accepted and left out (as vLLM does), by name: the first
  :data:`MAX_IGNORED_NAMES` names, any later one as ``other`` (clients cannot grow the
  label set). Each name is logged once, at warning, on ``sclsd.http``.
* ``sclsd:http_connections``: open HTTP connections; ``sclsd:http_daemon_up``: 1 while
  the daemon answered the last metrics request.

The access log is one line per request at info on the logger ``sclsd.http.access``:
client, method, path, status, duration, the request id (the response's ``id`` for
completions) and the client's ``X-Request-Id`` if it sent one. Control characters in
client-chosen text are escaped, so no client can forge a log line.
"""

from __future__ import annotations

import logging
import re

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

access_log = logging.getLogger("sclsd.http.access")

#: Route templates, for the ``route`` label (anything else is ``other``).
ROUTES = frozenset({
    "/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/ready", "/metrics",
    "/tokenize", "/detokenize", "/version", "/docs", "/openapi.json", "/v1/responses",
    "/get_load", "/server_info", "/get_server_info", "/model_info", "/get_model_info",
})
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
#: Distinct ignored parameter names labelled and logged; later ones count as ``other``.
MAX_IGNORED_NAMES = 100
log = logging.getLogger("sclsd.http")


def route_of(path: str) -> str:
    if path in ROUTES:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    return "other"


def escape(text: str) -> str:
    """Control characters as ``\\xNN``: one log line stays one line."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


class HttpMetrics:
    """The front end's own counters, in a registry of their own (one per app)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("sclsd:http_requests", "HTTP requests answered",
                                ["method", "route", "status"], registry=r)
        self.duration = Histogram("sclsd:http_request_duration_seconds",
                                  "HTTP request arrival to last byte", ["route"], registry=r,
                                  buckets=(0.005, 0.025, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
        self.refused = Counter("sclsd:http_refused", "requests and connections refused at the "
                               "HTTP door", ["reason"], registry=r)
        self.connections = Gauge("sclsd:http_connections", "open HTTP connections", registry=r)
        self.ignored = Counter("sclsd:http_ignored_parameters", "request parameters this server "
                               "does not know, accepted and left out, by name", ["parameter"],
                               registry=r)
        self._ignored_names: set[str] = set()
        self.daemon_up = Gauge("sclsd:http_daemon_up", "1 if the daemon answered the last "
                               "metrics request", registry=r)

    def refuse(self, reason: str | None) -> None:
        self.refused.labels(reason or "other").inc()

    def ignore(self, names: tuple[str, ...], route: str) -> None:
        """Count the parameters a request to ``route`` carried that this server does not know;
        log each name the first time it is seen."""
        for name in names:
            if name not in self._ignored_names:
                if len(self._ignored_names) >= MAX_IGNORED_NAMES:
                    if len(self._ignored_names) == MAX_IGNORED_NAMES:
                        self._ignored_names.add("")  # say it once
                        log.warning("more than %d unknown parameter names seen: later ones are "
                                    "counted as 'other' and not logged", MAX_IGNORED_NAMES)
                    self.ignored.labels("other").inc()
                    continue
                self._ignored_names.add(name)
                log.warning("ignoring parameter %s (on %s): this server does not know it "
                            "(logged once per name; counted in sclsd:http_ignored_parameters_total)",
                            escape(repr(name)), route)
            self.ignored.labels(name).inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)
