"""The door every request passes (issues 20 and 21): the access log, the HTTP metrics,
body limits, the per-client bound, and every client error as a JSON 4xx."""

from __future__ import annotations

import asyncio
import logging

from prometheus_client.parser import text_string_to_metric_families

from sclsd.http.settings import Limits

from ..daemon.conftest import held
from .conftest import Front

ONE = {"model": "fake", "max_tokens": 4, "temperature": 0, "ignore_eos": True}


def test_access_log_line_per_request_and_x_request_id(front, caplog) -> None:
    caplog.set_level(logging.INFO, logger="sclsd.http.access")

    async def body(f: Front) -> None:
        r = await f.http.post("/v1/completions", json={**ONE, "prompt": "x"},
                              headers={"X-Request-ID": "client-42"})
        assert r.headers["x-request-id"] == "client-42"
        rid = r.json()["id"]
        bad = await f.http.post("/v1/completions", json={**ONE, "prompt": "x", "use_beam_search": True})
        assert bad.status_code == 400 and len(bad.headers["x-request-id"]) == 24
        await f.http.get("/no/such%0AFAKE%20LINE")  # the server decodes %0A into the path
        lines = [rec.getMessage() for rec in caplog.records if rec.name == "sclsd.http.access"]
        assert len(lines) == 3, lines
        assert '"POST /v1/completions" 200 ' in lines[0] and f"id={rid}" in lines[0]
        assert "x_request_id=client-42" in lines[0]
        assert '"POST /v1/completions" 400 ' in lines[1]
        assert "\n" not in lines[2] and "\\x0aFAKE LINE" in lines[2] and '" 404 ' in lines[2]

    front(body)


def test_access_log_off_with_the_flag(front, caplog) -> None:
    caplog.set_level(logging.INFO, logger="sclsd.http.access")

    async def body(f: Front) -> None:
        assert (await f.http.get("/health")).status_code == 200
        assert not [rec for rec in caplog.records if rec.name == "sclsd.http.access"]

    front(body, settings={"access_log": False})


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_http_requests_and_refusals_are_counted_on_metrics(front) -> None:
    async def body(f: Front) -> None:
        await f.http.post("/v1/completions", json={**ONE, "prompt": "x"})
        await f.http.post("/v1/completions", json={**ONE, "prompt": "x", "use_beam_search": True})
        await f.http.post("/v1/completions", content=b"{", headers={"content-type": "application/json"})
        await f.http.get("/v1/models/nope")
        s = _samples((await f.http.get("/metrics")).text)
        ok = ("sclsd:http_requests_total", (("method", "POST"), ("route", "/v1/completions"), ("status", "200")))
        assert s[ok] == 1
        assert s[("sclsd:http_requests_total", (("method", "POST"), ("route", "/v1/completions"),
                                                ("status", "400")))] == 2
        assert s[("sclsd:http_requests_total", (("method", "GET"), ("route", "/v1/models/{model}"),
                                                ("status", "404")))] == 1
        for reason in ("unsupported_parameter", "invalid_json", "model_not_found"):
            assert s[("sclsd:http_refused_total", (("reason", reason),))] == 1, reason
        assert s[("sclsd:http_daemon_up", ())] == 1
        assert any(name.startswith("sclsd:num_requests") for name, _ in s)  # the daemon's own

    front(body)


def test_bodies_over_the_limit_are_413_before_being_read(front) -> None:
    async def body(f: Front) -> None:
        r = await f.http.post("/v1/completions", content=b"x" * 5000,
                              headers={"content-type": "application/json"})
        err = r.json()["error"]
        assert (r.status_code, err["code"], err["type"]) == (413, "body_too_large", "invalid_request_error")
        assert r.headers["connection"] == "close"
        sent = []

        async def chunks():  # no Content-Length: chunked; refused once past the limit
            for _ in range(100):
                sent.append(1)
                yield b" " * 1000

        r = await f.http.post("/v1/chat/completions", content=chunks())
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
        assert len(sent) < 100
        ok = await f.http.post("/v1/completions", json={**ONE, "prompt": "y" * 100})
        assert ok.status_code == 200

    front(body, settings={"limits": Limits(max_body_bytes=4096)})


def test_client_errors_are_json_4xx(front) -> None:
    """Issue 21: raw invalid UTF-8 and deep nesting ended as plain-text 500 tracebacks."""
    async def body(f: Front) -> None:
        for raw in (b'{"prompt": "\xff\xfe", "max_tokens": 2}', b"[" * 100_000 + b"]" * 100_000,
                    b'{"prompt": ' + b"[" * 70 + b"1" + b"]" * 70 + b"}"):
            r = await f.http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
        r = await f.http.post("/v1/completions", json={**ONE, "prompt": "x", "stop_token_ids": [5] * 100_000})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids"

    front(body)


def test_a_request_larger_than_a_daemon_frame_is_413_and_the_connection_lives(front) -> None:
    async def body(f: Front) -> None:
        r = await f.http.post("/v1/completions", json={**ONE, "prompt": "z" * 3000})
        err = r.json()["error"]
        assert (r.status_code, err["code"]) == (413, "request_too_large") and "frame" in err["message"]
        # Nothing reached the daemon: the shared connection still serves.
        assert (await f.http.post("/v1/completions", json={**ONE, "prompt": "z"})).status_code == 200

    front(body, settings={"max_frame_bytes": 2048, "connections": 1})


async def until_live(f: Front, n: int) -> None:
    """Until the daemon holds ``n`` live requests (callers bound the wait)."""
    while len(f.h.live) < n:
        await asyncio.sleep(0.005)


def test_requests_in_flight_per_client_are_bounded(front) -> None:
    async def body(f: Front) -> None:
        w = f.h.worker("slow", hold=True)
        await f.h.registered("slow")
        f.h.drain("w0")
        first = asyncio.ensure_future(f.http.post("/v1/completions", json={**ONE, "prompt": "a"},
                                                  headers={"authorization": "Bearer k1"}))
        await held(w)
        r = await f.http.post("/v1/completions", json={**ONE, "prompt": "b"},
                              headers={"authorization": "Bearer k1"})
        assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_requests"
        other = asyncio.ensure_future(f.http.post("/v1/completions", json={**ONE, "prompt": "c"},
                                                  headers={"authorization": "Bearer k2"}))
        await asyncio.wait_for(until_live(f, 2), 5)  # another key is not held back
        assert (await f.http.get("/health")).status_code == 200  # nor are other routes
        w.hold = False
        w.release()
        assert (await asyncio.wait_for(first, 5)).status_code == 200
        assert (await asyncio.wait_for(other, 5)).status_code == 200
        again = await f.http.post("/v1/completions", json={**ONE, "prompt": "d"},
                                  headers={"authorization": "Bearer k1"})
        assert again.status_code == 200  # its place was given back

    front(body, settings={"limits": Limits(max_requests_per_client=1)})

