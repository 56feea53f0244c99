"""sclsd-http bounds a request's head however it arrives: a header over
``http.max_header_bytes`` or too many headers get 431 before the app sees the request,
even when the whole head comes in one read; and ``http.max_choices`` bounds how many
prompts a request holds, not how long a token-id prompt is."""

from __future__ import annotations

import httpx2  # noqa: F401 - the fixtures below need it (test_http_limits skips without it)

from sclsd.client import status
from sclsd.http.server import MAX_HEADERS

from .test_http_limits import GEN, WAIT_S, daemon, front, read_all, status_and_error  # noqa: F401

COMPLETION = b'{"prompt": "hi", "max_tokens": 2, "temperature": 0}'


def _post(extra_headers: bytes) -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + extra_headers
            + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(COMPLETION) + COMPLETION)


def _accepted(d) -> int:  # noqa: ANN001 - the daemon fixture
    return status(d.status_sock).counters["accepted"]


def test_a_huge_header_in_one_read_is_refused_before_the_app(front, daemon) -> None:  # noqa: F811
    f = front()  # the default bound, 32 KiB
    before = _accepted(daemon)
    for head in (b"X-Big: " + b"a" * 100_000 + b"\r\n",  # one 100 KB header
                 b"".join(b"X-H%04d: %s\r\n" % (i, b"v" * 40) for i in range(1000))):  # 1,000 of 50 B
        s = f.connect()
        s.sendall(_post(head))
        status_code, err = status_and_error(read_all(s))
        s.close()
        assert (status_code, err["code"]) == (431, "header_too_large"), err
    assert _accepted(daemon) == before, "a refused request reached the daemon"
    assert f.get() == 200  # and the server goes on


def test_more_headers_than_the_cap_are_refused_however_small(front) -> None:  # noqa: F811
    f = front()
    s = f.connect()
    s.sendall(_post(b"".join(b"X-%d: 1\r\n" % i for i in range(MAX_HEADERS + 1))))
    status_code, err = status_and_error(read_all(s))
    s.close()
    assert (status_code, err["code"]) == (431, "header_too_large")
    assert str(MAX_HEADERS) in err["message"]
    # Under the cap and the bound: served.
    s = f.connect()
    s.sendall(_post(b"".join(b"X-%d: 1\r\n" % i for i in range(MAX_HEADERS - 10))))
    reply = read_all(s)
    s.close()
    assert reply.startswith(b"HTTP/1.1 200"), reply[:300]


def test_a_token_id_prompt_longer_than_max_choices_is_served(front) -> None:  # noqa: F811
    f = front(max_choices=64)
    r = f.post({**GEN, "prompt": [65 + i % 26 for i in range(500)]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 500
    # Many prompts are still bounded by it.
    r = f.post({**GEN, "prompt": ["a"] * 65})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
