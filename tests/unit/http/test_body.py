"""Request bodies that are not JSON objects as they should be: each a 400 naming the
cause, never a traceback (issue 21: UnicodeDecodeError and RecursionError escaped)."""

from __future__ import annotations

import pytest

from sclsd.http.body import MAX_JSON_DEPTH, decode, depth
from sclsd.http.errors import ApiError


def refused(raw: bytes) -> ApiError:
    with pytest.raises(ApiError) as e:
        decode(raw)
    assert e.value.status == 400 and e.value.code == "invalid_json"
    return e.value


def test_invalid_utf8_and_json() -> None:
    assert "UTF-8" in refused(b'{"prompt": "\xff\xfe"}').message
    assert "not valid JSON" in refused(b"{not json").message
    refused(b'{"prompt": "\\ud800"}')  # a lone surrogate cannot travel to the daemon


def test_nesting_beyond_the_bound() -> None:
    ok = b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH
    assert decode(ok) is not None
    too_deep = b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1)
    assert str(MAX_JSON_DEPTH) in refused(too_deep).message
    # Far beyond what the decoder's recursion takes: still a 400.
    refused(b'{"a":' * 100_000 + b"1" + b"}" * 100_000)
    refused(b"[" * 1_000_000 + b"]" * 1_000_000)
    # Brackets inside strings are text, not nesting.
    assert decode(b'{"prompt": "' + b"[{" * 5000 + b'"}') == {"prompt": "[{" * 5000}


def test_depth_walks_without_recursion() -> None:
    x: list = []
    for _ in range(50_000):
        x = [x]
    assert depth(x, 64) and not depth([[1], {"a": [2]}], 3) and depth([[1], {"a": [2]}], 2)
