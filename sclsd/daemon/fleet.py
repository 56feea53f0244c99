"""The fleet: which transport peer is which worker, and who may register.

Every message from a worker arrives with the transport's peer id. A peer is
mapped to a worker id only once the serving core accepted its ``register``,
and the register must be authenticated first (:meth:`Fleet.authenticate`:
the daemon's worker secret, or CURVE on the transport) and speak this
protocol. Messages from a peer that is no member (declared dead, e.g. hung
past the heartbeat timeout, but alive again) are answered with
``reregister``; a member that sends in another worker's name is ignored.
What membership means (who serves, who is lost) is the serving core's
business (:mod:`sclsd.daemon.serving.membership`).
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable

from .. import protocol as P
from .transport.base import WorkerTransport

log = logging.getLogger("sclsd.workers")

#: Seconds between two Reregister messages to the same unknown peer.
REREGISTER_EVERY_S = 1.0


class Fleet:
    """Peers ↔ worker ids and registration checks (see the module docstring)."""

    def __init__(self, transport: WorkerTransport, secret: str | None, clock: Callable[[], float]) -> None:
        self.transport = transport
        self.secret = secret
        self.clock = clock
        self.peers: dict[str, bytes] = {}
        """Member worker id -> its peer."""
        self.by_peer: dict[bytes, str] = {}
        self.refused = 0
        self.stopping = False
        """Every member was told to exit (:meth:`shutdown_all`)."""
        self._unknown_asked: dict[bytes, float] = {}

    # ------------------------------------------------------------------ registration

    def authenticate(self, reg: P.Register) -> str | None:
        """Why this registration is refused before its worker is considered, if it is."""
        if reg.protocol != P.PROTOCOL_VERSION:
            return f"speaks protocol {reg.protocol}, the daemon {P.PROTOCOL_VERSION}"
        if not self._authentic(reg):
            return "missing or wrong worker secret (daemon.worker_secret_file)"
        return None

    def _authentic(self, reg: P.Register) -> bool:
        if self.transport.authenticated:
            return True  # CURVE: the ZAP handler admitted the connection's key
        return self.secret is not None and hmac.compare_digest(reg.auth.encode(), self.secret.encode())

    def refuse(self, peer: bytes, reg: P.Register, why: str) -> None:
        """Tell a worker it may not register (it exits)."""
        self.refused += 1
        log.warning("worker=%r pid=%d registration refused: %s", reg.worker_id, reg.pid, why)
        self.transport.send(peer, P.Shutdown())

    def turn_away(self, peer: bytes, reg: P.Register) -> None:
        """A worker registers while the daemon stops: it is told to exit, not welcomed."""
        log.info("worker=%s pid=%d registered while the daemon stops: told to exit", reg.worker_id, reg.pid)
        self.transport.send(peer, P.Shutdown())

    def bind(self, peer: bytes, wid: str) -> None:
        """``peer`` is member ``wid`` from now on."""
        self._unknown_asked.pop(peer, None)
        self.peers[wid] = peer
        self.by_peer[peer] = wid

    def unbind(self, wid: str) -> None:
        """``wid`` is no member any more: its peer's messages are no longer its."""
        peer = self.peers.pop(wid, None)
        if peer is not None and self.by_peer.get(peer) == wid:
            del self.by_peer[peer]

    # ------------------------------------------------------------------ messages

    def member(self, peer: bytes, msg: P.WorkerMsg) -> str | None:
        """The member that sent ``msg`` (not a ``register``), or None when it counts for
        nothing: a peer that is no member is asked to register again."""
        assert not isinstance(msg, P.Register)
        wid = self.by_peer.get(peer)
        if wid is not None and msg.worker_id == wid:
            return wid
        if wid is not None:
            log.warning("worker=%s sent a %s as %r; dropped", wid, type(msg).__name__, msg.worker_id)
        else:
            self._ask_reregister(peer, msg.worker_id, type(msg).__name__)
        return None

    def _ask_reregister(self, peer: bytes, wid: str, what: str) -> None:
        """A peer we do not know would otherwise heartbeat into the void forever."""
        now = self.clock()
        if now - self._unknown_asked.get(peer, -1e9) < REREGISTER_EVERY_S:
            return
        self._unknown_asked[peer] = now
        if len(self._unknown_asked) > 4096:  # bounded: peers come and go
            self._unknown_asked.clear()
        log.info("worker=%s unknown (%s received): asking it to register again", wid, what.lower())
        self.transport.send(peer, P.Reregister())

    def send(self, wid: str, msg: P.DaemonToWorkerMsg) -> bool | None:
        """Send to a member: True if the transport took it, False if it refused (the member
        is to be declared lost), None if ``wid`` is no member (nothing to send to), or if
        every member was told to exit (:meth:`shutdown_all`): one that left is exiting as
        asked, not lost, and its process is not killed in the middle of closing."""
        peer = self.peers.get(wid)
        if peer is None:
            return None
        sent = self.transport.send(peer, msg)
        return None if self.stopping and not sent else sent

    def shutdown_all(self) -> None:
        """Ask every member to exit (daemon stopping)."""
        self.stopping = True
        for peer in list(self.peers.values()):
            self.transport.send(peer, P.Shutdown())
