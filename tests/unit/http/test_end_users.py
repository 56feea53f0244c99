"""Each end user of sclsd-http is its own group in the daemon's fair turns (its line, its
grammar checks): the one its API key names where several keys tell users apart, else the
request's ``user``, else the HTTP request itself; an HTTP request's ``n`` choices are in
its user's group. sclsd-http's users share its few daemon connections, so without this
they would all be one group per connection."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sclsd import protocol as P
from sclsd.config import ConfigError
from sclsd.http.cli import build_parser, settings_from
from sclsd.http.params import parse

from .conftest import Front


def groups(kind: Any, body: dict[str, Any], end_user: str | None = None) -> list[str | None]:
    parsed = parse(kind, body, 64)
    parsed.end_user = end_user
    return [g.group for g in parsed.messages("cmpl-1")]


def test_the_group_is_the_key_s_end_user_else_the_user_else_the_request() -> None:
    assert groups("completion", {"prompt": "x", "n": 3}) == ["cmpl-1"] * 3
    assert groups("completion", {"prompt": "x", "n": 2, "user": "alice"}) == ["alice"] * 2
    # A key names its holder: the ``user`` it sends cannot make it more groups.
    assert groups("chat", {"messages": [{"role": "user", "content": "x"}], "n": 2, "user": "alice"},
                  end_user="key-0123") == ["key-0123"] * 2


def record_groups(f: Front) -> list[tuple[str | None, str | None]]:
    """(client id, group) of every ``generate`` the daemon gets from now on."""
    seen: list[tuple[str | None, str | None]] = []
    handlers = f.h.shell.frontend.handlers
    admit = handlers[P.Generate]

    def recording(conn: Any, g: P.Generate) -> Any:
        seen.append((g.id, g.group))
        return admit(conn, g)

    handlers[P.Generate] = recording
    return seen


def test_several_api_keys_are_several_end_users_in_the_daemon(front) -> None:
    async def body(f: Front) -> None:
        seen = record_groups(f)
        for key, user in (("key-a", "x"), ("key-b", "x"), ("key-a", "y")):
            r = await f.http.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                                  json={"prompt": "hi", "max_tokens": 2, "n": 2, "user": user})
            assert r.status_code == 200, r.text
        assert (await f.http.post("/v1/completions", headers={"Authorization": "Bearer key-c"},
                                  json={"prompt": "hi"})).status_code == 401
        by_request = [{g for _, g in seen[i:i + 2]} for i in range(0, 6, 2)]
        assert all(len(s) == 1 for s in by_request)  # a request's choices: one group
        a1, b, a2 = (s.pop() for s in by_request)
        assert a1 == a2 != b and a1 is not None and b is not None
        assert "key-a" not in a1 and "key-b" not in b  # named by a digest, never the key

    front(body, settings={"api_key": "key-a", "api_keys": ("key-a", "key-b")})


def test_one_api_key_leaves_the_user_as_the_group(front) -> None:
    async def body(f: Front) -> None:
        seen = record_groups(f)
        for user in ("alice", "bob"):
            r = await f.http.post("/v1/completions", headers={"Authorization": "Bearer k"},
                                  json={"prompt": "hi", "max_tokens": 2, "user": user})
            assert r.status_code == 200, r.text
        assert [g for _, g in seen] == ["alice", "bob"]

    front(body, settings={"api_key": "k"})


def test_the_key_file_lists_one_key_a_line(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("alpha\n\n  beta \nalpha\n")
    cfg = tmp_path / "sclsd.toml"
    cfg.write_text(f'[http]\napi_key_file = "{keys}"\n')
    s, _, _ = settings_from(build_parser().parse_args(["--config", str(cfg)]))
    assert s.api_keys == ("alpha", "beta") and s.api_key == "alpha"
    keys.write_text("\n \n")
    with pytest.raises(ConfigError) as info:
        settings_from(build_parser().parse_args(["--config", str(cfg)]))
    assert info.value.key == "http.api_key_file"
