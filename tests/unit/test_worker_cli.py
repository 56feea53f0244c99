"""sclsd-worker command line: option typing and dispatch."""

from __future__ import annotations

import os
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
         "--mem-budget", "5", "--opt", "vocab=300", "--opt", "max-natural=9"]
    )  # fmt: skip
    assert wm.engine_options(args) == {
        "decode_s": 0.1,
        "mem_budget": 5,
        "vocab": 300,
        "max_natural": 9,
    }


def test_hf_cb_on_a_cpu_bounds_the_tokens_of_a_step_unless_told():
    def opts(*extra: str) -> dict[str, object]:
        return wm.engine_options(wm.build_parser().parse_args(["--connect", "ipc:///x", "--id", "w", *extra]))

    assert opts("--engine", "hf-cb")["max_batch_tokens"] == wm.CPU_CB_MAX_BATCH_TOKENS  # hf-cb, cpu
    assert opts("--engine", "hf-cb", "--opt", "max_batch_tokens=512")["max_batch_tokens"] == 512
    assert "max_batch_tokens" not in opts("--device", "cuda:0")  # auto: hf-static-cb on CUDA
    assert "max_batch_tokens" not in opts("--engine", "hf")
    assert "max_batch_tokens" not in opts("--model", "tiny-random")  # auto: hf-static-cb
    assert "max_batch_tokens" not in opts()  # auto: llama, the default model being a GGUF


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


def test_new_flags_parse_with_defaults():
    args = wm.build_parser().parse_args(["--connect", "x", "--id", "w"])
    assert (args.secret_file, args.daemon_timeout, args.parent_pid) == (None, 30.0, None)
    args = wm.build_parser().parse_args(
        ["--connect", "x", "--id", "w", "--secret-file", "/s", "--daemon-timeout", "0",
         "--parent-pid", "42"]
    )  # fmt: skip
    assert (str(args.secret_file), args.daemon_timeout, args.parent_pid) == ("/s", 0.0, 42)
    for bad in (["--daemon-timeout", "-1"], ["--parent-pid", "0"]):
        with pytest.raises(SystemExit):
            wm.build_parser().parse_args(["--connect", "x", "--id", "w", *bad])


def write(path, text, mode):
    path.write_text(text)
    path.chmod(mode)
    return path


def test_read_secret_strips_a_private_hex_file(tmp_path):
    assert wm.read_secret(write(tmp_path / "s", " 0a1B2c\n", 0o600)) == "0a1B2c"


@pytest.mark.parametrize(
    ("text", "mode", "why"),
    [
        ("abcd", 0o644, "mode 0644"),
        ("abcd", 0o640, "mode 0640"),
        ("abcd", 0o602, "mode 0602"),
        (" \n", 0o600, "empty"),
        ("not hex", 0o600, "hex"),
        ("a" * 257, 0o600, "hex"),
    ],
)
def test_read_secret_refuses(tmp_path, text, mode, why):
    with pytest.raises(wm.SecretError, match=why):
        wm.read_secret(write(tmp_path / "s", text, mode))


def test_read_secret_refuses_missing_file_and_directory(tmp_path):
    with pytest.raises(wm.SecretError, match="does not exist"):
        wm.read_secret(tmp_path / "nope")
    d = tmp_path / "d"
    d.mkdir(mode=0o700)
    with pytest.raises(wm.SecretError, match="not a regular file"):
        wm.read_secret(d)


def test_secret_path_falls_back_to_the_environment(monkeypatch):
    parse = wm.build_parser().parse_args
    monkeypatch.setenv(wm.SECRET_FILE_ENV, "/from/env")
    assert str(wm.secret_path(parse(["--connect", "x", "--id", "w"]))) == "/from/env"
    flag = parse(["--connect", "x", "--id", "w", "--secret-file", "/flag"])
    assert str(wm.secret_path(flag)) == "/flag"
    monkeypatch.setenv(wm.SECRET_FILE_ENV, "")
    assert wm.secret_path(parse(["--connect", "x", "--id", "w"])) is None


def test_bad_secret_file_exits_2_before_the_engine_loads(tmp_path, monkeypatch):
    import worker.engines

    def no_engine(*args, **kwargs):
        raise AssertionError("the engine must not load")

    monkeypatch.setattr(worker.engines, "create_engine", no_engine)
    # main() is a process entry: keep its logging and signal set-up out of pytest's process.
    monkeypatch.setattr(wm, "setup_logging", lambda *a: None)
    monkeypatch.setattr(wm.signal, "signal", lambda *a: None)
    path = write(tmp_path / "s", "abcd", 0o644)
    argv = ["--connect", "ipc:///nowhere", "--id", "w", "--engine", "fake", "--secret-file", str(path)]
    assert wm.main(argv) == 2


def test_parent_pid_unsupported_platform_logs_and_still_checks(monkeypatch, caplog):
    # Never run prctl in the test process itself: it would tie pytest to its parent.
    monkeypatch.setattr(wm.sys, "platform", "darwin")
    with caplog.at_level("WARNING", logger="worker"):
        assert wm.die_with_parent(os.getppid()) is True
        assert wm.die_with_parent(os.getppid() + 100_000_000) is False
    assert "not supported" in caplog.text


def test_a_curve_key_that_starts_with_a_dash_is_one_argument() -> None:
    """Z85 keys may start with "-": the daemon passes them as --curve-server-key=KEY."""
    from worker.main import build_parser

    key = "-" + "a" * 39
    args, extra = build_parser().parse_known_args(["--connect", "ipc:///x", "--id", "w",
                                                   f"--curve-server-key={key}"])
    assert args.curve_server_key == key and extra == []


def test_a_model_the_arena_cannot_hold_gets_the_fallback_engine(monkeypatch, caplog):
    """With ``--engine-fallback`` (the daemon passes it where ``auto`` chose the arena), a model
    ``hf-static-cb`` refuses is loaded on the fallback, the arena's own options left out; without
    it the refusal stands."""
    pytest.importorskip("torch")
    import worker.engines.hf_static_cb as arena
    from worker.engines.base import ModelUnsupported

    monkeypatch.setattr(arena, "supports_reuse", lambda config: False)  # as for sliding-window layers

    def args(*extra: str):
        return wm.build_parser().parse_args(
            ["--connect", "ipc:///x", "--id", "w", "--engine", "hf-static-cb", "--model", "tiny-random",
             "--device", "cpu", "--threads", "1", "--mem-budget", str(64 * 1024**2), "--static-share", "0.6",
             *extra])

    with caplog.at_level("WARNING", logger="worker"):
        eng = wm.load_engine(args("--engine-fallback", "hf-cb"))
    try:
        assert eng.info().engine == "hf-cb"
        assert "cache layers are not all full attention" in caplog.text and "loading engine hf-cb" in caplog.text
    finally:
        eng.close()
    with pytest.raises(ModelUnsupported, match="use engine hf-cb"):
        wm.load_engine(args())
    # auto names the arena and its fallback for a transformers model, on CUDA and on the CPU.
    for device, engine, fallback in (("cuda:0", "hf-static-cb", "hf-cb"), ("cpu", "hf-static-cb", "hf-cb")):
        a = wm.build_parser().parse_args(["--connect", "ipc:///x", "--id", "w", "--model", "tiny-random",
                                          "--device", device])
        assert (wm.resolve_engine(a), a.engine_fallback) == (engine, fallback)
