"""The routes of ``sclsd-http`` (FastAPI).

* ``POST /v1/completions``, ``POST /v1/chat/completions`` (:mod:`.generate`),
  ``POST /v1/responses`` (over the chat path, :mod:`.responses`); any other route: 404
  naming it;
* ``GET /v1/models``, ``GET /v1/models/{model}``; ``POST /tokenize``,
  ``POST /detokenize``, ``GET /tokenizer_info`` (vLLM's shapes; the model's tokenizer,
  :mod:`.tokens`);
* ``GET /health`` (200 while the daemon answers a ping, else 503), ``GET /ready``
  (200 once a worker serves), ``GET /metrics`` (the daemon's Prometheus text and this
  process's own, :mod:`.observe`), ``GET /version``, ``GET /docs``, ``GET /openapi.json``;
* ``GET /get_load``, ``/server_info``, ``/model_info``: what load balancers in front of
  several boxes read (:mod:`.balancing`);
* ``HEAD`` wherever ``GET`` is served.

With an API key, ``/v1/*``, ``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` need ``Authorization:
Bearer KEY``; the others stay open, as in vLLM. Every error, from a route or from the
door (:mod:`.door`), is OpenAI's JSON error shape.
"""

from __future__ import annotations

import hashlib
import hmac
import inspect
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from . import balancing, generate, openapi, render, responses
from .body import read_json
from .door import Door
from .errors import ApiError, bad
from .link import STATUS_TTL_S, DaemonPool
from .observe import HttpMetrics
from .params import Kind, parse
from .settings import Settings
from .tokens import TokenizerAccess, to_tokenize

log = logging.getLogger("sclsd.http")

_JSON = "application/json"
#: Seconds a status snapshot is reused for ``/get_load`` (however many balancers poll).
LOAD_TTL_S = 0.5
#: The API routes, named in the 404 of any other.
SERVED = ("POST /v1/completions", "POST /v1/chat/completions", "POST /v1/responses",
          "GET /v1/models", "POST /tokenize", "POST /detokenize", "GET /tokenizer_info")


class Api:
    """The application's state and handlers."""

    def __init__(self, settings: Settings, metrics: HttpMetrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.link = DaemonPool(settings.socket, settings.status_socket, settings.connections,
                               settings.max_frame_bytes)
        self.tokens = TokenizerAccess(self._model_for_tokenizer, settings.cache_dir, settings.tokenizer,
                             self._max_input)
        self._known_max_input: int | None = None
        self.started = int(time.time())
        keys = settings.api_keys or ((settings.api_key,) if settings.api_key else ())
        self._auth = [f"Bearer {k}".encode() for k in keys]
        #: With several keys, each is an end user: their requests' group in the daemon's fair
        #: turns is named by a digest of the key (never the key itself).
        self._key_ids = [f"key-{hashlib.sha256(k.encode()).hexdigest()[:16]}" for k in keys] if len(keys) > 1 else []
        self._fp_of: object = None
        self._fp = ""

    # ------------------------------------------------------------------ checks

    def check_key(self, request: Request) -> str | None:
        """401 unless the request carries an accepted key (when keys are set). The end user the
        key names, where several keys tell end users apart (else None)."""
        if not self._auth:
            return None
        given = request.headers.get("authorization", "").encode()
        found = -1
        for i, auth in enumerate(self._auth):  # every key compared: the time says nothing of which
            if hmac.compare_digest(given, auth):
                found = i
        if found < 0:
            raise ApiError(401, "invalid or missing API key (Authorization: Bearer KEY)", None,
                           "invalid_api_key")
        return self._key_ids[found] if self._key_ids else None

    async def daemon(self) -> tuple[str | None, str]:
        """(the model name clients must use, or None when it cannot be known and any is
        accepted; the ``system_fingerprint``: the daemon's version, model, policy and slice)."""
        try:
            st = await self.link.status(STATUS_TTL_S)
        except ApiError as exc:
            if not self.settings.model_name:
                log.warning("model name unknown, accepting any: %s", exc.message)
            return self.settings.model_name or None, f"fp_sclsd-{__version__}"
        if st is not self._fp_of:  # once per snapshot, not per request
            what = f"{st.version}|{st.model}|{st.policy}|{st.slice_len}".encode()
            self._fp_of, self._fp = st, f"fp_{hashlib.sha256(what).hexdigest()[:12]}"
        return self.settings.model_name or st.model, self._fp

    async def _model_for_tokenizer(self) -> str:
        return (await self.link.status(STATUS_TTL_S)).model

    async def _max_input(self) -> int | None:
        """The daemon's ``model.max_input`` (from its status; the last one known while it
        does not answer), else the config file's; None: not known."""
        try:
            n = (await self.link.status(STATUS_TTL_S)).limits.max_input
        except ApiError:
            n = 0
        if n:
            self._known_max_input = n
        return self._known_max_input or self.settings.max_input

    async def _json(self, request: Request) -> Any:
        return await read_json(request, self.settings.limits.max_body_bytes)

    # ------------------------------------------------------------------ generation

    async def generate(self, request: Request, kind: Kind) -> Response:
        created = int(time.time())  # the arrival, as OpenAI's ``created`` means it
        end_user = self.check_key(request)
        parsed = parse(kind, await self._json(request), self.settings.max_choices)
        parsed.end_user = end_user
        if parsed.ignored:
            self.metrics.ignore(parsed.ignored, request.url.path)
        name, fingerprint = await self.daemon()
        if parsed.model is not None and name is not None and parsed.model != name:
            raise render.not_found(parsed.model)
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{request.state.request_id}"
        request.state.response_id = rid
        await generate.prepare(self, parsed)
        head = {"id": rid, "created": created, "model": name or parsed.model or "unknown",
                "system_fingerprint": fingerprint}
        return await generate.answer(self, request, parsed, head)

    async def responses(self, request: Request) -> Response:
        """``POST /v1/responses`` over the chat path (:mod:`.responses`)."""
        end_user = self.check_key(request)
        body = await self._json(request)
        try:
            parsed = parse("chat", responses.chat_body(body), self.settings.max_choices)
        except ApiError as exc:
            raise responses.rename(exc) from None
        parsed.end_user = end_user
        if parsed.ignored:
            self.metrics.ignore(parsed.ignored, request.url.path)
        name, fingerprint = await self.daemon()
        if parsed.model is not None and name is not None and parsed.model != name:
            raise render.not_found(parsed.model)
        rid = f"resp_{request.state.request_id}"
        request.state.response_id = rid
        try:
            await generate.prepare(self, parsed)
        except ApiError as exc:
            raise responses.rename(exc) from None
        model = name or parsed.model or "unknown"
        head = {"id": rid, "created": int(time.time()), "model": model, "system_fingerprint": fingerprint}
        answer = await generate.answer(self, request, parsed, head)
        shell = responses.Shell(rid, {k: v for k, v in body.items() if v is not None}, model)
        if isinstance(answer, generate.EventStream):
            chunks: Any = answer.body_iterator  # the chat stream's events, as bytes
            return generate.EventStream(responses.Events(shell).convert(chunks),
                                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        if answer.status_code != 200:
            return answer
        return Response(render.encode(shell.whole(json.loads(bytes(answer.body)))), media_type=_JSON)

    # ------------------------------------------------------------------ tokenizer

    async def tokenize(self, request: Request) -> Response:
        """vLLM's ``/tokenize``: ``prompt`` or ``messages`` -> ``{count, max_model_len, tokens,
        token_strs}``, counted as the daemon counts them."""
        self.check_key(request)
        body = await self._json(request)
        if not isinstance(body, dict):
            raise bad(None, "the request body must be a JSON object")
        body = {k: v for k, v in body.items() if v is not None}
        await self._check_model(body)
        known = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                 "return_token_strs", "tools"}
        unknown = sorted(set(body) - known)
        if unknown:
            raise bad(unknown[0], f"unsupported parameter(s): {', '.join(unknown)}",
                      "unsupported_parameter")
        what = to_tokenize(body)
        view = await self.tokens.view()
        bound = await self.tokens.bound(view)
        if bound is not None:
            bound.check(what.chars, what.param)  # before any tokenizing
        strs_too = body.get("return_token_strs") is True

        def tokenize() -> tuple[list[int], list[str] | None]:
            ids = what.ids(view)
            return ids, view.token_strs(ids) if strs_too else None

        ids, strs = await self.tokens.run(what.chars, tokenize)
        return Response(render.encode({"count": len(ids), "max_model_len": self.settings.max_model_len,
                                       "tokens": ids, "token_strs": strs}), media_type=_JSON)

    async def detokenize(self, request: Request) -> Response:
        """vLLM's ``/detokenize``: ``tokens`` -> ``{prompt}``."""
        self.check_key(request)
        body = await self._json(request)
        if not isinstance(body, dict):
            raise bad(None, "the request body must be a JSON object")
        body = {k: v for k, v in body.items() if v is not None}
        await self._check_model(body)
        ids = body.get("tokens")
        if set(body) - {"model", "tokens"} or not isinstance(ids, list):
            raise bad("tokens", "detokenize takes model and tokens (a list of token ids)")
        view = await self.tokens.view()
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < view.vocab_size
                   for t in ids):
            raise bad("tokens", f"tokens: must be token ids in 0..{view.vocab_size - 1}")
        text = await self.tokens.run(len(ids), view.decode, ids, False)
        return Response(render.encode({"prompt": text}), media_type=_JSON)

    async def tokenizer_info(self) -> Response:
        """vLLM's ``/tokenizer_info``: the tokenizer's configuration (:meth:`.tokens.View.info`),
        what lm-evaluation-harness's remote tokenizer reads (its EOS, its chat template)."""
        view = await self.tokens.view()
        return Response(render.encode(view.info()), media_type=_JSON)

    async def _check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model is None:
            return
        name, _ = await self.daemon()
        if not isinstance(model, str) or (name is not None and model != name):
            raise render.not_found(str(model))

    # ------------------------------------------------------------------ the rest

    async def models(self, request: Request, model: str | None = None) -> Response:
        self.check_key(request)
        name = self.settings.model_name or (await self.link.status(STATUS_TTL_S)).model
        card = render.models(name, self.started, self.settings.max_model_len)
        if model is None:
            return Response(render.encode({"object": "list", "data": [card]}), media_type=_JSON)
        if model != name:
            raise render.not_found(model)
        return Response(render.encode(card), media_type=_JSON)

    async def health(self) -> Response:
        try:
            await self.link.ping()
        except ApiError as exc:
            return Response(render.error_body(exc), status_code=503, media_type=_JSON)
        return Response(b"{}", media_type=_JSON)

    async def ready(self, min_workers: int | None = None) -> Response:
        """200 once the daemon serves with ``min_workers`` active workers; by default every
        worker its config starts (``expected_workers``), at least one: ``1/2`` is not ready."""
        try:
            st = await self.link.status()
        except ApiError as exc:
            return Response(render.error_body(exc), status_code=503, media_type=_JSON)
        workers = sum(w.state == "active" for w in st.workers)
        want = max(1, st.expected_workers) if min_workers is None else max(1, min_workers)
        ok = st.serving and workers >= want and not st.draining
        why = st.why
        if why is None and workers < want:
            why = f"{workers}/{want} workers active"
        body = msgspec.json.encode({"ready": ok, "workers": workers, "expected_workers": want,
                                    "draining": st.draining, "why": why})
        return Response(body, status_code=200 if ok else 503, media_type=_JSON)

    async def metrics_text(self) -> Response:
        """The daemon's metrics and this process's; while the daemon is away, this process's
        alone with ``sclsd:http_daemon_up 0`` (a scrape that fails tells nothing)."""
        try:
            text = (await self.link.metrics()).encode()
            self.metrics.daemon_up.set(1)
        except ApiError as exc:
            log.warning("metrics: %s", exc.message)
            text = b""
            self.metrics.daemon_up.set(0)
        return Response(text + self.metrics.text(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")


def create_app(settings: Settings) -> FastAPI:
    """The application for ``settings`` (``.state.api``: its :class:`Api`)."""
    metrics = HttpMetrics()
    api = Api(settings, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await api.link.close()

    extra: dict[str, Any] = {}
    if "telemetry" in inspect.signature(FastAPI).parameters:
        # FastAPI's OpenTelemetry hooks look for providers on every request (about 30 µs
        # of CPU each, measured): the daemon's Prometheus metrics are the ones to watch.
        extra["telemetry"] = {"tracing": False, "metrics": False, "logs": False}
    app = FastAPI(title="sclsd", version=__version__, lifespan=lifespan, redoc_url=None,
                  description="OpenAI-compatible HTTP front end of sclsd", **extra)
    app.state.api = api
    app.state.metrics = metrics

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        if exc.status >= 500:
            log.warning("%s %s: %d %s", request.method, request.url.path, exc.status, exc.message)
        metrics.refuse(exc.code)
        headers = {"connection": "close"} if exc.status in (408, 413) else None
        return Response(render.error_body(exc), status_code=exc.status, media_type=_JSON,
                        headers=headers)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        err = ApiError(exc.status_code, str(exc.detail), None,
                       "not_found" if exc.status_code == 404 else None)
        if exc.status_code == 404:
            # As OpenAI answers an unknown route, naming it, and saying what is served.
            err.message = (f"Invalid URL ({request.method} {request.url.path}): sclsd-http serves "
                           f"{', '.join(SERVED)}")
        metrics.refuse(err.code or str(exc.status_code))
        return Response(render.error_body(err), status_code=exc.status_code, media_type=_JSON,
                        headers=exc.headers)

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)

    async def completions(request: Request) -> Response:
        return await api.generate(request, "completion")

    async def chat_completions(request: Request) -> Response:
        return await api.generate(request, "chat")

    # The hot routes take the request as is (the body is checked by .params), so they
    # skip FastAPI's per-request dependency solving: plain Starlette routes on the app,
    # documented in the OpenAPI schema by .openapi.
    app.add_route("/v1/completions", completions, methods=["POST"])
    app.add_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_route("/v1/responses", api.responses, methods=["POST"])
    app.add_route("/tokenize", api.tokenize, methods=["POST"])
    app.add_route("/detokenize", api.detokenize, methods=["POST"])

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        return await api.models(request)

    @app.get("/v1/models/{model:path}")
    async def model_card(request: Request, model: str) -> Response:
        return await api.models(request, model)

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> Response:
        api.check_key(request)
        return await api.tokenizer_info()

    @app.get("/health")
    async def health() -> Response:
        return await api.health()

    @app.get("/ready")
    async def ready(min_workers: int | None = None) -> Response:
        return await api.ready(min_workers)

    @app.get("/metrics")
    async def metrics_route() -> Response:
        return await api.metrics_text()

    @app.get("/version")
    async def version() -> Response:
        return Response(render.encode({"version": __version__}), media_type=_JSON)

    # What load balancers in front of several boxes read (:mod:`.balancing`).
    @app.get("/get_load")
    async def get_load() -> Response:
        st = await api.link.status(LOAD_TTL_S)
        return Response(render.encode(balancing.load(st)), media_type=_JSON)

    @app.get("/server_info")
    @app.get("/get_server_info", include_in_schema=False)
    async def server_info() -> Response:
        st = await api.link.status(STATUS_TTL_S)
        body = balancing.server_info(st, settings.model_name or st.model, settings.max_model_len)
        return Response(render.encode(body), media_type=_JSON)

    @app.get("/model_info")
    @app.get("/get_model_info", include_in_schema=False)
    async def model_info() -> Response:
        name = settings.model_name or (await api.link.status(STATUS_TTL_S)).model
        return Response(render.encode(balancing.model_info(name)), media_type=_JSON)

    # Every GET route answers HEAD too (load generators probe ``HEAD /metrics``); the
    # server sends a HEAD answer's headers without its body. (FastAPI's own routes, /docs
    # and /openapi.json, are Starlette's, which do so already.)
    for route in list(app.routes):
        if isinstance(route, APIRoute) and route.methods == {"GET"}:
            app.add_api_route(route.path, route.endpoint, methods=["HEAD"], include_in_schema=False)
    openapi.install(app)
    # Outermost but for Starlette's last-resort error handler: every request, routed or not.
    app.add_middleware(Door, limits=settings.limits, metrics=metrics, log=settings.access_log)
    return app
