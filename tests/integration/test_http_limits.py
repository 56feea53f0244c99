"""sclsd-http's limits against hostile clients, over real sockets (issue 21): a header
deadline, a header size bound, a connection cap, a body limit enforced before the body
is read, keep-alive timeouts, and JSON errors for bad bytes. The daemon runs one fake
worker; each test starts its own sclsd-http with the ``[http]`` limits it exercises."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

httpx2 = pytest.importorskip("httpx2")

from sclsd.http.process import start_http, stop_http  # noqa: E402
from sclsd.launch import DaemonProcess, launch, toml_text  # noqa: E402

#: Upper bound on any single wait in these tests (each one states its own expectation).
WAIT_S = 20.0
GEN = {"prompt": "hi", "max_tokens": 2, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    d = launch({"model": {"name": "fake"}, "daemon": {"uid_share": 1.0},
                "workers": {"engine": "fake", "spawn": 1, "threads": 1}}, wait_workers=1, timeout=120)
    yield d
    assert d.stop() == 0, d.log_text()


class Front:
    """One sclsd-http process with its own ``[http]`` section."""

    def __init__(self, d: DaemonProcess, tmp: Path, http: dict[str, Any]) -> None:
        cfg = tmp / "http.toml"
        cfg.write_text(toml_text({"http": http}))
        self.proc, self.url = start_http(d.sock, d.status_sock, "--config", str(cfg))
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        self.addr = (host, int(port))

    def connect(self) -> socket.socket:
        s = socket.create_connection(self.addr, timeout=WAIT_S)
        return s

    def rss_kb(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    def get(self, path: str = "/health") -> int:
        return httpx2.get(self.url + path, timeout=WAIT_S).status_code

    def post(self, body: dict[str, Any]) -> Any:
        return httpx2.post(self.url + "/v1/completions", json=body, timeout=WAIT_S)

    def stop(self) -> None:
        assert stop_http(self.proc) == 0


@pytest.fixture
def front(daemon: DaemonProcess, tmp_path: Path) -> Iterator[Any]:
    started: list[Front] = []

    def make(**http: Any) -> Front:
        f = Front(daemon, tmp_path, http)
        started.append(f)
        return f

    yield make
    for f in started:
        f.stop()


def read_all(s: socket.socket) -> bytes:
    """Everything the server sends until it closes (bounded by the socket's timeout)."""
    out = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk


def read_response(s: socket.socket) -> bytes:
    """One whole response with a Content-Length, the connection left open."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    while len(body) < length:
        chunk = s.recv(65536)
        assert chunk
        body += chunk
    assert len(body) == length  # nothing of a next response read
    return head + b"\r\n\r\n" + body


def status_and_error(reply: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def test_headers_must_arrive_within_the_deadline(front) -> None:
    f = front(header_timeout_s=1.0, keep_alive_s=10.0)
    for opening in (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl", b""):
        s = f.connect()
        t0 = time.monotonic()
        s.sendall(opening)
        reply = read_all(s)
        took = time.monotonic() - t0
        assert status_and_error(reply) == (408, status_and_error(reply)[1])
        assert status_and_error(reply)[1]["code"] == "header_timeout"
        assert 0.9 <= took < WAIT_S, took
        s.close()
    # On a kept-alive connection, the next request's headers have the same deadline.
    s = f.connect()
    s.sendall(b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n")
    assert read_response(s).startswith(b"HTTP/1.1 200")
    s.sendall(b"GET /version HTTP/1.1\r\nHo")
    assert status_and_error(read_all(s))[0] == 408
    s.close()


def test_slowloris_connections_are_shed_and_bystanders_served(front) -> None:
    f = front(header_timeout_s=2.0, max_connections=400)
    slow = []
    for _ in range(150):
        s = f.connect()
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        slow.append(s)
    for _ in range(10):  # bystanders, while every slow connection is open
        r = f.post(GEN)
        assert r.status_code == 200 and r.elapsed.total_seconds() < 5.0
    for s in slow:
        assert status_and_error(read_all(s))[0] == 408
        s.close()


def test_a_huge_header_is_cut_off_without_growing_memory(front) -> None:
    f = front(max_header_bytes=8192)
    s = f.connect()
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 40_000)
    status, err = status_and_error(read_all(s))
    assert (status, err["code"]) == (431, "header_too_large")
    s.close()
    before = f.rss_kb()
    s = f.connect()
    sent = 0
    with pytest.raises((BrokenPipeError, ConnectionResetError)):
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
        for _ in range(200):  # 200 MB offered; the server closes after its bound
            s.sendall(b"a" * 1_000_000)
            sent += 1
    s.close()
    assert sent < 200
    assert f.rss_kb() - before < 20_000, (before, f.rss_kb())
    assert f.get() == 200


def test_connections_beyond_the_cap_are_refused_at_once(front) -> None:
    f = front(max_connections=8, header_timeout_s=60.0)
    idle = [f.connect() for _ in range(8)]
    extra = f.connect()
    status, err = status_and_error(read_all(extra))
    assert (status, err["code"]) == (503, "too_many_connections")
    extra.close()
    idle.pop().close()
    # The server sees the close on its next loop turns: a bounded number of attempts.
    for _ in range(50):
        try:
            if f.get("/version") == 200:
                break
        except httpx2.HTTPError:
            pass
    else:
        raise AssertionError("no connection admitted after one closed")
    for s in idle:
        s.close()


def test_a_declared_gigabyte_body_is_refused_before_it_is_read(front) -> None:
    f = front(max_body_bytes=65536)
    before = f.rss_kb()
    s = f.connect()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 1000000000\r\n\r\n" + b"{" + b" " * 1000)
    status, err = status_and_error(read_all(s))
    assert (status, err["code"]) == (413, "body_too_large")
    s.close()
    assert f.rss_kb() - before < 20_000
    r = f.post({**GEN, "prompt": "x" * 70_000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    assert f.post(GEN).status_code == 200


def test_a_body_that_does_not_arrive_in_time_is_408(front) -> None:
    f = front(body_timeout_s=1.0, header_timeout_s=30.0)
    s = f.connect()
    t0 = time.monotonic()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 100\r\n\r\n" + b'{"prompt": ')  # the rest never comes
    status, err = status_and_error(read_all(s))
    assert (status, err["code"]) == (408, "body_timeout")
    assert 0.9 <= time.monotonic() - t0 < WAIT_S
    s.close()
    assert f.post(GEN).status_code == 200


def test_idle_kept_alive_connections_close_after_keep_alive_s(front) -> None:
    f = front(keep_alive_s=1.0)
    s = f.connect()
    s.sendall(b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n")
    assert read_response(s).startswith(b"HTTP/1.1 200")
    t0 = time.monotonic()
    assert read_all(s) == b""
    assert 0.9 <= time.monotonic() - t0 < WAIT_S
    s.close()


def test_bad_bytes_get_json_400s_not_tracebacks(front) -> None:
    f = front()
    for raw in (b'{"prompt": "\xff\xfe", "max_tokens": 2}', b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"):
        r = httpx2.post(f.url + "/v1/completions", content=raw, timeout=WAIT_S,
                        headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text
        assert r.json()["error"]["code"] == "invalid_json"
    assert f.post({**GEN, "stop_token_ids": list(range(100_000))}).status_code == 400
    s = f.connect()  # not HTTP at all: uvicorn would answer in plain text
    s.sendall(b"\x16\x03\x01\x02\x00 not http\r\n\r\n")
    status, err = status_and_error(read_all(s))
    assert (status, err["code"]) == (400, "invalid_http")
    s.close()
