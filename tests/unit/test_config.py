from __future__ import annotations

import grp
import os
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from sclsd import config as C
from sclsd import defaults as D

REPO = Path(__file__).resolve().parents[2]


def test_shipped_config_is_valid_and_matches_defaults() -> None:
    cfg = C.load(REPO / "etc" / "sclsd.toml")
    builtin = C.load(None)
    # The documented file states every default: loading it changes nothing.
    assert (cfg.daemon, cfg.model, cfg.scheduler, cfg.workers) == (
        builtin.daemon, builtin.model, builtin.scheduler, builtin.workers)


def test_shipped_config_documents_every_key() -> None:
    text = (REPO / "etc" / "sclsd.toml").read_text()
    sections = dict(re.findall(r"^\[(\w+)\]\n(.*?)(?=^\[|\Z)", text, re.M | re.S))
    for name, cls in C._SECTIONS.items():
        body = sections[name]
        for f in fields(cls):
            # A key without a default value is documented commented out.
            assert re.search(rf"^(# )?{f.name} = ", body, re.M) or f.name == "options", (name, f.name)


@pytest.mark.parametrize(
    ("toml", "key"),
    [
        ("[scheduler]\nslice_len = 0", "scheduler.slice_len"),
        ("[scheduler]\nslice_len = 'x'", "scheduler.slice_len"),
        ("[scheduler]\npolicy = 'fastest'", "scheduler.policy"),
        ("[scheduler]\nzeta = 1.5", "scheduler.zeta"),
        ("[daemon]\nworker_endpoint = 'udp://x'", "daemon.worker_endpoint"),
        ("[daemon]\nsocket_mode = 'rw'", "daemon.socket_mode"),
        ("[daemon]\nheartbeat_timeout_s = 0.5", "daemon.heartbeat_timeout_s"),
        ("[daemon]\nbogus = 1", "daemon.bogus"),
        ("[nosuch]\na = 1", "nosuch"),
        ("[workers]\nengine = 'vllm'", "workers.engine"),
        ("[workers]\nspawn = -1", "workers.spawn"),
        ("[workers]\nthreads = true", "workers.threads"),
        ("[model]\nmax_input = 0", "model.max_input"),
        # Non-finite floats, in any section.
        ("[scheduler]\ngamma_s = inf", "scheduler.gamma_s"),
        ("[scheduler]\nlam = nan", "scheduler.lam"),
        ("[scheduler]\nzeta = -inf", "scheduler.zeta"),
        ("[daemon]\nheartbeat_interval_s = nan", "daemon.heartbeat_interval_s"),
        ("[daemon]\nheartbeat_timeout_s = inf", "daemon.heartbeat_timeout_s"),
        ("[daemon]\ndrain_timeout_s = inf", "daemon.drain_timeout_s"),
        ("[workers]\nrestart_backoff_s = nan", "workers.restart_backoff_s"),
        ("[scheduler]\ngamma_s = 0", "scheduler.gamma_s"),
        ("[daemon]\nallowed_uids = [0, -1]", "daemon.allowed_uids"),
        ("[daemon]\nstatus_allowed_uids = [-5]", "daemon.status_allowed_uids"),
        ("[daemon]\nadmin_uids = [-1]", "daemon.admin_uids"),
        ("[daemon]\nsocket_group = 'no-such-group-sclsd'", "daemon.socket_group"),
        ("[workers]\nengine = 'fake'", "workers.engine"),
        ("[model]\nname = 'tiny-random'\n[workers]\nengine = 'fake'", "workers.engine"),
        ("[model]\nname = 'fake'\n[workers]\nengine = 'hf'", "workers.engine"),
        ("[scheduler]\nprofile = 'no-such-profile'", "scheduler.profile"),
        ("[scheduler]\nprofile = '/nonexistent/p.json'", "scheduler.profile"),
        ("[model]\nname = '/nonexistent/model'", "model.name"),
        ("[model]\nname = 'missing.gguf'", "model.name"),
        ("[model]\nname = 'random:/nonexistent/config.json'", "model.name"),
        # New keys.
        ("[daemon]\nworker_socket_mode = '0999'", "daemon.worker_socket_mode"),
        ("[daemon]\nworker_socket_mode = 4096", "daemon.worker_socket_mode"),
        ("[daemon]\nframe_timeout_s = 0", "daemon.frame_timeout_s"),
        ("[daemon]\nmax_tokenizing = 0", "daemon.max_tokenizing"),
        ("[daemon]\nuid_share = 0", "daemon.uid_share"),
        ("[daemon]\nuid_share = 1.5", "daemon.uid_share"),
        ("[daemon]\nbatch_overdue_factor = 0.5", "daemon.batch_overdue_factor"),
        ("[daemon]\nbatch_overdue_min_s = 0", "daemon.batch_overdue_min_s"),
        ("[daemon]\nbatch_ack_timeout_s = 0", "daemon.batch_ack_timeout_s"),
        ("[daemon]\nlock_file = '/run/sclsd/sclsd.sock'", "daemon.lock_file"),
        ("[daemon]\nworker_secret_file = '/nonexistent/dir/secret'", "daemon.worker_secret_file"),
        ("[workers]\nrestart_backoff_max_s = 0.5", "workers.restart_backoff_max_s"),
        ("[workers]\nmax_quick_failures = 0", "workers.max_quick_failures"),
        ("[workers]\nquick_failure_s = -1", "workers.quick_failure_s"),
        ("[workers]\ndaemon_timeout_s = 0.5", "workers.daemon_timeout_s"),
        ("[workers]\ndaemon_timeout_s = -1", "workers.daemon_timeout_s"),
    ],
)
def test_bad_values_name_key_and_value(tmp_path: Path, toml: str, key: str) -> None:
    p = tmp_path / "c.toml"
    p.write_text(toml)
    with pytest.raises(C.ConfigError) as ei:
        C.load(p)
    assert ei.value.key == key
    assert key in str(ei.value)


def test_socket_mode_octal_and_int_coercion(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text("[daemon]\nsocket_mode = '0600'\ndrain_timeout_s = 5\n")
    cfg = C.load(p)
    assert cfg.daemon.socket_mode == 0o600
    assert cfg.daemon.drain_timeout_s == 5.0


def test_override_revalidates() -> None:
    cfg = C.load(None)
    assert C.override(cfg, scheduler__slice_len=16).scheduler.slice_len == 16
    with pytest.raises(C.ConfigError):
        C.override(cfg, scheduler__slice_len=-3)


def test_daemon_exits_nonzero_naming_key(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text("[scheduler]\nlam = 7\n")
    r = subprocess.run([sys.executable, "-m", "sclsd.daemon", "--config", str(p)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "scheduler.lam" in r.stderr and "7" in r.stderr
    r = subprocess.run([sys.executable, "-m", "sclsd.daemon", "--config", str(tmp_path / "missing.toml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "file not found" in r.stderr


def test_engines_are_one_list() -> None:
    from sclsd.daemon.cli import build_parser
    from worker.engines import ENGINES

    assert tuple(ENGINES) == D.ENGINES
    engine = next(a for a in build_parser()._actions if a.dest == "engine")
    assert tuple(engine.choices) == D.ENGINES


def test_shared_defaults() -> None:
    from sclsd import ctl, protocol

    d = C.load(None).daemon
    assert (d.socket, d.status_socket, d.worker_endpoint) == (
        D.SOCKET, D.STATUS_SOCKET, D.WORKER_ENDPOINT)
    assert (d.max_frame_bytes, d.max_conn_buffer_bytes, d.max_worker_msg_bytes) == (
        D.MAX_FRAME_BYTES, D.MAX_CONN_BUFFER_BYTES, D.MAX_WORKER_MSG_BYTES)
    assert protocol.DEFAULT_MAX_FRAME == D.MAX_FRAME_BYTES
    # sclsctl resolves its sockets when it runs: with nothing given, the shared defaults.
    args = ctl.build_parser().parse_args(["status"])
    args.socket_flag = args.status_socket_flag = None
    ctl.resolve_sockets(args, env={})
    assert (args.socket, args.status_socket) == (D.SOCKET, D.STATUS_SOCKET)


def test_offline_env() -> None:
    env = D.offline_env({"PATH": "/bin", "HF_HUB_OFFLINE": "0"})
    assert env == {"PATH": "/bin", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                   "TOKENIZERS_PARALLELISM": "false"}
    assert D.offline_env()["HF_HUB_OFFLINE"] == "1"


def test_gamma_defaults_to_profile_then_core() -> None:
    from sclsd.core.policy import DEFAULT_GAMMA

    s = C.load(None).scheduler
    assert s.gamma_s is None
    assert s.effective_gamma() == DEFAULT_GAMMA
    assert s.effective_gamma(6.0) == 6.0
    assert C.from_dict({"scheduler": {"gamma_s": 2}}).scheduler.effective_gamma(6.0) == 2.0


def test_new_keys_defaults_and_values(tmp_path: Path) -> None:
    cfg = C.load(None)
    d, w = cfg.daemon, cfg.workers
    assert d.worker_socket_mode == 0o600 and d.worker_secret_file == "" and d.lock_file == ""
    assert d.lock_path == d.socket + ".lock"
    assert (d.frame_timeout_s, d.max_tokenizing, d.uid_share) == (10.0, 64, 0.5)
    assert (d.batch_overdue_factor, d.batch_overdue_min_s, d.batch_ack_timeout_s) == (4.0, 30.0, 5.0)
    assert (w.restart_backoff_max_s, w.max_quick_failures, w.quick_failure_s, w.daemon_timeout_s) == (
        30.0, 5, 10.0, 30.0)
    p = tmp_path / "c.toml"
    p.write_text(f"[daemon]\nworker_socket_mode = '0640'\nlock_file = '{tmp_path}/l'\n"
                 f"worker_secret_file = '{tmp_path}/secret'\nuid_share = 1\n"
                 "[workers]\ndaemon_timeout_s = 0\n")
    cfg = C.load(p)
    assert cfg.daemon.worker_socket_mode == 0o640 and cfg.daemon.lock_path == f"{tmp_path}/l"
    assert cfg.daemon.uid_share == 1.0 and cfg.workers.daemon_timeout_s == 0.0


def test_existing_group_profile_and_model_paths(tmp_path: Path) -> None:
    group = grp.getgrgid(os.getgid()).gr_name
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    cfg = C.from_dict({"daemon": {"socket_group": group},
                       "scheduler": {"profile": "a100-llama2-13b-hf"},
                       "model": {"name": str(gguf)}})
    assert cfg.daemon.socket_group == group and cfg.model.name == str(gguf)
    cfg = C.from_dict({"model": {"name": "fake"}, "workers": {"engine": "fake"}})
    assert cfg.workers.engine == "fake"


def test_override_checks_types() -> None:
    cfg = C.load(None)
    with pytest.raises(C.ConfigError) as ei:
        C.override(cfg, scheduler__gamma_s=float("nan"))
    assert ei.value.key == "scheduler.gamma_s"
    with pytest.raises(C.ConfigError):
        C.override(cfg, workers__spawn="2")


def test_unreadable_config_is_a_config_error(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_bytes(b"\xff\xfe[daemon]")
    with pytest.raises(C.ConfigError, match="UTF-8"):
        C.load(p)
    with pytest.raises(C.ConfigError, match="cannot read"):
        C.load(tmp_path)  # a directory
