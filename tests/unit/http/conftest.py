"""The HTTP front end against an in-process daemon (fake engines, byte tokenizer) that
listens on real Unix sockets; requests go through ASGI in the same event loop."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Awaitable, Callable
from typing import Any

import httpx2
import pytest

from sclsd.daemon.server import Server
from sclsd.http.app import Settings, create_app
from sclsd.launch import short_dir
from sclsd.tokenizer import ByteTokenizer
from unit.inproc import InprocTransport

from ..daemon.conftest import Harness, make_config


class Front:
    """A started daemon, the app in front of it and an HTTP client for the app."""

    def __init__(self, h: Harness, app: Any, http: httpx2.AsyncClient) -> None:
        self.h = h
        self.app = app
        self.http = http

    @property
    def live(self) -> int:
        return len(self.h.live)

    def openai(self, **kw: Any) -> Any:
        import openai

        return openai.AsyncOpenAI(base_url="http://sclsd/v1", api_key=kw.pop("api_key", "none"),
                                  http_client=self.http, max_retries=0, **kw)


Body = Callable[[Front], Awaitable[None]]


def serve_front(body: Body, *, settings: dict[str, Any] | None = None, workers: int = 1,
                engine: Any = None, tokenizer: Any = None, prefix: str = "sclsd-http",
                **sections: dict[str, Any]) -> None:
    """Start an in-process daemon on ``sections`` (``tokenizer``: the daemon's, the byte one by
    default) with ``workers`` fake workers, or one worker ``w0`` on ``engine``; put the app
    (``settings``) in front of it and run ``await body(front)``; stop all of it."""
    d = short_dir(prefix)

    async def main() -> None:
        cfg = make_config(d, **sections)
        server = Server(cfg, transport=InprocTransport(), tokenizer=tokenizer or ByteTokenizer())
        await server.start(sockets=True, spawn=False)
        h = Harness(server, server.transport)  # type: ignore[arg-type]
        if engine is not None:
            server.transport.connect("w0", engine, auth=server.fleet.secret or "")  # type: ignore[attr-defined]
            await h.registered("w0")
        else:
            for i in range(workers):
                h.worker(f"w{i}")
            await h.registered(*(f"w{i}" for i in range(workers)))
        app = create_app(Settings(socket=cfg.daemon.socket, status_socket=cfg.daemon.status_socket,
                                  **(settings or {})))
        http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://sclsd")
        try:
            await body(Front(h, app, http))
        finally:
            await http.aclose()
            await app.state.api.link.close()
            await server.stop()

    try:
        asyncio.run(main())
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def front() -> Callable[..., None]:
    """``front(body, settings=..., **config_sections)``: run ``await body(front)``."""
    return serve_front
