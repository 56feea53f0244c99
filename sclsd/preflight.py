"""Checks of a loaded config against this machine, which the daemon runs after
:func:`sclsd.config.load` and before it starts anything: the model resolves to files it
can read (or may download), and the TCP addresses it listens on can be bound.

Apart from :mod:`sclsd.config` because other readers of the same file (``sclsd-http``,
``sclsctl``, which may run as other users) need neither: they read the file, not the
machine. Each check raises :class:`~sclsd.config.ConfigError` naming the key.
"""

from __future__ import annotations

from .config import Config, ConfigError, parse_host_port

__all__ = ["check_binds", "check_model"]


def check_model(cfg: Config) -> None:
    """Resolve ``model.name`` as the daemon and its workers will (built-in names, paths, hub
    ids in the local Hugging Face cache); :class:`ConfigError` if it names nothing usable.

    The daemon calls this after :func:`load`; other readers of the file (``sclsd-http``,
    which may run as another user with another Hugging Face cache) do not need the model.
    A hub id missing from the cache passes when ``model.allow_download`` is set: the
    daemon downloads it at start.
    """
    m = cfg.model
    if m.name == "fake":  # the fake engine's model: no files
        return
    from .models import ModelNotCached, resolve

    try:
        resolve(m.name)
    except ModelNotCached as exc:
        if not m.allow_download:
            raise ConfigError("model.name", m.name, str(exc)) from None
    except (ValueError, OSError) as exc:
        raise ConfigError("model.name", m.name, str(exc)) from None


def check_binds(cfg: Config) -> None:
    """The addresses the daemon listens on over TCP can be bound now (``daemon.metrics_http``):
    :class:`ConfigError` naming the key and the reason otherwise, before anything starts.
    (Something may still take the port between this check and the daemon's bind; that
    bind failing then ends the start as cleanly.)"""
    import socket as sk

    if not cfg.daemon.metrics_http:
        return
    host, port = parse_host_port(cfg.daemon.metrics_http)
    try:
        infos = sk.getaddrinfo(host, port, type=sk.SOCK_STREAM)
        with sk.socket(infos[0][0], sk.SOCK_STREAM) as s:
            s.setsockopt(sk.SOL_SOCKET, sk.SO_REUSEADDR, 1)
            s.bind(infos[0][4])
    except OSError as exc:
        raise ConfigError("daemon.metrics_http", cfg.daemon.metrics_http,
                          f"cannot listen there: {exc.strerror or exc}") from None
