"""The client socket's front end: one table from message type to handler.

``generate`` goes to :mod:`.admission`; ``cancel`` ends a live request of the
same connection (any connection's for an admin); ``ping`` is answered at once;
``drain_worker`` (admin) takes a worker out of rotation or puts it back.
Admins are the uids in ``daemon.admin_uids`` (by default root and the daemon's
own uid), as told by the connection's peer credentials.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

from .. import protocol as P
from ..config import Config
from .admission import Admission
from .fleet import Fleet
from .requests import LiveRequests
from .sockets import Conn

log = logging.getLogger("sclsd")


class Frontend:
    """Dispatches decoded client messages by type (see the module docstring)."""

    def __init__(self, cfg: Config, admission: Admission, live: LiveRequests, fleet: Fleet) -> None:
        self.admission = admission
        self.live = live
        self.fleet = fleet
        d = cfg.daemon
        self.admin_uids = set(d.admin_uids) if d.admin_uids else {0, os.geteuid()}
        self.handlers: dict[type, Callable[[Conn, Any], Awaitable[None] | None]] = {
            P.Generate: admission.on_generate,
            P.Cancel: self.on_cancel,
            P.Ping: self.on_ping,
            P.DrainWorker: self.on_drain_worker,
        }

    def handle(self, conn: Conn, msg: Any) -> Awaitable[None] | None:
        return self.handlers[type(msg)](conn, msg)

    def on_close(self, conn: Conn) -> None:
        self.live.conn_closed(conn)

    def is_admin(self, conn: Conn) -> bool:
        """May this connection send admin messages? (SO_PEERCRED uid in the admin set.)"""
        return conn.peer is not None and conn.peer.uid in self.admin_uids

    def on_ping(self, conn: Conn, msg: P.Ping) -> None:
        conn.send(P.Pong(nonce=msg.nonce))

    def on_cancel(self, conn: Conn, msg: P.Cancel) -> None:
        # A client cancels its own requests only: ids are client-chosen and guessable.
        mine = msg.id in conn.rids
        if msg.any_connection and not mine:
            if not self.is_admin(conn):
                log.warning("conn=%d cancel id=%s of another connection refused: uid %s is not an admin",
                            conn.cid, msg.id, conn.peer and conn.peer.uid)
                conn.send(P.Error(code="forbidden", message="only an admin may cancel other "
                                  "connections' requests", id=msg.id))
                return
            mine = msg.id in self.live
        if not mine or not self.live.cancel(msg.id, "cancelled"):
            conn.send(P.Error(code="unknown_id", message=f"no live request {msg.id!r}", id=msg.id))
            return
        log.info("id=%s cancelled by conn=%d", msg.id, conn.cid)

    def on_drain_worker(self, conn: Conn, msg: P.DrainWorker) -> None:
        verb = "resume" if msg.resume else "drain"
        if not self.is_admin(conn):
            log.warning("conn=%d %s worker=%s refused: uid %s is not an admin", conn.cid, verb, msg.worker,
                        conn.peer and conn.peer.uid)
            conn.send(P.Error(code="forbidden", message=f"only an admin may {verb} workers "
                              "(daemon.admin_uids)"))
            return
        ok = self.fleet.resume(msg.worker) if msg.resume else self.fleet.drain(msg.worker)
        if not ok:
            conn.send(P.Error(code="unknown_worker", message=f"no registered worker {msg.worker!r}"))
            return
        conn.send(P.WorkerStateReply(worker=msg.worker, state=self.fleet.state(msg.worker),
                                     batches_inflight=len(self.fleet.sched.workers[msg.worker].batches)))
