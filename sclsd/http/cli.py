"""``sclsd-http``: the command line of the OpenAI-compatible front end.

::

    sclsd-http --config /etc/sclsd/sclsd.toml            # sockets from [daemon], the rest from [http]
    sclsd-http --run-dir /tmp/sclsd --listen 127.0.0.1:8000  # /tmp/sclsd/sclsd.sock and status.sock

The daemon's sockets are found as ``sclsctl`` finds them: ``--socket`` /
``--status-socket``, else ``--run-dir DIR``, else ``--config``'s ``[daemon]``, else
``$SCLSD_SOCKET`` / ``$SCLSD_STATUS_SOCKET``, else the system install's. Other flags
override the config file. The API key
comes from ``--api-key``, else ``$SCLSD_API_KEY``, else ``[http] api_key_file``
(the environment and the file keep it out of the process list; the file may list
several keys, one a line: one per end user, each key's requests one group in the
daemon's fair turns). Once it listens
it prints ``sclsd-http listening on http://HOST:PORT`` (``--listen HOST:0`` picks a
free port) and tells systemd it is ready. SIGTERM stops it after the requests in
flight. Exit code 2 for a bad config or an unreadable key file, 1 if it cannot
listen. The limits at the door (body and header sizes, timeouts, connection and
per-client caps) come from ``[http]`` (:mod:`.settings`, :mod:`.server`).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from ..config import Config, ConfigError, load, override, parse_host_port
from ..ctl import resolve_sockets
from ..sdnotify import Notifier
from .app import create_app
from .server import effective_limits, guarded_protocol
from .settings import Limits, Settings

log = logging.getLogger("sclsd.http")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sclsd-http", description="OpenAI-compatible HTTP front end to sclsd")
    p.add_argument("--config", help="sclsd's TOML config: [daemon] sockets and the [http] section")
    p.add_argument("--socket", help="the daemon's client socket")
    p.add_argument("--status-socket", help="the daemon's status socket")
    p.add_argument("--run-dir", metavar="DIR", help="the daemon's run directory (sclsd --run-dir): "
                   "DIR/sclsd.sock and DIR/status.sock")
    p.add_argument("--listen", help="HOST:PORT to serve HTTP on (default: [http] listen, 127.0.0.1:8000)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/* (visible in ps: "
                   "prefer $SCLSD_API_KEY or [http] api_key_file)")
    p.add_argument("--model-name", help="model name to serve (default: [http] model_name, else the daemon's)")
    p.add_argument("--connections", type=int, help="Unix-socket connections to the daemon (default 4)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.add_argument("--no-access-log", action="store_true",
                   help="no line per request (default: [http] access_log, on: one line at info)")
    return p


def _api_keys(args: argparse.Namespace, cfg: Config) -> tuple[str, ...]:
    """The accepted keys: ``--api-key``, else ``$SCLSD_API_KEY``, else ``[http] api_key_file``
    (one key per line, blank lines skipped); () when none."""
    key = args.api_key or os.environ.get("SCLSD_API_KEY")
    if key:
        return (key,)
    if cfg.http.api_key_file:
        try:
            text = Path(cfg.http.api_key_file).read_text()
        except OSError as exc:
            raise ConfigError("http.api_key_file", cfg.http.api_key_file,
                              f"cannot read it: {exc.strerror or exc}") from None
        keys = tuple(dict.fromkeys(line.strip() for line in text.splitlines() if line.strip()))
        if not keys:
            raise ConfigError("http.api_key_file", cfg.http.api_key_file, "the file is empty")
        return keys
    return ()


def settings_from(args: argparse.Namespace) -> tuple[Settings, str, str]:
    """(settings, listen address, log level) from the flags and the config; raises ConfigError."""
    cfg = load(args.config)
    cfg = override(cfg, http__listen=args.listen, http__model_name=args.model_name,
                   http__connections=args.connections, http__log_level=args.log_level,
                   http__access_log=False if args.no_access_log else None)
    where = argparse.Namespace(run_dir=args.run_dir, config=args.config, socket=args.socket,
                               status_socket=args.status_socket)
    try:
        resolve_sockets(where)
    except ValueError as exc:
        raise ConfigError("--config", args.config, str(exc)) from None
    sock, status_sock = where.socket, where.status_socket
    h = cfg.http
    limits = Limits(max_body_bytes=h.max_body_bytes, body_timeout_s=h.body_timeout_s,
                    max_header_bytes=h.max_header_bytes, header_timeout_s=h.header_timeout_s,
                    keep_alive_s=h.keep_alive_s, max_connections=h.max_connections,
                    max_requests_per_client=h.max_requests_per_client)
    # The model's limits and cache are the daemon's: known here only from its config file.
    keys = _api_keys(args, cfg)
    settings = Settings(socket=sock, status_socket=status_sock, api_key=keys[0] if keys else None,
                        api_keys=keys,
                        model_name=h.model_name, connections=h.connections, max_choices=h.max_choices,
                        limits=limits, access_log=h.access_log,
                        max_frame_bytes=cfg.daemon.max_frame_bytes,
                        max_model_len=cfg.model.max_input + cfg.model.max_gen if args.config else None,
                        max_input=cfg.model.max_input if args.config else None,
                        cache_dir=cfg.model.cache_dir)
    return settings, h.listen, h.log_level


def _listen(address: str) -> socket.socket:
    host, port = parse_host_port(address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(4096)
    sock.setblocking(False)
    return sock


async def _serve(settings: Settings, sock: socket.socket, level: str) -> None:
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            # uvicorn re-raises a captured SIGTERM after its graceful shutdown; a drained stop
            # is a clean exit here (code 0, as sclsd's).
            captured = getattr(self, "_captured_signals", None)
            if sig == signal.SIGTERM and isinstance(captured, list) and sig in captured:
                captured.remove(sig)

    try:
        import uvloop  # noqa: F401 - uvicorn picks it when installed

        loop = "uvloop"
    except ImportError:  # pragma: no cover
        loop = "asyncio"
    app = create_app(settings)
    limits = effective_limits(settings.limits)
    # uvicorn's own access log stays off: the app writes one line per request (.observe).
    config = uvicorn.Config(app, loop=loop, http=guarded_protocol(limits, app.state.metrics),
                            lifespan="on", log_level=level, access_log=False, server_header=False,
                            proxy_headers=False, timeout_keep_alive=limits.keep_alive_s,  # type: ignore[arg-type]
                            timeout_graceful_shutdown=30)
    server = Server(config)
    notifier = Notifier.from_env()
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"

    async def announce() -> None:
        while not server.started:
            if server.should_exit:
                return
            await asyncio.sleep(0.05)
        print(f"sclsd-http listening on {url} (daemon at {settings.socket})", flush=True)
        notifier.ready(f"listening on {url}")

    task = asyncio.ensure_future(announce())
    # Everything made so far (modules, the app) lives as long as the process: out of the
    # collector's sight, so a collection scans only what requests make (measured: about
    # 30 us of CPU less per request).
    gc.collect()
    gc.freeze()
    try:
        await server.serve(sockets=[sock])
    finally:
        task.cancel()
        notifier.stopping()


def main(argv: list[str] | None = None) -> int:
    """Console entry point of ``sclsd-http``."""
    args = build_parser().parse_args(argv)
    try:
        settings, listen, level = settings_from(args)
    except ConfigError as exc:
        print(f"sclsd-http: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        sock = _listen(listen)
    except OSError as exc:
        print(f"sclsd-http: cannot listen on {listen}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    try:
        import uvloop

        uvloop.run(_serve(settings, sock, level))
    except ImportError:  # pragma: no cover
        asyncio.run(_serve(settings, sock, level))
    except KeyboardInterrupt:
        pass
    return 0
