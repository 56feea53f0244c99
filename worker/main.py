"""``sclsd-worker``: one engine behind a ZeroMQ DEALER, connected to the daemon.

::

    sclsd-worker --connect ENDPOINT --id ID [--engine auto|llama|hf-cb|hf-static-cb|hf|deepspeed|fake] [--model SPEC]
                 [--device cpu] [--threads N] [--mem-budget BYTES] [--heartbeat S]
                 [--dtype auto|float32|bfloat16|float16] [--cache-dir DIR] [--progress-file FILE]
                 [--ENGINE-OPTION VALUE ...] [--opt KEY=VALUE ...] [--profile FILE] [--log-level info]
                 [--secret-file FILE] [--daemon-timeout S] [--parent-pid PID]
                 [--curve-server-key KEY | --curve-server-key-file FILE] [--curve-keypair FILE]
    sclsd-worker profile ...      (see worker.profile)

Each engine option of :data:`sclsd.engine_options.OPTIONS` is a flag (``decode_s`` is
``--decode-s``, ``--graph-batch-sizes 1,2,4``, ``--static-cache auto``, ``--kv-reuse=false``),
made from its declaration and typed by :func:`sclsd.engine_options.parse_option`, as is
``--opt KEY=VALUE``; a bad value stops the worker at its command line.

Start-up order: tie the process's life to ``--parent-pid`` (the daemon that
spawned it), read the worker secret, load the engine (model), then register;
see :mod:`worker.runtime` for the threads and the protocol. SIGTERM and SIGINT
finish the running batch, hand queued ones back and exit 0.

Loading logs each step (reading and dequantising a GGUF, loading from the cache,
ready) with the worker's id; ``--progress-file`` also keeps the latest step in a
file, which the daemon that spawned the worker shows in its status until the
worker registers.

Authentication: the daemon accepts a worker that proves it holds the daemon's
worker secret (``--secret-file``, or ``$SCLSD_WORKER_SECRET_FILE``; hex text in
a file only its owner may read) or that connects with CURVE keys the daemon
trusts. A worker with neither still starts, and the daemon refuses it.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.abc
import json
import logging
import os
import signal
import stat
import string
import sys
import time
from pathlib import Path
from typing import Any

from sclsd.engine_options import OPTIONS, Choice, parse_option

log = logging.getLogger("worker")

#: Environment fallback for ``--secret-file``.
SECRET_FILE_ENV = "SCLSD_WORKER_SECRET_FILE"
#: Longest secret ``Register.auth`` carries.
MAX_SECRET_CHARS = 256
#: ``prctl`` option from <linux/prctl.h>: signal to receive when the parent dies.
PR_SET_PDEATHSIG = 1


class SecretError(ValueError):
    """The worker secret file cannot be used; the message says why."""


def read_secret(path: Path) -> str:
    """The worker secret in ``path``: hex text, stripped.

    Refused when the file is missing, not a regular file, empty, not hex, or open to
    group or others (any of ``mode & 0o077``): a secret others can read proves nothing.
    The mode is checked on the opened file, so it cannot change between check and read.
    """
    try:
        # O_NONBLOCK: a FIFO put in the secret's place must not hang the start-up.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise SecretError(f"secret file {path} does not exist") from None
    except OSError as exc:
        raise SecretError(f"cannot open secret file {path}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise SecretError(f"secret file {path} is not a regular file")
        if info.st_mode & 0o077:
            raise SecretError(
                f"secret file {path} has mode {stat.S_IMODE(info.st_mode):04o}: it must be "
                "private to its owner (chmod 600)"
            )
        raw = os.read(fd, MAX_SECRET_CHARS + 64)
    finally:
        os.close(fd)
    text = raw.decode("ascii", errors="replace").strip()
    if not text:
        raise SecretError(f"secret file {path} is empty")
    if len(text) > MAX_SECRET_CHARS or not all(c in string.hexdigits for c in text):
        raise SecretError(
            f"secret file {path} must hold one hex string of at most {MAX_SECRET_CHARS} characters"
        )
    return text


def die_with_parent(parent_pid: int) -> bool:
    """Have the kernel SIGKILL this process when its parent dies; False if it already has.

    Linux only (``prctl(PR_SET_PDEATHSIG)``); elsewhere the daemon's silence
    (``--daemon-timeout``) is what ends the worker's wait. The signal follows the
    parent *thread*: the daemon must spawn workers from a thread that lives as long as
    it does. ``getppid`` is checked after ``prctl`` so that a parent dying in between
    is caught one way or the other.
    """
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            ulong = ctypes.c_ulong
            rc = libc.prctl(
                ctypes.c_int(PR_SET_PDEATHSIG), ulong(signal.SIGKILL), ulong(0), ulong(0), ulong(0)
            )
        except (OSError, AttributeError) as exc:
            log.warning("--parent-pid: prctl unavailable (%s); relying on --daemon-timeout", exc)
        else:
            if rc != 0:
                log.warning(
                    "--parent-pid: prctl(PR_SET_PDEATHSIG) failed (%s); relying on "
                    "--daemon-timeout",
                    os.strerror(ctypes.get_errno()),
                )
    else:
        log.warning(
            "--parent-pid is not supported on %s; relying on --daemon-timeout", sys.platform
        )
    return os.getppid() == parent_pid


def secret_path(args: argparse.Namespace) -> Path | None:
    """``--secret-file``, else ``$SCLSD_WORKER_SECRET_FILE`` when set and not empty."""
    if args.secret_file is not None:
        return args.secret_file
    env = os.environ.get(SECRET_FILE_ENV, "").strip()
    return Path(env) if env else None


def parse_value(text: str) -> Any:
    """Type a value without knowing its option: int, float, true/false, none, else the string
    itself (for :mod:`sclsd.bench.gpu_stages`' lists of options; this command line types
    each engine option by its declaration, :func:`option_value`)."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def option_value(key: str, text: str) -> Any:
    """Engine option ``key``'s value typed by its declaration (:func:`parse_option`); a bad
    one is the command line's error, with the key and why."""
    try:
        return parse_option(key, text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def option_type(key: str) -> Any:
    """The argparse ``type`` of engine option ``key``'s flag."""

    def typed(text: str) -> Any:
        return option_value(key, text)

    typed.__name__ = key
    return typed


def parse_opt(text: str) -> tuple[str, Any]:
    """``--opt KEY=VALUE``: any engine option (``-`` or ``_`` in its key), typed as its flag is."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    key = key.strip().replace("-", "_")
    return key, option_value(key, value)


#: Engine options with a flag of their own in :func:`build_parser`, not made from
#: :data:`OPTIONS`: ``--dtype`` takes ``auto``, resolved where the device is known.
OWN_FLAGS = ("dtype",)

#: What each kind of engine option's flag takes, for its help.
KIND_METAVAR = {"bool": "true|false", "switch": "true|false|auto", "int": "N", "float": "X",
                "sizes": "N,N,..."}


def add_engine_options(p: argparse.ArgumentParser) -> None:
    """One flag per engine option of :data:`OPTIONS` (but :data:`OWN_FLAGS`): ``--key-name``,
    its value typed by :func:`parse_option`, its help the declaration's."""
    group = p.add_argument_group("engine options", "sclsd.engine_options.OPTIONS; [workers.options] in the config")
    for key, opt in OPTIONS.items():
        if key in OWN_FLAGS:
            continue
        choice = opt.rule if isinstance(opt.rule, Choice) and opt.rule.of is None else None
        metavar = "|".join(choice.values) if choice is not None else KIND_METAVAR.get(opt.kind, "VALUE")
        group.add_argument(f"--{key.replace('_', '-')}", dest=key, type=option_type(key), default=None,
                           metavar=metavar, help=f"{', '.join(opt.engines)}: {opt.help}".replace("%", "%%"))


def non_negative(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sclsd-worker",
        description="Serve batches from an sclsd daemon with one engine "
        "(or `sclsd-worker profile ...` to measure an engine).",
    )
    p.add_argument(
        "--connect", required=True, help="daemon worker endpoint (ipc://... or tcp://...)"
    )
    p.add_argument(
        "--id", required=True, dest="worker_id", help="worker id (sent in every message)"
    )
    # A continuous engine by default: it joins a daemon of the default policy (scls-cb, slice
    # grants need continuous batching) and serves the static policies' batches too.
    p.add_argument("--engine", default="auto",
                   help="engine name: auto (default: llama for a GGUF model on the CPU, hf-static-cb on "
                        "CUDA, else hf-cb; any policy), llama, hf-cb, hf-static-cb (slice grants on hf's "
                        "static arena), hf or deepspeed (static policies), fake")
    p.add_argument("--engine-fallback", default=None,
                   help="the engine to load instead where --engine cannot serve the model (its layers, "
                        "its attention); the daemon passes it where workers.engine = auto chose for it")
    p.add_argument("--model", default=None, help="model spec (default: the engine's default)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (torch's; llama.cpp's for llama)")
    p.add_argument(
        "--mem-budget", type=int, default=None, help="KV memory budget in bytes (CPU engines)"
    )
    p.add_argument("--heartbeat", type=float, default=1.0, help="seconds between heartbeats")
    p.add_argument(
        "--dtype",
        default=None,
        help="model dtype (hf, hf-cb, deepspeed): auto, float32, bfloat16, float16; auto is "
        "float32 on the CPU and the model's own half precision (else bfloat16) on CUDA "
        "(default: float32)",
    )
    p.add_argument(
        "--cache-dir",
        default=None,
        help="where converted GGUF models are cached (default: $SCLSD_CACHE_DIR, else "
        "$XDG_CACHE_HOME/sclsd or ~/.cache/sclsd)",
    )
    p.add_argument(
        "--progress-file",
        type=Path,
        default=None,
        help="keep the latest loading step in this file (for the daemon's status)",
    )
    add_engine_options(p)
    p.add_argument(
        "--opt",
        action="append",
        type=parse_opt,
        default=[],
        metavar="KEY=VALUE",
        help="an engine option as KEY=VALUE (repeatable; over its flag)",
    )
    p.add_argument("--profile", type=Path, default=None, help="estimator profile JSON to report")
    p.add_argument(
        "--register-retry", type=float, default=3.0, help="seconds before re-registering"
    )
    p.add_argument(
        "--shutdown-timeout", type=float, default=30.0, help="seconds to finish a batch on exit"
    )
    p.add_argument(
        "--secret-file",
        type=Path,
        default=None,
        help=f"file with the daemon's worker secret (hex; mode 0600); default ${SECRET_FILE_ENV}",
    )
    p.add_argument(
        "--daemon-timeout",
        type=non_negative,
        default=30.0,
        help="seconds without a message from the daemon before reconnecting and "
        "registering again (0: never)",
    )
    p.add_argument(
        "--parent-pid",
        type=positive_int,
        default=None,
        help="exit when this process (the spawning daemon) dies; Linux only",
    )
    p.add_argument("--curve-server-key", default=None, help="daemon's public CURVE key (Z85)")
    p.add_argument(
        "--curve-server-key-file",
        type=Path,
        default=None,
        help="file holding the daemon's public CURVE key (daemon.public of sclsctl keygen)",
    )
    p.add_argument(
        "--curve-keypair",
        type=Path,
        default=None,
        help="file with this worker's CURVE public and secret keys (Z85), one a line",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


#: hf-cb on a CPU, unless ``max_batch_tokens`` is given: the most tokens one step computes
#: (transformers' default is 8192). A newcomer's prefill is then split over steps beside the
#: running rows' decodes instead of stalling every stream on the worker for all of it at
#: once: on the default model a step stays under about 0.5 s and no stream waits a second
#: for its next token, at the same throughput (docs/benchmarks.md, "Streams that do not stall").
CPU_CB_MAX_BATCH_TOKENS = 128


def resolve_engine(args: argparse.Namespace) -> str:
    """``--engine``, with ``auto`` resolved as the daemon resolves ``workers.engine = "auto"``
    under its default policy: llama for a GGUF model on the CPU, else hf-static-cb with hf-cb
    as its fallback (:func:`sclsd.defaults.auto_engine`)."""
    if args.engine == "auto":
        from sclsd import defaults, models

        spec = args.model or models.DEFAULT_MODEL
        args.engine = defaults.auto_engine(True, spec, args.device)
        if args.engine_fallback is None:
            args.engine_fallback = defaults.AUTO_FALLBACK.get(args.engine)
    return str(args.engine)


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """Constructor options for the engine: ``--threads`` and ``--mem-budget``, the engine
    options of :data:`OPTIONS` given as flags (``--dtype`` among them), then ``--opt``s, then
    :data:`CPU_CB_MAX_BATCH_TOKENS` for hf-cb on a CPU where neither set it."""
    resolve_engine(args)
    opts: dict[str, Any] = {}
    for name in ("threads", "mem_budget", *OPTIONS):
        value = getattr(args, name)
        if value is not None:
            opts[name] = value
    opts.update(dict(args.opt))
    if args.engine == "hf-cb" and str(args.device).startswith("cpu"):
        opts.setdefault("max_batch_tokens", CPU_CB_MAX_BATCH_TOKENS)
    return opts


class ProgressFile(logging.Handler):
    """Keeps the latest loading step logged at info level in a file, replaced atomically
    so that a reader never sees half a line."""

    def __init__(self, path: Path) -> None:
        super().__init__(logging.INFO)
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            tmp.write_text(record.getMessage()[:200] + "\n")
            os.replace(tmp, self.path)
        except OSError:
            pass  # progress is a courtesy: never fail a load over it


def report_progress(path: Path | None) -> ProgressFile | None:
    """Send the loading steps (this module's and ``sclsd.models``') to ``path`` too."""
    if path is None:
        return None
    handler = ProgressFile(path)
    for name in ("worker", "sclsd.models"):
        logging.getLogger(name).addHandler(handler)
    return handler


def stop_progress(handler: ProgressFile | None) -> None:
    if handler is not None:
        for name in ("worker", "sclsd.models"):
            logging.getLogger(name).removeHandler(handler)


def setup_logging(worker_id: str, level: str) -> None:
    logging.basicConfig(
        stream=sys.stderr,
        level=getattr(logging, level.upper()),
        format=f"%(asctime)s sclsd-worker[{worker_id}] %(levelname)s %(name)s: %(message)s",
        force=True,
    )


def load_engine(args: argparse.Namespace) -> Any:
    """The engine the command line asks for, its model loaded (``--dtype auto`` resolved
    here, where the device is known; ``--cache-dir`` applied to this process)."""
    if args.cache_dir:
        from sclsd.modelcache import CACHE_ENV

        os.environ[CACHE_ENV] = args.cache_dir
    if resolve_engine(args) != "llama" and args.dtype == "auto":
        from sclsd import models

        args.dtype = models.auto_dtype(args.model or models.DEFAULT_MODEL, args.device)
    log.info("loading engine %s: model %s on %s%s", args.engine, args.model or "(default)",
             args.device, f" in {args.dtype}" if args.dtype else "")
    from worker.engines import create_engine, engine_class
    from worker.engines.base import ModelUnsupported

    t0 = time.perf_counter()
    with ImportSteps(HEAVY_LIBRARIES):
        engine_class(args.engine)
    log.info("engine %s's code imported in %.1f s", args.engine, time.perf_counter() - t0)
    try:
        return create_engine(args.engine, args.model, args.device, **engine_options(args))
    except ModelUnsupported as exc:
        if not args.engine_fallback or args.engine_fallback == args.engine:
            raise
        log.warning("%s; loading engine %s instead", exc, args.engine_fallback)
        args.engine = args.engine_fallback
        opts = {k: v for k, v in engine_options(args).items() if k not in OPTIONS or args.engine in OPTIONS[k].engines}
        return create_engine(args.engine, args.model, args.device, **opts)


#: Libraries whose first import is a step of its own in a worker's start (seconds each on
#: an idle CPU, a minute on a busy one): logged, so the wait has a name.
HEAVY_LIBRARIES = ("torch", "transformers", "accelerate", "gguf", "deepspeed", "llama_cpp",
                   "llguidance", "scipy")


class ImportSteps(importlib.abc.MetaPathFinder):
    """While in effect, logs the first import of each of ``names`` as it begins (a finder
    that finds nothing: the usual finders still import the module)."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.pending = {n for n in names if n not in sys.modules}
        self.t0 = time.perf_counter()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        if fullname in self.pending:
            self.pending.discard(fullname)
            log.info("importing %s (%.1f s into the engine's code)", fullname,
                     time.perf_counter() - self.t0)
        return None

    def __enter__(self) -> ImportSteps:
        sys.meta_path.insert(0, self)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.meta_path.remove(self)


def main(argv: list[str] | None = None) -> int:
    """Console entry point of ``sclsd-worker``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "profile":
        from worker import profile  # lazy: only the profiler needs it

        return profile.main(argv[1:])
    # Before torch/transformers import tqdm (it reads TQDM_* at import): no progress
    # bars (GGUF dequantisation) in worker logs.
    os.environ.setdefault("TQDM_DISABLE", "1")
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(args.worker_id, args.log_level)
    # First of all: a worker whose daemon is gone must not load a model for nobody.
    if args.parent_pid is not None and not die_with_parent(args.parent_pid):
        log.error("parent process %d is gone: exiting", args.parent_pid)
        return 1

    # Until the runtime exists a signal only records the wish to stop: model loading
    # is not interruptible, and we exit 0 as soon as it is done.
    stop: dict[str, Any] = {"reason": None, "runtime": None}

    def on_signal(signum: int, _frame: Any) -> None:
        name = signal.Signals(signum).name
        again = stop["reason"] is not None
        stop["reason"] = name
        if stop["runtime"] is not None:
            if again:
                log.warning("second %s: abandoning the running batch", name)
            stop["runtime"].request_stop(name, abandon=again)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    profile_data = json.loads(args.profile.read_text()) if args.profile else None
    server_key = args.curve_server_key.encode() if args.curve_server_key else None
    if args.curve_server_key_file:
        parts = args.curve_server_key_file.read_text().split()
        if not parts:
            log.error("%s: no key", args.curve_server_key_file)
            return 2
        server_key = parts[0].encode()
    keypair = None
    if args.curve_keypair:
        lines = args.curve_keypair.read_text().split()
        if len(lines) != 2:
            log.error("%s: expected a public and a secret key", args.curve_keypair)
            return 2
        keypair = (lines[0].encode(), lines[1].encode())
    auth = ""
    path = secret_path(args)
    if path is not None:
        try:
            auth = read_secret(path)
        except SecretError as exc:
            log.error("%s", exc)
            return 2
    elif server_key is None:
        log.warning(
            "no worker secret (--secret-file, $%s) and no CURVE key: the daemon will refuse "
            "this worker",
            SECRET_FILE_ENV,
        )

    progress = report_progress(args.progress_file)
    t0 = time.perf_counter()
    try:
        engine = load_engine(args)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        log.error("cannot start engine %s: %s", args.engine, exc)
        return 2
    if stop["reason"] is None:
        engine.warm_up(lambda step: log.info("%s", step))
    log.info("engine %s ready in %.1fs: registering with the daemon", args.engine,
             time.perf_counter() - t0)
    stop_progress(progress)
    if stop["reason"] is not None:
        log.info("%s during start-up: exiting", stop["reason"])
        return 0

    from worker.runtime import RuntimeOptions, WorkerRuntime

    runtime = WorkerRuntime(
        engine,
        RuntimeOptions(
            endpoint=args.connect,
            worker_id=args.worker_id,
            heartbeat_s=args.heartbeat,
            register_retry_s=args.register_retry,
            daemon_timeout_s=args.daemon_timeout,
            shutdown_timeout_s=args.shutdown_timeout,
            profile=profile_data,
            auth=auth,
            curve_server_key=server_key,
            curve_keypair=keypair,
        ),
    )
    stop["runtime"] = runtime
    if stop["reason"] is not None:  # a signal between the check above and the line before
        log.info("%s during start-up: exiting", stop["reason"])
        close_engine(engine)
        return 0
    rc = 1
    try:
        rc = runtime.run()
    finally:
        close_engine(engine)
    exit_now(rc)
    return rc  # not reached


def close_engine(engine: Any) -> None:
    """Free what the engine holds, whatever it served: every request's kept KV (on the
    device and in the host tier), then its threads (hf-cb's generation thread, stopped
    without finishing anything: the daemon has ended or moved every request) and the model."""
    t0 = time.perf_counter()
    try:
        engine.release()
    finally:
        engine.close()
    log.info("engine closed in %.1f s: kept KV, host tier and model freed", time.perf_counter() - t0)


def exit_now(rc: int) -> None:
    """Exit with ``rc`` once the logs are out, skipping the interpreter's teardown:
    finalising the ~3,000 modules torch and transformers load (torch's inductor among them)
    takes seconds of CPU, a minute on a busy machine, and frees nothing the process's exit
    does not. Everything that matters (sockets, the engine) was closed before."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    sys.exit(main())
