"""The routes of ``sclsd-http`` (FastAPI).

* ``POST /v1/completions``, ``POST /v1/chat/completions``: one daemon request per
  choice, gathered; ``stream: true`` answers server-sent events. A streaming
  request is answered only once the daemon accepted every choice, so a refusal
  still gets its HTTP status (400, 429, 503); a failure after that is one error
  event, then ``data: [DONE]``.
* ``GET /v1/models``; ``GET /health`` (200 while the daemon answers a ping, else
  503), ``GET /ready`` (200 once a worker serves), ``GET /metrics`` (the daemon's
  Prometheus text). With an API key, ``/v1/*`` needs ``Authorization: Bearer KEY``;
  the other three stay open, as in vLLM.

A client that goes away before its answer is complete (streaming or not) has
its requests cancelled in the daemon at once: the response watches the
connection, and leaving :meth:`sclsd.client.AsyncClient.events` early sends
``cancel`` for every choice not yet done.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from .. import protocol as P
from ..client import RequestError
from . import render
from .link import STATUS_TTL_S, DaemonLink, unavailable
from .params import ApiError, Kind, Parsed, bad, parse

log = logging.getLogger("sclsd.http")

_JSON = "application/json"


@dataclass(frozen=True)
class Settings:
    """What ``sclsd-http`` serves and where it finds the daemon."""

    socket: str
    status_socket: str
    api_key: str | None = None
    model_name: str = ""
    """The served model's name; "": the daemon's ``model.name`` (from its status)."""
    connections: int = 4
    max_choices: int = 64


class EventStream(StreamingResponse):
    """Server-sent events that stop, and cancel their source, when the client disconnects
    (whatever ASGI version the server speaks)."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as tg:

            async def stream() -> None:
                try:
                    await self.stream_response(send)
                except OSError:
                    pass  # the client went away mid-send
                tg.cancel_scope.cancel()

            tg.start_soon(stream)
            await self.listen_for_disconnect(receive)
            tg.cancel_scope.cancel()
        # A body cancelled while it waited in ``yield`` is still open: close it now, so its
        # ``finally`` cancels the daemon's requests at once rather than when it is collected.
        aclose = getattr(self.body_iterator, "aclose", None)
        if aclose is not None:
            await aclose()


def _daemon_error(exc: Exception, link: DaemonLink) -> ApiError:
    if isinstance(exc, RequestError):
        return render.from_daemon(P.Error(code=exc.code, message=exc.message, id=exc.id))
    if isinstance(exc, ApiError):
        return exc
    return unavailable(f"at {link.socket}", exc)


async def _cancel_on_disconnect(request: Request, task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` when the client closes its connection."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    task.cancel()


class Api:
    """The application's state and handlers."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.link = DaemonLink(settings.socket, settings.status_socket, settings.connections)
        self.started = int(time.time())
        self._auth = f"Bearer {settings.api_key}".encode() if settings.api_key else None

    # ------------------------------------------------------------------ checks

    def check_key(self, request: Request) -> None:
        if self._auth is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, self._auth):
            raise ApiError(401, "invalid or missing API key (Authorization: Bearer KEY)", None,
                           "invalid_api_key")

    async def served_name(self) -> str | None:
        """The model name clients must use; None when it cannot be known (any is accepted)."""
        if self.settings.model_name:
            return self.settings.model_name
        try:
            return (await self.link.status(STATUS_TTL_S)).model
        except ApiError as exc:
            log.warning("model name unknown, accepting any: %s", exc.message)
            return None

    # ------------------------------------------------------------------ generation

    async def generate(self, request: Request, kind: Kind) -> Response:
        self.check_key(request)
        try:
            body = msgspec.json.decode(await request.body())
        except msgspec.DecodeError as exc:
            raise bad(None, f"the request body is not valid JSON: {exc}", "invalid_json") from None
        parsed = parse(kind, body, self.settings.max_choices)
        name = await self.served_name()
        if parsed.model is not None and name is not None and parsed.model != name:
            raise render.not_found(parsed.model)
        model = name or parsed.model or "unknown"
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        msgs = parsed.messages(rid)
        client = await self.link.client()
        if parsed.stream:
            return await self._stream(request, parsed, msgs, client.events(msgs), rid, model)
        # One watcher task per request: it cancels this handler if the client goes away, and
        # the events' generator then cancels the choices in the daemon.
        me = asyncio.current_task()
        assert me is not None
        gone = asyncio.ensure_future(_cancel_on_disconnect(request, me))
        try:
            body = await self._complete(parsed, msgs, client.events(msgs), rid, model)
        except asyncio.CancelledError:
            if not gone.done() or gone.cancelled():
                raise  # not the client's doing (shutdown)
            if hasattr(me, "uncancel"):  # Python >= 3.11 counts cancellations
                me.uncancel()
            log.info("%s: client disconnected; cancelled", rid)
            return Response(status_code=499)  # nobody reads it: nginx's "client closed request"
        finally:
            gone.cancel()
        return Response(body, media_type=_JSON)

    async def _complete(self, parsed: Parsed, msgs: list[P.Generate], events: AsyncIterator[Any],
                        rid: str, model: str) -> bytes:
        dones: dict[str, P.Done] = {}
        try:
            async for ev in events:
                if isinstance(ev, P.Done):
                    dones[ev.id] = ev
        except (RequestError, ConnectionError) as exc:
            raise _daemon_error(exc, self.link) from None
        ordered = [dones[m.id] for m in msgs if m.id is not None]
        return render.response(parsed.kind, rid, int(time.time()), model, ordered, parsed.n,
                               parsed.top_logprobs is not None)

    async def _stream(self, request: Request, parsed: Parsed, msgs: list[P.Generate],
                      events: AsyncIterator[Any], rid: str, model: str) -> Response:
        index = {m.id: i for i, m in enumerate(msgs)}
        chunks = render.Chunks(parsed.kind, rid, int(time.time()), model, len(msgs), parsed.n,
                               parsed.include_usage, parsed.top_logprobs is not None)
        it = events.__aiter__()
        early: list[Any] = []
        accepted = 0
        try:
            # Hold the response until every choice is accepted: a refusal keeps its status.
            while accepted < len(msgs):
                ev = await it.__anext__()
                early.append(ev)
                accepted += isinstance(ev, P.Accepted)
        except (RequestError, ConnectionError, StopAsyncIteration) as exc:
            raise _daemon_error(exc if not isinstance(exc, StopAsyncIteration)
                                else ConnectionError("stream ended early"), self.link) from None
        except BaseException:
            await it.aclose()  # type: ignore[attr-defined]
            raise

        async def body() -> AsyncIterator[bytes]:
            try:
                for ev in early:
                    out = self._chunk(chunks, index, ev)
                    if out:
                        yield out
                async for ev in it:
                    out = self._chunk(chunks, index, ev)
                    if out:
                        yield out
                if parsed.include_usage:
                    yield chunks.usage()
            except (RequestError, ConnectionError, ApiError) as exc:
                err = _daemon_error(exc, self.link)
                log.warning("%s: stream failed after it started: %s", rid, err.message)
                yield render.error_event(err)
            finally:
                await it.aclose()  # type: ignore[attr-defined]
            yield render.DONE_EVENT

        return EventStream(body(), headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @staticmethod
    def _chunk(chunks: render.Chunks, index: dict[str | None, int], ev: Any) -> bytes:
        i = index[ev.id]
        if isinstance(ev, P.Accepted):
            return chunks.start(i)
        if isinstance(ev, P.Delta):
            return chunks.delta(i, ev.text, ev.logprobs)
        return chunks.done(i, ev)

    # ------------------------------------------------------------------ the rest

    async def models(self, request: Request) -> Response:
        self.check_key(request)
        name = self.settings.model_name
        if not name:
            name = (await self.link.status(STATUS_TTL_S)).model
        return Response(render.models(name, self.started), media_type=_JSON)

    async def health(self) -> Response:
        try:
            await self.link.ping()
        except ApiError as exc:
            return Response(render.error_body(exc), status_code=503, media_type=_JSON)
        return Response(b"{}", media_type=_JSON)

    async def ready(self) -> Response:
        try:
            st = await self.link.status()
        except ApiError as exc:
            return Response(render.error_body(exc), status_code=503, media_type=_JSON)
        workers = sum(w.state == "active" for w in st.workers)
        ok = st.serving and workers > 0 and not st.draining
        body = msgspec.json.encode({"ready": ok, "workers": workers, "draining": st.draining,
                                    "why": st.why})
        return Response(body, status_code=200 if ok else 503, media_type=_JSON)

    async def metrics(self) -> Response:
        text = await self.link.metrics()
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")


def create_app(settings: Settings) -> FastAPI:
    """The FastAPI application for ``settings``."""
    api = Api(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await api.link.close()

    extra: dict[str, Any] = {}
    if "telemetry" in inspect.signature(FastAPI).parameters:
        # FastAPI's OpenTelemetry hooks look for providers on every request (about 30 µs
        # of CPU each, measured): the daemon's Prometheus metrics are the ones to watch.
        extra["telemetry"] = {"tracing": False, "metrics": False, "logs": False}
    app = FastAPI(title="sclsd", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  **extra)
    app.state.api = api

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        if exc.status >= 500:
            log.warning("%s %s: %d %s", request.method, request.url.path, exc.status, exc.message)
        return Response(render.error_body(exc), status_code=exc.status, media_type=_JSON)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        err = ApiError(exc.status_code, str(exc.detail), None,
                       "not_found" if exc.status_code == 404 else None)
        return Response(render.error_body(err), status_code=exc.status_code, media_type=_JSON,
                        headers=exc.headers)

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)

    async def completions(request: Request) -> Response:
        return await api.generate(request, "completion")

    async def chat_completions(request: Request) -> Response:
        return await api.generate(request, "chat")

    # The two hot routes take the request as is (the body is checked by .params), so they
    # skip FastAPI's per-request dependency solving: plain Starlette routes on the app.
    app.add_route("/v1/completions", completions, methods=["POST"])
    app.add_route("/v1/chat/completions", chat_completions, methods=["POST"])

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        return await api.models(request)

    @app.get("/health")
    async def health() -> Response:
        return await api.health()

    @app.get("/ready")
    async def ready() -> Response:
        return await api.ready()

    @app.get("/metrics")
    async def metrics() -> Response:
        return await api.metrics()

    return app
