"""The exact requests guidellm 0.8.1 and aiperf 0.13.0 send (``clients/*.json``: bodies,
headers, and where in each tool they come from), replayed against a running sclsd-http
and read back the way each tool reads the answers (issue 20: guidellm's streaming
requests all failed with 400 on ``continuous_usage_stats``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

httpx2 = pytest.importorskip("httpx2")

from sclsd.http.process import start_http, stop_http  # noqa: E402
from sclsd.launch import DaemonProcess, launch  # noqa: E402

CLIENTS = Path(__file__).parent / "clients"
TOOLS = sorted(p.name for p in CLIENTS.glob("*.json"))
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    d: DaemonProcess = launch({"model": {"name": "fake"}, "daemon": {"uid_share": 1.0},
                               # 30 ms a token: deltas come apart, as from a real model
                               "workers": {"engine": "fake", "spawn": 1, "threads": 1,
                                           "options": {"decode_s": 0.03}}},
                              wait_workers=1, timeout=120)
    try:
        proc, base = start_http(d.sock, d.status_sock)
        yield base
        assert stop_http(proc) == 0
    finally:
        assert d.stop() == 0, d.log_text()


def _send(url: str, req: dict[str, Any]) -> Any:
    body = req.get("body")
    content = None
    if body is not None:
        body = {**body, "model": "fake"} if body.get("model") == "MODEL" else body
        content = json.dumps(body, separators=(",", ":")).encode()  # both tools send compact JSON
    return httpx2.request(req["method"], url + req["path"], headers=req["headers"], content=content,
                          timeout=60)


def guidellm_stream(text: str) -> tuple[str, dict[str, Any] | None, int, int]:
    """guidellm's add_streaming_line over the body: (text, last usage, content lines, lines with
    usage). A ``data:`` payload with ``error`` fails the request, as _check_streaming_error."""
    texts, usage, content, with_usage = [], None, 0, 0
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("data:"):
            continue
        payload = line[len("data:"):].strip()
        if payload == "[DONE]":
            break
        data = json.loads(payload)
        assert not data.get("error"), data
        choices = data.get("choices", [])
        choice = choices[0] if choices else {}
        piece = choice.get("text") or (choice.get("delta") or {}).get("content")
        if piece:
            texts.append(piece)
            content += 1
        if data.get("usage"):
            usage = data["usage"]
            with_usage += 1
    return "".join(texts), usage, content, with_usage


def aiperf_stream(text: str) -> tuple[str, dict[str, Any] | None]:
    """aiperf's per-chunk parse (extract_*_response_data): only known ``object`` values count."""
    texts, usage = [], None
    for line in text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        obj = json.loads(line[len("data: "):])
        assert obj.get("object") in ("text_completion", "chat.completion.chunk"), obj
        choices = obj.get("choices") or []
        if choices:
            data = choices[0].get("delta") if obj["object"] == "chat.completion.chunk" else choices[0]
            texts.append((data or {}).get("content") or (data or {}).get("text") or "")
        usage = obj.get("usage") or usage
    return "".join(texts), usage


@pytest.mark.parametrize("tool", TOOLS)
def test_the_tools_requests_are_served_and_read_back(url: str, tool: str) -> None:
    spec = json.loads((CLIENTS / tool).read_text())
    for req in spec["requests"]:
        r = _send(url, req)
        assert r.status_code == 200, (tool, req["name"], r.text)
        body = req.get("body") or {}
        if body.get("stream"):
            assert r.headers["content-type"].startswith("text/event-stream")
            if tool.startswith("guidellm"):
                text, usage, content, with_usage = guidellm_stream(r.text)
                assert content >= 2  # at least two token iterations: TTFT and ITL are measurable
                chunks = r.text.count("data: {")
                assert with_usage == chunks  # continuous_usage_stats: usage in every chunk
            else:
                text, usage = aiperf_stream(r.text)
            assert text and usage is not None
            assert usage["completion_tokens"] == MAX_TOKENS or not body.get("ignore_eos")
            assert usage["prompt_tokens"] > 0 and "prompt_tokens_details" in usage
        elif req["method"] == "POST":
            out = r.json()
            choice = out["choices"][0]
            assert out["object"] in ("text_completion", "chat.completion")
            assert (choice.get("text") or choice["message"]["content"])
            assert out["usage"]["completion_tokens"] <= MAX_TOKENS and out["id"]
        elif req["path"] == "/v1/models":
            assert [m["id"] for m in r.json()["data"]] == ["fake"]
        if "X-Request-ID" in req["headers"]:
            assert r.headers["x-request-id"] == req["headers"]["X-Request-ID"]
