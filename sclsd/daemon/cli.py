"""``sclsd``: parse the command line, load the config, run the server.

Exit codes: 0 after a drain, 1 when the daemon fails while serving, 2 for a bad
config or a start-up error (one line on stderr naming the key or the cause).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import resource
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from ..config import ConfigError, load
from ..defaults import AUTO_ENGINE, ENGINES, force_offline, in_run_dir
from ..preflight import check_binds, check_model
from .errors import StartupError
from .logs import setup_logging

log = logging.getLogger("sclsd")


def raise_nofile(want: int) -> None:
    """Raise the soft limit on open files towards ``want`` (capped by the hard limit):
    every client connection is a descriptor, and the default soft limit is often 1024."""
    if want <= 0:
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, exc)
            return
    log.info("open-file limit %s (hard %s)", resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sclsd", description="LLM serving daemon with slice-level scheduling")
    p.add_argument("--config", help="TOML config file (default: built-in defaults)")
    p.add_argument("--socket", help="client API Unix socket path")
    p.add_argument("--status-socket", help="status Unix socket path")
    p.add_argument("--worker-endpoint", help="ZeroMQ endpoint for workers (ipc:// or tcp://)")
    p.add_argument("--run-dir", metavar="DIR",
                   help="put the sockets in DIR, named as in /run/sclsd: DIR/sclsd.sock, DIR/status.sock "
                   "and ipc://DIR/workers.ipc (sclsctl and sclsd-http take the same --run-dir); "
                   "--socket, --status-socket and --worker-endpoint still win")
    p.add_argument("--engine", choices=[AUTO_ENGINE, *ENGINES],
                   help="engine of spawned workers (auto, the default: the one the policy needs, "
                   "hf-cb for scls-cb, hf for the static policies; hf-static-cb serves scls-cb on hf's "
                   "static arena)")
    p.add_argument("--model", help="model: smollm2-135m-instruct (default), tiny-random, random:CONFIG, "
                   "a Hugging Face hub id (ORG/NAME) in the local cache, a model directory or a .gguf file")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights' dtype on the workers (auto: float32 on cpu, half precision on cuda)")
    p.add_argument("--device", choices=["cpu", "cuda"], help="device of spawned workers (cuda: worker i on cuda:i)")
    p.add_argument("--workers", type=int, help="number of local workers to spawn")
    p.add_argument("--slice-len", type=int, help="slice length S")
    p.add_argument("--policy", help="scls-cb (the default: slice grants on continuous batching, engine "
                   "hf-cb), or the paper's static policies sls, so, pm, ab, lb, scls (engine hf or deepspeed)")
    p.add_argument("--work-conserving", action=argparse.BooleanOptionalAction, default=None,
                   help="idle workers get work at once (scheduler.work_conserving)")
    p.add_argument("--kv-reuse", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse KV kept across slices (scheduler.kv_reuse)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    return p


def main(argv: list[str] | None = None) -> int:
    """Console entry point of ``sclsd``."""
    args = build_parser().parse_args(argv)
    if args.run_dir:
        sock, status_sock, endpoint = in_run_dir(args.run_dir)
        args.socket = args.socket or sock
        args.status_socket = args.status_socket or status_sock
        args.worker_endpoint = args.worker_endpoint or endpoint
    try:
        # The command line's changes go into the file's values before the one validation:
        # --policy scls mends a file whose engine only a static policy takes.
        cfg = load(
            args.config,
            daemon__socket=args.socket,
            daemon__status_socket=args.status_socket,
            daemon__worker_endpoint=args.worker_endpoint,
            daemon__log_level=args.log_level,
            workers__engine=args.engine,
            workers__spawn=args.workers,
            model__name=args.model,
            model__dtype=args.dtype,
            workers__device=args.device,
            scheduler__slice_len=args.slice_len,
            scheduler__policy=args.policy,
            scheduler__work_conserving=args.work_conserving,
            scheduler__kv_reuse=args.kv_reuse,
        )
        check_model(cfg)  # here, not in load(): sclsd-http reads the same file without the model
        check_binds(cfg)
    except ConfigError as exc:
        print(f"sclsd: {exc}", file=sys.stderr)
        return 2
    setup_logging(cfg.daemon.log_level)
    raise_nofile(cfg.daemon.nofile_limit)
    force_offline()
    from .server import Server  # after logging: importing it pulls in zmq and the core

    runner: Callable[[Coroutine[Any, Any, int]], int]
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        runner = asyncio.run

    async def _main() -> int:
        return await Server(cfg).run()

    try:
        return runner(_main())
    except StartupError as exc:
        print(f"sclsd: {exc}", file=sys.stderr)
        return 2
    except Exception:
        log.exception("sclsd failed")
        return 1
