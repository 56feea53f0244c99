"""The client socket's front end: one table from message type to handler.

``generate`` goes to :mod:`.admission`; ``cancel`` ends a live request of the
same connection, by the id the client gave it (or one still waiting for its grammar's
check there: admission ends it); an admin's ``cancel`` with
``any_connection`` reaches any connection's, by the daemon's id
(``<connection>:<client id>``, as the logs show it) or by a client id only one live
request has; ``ping`` is answered at once;
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
from .admission import Admission, daemon_id
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
        self.admission.client_gone(conn)
        return self.core.client_gone(conn, self.clock())

    def is_admin(self, conn: Conn) -> bool:
        """May this connection send admin messages? (SO_PEERCRED uid in the admin set.)"""
        return conn.peer is not None and conn.peer.uid in self.admin_uids

    def on_ping(self, conn: Conn, msg: P.Ping) -> Effects:
        out = Effects()
        out.send(conn, P.Pong(nonce=msg.nonce, features=list(P.GENERATE_FEATURES)))
        return out

    def on_cancel(self, conn: Conn, msg: P.Cancel) -> Effects:
        # A client cancels its own requests only, by its own ids (scoped to its connection).
        rid = self.core.table.find(conn, msg.id)
        other = rid is None and msg.any_connection
        if other and not self.is_admin(conn):
            log.warning("conn=%d cancel id=%s of another connection refused: uid %s is not an admin",
                        conn.cid, msg.id, conn.peer and conn.peer.uid)
            return self._error(conn, "forbidden", "only an admin may cancel other connections' "
                               "requests", msg.id)
        if other:
            rid, waiting, why = self._anyones(msg.id)
            if waiting is not None:
                # It waits for its grammar's check: accepted and ended (admission), as its own
                # client's cancel would end it.
                self.admission.cancel(*waiting)
                log.info("id=%s (waiting for its grammar's check) cancelled by conn=%d", msg.id, conn.cid)
                return Effects()
            if rid is None:
                return self._error(conn, "unknown_id", why, msg.id)
        if rid is None and not other and self.admission.cancel(conn, msg.id):
            return Effects()  # it waited for its grammar's check: accepted and ended (admission)
        if rid is None:
            return self._error(conn, "unknown_id", f"no live request {msg.id!r}", msg.id)
        out = self.core.cancel(rid, self.clock(), requester=conn, any_client=other)
        if out.ended:
            log.info("id=%s cancelled by conn=%d", rid, conn.cid)
        return out

    def _anyones(self, asked: str) -> tuple[str | None, tuple[Conn, str] | None, str]:
        """The request an admin means by ``asked`` (the daemon's id, or a client id that one
        request has): a live one's daemon id, or the (connection, client id) of one waiting
        for its grammar's check; (None, None, why) when there is none, or several."""
        table = self.core.table
        live = [asked] if asked in table else table.with_client_id(asked)
        waiting = self.admission.waiting_for(asked)
        if len(live) + len(waiting) == 1:
            return (live[0], None, "") if live else (None, waiting[0], "")
        if not live and not waiting:
            return None, None, f"no live request {asked!r}"
        ids = sorted([*live, *(daemon_id(c, i) for c, i in waiting)])
        return None, None, (f"{len(ids)} live requests have the client id {asked!r}; cancel one by "
                            f"the daemon's id: {', '.join(ids[:10])}")

    @staticmethod
    def _error(conn: Conn, code: P.ErrorCode, message: str, rid: str) -> Effects:
        out = Effects()
        out.send(conn, P.Error(code=code, message=message, id=rid))
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
