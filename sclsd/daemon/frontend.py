"""The client socket's front end: one table from message type to handler.

``generate`` goes to :mod:`.admission`; ``cancel`` ends a live request of the
same connection (any connection's for an admin); ``ping`` is answered at once;
``drain_worker`` (admin) takes a worker out of rotation or puts it back.
Admins are the uids in ``daemon.admin_uids`` (by default root and the daemon's
own uid), as told by the connection's peer credentials.

Each handler returns the :class:`~sclsd.daemon.serving.effects.Effects` to
deliver (``generate`` after admission, which may await the tokenizer).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

from .. import protocol as P
from ..config import Config
from .admission import Admission
from .serving.core import ServingCore
from .serving.effects import Effects
from .sockets import Conn

log = logging.getLogger("sclsd")

Handled = Effects | Awaitable[Effects]


class Frontend:
    """Dispatches decoded client messages by type (see the module docstring)."""

    def __init__(self, cfg: Config, admission: Admission, core: ServingCore,
                 clock: Callable[[], float]) -> None:
        self.admission = admission
        self.core = core
        self.clock = clock
        d = cfg.daemon
        self.admin_uids = set(d.admin_uids) if d.admin_uids else {0, os.geteuid()}
        self.handlers: dict[type, Callable[[Conn, Any], Handled]] = {
            P.Generate: admission.on_generate,
            P.Cancel: self.on_cancel,
            P.Ping: self.on_ping,
            P.DrainWorker: self.on_drain_worker,
        }

    def handle(self, conn: Conn, msg: Any) -> Handled:
        return self.handlers[type(msg)](conn, msg)

    def on_close(self, conn: Conn) -> Effects:
        """A client that disconnects cancels its requests (one log line for them all: a
        pipelining client may leave thousands)."""
        rids = sorted(self.core.table.of_client(conn))
        if rids:
            more = f" and {len(rids) - 5} more" if len(rids) > 5 else ""
            log.info("conn=%d disconnected: %d requests cancelled (id=%s%s)", conn.cid, len(rids),
                     ",".join(rids[:5]), more)
        return self.core.client_gone(conn, self.clock())

    def is_admin(self, conn: Conn) -> bool:
        """May this connection send admin messages? (SO_PEERCRED uid in the admin set.)"""
        return conn.peer is not None and conn.peer.uid in self.admin_uids

    def on_ping(self, conn: Conn, msg: P.Ping) -> Effects:
        out = Effects()
        out.send(conn, P.Pong(nonce=msg.nonce, features=list(P.GENERATE_FEATURES)))
        return out

    def on_cancel(self, conn: Conn, msg: P.Cancel) -> Effects:
        # A client cancels its own requests only: ids are client-chosen and guessable.
        other = msg.any_connection and not self.core.owns(conn, msg.id)
        if other and not self.is_admin(conn):
            log.warning("conn=%d cancel id=%s of another connection refused: uid %s is not an admin",
                        conn.cid, msg.id, conn.peer and conn.peer.uid)
            out = Effects()
            out.send(conn, P.Error(code="forbidden", message="only an admin may cancel other "
                                   "connections' requests", id=msg.id))
            return out
        out = self.core.cancel(msg.id, self.clock(), requester=conn, any_client=other)
        if out.ended:
            log.info("id=%s cancelled by conn=%d", msg.id, conn.cid)
        return out

    def on_drain_worker(self, conn: Conn, msg: P.DrainWorker) -> Effects:
        verb = "resume" if msg.resume else "drain"
        if not self.is_admin(conn):
            log.warning("conn=%d %s worker=%s refused: uid %s is not an admin", conn.cid, verb, msg.worker,
                        conn.peer and conn.peer.uid)
            out = Effects()
            out.send(conn, P.Error(code="forbidden", message=f"only an admin may {verb} workers "
                                   "(daemon.admin_uids)"))
            return out
        return self.core.drain_worker(msg.worker, msg.resume, conn)
