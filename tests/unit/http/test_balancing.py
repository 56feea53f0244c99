"""What load balancers read from a box (``/get_load``, ``/server_info``, ``/model_info``),
from the daemon's own figures; and ``HEAD`` wherever ``GET`` is served."""

from __future__ import annotations

import asyncio

from fastapi.routing import APIRoute

from .conftest import Front, serve_front

ONE = {"model": "fake", "prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}


def test_get_load_counts_the_requests_in_the_box_as_vllm_router_reads_it() -> None:
    async def body(f: Front) -> None:
        w = f.h.worker("w0", hold=True)
        await f.h.registered("w0")
        idle = (await f.http.get("/get_load")).json()
        assert idle["load"] == 0 and idle["num_reqs"] == 0 and idle["num_waiting_reqs"] == 0
        posts = [asyncio.create_task(f.http.post("/v1/completions", json=ONE)) for _ in range(3)]

        async def held() -> None:
            while len(w.batches()) < 1 or f.live < 3:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(held(), 10)
        await asyncio.sleep(0.6)  # past the snapshot's reuse (LOAD_TTL_S)
        busy = (await f.http.get("/get_load")).json()
        st = f.h.server.snapshot()
        # vllm-router reads an integer "load" and adds its own in-flight requests to it.
        assert isinstance(busy["load"], int) and busy["load"] == 3 == st.live_requests
        assert busy["num_reqs"] + busy["num_waiting_reqs"] == 3
        assert busy["num_tokens"] == st.queued_tokens > 0
        while not all(p.done() for p in posts):
            w.release()
            await asyncio.sleep(0.01)
        assert all(p.result().status_code == 200 for p in posts)

    serve_front(body, workers=0)


def test_server_and_model_info_name_the_served_model() -> None:
    async def body(f: Front) -> None:
        for path in ("/server_info", "/get_server_info"):
            info = (await f.http.get(path)).json()
            assert info["model_id"] == info["served_model_name"] == "served-name", info
            assert info["dp_size"] == 1 and info["workers"] == 1 and info["serving"] is True
            assert info["max_queued_requests"] == f.h.server.snapshot().limits.max_queued_requests
        for path in ("/model_info", "/get_model_info"):
            m = (await f.http.get(path)).json()
            assert m["model_path"] == "served-name" and m["is_generation"] is True

    serve_front(body, settings={"model_name": "served-name"})


def test_every_get_route_answers_head() -> None:
    async def body(f: Front) -> None:
        gets = sorted(r.path for r in f.app.routes if isinstance(r, APIRoute) and "GET" in r.methods)
        heads = {r.path for r in f.app.routes if isinstance(r, APIRoute) and "HEAD" in r.methods}
        assert "/metrics" in gets and set(gets) <= heads
        for path in ("/metrics", "/health", "/ready", "/version", "/v1/models", "/v1/models/fake",
                     "/get_load", "/server_info", "/model_info", "/docs", "/openapi.json"):
            get, head = await f.http.get(path), await f.http.head(path)
            assert head.status_code == get.status_code == 200, (path, head.status_code)
            assert head.headers["content-type"] == get.headers["content-type"], path
        assert (await f.http.head("/v1/completions")).status_code == 405  # no GET there either
        spec = (await f.http.get("/openapi.json")).json()
        assert "head" not in spec["paths"]["/metrics"] and "get" in spec["paths"]["/get_load"]

    serve_front(body)
