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
from sclsd.preflight import check_binds

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
        ("[model]\ndefault_max_tokens = 0", "model.default_max_tokens"),
        ("[model]\ndefault_max_tokens = 'all'", "model.default_max_tokens"),
        ("[model]\ndefault_max_tokens = 2e6", "model.default_max_tokens"),
        # Non-finite floats, in any section.
        ("[scheduler]\ngamma_s = inf", "scheduler.gamma_s"),
        ("[scheduler]\nlam = nan", "scheduler.lam"),
        ("[scheduler]\nzeta = -inf", "scheduler.zeta"),
        ("[daemon]\nheartbeat_interval_s = nan", "daemon.heartbeat_interval_s"),
        ("[daemon]\nheartbeat_timeout_s = inf", "daemon.heartbeat_timeout_s"),
        ("[daemon]\ndrain_timeout_s = inf", "daemon.drain_timeout_s"),
        ("[workers]\nrestart_backoff_s = nan", "workers.restart_backoff_s"),
        ("[scheduler]\ngamma_s = 0", "scheduler.gamma_s"),
        # Accepted once, and then nothing could be served or every worker refused.
        ("[scheduler]\ngamma_s = 1e300\nwork_conserving = false", "scheduler.gamma_s"),
        ("[daemon]\nworker_socket_mode = '0666'", "daemon.worker_socket_mode"),
        ("[scheduler]\nmax_slice_gap_s = -1", "scheduler.max_slice_gap_s"),
        ("[scheduler]\nmax_slice_gap_s = inf", "scheduler.max_slice_gap_s"),
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
        ("[daemon]\nbatch_stall_timeout_s = 0.5", "daemon.batch_stall_timeout_s"),
        ("[daemon]\nbatch_overdue_min_s = 30", "daemon.batch_overdue_min_s"),
        ("[daemon]\nbatch_ack_timeout_s = 0", "daemon.batch_ack_timeout_s"),
        ("[daemon]\nlock_file = '/run/sclsd/sclsd.sock'", "daemon.lock_file"),
        ("[daemon]\nworker_secret_file = '/nonexistent/dir/secret'", "daemon.worker_secret_file"),
        ("[workers]\nrestart_backoff_max_s = 0.5", "workers.restart_backoff_max_s"),
        ("[workers]\nmax_quick_failures = 0", "workers.max_quick_failures"),
        ("[workers]\nquick_failure_s = -1", "workers.quick_failure_s"),
        ("[workers]\ndaemon_timeout_s = 0.5", "workers.daemon_timeout_s"),
        ("[workers]\ndaemon_timeout_s = -1", "workers.daemon_timeout_s"),
        # Timeouts past an hour: a stalled worker would hold its requests that long.
        ("[daemon]\nbatch_stall_timeout_s = 1e300", "daemon.batch_stall_timeout_s"),
        ("[daemon]\nbatch_stall_timeout_s = 3601", "daemon.batch_stall_timeout_s"),
        ("[daemon]\nheartbeat_timeout_s = 7200", "daemon.heartbeat_timeout_s"),
        ("[daemon]\nframe_timeout_s = 1e9", "daemon.frame_timeout_s"),
        ("[daemon]\ndrain_timeout_s = 86400", "daemon.drain_timeout_s"),
        ("[daemon]\nbatch_ack_timeout_s = 1e6", "daemon.batch_ack_timeout_s"),
        ("[workers]\ndaemon_timeout_s = 1e300", "workers.daemon_timeout_s"),
        ("[workers]\nrestart_backoff_max_s = 1e9", "workers.restart_backoff_max_s"),
        ("[scheduler]\nmax_slice_gap_s = 1e9", "scheduler.max_slice_gap_s"),
        ("[scheduler]\ngrant_lookahead = 2", "scheduler.grant_lookahead"),
        # A client socket open to every local user is said in words, not by a mode number.
        ("[daemon]\nsocket_mode = '0666'", "daemon.socket_mode"),
        ("[daemon]\nsocket_mode = '0662'", "daemon.socket_mode"),
    ],
)
def test_bad_values_name_key_and_value(tmp_path: Path, toml: str, key: str) -> None:
    p = tmp_path / "c.toml"
    p.write_text(toml)
    with pytest.raises(C.ConfigError) as ei:
        C.load(p)
    assert ei.value.key == key
    assert key in str(ei.value)


def test_a_socket_open_to_every_user_is_said_in_words(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text("[daemon]\nsocket_mode = '0660'\nsocket_open_to_all_users = true\n")
    d = C.load(p).daemon
    assert d.socket_mode == 0o660 and d.client_socket_mode == 0o666
    assert C.DaemonConfig().client_socket_mode == 0o660


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


def test_an_open_max_tokens_is_the_default_and_a_given_one_the_clients(tmp_path: Path) -> None:
    m = C.load(None).model
    assert (m.default_max_tokens, m.max_gen) == (256, 1024)
    assert [m.max_tokens(None), m.max_tokens(None, min_tokens=300), m.max_tokens(None, min_tokens=5000)] == [
        256, 300, 1024]
    assert [m.max_tokens(1), m.max_tokens(600), m.max_tokens(4096)] == [1, 600, 1024]
    p = tmp_path / "c.toml"
    # Above the limit it is the limit, as a request's max_tokens is (max_gen lowered alone stays valid).
    p.write_text("[model]\nmax_gen = 64\n")
    assert C.load(p).model.max_tokens(None) == 64
    p.write_text("[model]\ndefault_max_tokens = 2048\nmax_gen = 4096\n")
    assert C.load(p).model.max_tokens(None) == 2048
    p.write_text("[model]\ndefault_max_tokens = -1\n")
    r = subprocess.run([sys.executable, "-m", "sclsd.daemon", "--config", str(p)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "model.default_max_tokens = -1" in r.stderr, r.stderr


def test_engines_are_one_list() -> None:
    from sclsd.daemon.cli import build_parser
    from worker.engines import ENGINES

    assert tuple(ENGINES) == D.ENGINES
    engine = next(a for a in build_parser()._actions if a.dest == "engine")
    assert tuple(engine.choices) == (D.AUTO_ENGINE, *D.ENGINES)


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
    assert (d.batch_stall_timeout_s, d.batch_ack_timeout_s) == (300.0, 5.0)
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


# ---------------------------------------------------------------------- the last gaps


def _err(raw: dict) -> C.ConfigError:
    with pytest.raises(C.ConfigError) as exc:
        C.from_dict(raw)
    return exc.value


def test_socket_paths_longer_than_a_unix_socket_holds_are_refused(tmp_path) -> None:
    long = "/tmp/" + "s" * 103  # 108 bytes
    assert _err({"daemon": {"socket": long}}).key == "daemon.socket"
    assert _err({"daemon": {"status_socket": long}}).key == "daemon.status_socket"
    e = _err({"daemon": {"worker_endpoint": "ipc://" + long}})
    assert e.key == "daemon.worker_endpoint" and "107 bytes" in str(e)
    C.from_dict({"daemon": {"socket": long[:-1]}})  # 107 bytes fit


def test_a_deeply_nested_value_is_a_config_error(tmp_path) -> None:
    p = tmp_path / "deep.toml"
    p.write_text("[workers.options]\nx = " + "[" * 50000 + "]" * 50000 + "\n")
    with pytest.raises(C.ConfigError) as exc:
        C.load(p)
    assert exc.value.key == "--config" and "nested too deeply" in str(exc.value)


def test_metrics_http_must_be_bindable() -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        cfg = C.from_dict({"daemon": {"metrics_http": f"127.0.0.1:{port}"}})
        with pytest.raises(C.ConfigError) as exc:
            check_binds(cfg)
        assert exc.value.key == "daemon.metrics_http" and "cannot listen" in str(exc.value)
    # An address that is not this machine's (TEST-NET-3) cannot be bound either.
    with pytest.raises(C.ConfigError):
        check_binds(C.from_dict({"daemon": {"metrics_http": "203.0.113.7:9100"}}))
    check_binds(C.from_dict({"daemon": {"metrics_http": "127.0.0.1:0"}}))


@pytest.mark.parametrize(
    ("engine", "options", "key", "why"),
    [
        ("fake", {"decode_s": float("inf")}, "decode_s", "finite"),
        ("fake", {"decode_s": -1.0}, "decode_s", ">= 0"),
        ("fake", {"vocab": 3}, "vocab", ">= 256"),
        ("fake", {"vocab": 10}, "vocab", ">= 256"),  # accepted once; every worker was then refused
        ("fake", {"vocab": 255}, "vocab", ">= 256"),
        ("fake", {"vocab": 2.5}, "vocab", "integer"),
        ("fake", {"batching": "paged"}, "batching", "one of"),
        ("hf", {"decode_s": 0.1}, "decode_s", "does not take it"),
        ("hf", {"warp_speed": 9}, "warp_speed", "unknown engine option"),
        ("hf", {"static_cache": "maybe"}, "static_cache", '"auto"'),
        ("hf", {"static_share": 0.0}, "static_share", "in (0, 1]"),
        ("hf", {"static_share": 1.5}, "static_share", "in (0, 1]"),
        ("hf", {"graph_batch_sizes": "1,x"}, "graph_batch_sizes", "positive integers"),
        ("hf", {"graph_batch_sizes": [0, 2]}, "graph_batch_sizes", "positive integers"),
        ("hf-static-cb", {"graph_capture_s": -1}, "graph_capture_s", ">= 0"),
        ("hf-cb", {"graph_capture_s": 30}, "graph_capture_s", "does not take it"),
        ("hf-cb", {"num_blocks": 0}, "num_blocks", ">= 1"),
        ("hf-cb", {"poll_s": float("nan")}, "poll_s", "finite"),
        ("hf-cb", {"kv_reuse": True}, "kv_reuse", "does not take it"),
    ],
)
def test_engine_options_are_checked_at_load(engine, options, key, why) -> None:
    raw = {"workers": {"engine": engine, "options": options}}
    if engine == "fake":
        raw["model"] = {"name": "fake"}
    if engine == "hf":
        raw["scheduler"] = {"policy": "scls"}  # a static engine: the static policy
    e = _err(raw)
    assert e.key == f"workers.options.{key}" and why in str(e), str(e)


def test_good_engine_options_pass_and_reach_the_worker_as_flags() -> None:
    from worker.main import build_parser

    C.from_dict({"scheduler": {"policy": "scls"}, "workers": {"engine": "hf", "options": {
        "static_cache": "auto", "cuda_graphs": False, "static_share": 0.25, "graph_batch_sizes": "1,2,4",
        "graph_cache_tokens": [256, 512], "prefill_chunk_tokens": 0, "kv_reuse": True}}})
    C.from_dict({"workers": {"engine": "hf-cb", "options": {"num_blocks": 128, "memory_share": 0.8,
                                                            "page_size": 64}}})
    head = ["--connect", "ipc:///x", "--id", "w"]
    args = build_parser().parse_args([*head, "--num-blocks", "128", "--memory-share=0.8", "--page-size", "64"])
    assert (args.num_blocks, args.memory_share, args.page_size) == (128, 0.8, 64)
    for bad in (["--warp-speed", "9"], ["--num-blocks"], ["stray"], ["--num-blocks", "0"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args([*head, *bad])


def test_the_daemon_ends_each_of_the_last_gaps_in_one_line_and_exit_2(tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        cases = {
            "long": f'[daemon]\nsocket = "/tmp/{"s" * 120}"\n',
            "nested": "[workers.options]\nx = " + "[" * 50000 + "]" * 50000 + "\n",
            "metrics": f'[daemon]\nmetrics_http = "127.0.0.1:{taken.getsockname()[1]}"\n',
            "inf": '[model]\nname = "fake"\n[workers]\nengine = "fake"\n[workers.options]\ndecode_s = inf\n',
        }
        for name, text in cases.items():
            p = tmp_path / f"{name}.toml"
            p.write_text(text)
            r = subprocess.run([sys.executable, "-m", "sclsd.daemon", "--config", str(p)],
                               capture_output=True, text=True, timeout=60)
            assert r.returncode == 2, (name, r.stderr[-2000:])
            assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, (name, r.stderr)


# ------------------------------------------------------------------ declared constraints

#: Number keys with no declared range: each is checked against another key, in code.
CHECKED_AS_CODE = {
    "daemon.max_conn_buffer_bytes", "daemon.max_partial_frame_bytes", "daemon.max_partial_frame_bytes_per_uid",
}
#: Bounds a key declares that code refuses against another key's default (or in words).
REFUSED_IN_CODE = {
    ("daemon", "worker_socket_mode", 0o777), ("daemon", "socket_mode", 0o777),  # open to others
    ("daemon", "heartbeat_interval_s", 60),  # above heartbeat_timeout_s's default
    ("workers", "restart_backoff_s", 3600), ("workers", "restart_backoff_max_s", 0),  # against each other
}
DECLARED = [(section, name, rule) for section, cls in C._SECTIONS.items()
            for name, rule in C.declared(cls).items()]


def _as_field(section: str, name: str, number: float) -> object:
    """``number`` in the type of ``section.name`` (a list of it for a list of uids)."""
    want, _ = C._kind(C._SECTIONS[section], name)
    return [int(number)] if want is list else want(number)


def _outside(rule: C.Range | C.Choice) -> list[float | str]:
    """Values just outside a declared constraint."""
    if isinstance(rule, C.Choice):
        return ["no-such-value"]
    low = [rule.ge - 1] if rule.ge is not None else [rule.gt] if rule.gt is not None else []
    return low + ([rule.le + 1] if rule.le is not None else [])


@pytest.mark.parametrize(("section", "name", "rule"), DECLARED, ids=[f"{s}.{n}" for s, n, _ in DECLARED])
def test_a_declared_constraint_refuses_a_value_outside_it_naming_the_key(section, name, rule) -> None:
    bad_values = _outside(rule)
    assert bad_values, (section, name, rule)
    for bad in bad_values:
        value = bad if isinstance(bad, str) else _as_field(section, name, bad)
        e = _err({section: {name: value}})
        assert e.key == f"{section}.{name}" and str(e).startswith(f"config error: {section}.{name} = ")
        assert "must" in str(e) and (repr(value) in str(e) or oct(int(bad)) in str(e)), str(e)


@pytest.mark.parametrize(("section", "name", "rule"), DECLARED, ids=[f"{s}.{n}" for s, n, _ in DECLARED])
def test_a_declared_range_takes_its_own_bounds(section, name, rule) -> None:
    if isinstance(rule, C.Choice):
        return
    for bound in (rule.ge, rule.le):
        if bound is not None and (section, name, bound) not in REFUSED_IN_CODE:
            C.from_dict({section: {name: _as_field(section, name, bound)}})


def test_every_number_key_declares_its_range_or_is_checked_as_code() -> None:
    for section, cls in C._SECTIONS.items():
        if section == "grammar":
            continue  # sclsd.grammar_config bounds every key of its own
        for f in fields(cls):
            want, _ = C._kind(cls, f.name)
            key = f"{section}.{f.name}"
            if want in (int, float, list):
                assert (f.name in C.declared(cls)) != (key in CHECKED_AS_CODE), key
    for key in CHECKED_AS_CODE:
        section, name = key.split(".")
        assert _err({section: {name: _as_field(section, name, -1)}}).key == key


def test_declared_messages() -> None:
    assert str(_err({"http": {"connections": 0}})) == "config error: http.connections = 0: must be in 1..256"
    assert "must be in (0, 1]" in str(_err({"scheduler": {"lam": 0}}))
    assert "must be >= 0 (0: leave it)" in str(_err({"daemon": {"nofile_limit": -1}}))
    assert "every item must be >= 0" in str(_err({"daemon": {"admin_uids": [3, -1]}}))
    e = _err({"daemon": {"socket_mode": 0o1000}})
    assert e.value == "0o1000" and "0o777" in str(e)
    assert "must be one of debug, info, warning, error" in str(_err({"http": {"log_level": "loud"}}))
    assert C.from_dict({"scheduler": {"gamma_s": None}}).scheduler.gamma_s is None  # None passes
