"""sclsctl's rough edges (issue 20): both sockets from one place, ``--help`` saying
which, ``wait-ready`` counting what it waits for, ``drain --wait`` checking the status
socket before it drains, and the hub hint."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import pytest

import sclsd.ctl as ctl
from sclsd import models
from sclsd.protocol import EstimatorError, Limits, LoadingWorker, StatusSnapshot, WorkerStatus


def sockets(argv: list[str], env: dict[str, str] | None = None) -> tuple[str, str, str]:
    args = ctl.build_parser().parse_args([*argv, "status"])
    args.socket_flag, args.status_socket_flag = args.socket, args.status_socket
    ctl.resolve_sockets(args, env or {})
    return args.socket, args.status_socket, args.sockets_from


def test_both_sockets_from_one_place(tmp_path: Path) -> None:
    assert sockets([]) == ("/run/sclsd/sclsd.sock", "/run/sclsd/status.sock", "the default")
    assert sockets(["--run-dir", "/tmp/r"])[:2] == ("/tmp/r/sclsd.sock", "/tmp/r/status.sock")
    cfg = tmp_path / "sclsd.toml"
    cfg.write_text('[daemon]\nsocket = "/srv/a.sock"\nstatus_socket = "/srv/b.sock"\n')
    assert sockets(["--config", str(cfg)])[:2] == ("/srv/a.sock", "/srv/b.sock")
    env = {"SCLSD_SOCKET": "/e/a.sock", "SCLSD_STATUS_SOCKET": "/e/b.sock"}
    assert sockets([], env)[:2] == ("/e/a.sock", "/e/b.sock")
    # Order: explicit sockets, then --run-dir, then --config, then the environment.
    assert sockets(["--run-dir", "/tmp/r", "--config", str(cfg)], env)[:2] == (
        "/tmp/r/sclsd.sock", "/tmp/r/status.sock")
    assert sockets(["--config", str(cfg), "--socket", "/x.sock"], env)[:2] == ("/x.sock", "/srv/b.sock")
    # The options also work after the subcommand.
    args = ctl.build_parser().parse_args(["drain", "w0", "--run-dir", "/tmp/q"])
    args.socket_flag = args.status_socket_flag = None
    ctl.resolve_sockets(args, {})
    assert (args.socket, args.status_socket) == ("/tmp/q/sclsd.sock", "/tmp/q/status.sock")


def test_a_bad_config_file_is_exit_2(tmp_path: Path, capsys) -> None:
    assert ctl.main(["--config", str(tmp_path / "missing.toml"), "status"]) == 2
    assert "file not found" in capsys.readouterr().err


def test_help_says_which_sockets_each_command_uses(capsys) -> None:
    parser = ctl.build_parser()
    top = parser.format_help()
    assert "--run-dir DIR" in top and "--config FILE" in top and "$SCLSD_SOCKET" in top
    subs = {a.dest: a for a in parser._actions if isinstance(a, argparse._SubParsersAction)}
    choices = subs["cmd"].choices
    for name, uses in (("submit", "client socket"), ("status", "status socket"),
                       ("wait-ready", "status socket"), ("top", "status socket"),
                       ("drain", "--wait also the status socket"), ("cancel", "client socket")):
        assert f"Uses the {uses}" in choices[name].format_help() or uses in choices[name].format_help(), name


def test_unreachable_sockets_are_named_with_their_origin(tmp_path: Path, capsys) -> None:
    assert ctl.main(["--run-dir", str(tmp_path), "status"]) == 1
    err = capsys.readouterr().err
    assert f"{tmp_path}/status.sock (from --run-dir {tmp_path})" in err


def snapshot(workers: int, loading: int, serving: bool = True, expected: int = 0,
             states: tuple[str, ...] = ()) -> StatusSnapshot:
    w = [WorkerStatus(id=f"w{i}", engine="fake", model="m", device="cpu", pid=1, state="active",
                      load_s=0, batches_inflight=0, queued_batches=0, busy=False, batches_done=0,
                      tokens_done=0, heartbeat_age_s=0) for i in range(workers)]
    lw = [LoadingWorker(id=f"w{workers + i}", pid=2, age_s=3.0, step="loading engine",
                        state=states[i] if i < len(states) else "loading")  # type: ignore[arg-type]
          for i in range(loading)]
    return StatusSnapshot(version="0", protocol=5, uptime_s=1, draining=False, model="m", policy="scls",
                          slice_len=8, interval_s=0.1, pool_size=0, live_requests=0, running_requests=0,
                          admitting=0, queued_tokens=0, limits=Limits(1, 1), connections=0,
                          metrics_http=None, workers=w, estimator={},
                          estimator_error=EstimatorError(0, None, None, []), counters={},
                          serving=serving, loading=lw, expected_workers=expected)


def test_wait_ready_waits_for_every_configured_worker() -> None:
    # Two configured, one registered, the other between its exit and its restart: 1/2 is not
    # ready, and not hopeless either.
    ready, doing = ctl.readiness(snapshot(1, 1, expected=2, states=("restarting",)))
    assert ready is False and doing.startswith("1/2 workers registered")
    # Even when the status lists nobody else (a moment between processes): still 1/2.
    ready, doing = ctl.readiness(snapshot(1, 0, expected=2))
    assert ready is False and doing.startswith("1/2 workers registered")
    assert ctl.readiness(snapshot(1, 0, expected=2), 1)[0] is True  # --min-workers 1
    # A worker given up will not come: say so at once rather than wait for the timeout.
    ready, doing = ctl.readiness(snapshot(1, 1, expected=2, states=("given_up",)))
    assert ready is None and "given up: w1" in doing


def test_wait_ready_counts_the_workers_still_loading() -> None:
    ready, doing = ctl.readiness(snapshot(1, 1))
    assert ready is False and doing.startswith("1/2 workers registered; loading w1: loading engine")
    assert ctl.readiness(snapshot(2, 0)) == (True, "2/2 workers registered")
    # An explicit count is a minimum: reached with one registered, and it says what still loads.
    ready, doing = ctl.readiness(snapshot(1, 1), 1)
    assert ready is True and doing.startswith("1/1 workers registered; loading w1")
    assert ctl.readiness(snapshot(0, 0, serving=False))[0] is None


def test_wait_ready_says_what_each_worker_does_while_it_waits(monkeypatch, capsys) -> None:
    """A line when what it waits for changes and at least every PROGRESS_S (a fake clock):
    never more than PROGRESS_S of silence; the ready line alone on stdout."""
    clock = [100.0]
    seen = [snapshot(0, 2)] * 30 + [snapshot(1, 1)] * 40 + [snapshot(2, 0)]

    def fake_status(*_a: Any, **_kw: Any) -> StatusSnapshot:
        return seen.pop(0)

    def nap(s: float) -> None:
        clock[0] += 0.5

    monkeypatch.setattr(ctl, "status", fake_status)
    monkeypatch.setattr(ctl.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(ctl.time, "sleep", nap)
    assert ctl.main(["--run-dir", "/tmp/none", "wait-ready", "--timeout", "300"]) == 0
    out, err = capsys.readouterr()
    assert out == "ready: 2/2 workers registered\n"
    lines = err.splitlines()
    assert lines[0] == "sclsctl: waiting (1s): 0/2 workers registered; loading w0: loading engine (3s), " \
                       "w1: loading engine (3s)"
    # The change is said at the next poll, not PROGRESS_S later.
    assert any(re.match(r"sclsctl: waiting \(1[56]s\): 1/2 workers registered; loading w1", line)
               for line in lines), err
    times = [float(line.split("(")[1].split("s)")[0]) for line in lines]
    assert all(b - a <= ctl.PROGRESS_S + 1 for a, b in zip(times, times[1:], strict=False))  # shown rounded
    seen[:] = [snapshot(0, 2)] * 30 + [snapshot(2, 0)]
    assert ctl.main(["--run-dir", "/tmp/none", "wait-ready", "--quiet"]) == 0
    assert capsys.readouterr() == ("", "")


def test_drain_wait_checks_the_status_socket_before_draining(monkeypatch, capsys, tmp_path: Path) -> None:
    calls: list[Any] = []

    class Recorder:
        def __init__(self, *a: Any, **kw: Any) -> None:
            calls.append(a)

    monkeypatch.setattr(ctl, "Client", Recorder)
    rc = ctl.main(["--socket", str(tmp_path / "api.sock"), "drain", "w0", "--wait"])
    err = capsys.readouterr().err
    assert rc == 1 and calls == []  # nothing was drained
    assert "cannot reach sclsd status at /run/sclsd/status.sock (from the default)" in err
    assert "nothing drained" in err


def test_hub_hint_is_hf_download_and_only_for_org_name(tmp_path: Path, monkeypatch) -> None:
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(models.ModelNotCached, match=r"\(hf download acme/tiny\)"):
        models.resolve("acme/tiny")
    with pytest.raises(models.ModelNotCached) as e:
        models.resolve("smollm3")
    assert "hf download" not in str(e.value) and "ORG/NAME" in str(e.value)


def test_one_run_dir_places_the_daemon_sclsctl_and_sclsd_http_alike(tmp_path: Path, monkeypatch) -> None:
    """``--run-dir DIR`` means the same sockets to all three commands."""
    import sclsd.daemon.cli as daemon_cli
    from sclsd.http import cli as http_cli

    seen: dict[str, Any] = {}

    def fake_load(path: Any = None, **overrides: Any) -> Any:
        seen.update(overrides)
        raise ctl_config_error()

    def ctl_config_error() -> Exception:
        from sclsd.config import ConfigError

        return ConfigError("stop", "here", "the test has what it needs")

    monkeypatch.setattr(daemon_cli, "load", fake_load)
    assert daemon_cli.main(["--run-dir", str(tmp_path)]) == 2
    assert (seen["daemon__socket"], seen["daemon__status_socket"], seen["daemon__worker_endpoint"]) == (
        f"{tmp_path}/sclsd.sock", f"{tmp_path}/status.sock", f"ipc://{tmp_path}/workers.ipc")
    # An explicit path still wins over the directory.
    assert daemon_cli.main(["--run-dir", str(tmp_path), "--socket", "/x.sock"]) == 2
    assert seen["daemon__socket"] == "/x.sock" and seen["daemon__status_socket"] == f"{tmp_path}/status.sock"
    settings, _, _ = http_cli.settings_from(http_cli.build_parser().parse_args(["--run-dir", str(tmp_path)]))
    assert (settings.socket, settings.status_socket) == (f"{tmp_path}/sclsd.sock", f"{tmp_path}/status.sock")
    assert sockets(["--run-dir", str(tmp_path)])[:2] == (settings.socket, settings.status_socket)


def test_the_client_library_names_the_socket_it_cannot_reach(tmp_path: Path) -> None:
    import asyncio

    from sclsd.client import AsyncClient, Client, status

    path = str(tmp_path / "sclsd.sock")
    with pytest.raises(FileNotFoundError, match=f"client socket at {path}: No such file"):
        Client(path)
    with pytest.raises(FileNotFoundError, match=f"status socket at {tmp_path}/s.sock"):
        status(str(tmp_path / "s.sock"))

    async def connect() -> None:
        await AsyncClient(path).connect()

    with pytest.raises(OSError, match=f"client socket at {path}"):
        asyncio.run(connect())


def test_tokenizer_prints_the_directory_load_generators_take(monkeypatch, capsys, tmp_path: Path) -> None:
    import msgspec

    from sclsd.tokenizer import load

    directory = load("tiny-random").directory  # type: ignore[attr-defined]
    assert directory is not None and Path(directory, "tokenizer.json").is_file()
    from transformers import AutoTokenizer

    assert len(AutoTokenizer.from_pretrained(directory)) == len(load("tiny-random").tok)  # type: ignore[attr-defined]
    st = msgspec.structs.replace(snapshot(1, 0), tokenizer=directory)
    monkeypatch.setattr(ctl, "status", lambda path, **kw: st)
    assert ctl.main(["--run-dir", str(tmp_path), "tokenizer"]) == 0
    assert capsys.readouterr().out.strip() == directory
    assert f"tokenizer={directory}" in ctl.format_status(st)
    monkeypatch.setattr(ctl, "status", lambda path, **kw: snapshot(1, 0))
    assert ctl.main(["--run-dir", str(tmp_path), "tokenizer"]) == 1
    assert "no tokenizer directory" in capsys.readouterr().err
