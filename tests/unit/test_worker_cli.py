"""sclsd-worker command line: option typing and dispatch."""

from __future__ import annotations

import sys
import types

import pytest

from worker import main as wm


@pytest.mark.parametrize(
    ("text", "value"),
    [("3", 3), ("0.5", 0.5), ("true", True), ("False", False), ("none", None), ("fp16", "fp16")],
)
def test_parse_value(text, value):
    assert wm.parse_value(text) == value


def test_engine_options_merge_flags_and_opts():
    args = wm.build_parser().parse_args(
        ["--connect", "ipc:///x", "--id", "w", "--engine", "fake", "--decode-s", "0.1",
         "--mem-budget", "5", "--opt", "vocab=50", "--opt", "max-natural=9"]
    )  # fmt: skip
    assert wm.engine_options(args) == {
        "decode_s": 0.1,
        "mem_budget": 5,
        "vocab": 50,
        "max_natural": 9,
    }


def test_bad_opt_is_rejected():
    with pytest.raises(SystemExit):
        wm.build_parser().parse_args(["--connect", "x", "--id", "w", "--opt", "novalue"])


def test_profile_subcommand_dispatches(monkeypatch):
    seen = {}
    fake = types.ModuleType("worker.profile")
    fake.main = lambda argv: seen.setdefault("argv", argv) and 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "worker.profile", fake)
    import worker

    monkeypatch.setattr(worker, "profile", fake, raising=False)
    wm.main(["profile", "--budget", "5"])
    assert seen["argv"] == ["--budget", "5"]
