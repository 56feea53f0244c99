"""``POST /v1/completions`` and ``POST /v1/chat/completions``: one daemon request per
choice, gathered.

``stream: true`` answers server-sent events. A streaming request is answered only
once the daemon accepted every choice, so a refusal still gets its HTTP status
(400, 429, 503); a failure after that is one error event, then ``data: [DONE]``.

A client that goes away before its answer is complete (streaming or not) has its
requests cancelled in the daemon at once: the response watches the connection, and
leaving :meth:`sclsd.client.AsyncClient.events` early sends ``cancel`` for every
choice not yet done.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol

import anyio
import msgspec
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from .. import protocol as P
from ..client import FrameTooLarge, RequestError
from . import render, tokens
from .errors import ApiError, unsupported
from .link import DaemonPool, unavailable
from .params import Parsed
from .stream import Chunks

log = logging.getLogger("sclsd.http")

_JSON = "application/json"


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


def daemon_error(exc: Exception, link: DaemonPool) -> ApiError:
    """What the daemon (or the connection to it) said, as the HTTP error to answer."""
    if isinstance(exc, RequestError):
        return render.from_daemon(P.Error(code=exc.code, message=exc.message, id=exc.id))
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, FrameTooLarge):
        return ApiError(413, str(exc), None, "request_too_large")
    return unavailable(f"at {link.socket}", exc)


async def _cancel_on_disconnect(request: Request, task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` when the client closes its connection."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    task.cancel()


class Host(Protocol):
    """What the generation routes need from the application (:class:`.app.Api`)."""

    link: DaemonPool
    tokens: tokens.TokenizerAccess


async def prepare(host: Host, parsed: Parsed) -> None:
    """Resolve the prompt forms that need the tokenizer here, and refuse a request that
    needs a daemon feature this daemon does not list."""
    if tokens.needs_view(parsed):
        view = await host.tokens.view()
        tokens.check_bound(parsed, await host.tokens.bound(view))  # before any tokenizing
        await host.tokens.run(tokens.view_chars(parsed), tokens.resolve, parsed, view)
    else:
        tokens.resolve(parsed, None)
    await host.link.client()  # connected, so ``features`` is this daemon's
    missing = sorted(parsed.features - host.link.features)
    if missing:
        # The OpenAI parameter behind each daemon feature.
        param = {"structured": "response_format", "include_stop_str": "include_stop_str_in_output",
                 "prompt_logprobs": _prompt_param(parsed)}.get(missing[0], missing[0])
        why = ("with logprobs it needs the prompt's log-probabilities: this daemon does not "
               "compute them yet" if param == "echo" else "this daemon's engines do not apply it yet")
        raise unsupported(param, f"{why} (the daemon lists what it applies; docs/operations.md, "
                          "sclsd-http)")


def _prompt_param(parsed: Parsed) -> str:
    """The parameter that asked for the prompt's log-probabilities."""
    return "prompt_logprobs" if parsed.prompt_logprobs is not None else "echo"


def _refused(exc: Exception, host: Host, parsed: Parsed) -> ApiError:
    """:func:`daemon_error`, naming ``echo`` where the daemon refused the ``prompt_logprobs``
    that a completion's echo with logprobs asked for."""
    err = daemon_error(exc, host.link)
    if err.param == "prompt_logprobs" and _prompt_param(parsed) == "echo":
        err.param = "echo"
        err.message = f"echo: with logprobs it needs the prompt's log-probabilities; {err.message}"
    return err


def prompt_logprobs(parsed: Parsed, dones: list[P.Done]) -> render.PromptLogprobs | None:
    """What the answer shows of the prompts' log-probabilities: each prompt's first choice
    asked for them (``dones`` in choice order)."""
    if parsed.ask_prompt is None:
        return None
    entries = []
    for d in dones[::parsed.per_prompt]:
        if d.prompt_logprobs is None and d.usage.prompt_tokens > 1:
            render.finish_reason(d)  # a failed choice says why
            raise ApiError(500, "the daemon sent no prompt log-probabilities", None, "internal")
        entries.append(d.prompt_logprobs or [])  # a one-token prompt has none
    return render.PromptLogprobs(entries, parsed.prompt_heads if parsed.echo_logprobs else None,
                                 parsed.top_logprobs or 0, parsed.prompt_logprobs)


def echo_only(ev: Any) -> Any:
    """A daemon event of a ``max_tokens: 0`` echo: its generated token left out (text, ids,
    log-probabilities, usage), the prompt's log-probabilities kept."""
    if isinstance(ev, P.Delta):
        return msgspec.structs.replace(ev, token_ids=[], text="", logprobs=None)
    if isinstance(ev, P.Done):
        return msgspec.structs.replace(
            ev, text=None if ev.text is None else "", token_ids=None if ev.token_ids is None else [],
            logprobs=None if ev.logprobs is None else [],
            usage=msgspec.structs.replace(ev.usage, completion_tokens=0))
    return ev


async def answer(host: Host, request: Request, parsed: Parsed, head: dict[str, Any]) -> Response:
    """Send the request's choices to the daemon and answer with their results."""
    msgs = parsed.messages(head["id"])
    client = await host.link.client()
    if parsed.stream:
        return await _stream(host, parsed, msgs, client.events(msgs), head)
    # One watcher task per request: it cancels this handler if the client goes away, and
    # the events' generator then cancels the choices in the daemon.
    me = asyncio.current_task()
    assert me is not None
    gone = asyncio.ensure_future(_cancel_on_disconnect(request, me))
    try:
        body = await _complete(host, parsed, msgs, client.events(msgs), head)
    except asyncio.CancelledError:
        if not gone.done() or gone.cancelled():
            raise  # not the client's doing (shutdown)
        if hasattr(me, "uncancel"):  # Python >= 3.11 counts cancellations
            me.uncancel()
        log.info("%s: client disconnected; cancelled", head["id"])
        return Response(status_code=499)  # nobody reads it: nginx's "client closed request"
    finally:
        gone.cancel()
    return Response(body, media_type=_JSON)


async def _complete(host: Host, parsed: Parsed, msgs: list[P.Generate],
                    events: AsyncIterator[Any], head: dict[str, Any]) -> bytes:
    dones: dict[str, P.Done] = {}
    try:
        async for ev in events:
            if isinstance(ev, P.Done):
                dones[ev.id] = echo_only(ev) if parsed.echo_only else ev
    except (RequestError, ConnectionError, FrameTooLarge) as exc:
        raise _refused(exc, host, parsed) from None
    ordered = [dones[m.id] for m in msgs if m.id is not None]
    shown = render.best(ordered, parsed.best_of, parsed.n) if parsed.best_of else ordered
    return render.response(parsed.kind, head, ordered, shown, parsed.per_prompt,
                           parsed.top_logprobs is not None, parsed.echo_texts or None,
                           parsed.chat.mode if parsed.chat else None, prompt_logprobs(parsed, ordered))


async def _stream(host: Host, parsed: Parsed, msgs: list[P.Generate], events: AsyncIterator[Any],
                  head: dict[str, Any]) -> Response:
    index = {m.id: i for i, m in enumerate(msgs)}
    chunks = Chunks(parsed.kind, head, len(msgs), parsed.per_prompt,
                    include_usage=parsed.include_usage, continuous=parsed.continuous_usage,
                    logprobs=parsed.top_logprobs is not None, echo=parsed.echo_texts or None,
                    tool_mode=parsed.chat.mode if parsed.chat else None,
                    prompt_heads=parsed.prompt_heads if parsed.echo_logprobs else None)
    it = events.__aiter__()
    early: list[Any] = []
    accepted = 0
    try:
        # Hold the response until every choice is accepted: a refusal keeps its status.
        while accepted < len(msgs):
            ev = await it.__anext__()
            early.append(ev)
            accepted += isinstance(ev, P.Accepted)
    except (RequestError, ConnectionError, FrameTooLarge, StopAsyncIteration) as exc:
        raise _refused(exc if not isinstance(exc, StopAsyncIteration)
                       else ConnectionError("stream ended early"), host, parsed) from None
    except BaseException:
        await it.aclose()  # type: ignore[attr-defined]
        raise

    async def body() -> AsyncIterator[bytes]:
        try:
            for ev in early:
                out = chunks.event(index[ev.id], echo_only(ev) if parsed.echo_only else ev)
                if out:
                    yield out
            async for ev in it:
                out = chunks.event(index[ev.id], echo_only(ev) if parsed.echo_only else ev)
                if out:
                    yield out
            if parsed.include_usage:
                yield chunks.usage()
        except (RequestError, ConnectionError, ApiError) as exc:
            err = _refused(exc, host, parsed)
            log.warning("%s: stream failed after it started: %s", head["id"], err.message)
            yield render.error_event(err)
        finally:
            await it.aclose()  # type: ignore[attr-defined]
        yield render.DONE_EVENT

    return EventStream(body(), headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

