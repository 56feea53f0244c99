from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sclsd import config as C

REPO = Path(__file__).resolve().parents[2]


def test_shipped_config_is_valid_and_matches_defaults() -> None:
    cfg = C.load(REPO / "etc" / "sclsd.toml")
    defaults = C.load(None)
    # The documented file states every default: loading it changes nothing.
    assert (cfg.daemon, cfg.model, cfg.scheduler, cfg.workers) == (
        defaults.daemon, defaults.model, defaults.scheduler, defaults.workers)


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


def test_config_engines_are_the_registered_engines() -> None:
    from worker.engines import ENGINES

    assert set(C._ENGINES) == set(ENGINES)
