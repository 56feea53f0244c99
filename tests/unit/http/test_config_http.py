"""``[http]``: the shipped file states every default; bad values name the key; the
command line turns the section into the front end's settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from sclsd import config as C
from sclsd.http.cli import build_parser, settings_from
from sclsd.http.settings import Limits

REPO = Path(__file__).resolve().parents[3]


def test_shipped_http_section_is_the_defaults() -> None:
    assert C.load(REPO / "etc" / "sclsd.toml").http == C.load(None).http
    h, lim = C.load(None).http, Limits()
    for key in ("max_body_bytes", "body_timeout_s", "max_header_bytes", "header_timeout_s",
                "keep_alive_s", "max_connections", "max_requests_per_client"):
        assert getattr(h, key) == getattr(lim, key), key


@pytest.mark.parametrize(("key", "value"), [
    ("max_body_bytes", 10), ("max_body_bytes", 2**31), ("max_header_bytes", 100),
    ("header_timeout_s", 0), ("body_timeout_s", -1.0), ("keep_alive_s", 7200),
    ("max_connections", 0), ("max_requests_per_client", -1), ("access_log", "yes"),
    ("header_timeout_s", float("inf")),
])
def test_bad_http_values_name_the_key(key: str, value: object) -> None:
    with pytest.raises(C.ConfigError) as e:
        C.from_dict({"http": {key: value}})
    assert e.value.key == f"http.{key}"


def test_settings_from_a_config_file(tmp_path: Path) -> None:
    cfg = tmp_path / "sclsd.toml"
    cfg.write_text('[daemon]\nsocket = "/tmp/a.sock"\nstatus_socket = "/tmp/b.sock"\n'
                   'max_frame_bytes = 1048576\n[model]\nmax_input = 2000\nmax_gen = 500\n'
                   '[http]\nmax_body_bytes = 65536\nmax_connections = 10\naccess_log = true\n')
    s, listen, level = settings_from(build_parser().parse_args(["--config", str(cfg), "--no-access-log"]))
    assert (s.socket, s.status_socket, s.max_frame_bytes, s.max_model_len) == (
        "/tmp/a.sock", "/tmp/b.sock", 1048576, 2500)
    assert (s.limits.max_body_bytes, s.limits.max_connections, s.access_log) == (65536, 10, False)
    plain, _, _ = settings_from(build_parser().parse_args(["--socket", "/tmp/x.sock"]))
    assert plain.max_model_len is None and plain.access_log and plain.limits == Limits()
