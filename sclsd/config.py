"""TOML config -> validated, typed config.

Every key is documented in ``etc/sclsd.toml``. A bad value raises
:class:`ConfigError` naming the key and the value; the daemon turns that into a
non-zero exit.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """A config key has a bad value."""

    def __init__(self, key: str, value: Any, why: str) -> None:
        super().__init__(f"config error: {key} = {value!r}: {why}")
        self.key = key
        self.value = value


@dataclass(frozen=True)
class DaemonConfig:
    socket: str = "/run/sclsd/sclsd.sock"
    status_socket: str = "/run/sclsd/status.sock"
    worker_endpoint: str = "ipc:///run/sclsd/workers.ipc"
    socket_mode: int = 0o660
    socket_group: str = ""
    allowed_uids: list[int] = field(default_factory=list)
    status_allowed_uids: list[int] = field(default_factory=list)
    admin_uids: list[int] = field(default_factory=list)
    max_frame_bytes: int = 4 * 1024 * 1024
    max_conn_buffer_bytes: int = 8 * 1024 * 1024
    max_worker_msg_bytes: int = 64 * 1024 * 1024
    listen_backlog: int = 4096
    nofile_limit: int = 65536
    max_queued_requests: int = 10_000
    max_queued_tokens: int = 20_000_000
    drain_timeout_s: float = 30.0
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 10.0
    curve_keypair_file: str = ""
    curve_authorized_keys: str = ""
    metrics_http: str = ""
    log_level: str = "info"


@dataclass(frozen=True)
class ModelConfig:
    name: str = "smollm2-135m-instruct"
    max_input: int = 1024
    max_gen: int = 1024


@dataclass(frozen=True)
class SchedulerConfig:
    policy: str = "scls"
    slice_len: int = 128
    batch_size: int = 16
    gamma_s: float = 0.5
    lam: float = 0.5
    zeta: float = 0.9
    profile: str = ""
    max_failures: int = 3


@dataclass(frozen=True)
class WorkersConfig:
    spawn: int = 2
    engine: str = "hf"
    device: str = "cpu"
    threads: int = 1
    mem_budget_bytes: int = 4 * 1024**3
    restart_backoff_s: float = 1.0
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Config:
    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    workers: WorkersConfig = field(default_factory=WorkersConfig)
    source: str = "<defaults>"


_SECTIONS = {
    "daemon": DaemonConfig,
    "model": ModelConfig,
    "scheduler": SchedulerConfig,
    "workers": WorkersConfig,
}
_LOG_LEVELS = ("debug", "info", "warning", "error")
# Must match worker.engines.ENGINES (tests/unit/test_config.py checks it).
_ENGINES = ("hf", "hf-cb", "fake")


def _typed(section: str, cls: type, raw: dict[str, Any]) -> Any:
    """Build a section dataclass, checking unknown keys and value types."""
    known = {f.name: f for f in fields(cls)}
    values: dict[str, Any] = {}
    defaults = cls()
    for key, value in raw.items():
        name = f"{section}.{key}"
        if key not in known:
            raise ConfigError(name, value, f"unknown key (known: {', '.join(sorted(known))})")
        want = type(getattr(defaults, key))
        if key == "socket_mode" and isinstance(value, str):
            try:
                value = int(value, 8)
            except ValueError:
                raise ConfigError(name, value, "must be an octal mode like '0660'") from None
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if want is bool or isinstance(value, bool):
            ok = isinstance(value, want) and type(value) is type(getattr(defaults, key))
        else:
            ok = isinstance(value, want)
        if not ok:
            raise ConfigError(name, value, f"must be of type {want.__name__}")
        if want is list and not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise ConfigError(name, value, "must be a list of integers")
        values[key] = value
    return cls(**values)


def _check(cfg: Config) -> None:
    d, m, s, w = cfg.daemon, cfg.model, cfg.scheduler, cfg.workers

    def need(ok: bool, key: str, value: Any, why: str) -> None:
        if not ok:
            raise ConfigError(key, value, why)

    need(bool(d.socket), "daemon.socket", d.socket, "must be a path")
    need(bool(d.status_socket), "daemon.status_socket", d.status_socket, "must be a path")
    need(d.status_socket != d.socket, "daemon.status_socket", d.status_socket, "must differ from daemon.socket")
    need(
        d.worker_endpoint.startswith(("ipc://", "tcp://")),
        "daemon.worker_endpoint", d.worker_endpoint, "must start with ipc:// or tcp://",
    )
    need(0 <= d.socket_mode <= 0o777, "daemon.socket_mode", oct(d.socket_mode), "must be a file mode")
    need(d.max_frame_bytes >= 1024, "daemon.max_frame_bytes", d.max_frame_bytes, "must be >= 1024")
    need(d.max_conn_buffer_bytes >= d.max_frame_bytes, "daemon.max_conn_buffer_bytes",
         d.max_conn_buffer_bytes, "must be >= daemon.max_frame_bytes")
    need(d.max_worker_msg_bytes >= 65536, "daemon.max_worker_msg_bytes", d.max_worker_msg_bytes,
         "must be >= 65536")
    need(1 <= d.listen_backlog <= 65535, "daemon.listen_backlog", d.listen_backlog, "must be in 1..65535")
    need(d.nofile_limit >= 0, "daemon.nofile_limit", d.nofile_limit, "must be >= 0 (0: leave it)")
    if d.worker_endpoint.startswith("tcp://"):
        need(bool(d.curve_keypair_file), "daemon.curve_keypair_file", d.curve_keypair_file,
             "workers on tcp:// must authenticate with CURVE: give the daemon's key pair "
             "(sclsctl keygen writes it)")
    if d.curve_keypair_file:
        need(bool(d.curve_authorized_keys), "daemon.curve_authorized_keys", d.curve_authorized_keys,
             "CURVE needs the file of authorized worker public keys (sclsctl keygen writes it)")
        for key in ("curve_keypair_file", "curve_authorized_keys"):
            path = getattr(d, key)
            need(Path(path).is_file(), f"daemon.{key}", path, "file not found")
        try:
            from .keys import read_keypair

            read_keypair(d.curve_keypair_file)
        except (OSError, ValueError) as exc:
            raise ConfigError("daemon.curve_keypair_file", d.curve_keypair_file, str(exc)) from None
    if d.metrics_http:
        try:
            parse_host_port(d.metrics_http)
        except ValueError as exc:
            raise ConfigError("daemon.metrics_http", d.metrics_http, str(exc)) from None
    need(d.max_queued_requests >= 1, "daemon.max_queued_requests", d.max_queued_requests, "must be >= 1")
    need(d.max_queued_tokens >= 1, "daemon.max_queued_tokens", d.max_queued_tokens, "must be >= 1")
    need(d.drain_timeout_s >= 0, "daemon.drain_timeout_s", d.drain_timeout_s, "must be >= 0")
    need(d.heartbeat_interval_s > 0, "daemon.heartbeat_interval_s", d.heartbeat_interval_s, "must be > 0")
    need(d.heartbeat_timeout_s > d.heartbeat_interval_s, "daemon.heartbeat_timeout_s",
         d.heartbeat_timeout_s, "must be > daemon.heartbeat_interval_s")
    need(d.log_level in _LOG_LEVELS, "daemon.log_level", d.log_level, f"must be one of {_LOG_LEVELS}")
    need(bool(m.name), "model.name", m.name, "must name a model")
    need(1 <= m.max_input <= 1 << 20, "model.max_input", m.max_input, "must be in 1..1048576")
    need(1 <= m.max_gen <= 1 << 20, "model.max_gen", m.max_gen, "must be in 1..1048576")
    from .core.policy import POLICIES

    need(s.policy in POLICIES, "scheduler.policy", s.policy, f"must be one of {', '.join(POLICIES)}")
    need(s.slice_len >= 1, "scheduler.slice_len", s.slice_len, "must be >= 1")
    need(s.batch_size >= 1, "scheduler.batch_size", s.batch_size, "must be >= 1")
    need(s.gamma_s > 0, "scheduler.gamma_s", s.gamma_s, "must be > 0")
    need(0 < s.lam <= 1, "scheduler.lam", s.lam, "must be in (0, 1]")
    need(0 < s.zeta <= 1, "scheduler.zeta", s.zeta, "must be in (0, 1]")
    need(s.max_failures >= 0, "scheduler.max_failures", s.max_failures, "must be >= 0")
    need(0 <= w.spawn <= 64, "workers.spawn", w.spawn, "must be in 0..64")
    need(w.engine in _ENGINES, "workers.engine", w.engine, f"must be one of {', '.join(_ENGINES)}")
    need(w.device == "cpu" or w.device.startswith("cuda"), "workers.device", w.device, "must be cpu or cuda")
    need(w.threads >= 1, "workers.threads", w.threads, "must be >= 1")
    need(w.mem_budget_bytes >= 1, "workers.mem_budget_bytes", w.mem_budget_bytes, "must be >= 1")
    need(w.restart_backoff_s >= 0, "workers.restart_backoff_s", w.restart_backoff_s, "must be >= 0")


def parse_host_port(text: str) -> tuple[str, int]:
    """``"host:port"``, ``":port"`` or ``"port"`` -> (host, port); host defaults to 127.0.0.1,
    port 0 means any free port."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "", text
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError("must be host:port with a port in 0..65535")
    return host, int(port)


def from_dict(raw: dict[str, Any], source: str = "<dict>") -> Config:
    """Validate a parsed TOML document."""
    parts: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in _SECTIONS:
            raise ConfigError(key, "...", f"unknown section (known: {', '.join(_SECTIONS)})")
        if not isinstance(value, dict):
            raise ConfigError(key, value, "must be a table")
        parts[key] = _typed(key, _SECTIONS[key], value)
    cfg = Config(**parts, source=source)
    _check(cfg)
    return cfg


def load(path: str | Path | None) -> Config:
    """Load and validate a TOML file (defaults when ``path`` is None)."""
    if path is None:
        cfg = Config()
        _check(cfg)
        return cfg
    p = Path(path)
    try:
        raw = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError("--config", str(p), "file not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("--config", str(p), f"not valid TOML: {exc}") from None
    return from_dict(raw, source=str(p))


def override(cfg: Config, **changes: Any) -> Config:
    """Apply ``section__key=value`` overrides (from the command line) and re-validate."""
    sections: dict[str, dict[str, Any]] = {}
    for name, value in changes.items():
        if value is None:
            continue
        section, key = name.split("__", 1)
        sections.setdefault(section, {})[key] = value
    new = cfg
    for section, vals in sections.items():
        new = replace(new, **{section: replace(getattr(new, section), **vals)})
    _check(new)
    return new
