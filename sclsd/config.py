"""TOML config -> validated, typed config.

Every key is documented in ``etc/sclsd.toml``. A bad value raises
:class:`ConfigError` naming the key and the value; the daemon turns that into a
non-zero exit. A key's range or allowed values are declared on its field, as
``Annotated[int, Range(ge=1)]`` or ``Annotated[str, Choice(...)]`` (the constraints
the engine options of :mod:`sclsd.engine_options` declare too), and checked by
:func:`_check_declared`; what is no simple range (paths, sockets, groups, one key
against another, the model, the engine) is checked by the ``_check_*`` functions.
"""

from __future__ import annotations

import functools
import grp
import math
import sys
import types
import typing
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Annotated, Any

from . import defaults, grammar_config
from .engine_options import Choice, Range, check_options, dtypes

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib  # type: ignore[import-not-found]


class ConfigError(ValueError):
    """A config key has a bad value (the one exception this module raises)."""

    def __init__(self, key: str, value: Any, why: str) -> None:
        super().__init__(f"config error: {key} = {value!r}: {why}")
        self.key = key
        self.value = value


def _policies() -> tuple[str, ...]:
    from .core.policy import GRANT_POLICIES, POLICIES
    return POLICIES + GRANT_POLICIES


#: ``log_level`` values (the daemon's and ``sclsd-http``'s).
_LOG_LEVELS = ("debug", "info", "warning", "error")
#: ``scheduler.memory`` values: the KV-cache model or a profiled rule table.
MEMORY_MODELS = ("kv", "rules")
_MODE = Range(ge=0, le=0o777, note="a file mode", octal=True)
_UIDS = Range(ge=0)  # every uid
_HTTP_TIMEOUT = Range(gt=0, le=3600, note="seconds")
#: Every timeout of the daemon: an hour at most (a longer one is a mistake: a worker that
#: heartbeats but makes no progress would hold its requests that long, their clients told nothing).
_TIMEOUT = Range(gt=0, le=3600, note="seconds")


@dataclass(frozen=True)
class DaemonConfig:
    """``[daemon]``: sockets, access, limits and timeouts of the daemon process."""

    socket: str = defaults.SOCKET
    status_socket: str = defaults.STATUS_SOCKET
    worker_endpoint: str = defaults.WORKER_ENDPOINT
    socket_mode: Annotated[int, _MODE] = 0o660
    """Mode of the client and status sockets, for their owner and group only: a mode that
    opens them to every local user is refused (:attr:`socket_open_to_all_users` says it)."""
    socket_group: str = ""
    socket_open_to_all_users: bool = False
    """Let every local user open the client and status sockets (``socket_mode`` plus read and
    write for others); ``allowed_uids``, the per-uid share and the frame budgets still apply."""
    worker_socket_mode: Annotated[int, _MODE] = 0o600
    worker_secret_file: str = ""
    lock_file: str = ""
    allowed_uids: Annotated[list[int], _UIDS] = field(default_factory=list)
    status_allowed_uids: Annotated[list[int], _UIDS] = field(default_factory=list)
    admin_uids: Annotated[list[int], _UIDS] = field(default_factory=list)
    max_frame_bytes: Annotated[int, Range(ge=1024)] = defaults.MAX_FRAME_BYTES
    max_conn_buffer_bytes: int = defaults.MAX_CONN_BUFFER_BYTES
    max_worker_msg_bytes: Annotated[int, Range(ge=65536)] = defaults.MAX_WORKER_MSG_BYTES
    frame_timeout_s: Annotated[float, _TIMEOUT] = 10.0
    max_partial_frame_bytes: int = 256 * 1024**2
    """Bytes all half-sent frames on the client and status sockets may hold together."""
    max_partial_frame_bytes_per_uid: int = 64 * 1024**2
    """Bytes the half-sent frames of one peer uid may hold."""
    listen_backlog: Annotated[int, Range(ge=1, le=65535)] = 4096
    nofile_limit: Annotated[int, Range(ge=0, note="0: leave it")] = 65536
    max_queued_requests: Annotated[int, Range(ge=1)] = 10_000
    max_queued_tokens: Annotated[int, Range(ge=1)] = 20_000_000
    uid_share: Annotated[float, Range(gt=0, le=1)] = 0.5
    max_tokenizing: Annotated[int, Range(ge=1)] = 64
    drain_timeout_s: Annotated[float, Range(ge=0, le=3600, note="seconds")] = 30.0
    heartbeat_interval_s: Annotated[float, Range(gt=0, le=60, note="seconds")] = 1.0
    heartbeat_timeout_s: Annotated[float, _TIMEOUT] = 10.0
    batch_ack_timeout_s: Annotated[float, _TIMEOUT] = 5.0
    batch_stall_timeout_s: Annotated[float, _TIMEOUT] = 300.0
    """A batch whose worker shows no progress on it this long drops (and kills) the worker."""
    curve_keypair_file: str = ""
    curve_authorized_keys: str = ""
    metrics_http: str = ""
    log_level: Annotated[str, Choice(*_LOG_LEVELS)] = "info"

    @property
    def client_socket_mode(self) -> int:
        """The client and status sockets' mode (``socket_open_to_all_users``: others read, write)."""
        return self.socket_mode | (0o006 if self.socket_open_to_all_users else 0)

    @property
    def lock_path(self) -> str:
        """The client socket's lock file: ``lock_file``, else ``<socket>.lock``."""
        return self.lock_file or f"{self.socket}.lock"

    def endpoints(self) -> list[tuple[str, str]]:
        """Every path the daemon binds (the client and status sockets, an ``ipc://`` worker endpoint)
        with the lock file that keeps it: ``<path>.lock``, the client socket's :attr:`lock_path`."""
        paths = [(self.socket, self.lock_path), (self.status_socket, f"{self.status_socket}.lock")]
        if self.worker_endpoint.startswith("ipc://"):
            ipc = self.worker_endpoint.removeprefix("ipc://")
            paths.append((ipc, f"{ipc}.lock"))
        return paths


@dataclass(frozen=True)
class ModelConfig:
    """``[model]``: the model spec, how it is loaded, and the length limits."""

    name: str = "smollm2-135m-instruct"
    dtype: Annotated[str, Choice(of=dtypes)] = "auto"
    """Weights' dtype on the workers (``sclsd.models.DTYPES``; ``auto``: ``models.auto_dtype``)."""
    allow_download: bool = False
    """Download a hub id missing from the local Hugging Face cache at start (else: config error)."""
    cache_dir: str = ""
    """Cache of converted GGUF models (``sclsd.modelcache``); "": ``$XDG_CACHE_HOME/sclsd``."""
    max_input: Annotated[int, Range(ge=1, le=1 << 20)] = 1024
    max_gen: Annotated[int, Range(ge=1, le=1 << 20)] = 1024
    default_max_tokens: Annotated[int, Range(ge=1, le=1 << 20)] = 256
    """Most tokens a request that leaves ``max_tokens`` open may generate (``generate`` with
    ``max_tokens = null``: an HTTP body without ``max_tokens``); above ``max_gen`` it is
    ``max_gen``, as a request's ``max_tokens`` is."""

    def max_tokens(self, asked: int | None, min_tokens: int = 0) -> int:
        """The most tokens a request may generate: ``asked`` lowered to ``max_gen``; ``None``:
        ``default_max_tokens``, raised to the request's ``min_tokens`` (an open length never
        ends before the tokens it asks for), within ``max_gen``."""
        if asked is None:
            asked = max(self.default_max_tokens, min_tokens)
        return min(asked, self.max_gen)


@dataclass(frozen=True)
class SchedulerConfig:
    """``[scheduler]``: the policy and its parameters."""

    policy: Annotated[str, Choice(of=_policies)] = defaults.POLICY
    """``scls-cb`` (slice grants) or a static policy (``scls``: the paper's); see Config.engine."""
    slice_len: Annotated[int, Range(ge=1)] = 128
    batch_size: Annotated[int, Range(ge=1)] = 16
    gamma_s: Annotated[float | None, Range(gt=0, le=60)] = None
    """Minimal interval Γ; None: the profile's ``gamma_s``, else ``core.policy.DEFAULT_GAMMA``."""
    lam: Annotated[float, Range(gt=0, le=1)] = 0.5
    zeta: Annotated[float, Range(gt=0, le=1)] = 0.9
    profile: str = ""
    memory: Annotated[str, Choice(*MEMORY_MODELS)] = "kv"
    """OOM judgement: ``kv`` (eq. 8 with the workers' Δ and M_ava) or ``rules`` (a rule
    table, Algorithm 2: the profile's, else the paper's DeepSpeed table)."""
    max_failures: Annotated[int, Range(ge=0)] = 3
    max_worker_losses: Annotated[int, Range(ge=0, note="0: off")] = 2
    """A request on this many workers that died ends with an error (poison stops); 0: never."""
    work_conserving: bool = True
    """An idle worker gets work at once instead of waiting out the interval (docs/design.md §8)."""
    kv_reuse: bool = True
    """Batch requests by the worker keeping their KV and estimate only the uncached prefill."""
    max_slice_gap_s: Annotated[float, Range(ge=0, le=3600, note="seconds; 0: off")] = 1.0
    """Bound on the wait between two slices of a stream (0: off); see ``Policy.max_slice_gap_s``."""
    prefix_routing: bool = True
    """Slice grants: a new request goes where its prompt's prefix is likely cached (design.md §8)."""
    grant_lookahead: Annotated[float, Range(ge=0, le=1)] = 0.125
    """Slice grants: a worker whose engine runs at most ``max_rows`` rows holds at most that many
    grants plus this share of it (at least one; 0: none), so a row that ends is refilled at the
    engine's next step while the rest of the line waits in the daemon."""

    def grant_rows(self, max_rows: int) -> int:
        """The most grants a worker whose engine runs ``max_rows`` rows at once may hold (0:
        unbounded, as its engine is)."""
        if max_rows <= 0:
            return 0
        extra = 0 if self.grant_lookahead == 0 else max(1, math.ceil(self.grant_lookahead * max_rows))
        return max_rows + extra

    def effective_gamma(self, profile_gamma_s: float | None = None) -> float:
        """Γ in effect: ``gamma_s`` if set, else the profile's recommended ``gamma_s``,
        else :data:`sclsd.core.policy.DEFAULT_GAMMA`."""
        if self.gamma_s is not None:
            return self.gamma_s
        if profile_gamma_s is not None:
            return profile_gamma_s
        from .core.policy import DEFAULT_GAMMA
        return DEFAULT_GAMMA


@dataclass(frozen=True)
class WorkersConfig:
    """``[workers]``: local workers the daemon spawns and supervises."""

    spawn: Annotated[int, Range(ge=0, le=64)] = 2
    engine: Annotated[str, Choice(defaults.AUTO_ENGINE, *defaults.ENGINES)] = defaults.AUTO_ENGINE
    """An engine of ``defaults.ENGINES``, or ``auto`` (:attr:`Config.engine` is the one in effect)."""
    device: str = "cpu"
    threads: Annotated[int, Range(ge=1)] = 1
    mem_budget_bytes: Annotated[int, Range(ge=1)] = 4 * 1024**3
    restart_backoff_s: Annotated[float, Range(ge=0, le=3600, note="seconds")] = 1.0
    restart_backoff_max_s: Annotated[float, Range(ge=0, le=3600, note="seconds")] = 30.0
    max_quick_failures: Annotated[int, Range(ge=1)] = 5
    quick_failure_s: Annotated[float, Range(ge=0, le=3600, note="seconds")] = 10.0
    daemon_timeout_s: Annotated[float, Range(ge=0, le=3600, note="seconds; 0: off")] = 30.0
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class HttpConfig:
    """``[http]``: the OpenAI-compatible front end, ``sclsd-http`` (read by it, not the daemon)."""

    listen: str = "127.0.0.1:8000"
    api_key_file: str = ""
    model_name: str = ""
    connections: Annotated[int, Range(ge=1, le=256)] = 4
    max_choices: Annotated[int, Range(ge=1, le=1024)] = 64
    log_level: Annotated[str, Choice(*_LOG_LEVELS)] = "info"
    access_log: bool = True
    max_body_bytes: Annotated[int, Range(ge=1024, le=1024**3)] = 4 * 1024 * 1024
    body_timeout_s: Annotated[float, _HTTP_TIMEOUT] = 30.0
    max_header_bytes: Annotated[int, Range(ge=1024, le=16 * 1024**2)] = 32 * 1024
    header_timeout_s: Annotated[float, _HTTP_TIMEOUT] = 10.0
    keep_alive_s: Annotated[float, _HTTP_TIMEOUT] = 5.0
    max_connections: Annotated[int, Range(ge=1, le=1_000_000)] = 2048
    max_requests_per_client: Annotated[int, Range(ge=0, le=1_000_000, note="0: no bound")] = 1024


@dataclass(frozen=True)
class Config:
    """The whole validated config; ``source`` is the file it came from."""

    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    workers: WorkersConfig = field(default_factory=WorkersConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    grammar: grammar_config.GrammarConfig = field(default_factory=grammar_config.GrammarConfig)
    source: str = "<defaults>"

    @property
    def engine(self) -> str:
        """The engine in effect: ``workers.engine``, or for ``auto`` the policy's (read this)."""
        from .core.policy import GRANT_POLICIES
        if self.workers.engine != defaults.AUTO_ENGINE:
            return self.workers.engine
        return defaults.auto_engine(self.scheduler.policy in GRANT_POLICIES, self.model.name, self.workers.device)


_SECTIONS: dict[str, type] = {"daemon": DaemonConfig, "model": ModelConfig, "scheduler": SchedulerConfig,
                               "workers": WorkersConfig, "http": HttpConfig, "grammar": grammar_config.GrammarConfig}
#: Keys given as file modes: an octal string ("0660") or an integer.
_MODE_KEYS = ("socket_mode", "worker_socket_mode")


def _kind(cls: type, name: str) -> tuple[type, bool]:
    """(base type, None allowed) of a section field, from its annotation."""
    hint = typing.get_type_hints(cls)[name]
    optional = False
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional, hint = True, args[0]
    return typing.get_origin(hint) or hint, optional


def _typed(section: str, cls: type, raw: dict[str, Any]) -> dict[str, Any]:
    """Check a section's keys and value types; return the values, coerced (int -> float,
    octal mode strings -> int)."""
    known = {f.name for f in fields(cls)}
    values: dict[str, Any] = {}
    for key, value in raw.items():
        name = f"{section}.{key}"
        if key not in known:
            raise ConfigError(name, value, f"unknown key (known: {', '.join(sorted(known))})")
        want, optional = _kind(cls, key)
        if value is None and optional:
            values[key] = None
            continue
        if key in _MODE_KEYS and isinstance(value, str):
            try:
                value = int(value, 8)
            except ValueError:
                raise ConfigError(name, value, "must be an octal mode like '0660'") from None
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        # bool is an int subclass: neither may stand in for the other.
        ok = isinstance(value, want) and (isinstance(value, bool) == (want is bool))
        if not ok:
            raise ConfigError(name, value, f"must be of type {want.__name__}")
        if want is float and not math.isfinite(value):
            raise ConfigError(name, value, "must be a finite number")
        if want is list and not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise ConfigError(name, value, "must be a list of integers")
        values[key] = value
    return values


def _need(ok: bool, key: str, value: Any, why: str) -> None:
    if not ok:
        raise ConfigError(key, value, why)


def _path_check(key: str, value: Any, check: Any) -> bool:
    """``check()`` on a path, an ``OSError`` (no permission to look) reported as the key's error."""
    try:
        return bool(check())
    except OSError as exc:
        raise ConfigError(key, value, f"cannot check the path: {exc}") from None


def _check_finite(cfg: Config) -> None:
    """Every float in every section is finite (TOML allows inf and nan)."""
    for section in _SECTIONS:
        part = getattr(cfg, section)
        for f in fields(part):
            value = getattr(part, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{section}.{f.name}", value, "must be a finite number")


@functools.cache
def declared(cls: type) -> dict[str, Range | Choice]:
    """The constraint declared on each field of a section class that has one."""
    hints = typing.get_type_hints(cls, include_extras=True)
    return {f.name: rule for f in fields(cls)
            for rule in getattr(hints[f.name], "__metadata__", ()) if isinstance(rule, (Range, Choice))}


def _check_declared(cfg: Config) -> None:
    """Every field's declared :class:`Range` or :class:`Choice` (None, where allowed, passes)."""
    for section, cls in _SECTIONS.items():
        part = getattr(cfg, section)
        for name, rule in declared(cls).items():
            value = getattr(part, name)
            why = None if value is None else rule.why(value)
            if why is not None:
                shown = oct(value) if isinstance(rule, Range) and rule.octal else value
                raise ConfigError(f"{section}.{name}", shown, why)


#: Longest path of a Unix socket (``sun_path`` holds 108 bytes with the final NUL); ZeroMQ's
#: ipc:// endpoints are Unix sockets too.
MAX_SOCKET_PATH = 107


def _socket_path(key: str, path: str) -> None:
    size = len(path.encode())
    _need(size <= MAX_SOCKET_PATH, key, path,
          f"a Unix socket path holds at most {MAX_SOCKET_PATH} bytes; this one has {size}")


def _check_daemon(d: DaemonConfig) -> None:
    need = _need
    need(bool(d.socket), "daemon.socket", d.socket, "must be a path")
    need(bool(d.status_socket), "daemon.status_socket", d.status_socket, "must be a path")
    _socket_path("daemon.socket", d.socket)
    _socket_path("daemon.status_socket", d.status_socket)
    if d.worker_endpoint.startswith("ipc://"):
        _socket_path("daemon.worker_endpoint", d.worker_endpoint.removeprefix("ipc://"))
    need(d.status_socket != d.socket, "daemon.status_socket", d.status_socket, "must differ from daemon.socket")
    need(d.worker_endpoint.startswith(("ipc://", "tcp://")), "daemon.worker_endpoint", d.worker_endpoint,
         "must start with ipc:// or tcp://")
    need(not d.socket_mode & 0o007, "daemon.socket_mode", oct(d.socket_mode),
         "must not open the sockets to other users by a mode number: set "
         "daemon.socket_open_to_all_users = true to let every local user connect")
    need(not d.worker_socket_mode & 0o007, "daemon.worker_socket_mode", oct(d.worker_socket_mode),
         "must not open the worker endpoint to other users (it takes registrations): 0600 or 0660")
    if d.socket_group:
        try:
            grp.getgrnam(d.socket_group)
        except KeyError:
            raise ConfigError("daemon.socket_group", d.socket_group, "no such group") from None
    if d.worker_secret_file:
        p = Path(d.worker_secret_file)
        key = "daemon.worker_secret_file"
        need(_path_check(key, p, p.parent.is_dir), key, d.worker_secret_file, "its directory does not exist")
        need(_path_check(key, p, lambda: not p.exists() or p.is_file()), key, d.worker_secret_file,
             "must be a regular file")
    bound = [path for path, _ in d.endpoints()]
    need(len(set(bound)) == len(bound), "daemon.worker_endpoint", d.worker_endpoint,
         "must differ from daemon.socket and daemon.status_socket")
    need(all(lock not in bound for _, lock in d.endpoints()), "daemon.lock_file", d.lock_file,
         "must differ from the socket paths")
    need(d.max_conn_buffer_bytes >= d.max_frame_bytes, "daemon.max_conn_buffer_bytes",
         d.max_conn_buffer_bytes, "must be >= daemon.max_frame_bytes")
    # A uid must be able to send one frame of the largest size, in pieces.
    need(d.max_partial_frame_bytes_per_uid >= d.max_frame_bytes, "daemon.max_partial_frame_bytes_per_uid",
         d.max_partial_frame_bytes_per_uid, "must be >= daemon.max_frame_bytes")
    need(d.max_partial_frame_bytes >= d.max_partial_frame_bytes_per_uid, "daemon.max_partial_frame_bytes",
         d.max_partial_frame_bytes, "must be >= daemon.max_partial_frame_bytes_per_uid")
    if d.worker_endpoint.startswith("tcp://"):
        need(bool(d.curve_keypair_file), "daemon.curve_keypair_file", d.curve_keypair_file,
             "workers on tcp:// must authenticate with CURVE: give the daemon's key pair "
             "(sclsctl keygen writes it)")
    if d.curve_keypair_file:
        need(bool(d.curve_authorized_keys), "daemon.curve_authorized_keys", d.curve_authorized_keys,
             "CURVE needs the file of authorized worker public keys (sclsctl keygen writes it)")
        for key in ("curve_keypair_file", "curve_authorized_keys"):
            path = getattr(d, key)
            need(_path_check(f"daemon.{key}", path, Path(path).is_file), f"daemon.{key}", path,
                 "file not found")
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
    need(d.heartbeat_timeout_s > d.heartbeat_interval_s, "daemon.heartbeat_timeout_s",
         d.heartbeat_timeout_s, "must be > daemon.heartbeat_interval_s")
    need(d.batch_stall_timeout_s > d.heartbeat_interval_s, "daemon.batch_stall_timeout_s",
         d.batch_stall_timeout_s, "must be > daemon.heartbeat_interval_s")


def _is_model_path(name: str) -> bool:
    """Whether a model spec names a file or directory (see :func:`sclsd.models.resolve`);
    ``random:llama2-7b`` and the other shipped architectures do not, nor does a hub id
    (``ORG/NAME``) that is no local path."""
    from .hub import is_hub_id
    from .models import RANDOM_CONFIGS

    if name.startswith("random:") and name[len("random:") :].strip().lower() in RANDOM_CONFIGS:
        return False
    if is_hub_id(name) and not _path_check("model.name", name, Path(name).exists):
        return False
    return "/" in name or name.endswith(".gguf") or name.startswith("random:")


def _check_model(m: ModelConfig) -> None:
    _need(bool(m.name), "model.name", m.name, "must name a model")
    if _is_model_path(m.name):
        from .models import resolve

        path = Path(m.name.removeprefix("random:")).expanduser()
        _need(_path_check("model.name", m.name, path.exists), "model.name", m.name,
              f"no such file or directory: {path}")
        try:
            resolve(m.name)
        except (ValueError, OSError) as exc:
            raise ConfigError("model.name", m.name, str(exc)) from None


def _check_scheduler(s: SchedulerConfig) -> None:
    if s.profile:
        from .core.profiles import load_profile

        try:
            load_profile(s.profile)
        except (OSError, ValueError) as exc:
            raise ConfigError("scheduler.profile", s.profile, str(exc)) from None


def _check_workers(w: WorkersConfig, cfg: Config) -> None:
    from .core.policy import GRANT_POLICIES

    need = _need
    # Every check below is of the engine in effect; "auto" picks one that passes them all.
    engine = cfg.engine
    # The fake engine's tokens only make sense to the fake model's byte tokenizer, and
    # the fake model has no weights any other engine could load.
    need(engine != "fake" or cfg.model.name == "fake", "workers.engine", w.engine,
         f"the fake engine serves only model.name = 'fake' (model.name is {cfg.model.name!r})")
    need(engine == "fake" or cfg.model.name != "fake" or w.spawn == 0, "workers.engine", w.engine,
         "model.name = 'fake' needs engine 'fake' (or 'auto')")
    need(cfg.scheduler.policy not in GRANT_POLICIES or engine in defaults.GRANT_ENGINES,
         "workers.engine", w.engine,
         f"scheduler.policy = {cfg.scheduler.policy!r} hands out slice grants to continuous-batching "
         f"workers, which engine {engine!r} is not: use engine 'hf-cb' or 'hf-static-cb' (or {defaults.AUTO_ENGINE!r}, "
         f"which picks it), or a static policy such as 'scls' for engine {engine!r}")
    need(w.device == "cpu" or w.device.startswith("cuda"), "workers.device", w.device, "must be cpu or cuda")
    need(engine != "llama" or (w.device == "cpu" and cfg.model.dtype == "auto"), "workers.engine", w.engine, f"the llama engine runs on the CPU, the GGUF's weights as they are (workers.device = {w.device!r}, model.dtype = {cfg.model.dtype!r}): use hf-cb or hf on a GPU; leave model.dtype auto")
    # [workers.options] dtype predates [model] dtype; both set and different is ambiguous.
    old_dtype = w.options.get("dtype")
    need(old_dtype is None or cfg.model.dtype in ("auto", old_dtype), "workers.options.dtype", old_dtype,
         f"conflicts with model.dtype = {cfg.model.dtype!r}: set model.dtype only")
    bad = check_options(engine, w.options, spawned=w.spawn > 0)
    if bad is not None:
        raise ConfigError(f"workers.options.{bad[0]}", bad[1], bad[2])
    _check_kernel_inject(w)
    need(w.restart_backoff_max_s >= w.restart_backoff_s, "workers.restart_backoff_max_s",
         w.restart_backoff_max_s, "must be >= workers.restart_backoff_s")
    hb = cfg.daemon.heartbeat_interval_s
    # The daemon speaks to each worker once per heartbeat interval: a shorter silence
    # timeout would make idle workers register again and again.
    need(w.daemon_timeout_s == 0 or w.daemon_timeout_s > hb, "workers.daemon_timeout_s",
         w.daemon_timeout_s, f"must be 0 (off) or > daemon.heartbeat_interval_s ({hb})")


def _check_kernel_inject(w: WorkersConfig) -> None:
    """``workers.options.kernel_inject`` (its type and engine checked with the other options)
    is refused when true (CPU: DeepSpeed's kernels are CUDA-only; CUDA: see
    worker/engines/deepspeed.py)."""
    key, value = "workers.options.kernel_inject", w.options.get("kernel_inject", False)
    _need(not value or w.device.startswith("cuda"), key, value,
          "DeepSpeed kernel injection needs CUDA (workers.device is cpu)")
    _need(not value, key, value,
          "not supported: DeepSpeed's injected Llama layers keep their own KV cache and rotary "
          "positions, which the slice loop's per-row cache and left padding cannot use "
          "(docs/operations.md, Engines)")


def _check(cfg: Config) -> None:
    _check_finite(cfg)
    _check_declared(cfg)
    try:
        parse_host_port(cfg.http.listen)
    except ValueError as exc:
        raise ConfigError("http.listen", cfg.http.listen, str(exc)) from None
    _check_daemon(cfg.daemon)
    _check_model(cfg.model)
    _check_scheduler(cfg.scheduler)
    _check_workers(cfg.workers, cfg)
    grammar_config.check(cfg.grammar, _need)


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
        parts[key] = _SECTIONS[key](**_typed(key, _SECTIONS[key], value))
    cfg = Config(**parts, source=source)
    _check(cfg)
    return cfg


def load(path: str | Path | None, **changes: Any) -> Config:
    """Load a TOML file (defaults when ``path`` is None), apply ``section__key=value`` changes
    (the command line's; None: not given) and validate the result once, so that a change can
    mend what the file alone would fail (``--policy scls`` over ``engine = "hf"``)."""
    p = Path(path or ".")
    try:
        raw = tomllib.loads(p.read_text()) if path is not None else {}
    except FileNotFoundError:
        raise ConfigError("--config", str(p), "file not found") from None
    except OSError as exc:
        raise ConfigError("--config", str(p), f"cannot read it: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError("--config", str(p), "not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("--config", str(p), f"not valid TOML: {exc}") from None
    except RecursionError:
        # tomllib parses nested arrays and tables recursively; no key of ours nests at all.
        raise ConfigError("--config", str(p), "a value is nested too deeply to parse") from None
    for name, value in changes.items():
        section, _, key = name.partition("__")
        if value is not None and isinstance(part := raw.setdefault(section, {}), dict):
            part[key] = value  # from_dict names an unknown section or key
    return from_dict(raw, source=str(p) if path is not None else Config.source)


def override(cfg: Config, **changes: Any) -> Config:
    """Apply ``section__key=value`` overrides (from the command line) and re-validate.

    ``None`` values are skipped (an option not given).
    """
    sections: dict[str, dict[str, Any]] = {}
    for name, value in changes.items():
        if value is None:
            continue
        section, sep, key = name.partition("__")
        if not sep or section not in _SECTIONS:
            raise ConfigError(name.replace("__", "."), value, "unknown config key")
        sections.setdefault(section, {})[key] = value
    new = cfg
    for section, vals in sections.items():
        typed = _typed(section, _SECTIONS[section], vals)
        new = replace(new, **{section: replace(getattr(new, section), **typed)})
    _check(new)
    return new
