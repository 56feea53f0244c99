"""``sclsd-worker``: one engine behind a ZeroMQ DEALER, connected to the daemon.

::

    sclsd-worker --connect ENDPOINT --id ID [--engine hf|fake] [--model SPEC]
                 [--device cpu] [--threads N] [--mem-budget BYTES] [--heartbeat S]
                 [--dtype float32] [--decode-s S] [--prefill-s-per-token S] [--vocab N]
                 [--opt KEY=VALUE ...] [--profile FILE] [--log-level info]
                 [--curve-server-key KEY | --curve-server-key-file FILE] [--curve-keypair FILE]
    sclsd-worker profile ...      (see worker.profile)

The engine (model) is loaded first, then the worker registers; see
:mod:`worker.runtime` for the threads and the protocol. SIGTERM and SIGINT
finish the running batch, hand queued ones back and exit 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("worker")


def parse_value(text: str) -> Any:
    """Type an ``--opt`` value: int, float, true/false, none, else the string itself."""
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


def parse_opt(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip().replace("-", "_"), parse_value(value)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sclsd-worker",
        description="Serve batches from an sclsd daemon with one engine "
        "(or `sclsd-worker profile ...` to measure an engine).",
    )
    p.add_argument(
        "--connect", required=True, help="daemon worker endpoint (ipc://... or tcp://...)"
    )
    p.add_argument("--id", required=True, dest="worker_id", help="worker id (ZeroMQ identity)")
    p.add_argument("--engine", default="hf", help="engine name (hf, fake, ...)")
    p.add_argument("--model", default=None, help="model spec (default: the engine's default)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument(
        "--mem-budget", type=int, default=None, help="KV memory budget in bytes (CPU engines)"
    )
    p.add_argument("--heartbeat", type=float, default=1.0, help="seconds between heartbeats")
    p.add_argument("--dtype", default=None, help="model dtype (hf): float32, float16, bfloat16")
    p.add_argument("--decode-s", type=float, default=None, help="fake: seconds per iteration")
    p.add_argument(
        "--prefill-s-per-token", type=float, default=None, help="fake: prefill seconds per token"
    )
    p.add_argument("--vocab", type=int, default=None, help="fake: vocabulary size")
    p.add_argument(
        "--opt",
        action="append",
        type=parse_opt,
        default=[],
        metavar="KEY=VALUE",
        help="extra engine option (repeatable)",
    )
    p.add_argument("--profile", type=Path, default=None, help="estimator profile JSON to report")
    p.add_argument(
        "--register-retry", type=float, default=3.0, help="seconds before re-registering"
    )
    p.add_argument(
        "--shutdown-timeout", type=float, default=30.0, help="seconds to finish a batch on exit"
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


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """Constructor options for the engine: the explicit flags given, then ``--opt``s."""
    opts: dict[str, Any] = {}
    for name in ("threads", "mem_budget", "dtype", "decode_s", "prefill_s_per_token", "vocab"):
        value = getattr(args, name)
        if value is not None:
            opts[name] = value
    opts.update(dict(args.opt))
    return opts


def setup_logging(worker_id: str, level: str) -> None:
    logging.basicConfig(
        stream=sys.stderr,
        level=getattr(logging, level.upper()),
        format=f"%(asctime)s sclsd-worker[{worker_id}] %(levelname)s %(name)s: %(message)s",
        force=True,
    )


def main(argv: list[str] | None = None) -> int:
    """Console entry point of ``sclsd-worker``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "profile":
        from worker import profile  # lazy: only the profiler needs it

        return profile.main(argv[1:])
    # Before torch/transformers import tqdm (it reads TQDM_* at import): no progress
    # bars (GGUF dequantisation) in worker logs.
    os.environ.setdefault("TQDM_DISABLE", "1")
    args = build_parser().parse_args(argv)
    setup_logging(args.worker_id, args.log_level)

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

    from worker.engines import create_engine
    from worker.runtime import RuntimeOptions, WorkerRuntime

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

    t0 = time.perf_counter()
    try:
        engine = create_engine(args.engine, args.model, args.device, **engine_options(args))
    except (ValueError, TypeError, FileNotFoundError) as exc:
        log.error("cannot start engine %s: %s", args.engine, exc)
        return 2
    log.info("engine %s ready in %.1fs", args.engine, time.perf_counter() - t0)
    if stop["reason"] is not None:
        log.info("%s during start-up: exiting", stop["reason"])
        return 0

    runtime = WorkerRuntime(
        engine,
        RuntimeOptions(
            endpoint=args.connect,
            worker_id=args.worker_id,
            heartbeat_s=args.heartbeat,
            register_retry_s=args.register_retry,
            shutdown_timeout_s=args.shutdown_timeout,
            profile=profile_data,
            curve_server_key=server_key,
            curve_keypair=keypair,
        ),
    )
    stop["runtime"] = runtime
    try:
        return runtime.run()
    finally:
        engine.close()


if __name__ == "__main__":
    sys.exit(main())
