"""The worker's connection to its daemon: one DEALER, registration, silence detection.

Owned by the receive thread (ZeroMQ sockets are not thread-safe).

* **Routing ids are the daemon's.** The DEALER sets no ``ZMQ_IDENTITY``: the
  daemon's ROUTER assigns a routing id to each connection and maps it to a
  worker id only when an authenticated :class:`~sclsd.protocol.Register` comes
  in on it, so a process that merely connects cannot take over a registered
  worker's id. The worker id travels inside every message instead.
* **Registration.** ``ZMQ_IMMEDIATE`` queues nothing while the daemon is
  unreachable, so re-sent Registers do not pile up and replay later. ZeroMQ
  reconnects by itself; a socket monitor tells us when the connection drops,
  and we register again on the next one (a restarted daemon has forgotten us).
  Register is also re-sent when no Welcome follows within ``register_retry_s``
  of the send (the timer starts once the message is out, however long building
  it took); a re-send is the same message, and the daemon answers a member's
  repeated Register on the same connection with another Welcome. The message is
  built once per registration (a new connection, or the daemon's ``reregister``):
  building it drops the KV the engine keeps, which only a registration that the
  daemon starts afresh may do. Nothing else leaves before the Register of the
  current connection: the daemon only knows a routing id once it has
  registered.
* **Silence.** Any message from the daemon counts as hearing from it (it sends
  :class:`~sclsd.protocol.Keepalive` every heartbeat interval). Once welcomed,
  ``daemon_timeout_s`` without a word means the daemon is hung or gone, or the
  connection is half-open: :meth:`DaemonLink.reopen` replaces the DEALER (a
  fresh connection gets a fresh routing id) and registration starts over.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from sclsd import protocol as P

log = logging.getLogger("worker")

#: Cap on one message from the daemon (same order as the daemon's own cap).
MAX_MSG_BYTES = 64 * 1024 * 1024


@dataclass
class RuntimeOptions:
    """How a worker talks to its daemon."""

    endpoint: str
    worker_id: str
    heartbeat_s: float = 1.0
    """Heartbeat interval until the daemon's Welcome says otherwise."""
    register_retry_s: float = 3.0
    """Re-send Register when no Welcome arrived within this many seconds."""
    daemon_timeout_s: float = 30.0
    """Once welcomed, reconnect and register again after this long without a message
    from the daemon; 0 disables the check."""
    shutdown_timeout_s: float = 30.0
    """After a shutdown request, abandon the running batch after this long."""
    poll_ms: int = 100
    """Longest sleep of the receive loop (signals and timers are checked in between)."""
    profile: dict[str, Any] | None = None
    auth: str = ""
    """The daemon's worker secret (hex), sent in Register; empty when there is none."""
    curve_server_key: bytes | None = None
    """Daemon's public CURVE key (Z85) for ``tcp://``; enables encryption when set."""
    curve_keypair: tuple[bytes, bytes] | None = None
    """This worker's (public, secret) CURVE keys; generated when absent."""


class DaemonLink:
    """The current DEALER and what is known about the daemon on it (module docstring)."""

    def __init__(
        self, ctx: zmq.Context, opts: RuntimeOptions, make_register: Callable[[], P.Register]
    ) -> None:
        self.ctx = ctx
        self.opts = opts
        self.make_register = make_register
        self.sock: zmq.Socket | None = None
        self.monitor: zmq.Socket | None = None
        self.generation = 0
        """Bumped on every new DEALER, so a poller knows to pick up the new sockets."""
        self.connected = False
        self.welcomed = False
        self.registered = False
        """A Register went out on the current connection."""
        self.heartbeat_s = opts.heartbeat_s
        self.last_register = -1e9
        self.pending_register: P.Register | None = None
        """The Register of the current registration, built once, re-sent as it is."""
        self.last_heard = time.monotonic()
        self.outbox: deque[bytes] = deque()
        """Encoded messages that must reach the daemon, in order (results, acks)."""

    # ------------------------------------------------------------------ socket lifecycle

    def open(self) -> None:
        """Create a DEALER and its monitor and start connecting."""
        sock = self.ctx.socket(zmq.DEALER)
        # No ZMQ_IDENTITY on purpose: the daemon's ROUTER assigns routing ids.
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MSG_BYTES)
        # Long enough for the last Result to leave on shutdown, bounded so exit never hangs.
        sock.setsockopt(zmq.LINGER, 2000)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        if self.opts.curve_server_key:
            public, secret = self.opts.curve_keypair or zmq.curve_keypair()
            sock.setsockopt(zmq.CURVE_SERVERKEY, self.opts.curve_server_key)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        self.monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sock.connect(self.opts.endpoint)
        self.sock = sock
        self.generation += 1
        self.connected = self.welcomed = self.registered = False
        self.pending_register = None
        log.info("connecting to %s", self.opts.endpoint)

    def close(self, linger: int | None = None) -> None:
        """Close the DEALER (``linger`` ms for queued messages; None: the socket's own)."""
        if self.sock is None:
            return
        assert self.monitor is not None
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(linger)
        self.sock = self.monitor = None

    def reopen(self) -> None:
        """Replace the DEALER: a fresh connection, a fresh routing id, registration anew.

        What ZeroMQ still holds for the old connection is dropped (its peer is not
        listening); the outbox is kept and goes out after the new Register.
        """
        self.close(0)
        self.open()

    # ------------------------------------------------------------------ sending

    def send(self, msg: Any, *, keep: bool = False) -> bool:
        """Send without blocking. ``keep``: on failure, queue it for :meth:`flush` to retry.

        A kept message joins the outbox behind older ones (and waits for Register on a
        fresh connection), so an ack never overtakes the messages before it.
        """
        assert self.sock is not None
        body = P.encode(msg)
        if keep and (self.outbox or not self.registered):
            self.outbox.append(body)
            return False
        try:
            self.sock.send(body, flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            if keep:
                self.outbox.append(body)
            return False

    def flush(self) -> None:
        """Send what the outbox holds, oldest first, as far as the socket takes it."""
        if not self.registered or self.sock is None:
            return  # the daemon ignores a routing id that has not registered
        out = self.outbox
        while out:
            try:
                self.sock.send(out[0], flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            out.popleft()

    def maybe_register(self, now: float) -> None:
        """Send Register when this connection needs one (see the module docstring)."""
        if self.welcomed:
            return
        # Until a Register gets onto a connection, try every loop; after that, re-send
        # only when no Welcome came (the daemon may have lost it).
        if self.registered and now - self.last_register < self.opts.register_retry_s:
            return
        if self.pending_register is None:
            self.pending_register = self.make_register()
        reg = self.pending_register
        if self.send(reg):
            again = self.registered
            self.registered = True
            # The retry timer starts now that it is out, not when this call began.
            self.last_register = time.monotonic()
            if again:
                log.info("no welcome within %.1fs: register sent again", self.opts.register_retry_s)
                return
            log.info(
                "register sent: engine=%s model=%s device=%s kv_bytes_per_token=%d "
                "mem_available=%d vocab_size=%d auth=%s",
                reg.engine,
                reg.model,
                reg.device,
                reg.kv_bytes_per_token,
                reg.mem_available,
                reg.vocab_size,
                "secret" if reg.auth else ("curve" if self.opts.curve_server_key else "none"),
            )

    # ------------------------------------------------------------------ receiving

    def receive(self) -> Iterator[Any]:
        """Decode every waiting message; Welcome is handled here, the rest yielded."""
        assert self.sock is not None
        while True:
            try:
                frames = self.sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            # Even an undecodable message proves the daemon is alive.
            self.last_heard = time.monotonic()
            try:
                msg = P.to_worker_decoder.decode(frames[-1])
            except P.DecodeError as exc:
                log.warning("undecodable message from the daemon dropped: %s", exc)
                continue
            if isinstance(msg, P.Welcome):
                self._on_welcome(msg)
            else:
                yield msg

    def _on_welcome(self, msg: P.Welcome) -> None:
        if not self.welcomed:
            log.info("welcomed (heartbeat every %.2fs)", msg.heartbeat_interval_s)
            timeout = self.opts.daemon_timeout_s
            if 0 < timeout <= 2 * msg.heartbeat_interval_s:
                log.warning(
                    "--daemon-timeout %.1fs is within two daemon heartbeats (%.1fs): "
                    "a late keepalive will make this worker reconnect",
                    timeout,
                    msg.heartbeat_interval_s,
                )
        self.welcomed = True
        if msg.heartbeat_interval_s > 0:
            self.heartbeat_s = msg.heartbeat_interval_s

    def on_monitor(self) -> None:
        """Track connects and drops of the current DEALER."""
        assert self.monitor is not None
        event = recv_monitor_message(self.monitor)["event"]
        if event == zmq.EVENT_CONNECTED:
            log.info("connected to %s", self.opts.endpoint)
            self.connected = True
        elif event == zmq.EVENT_DISCONNECTED:
            log.warning("daemon disconnected; will register again on reconnect")
            self.connected = self.welcomed = self.registered = False
            self.pending_register = None

    def unregister(self) -> None:
        """Forget the registration (the daemon asked for a new one)."""
        self.welcomed = self.registered = False
        self.pending_register = None

    def silent_for(self, now: float) -> float | None:
        """Seconds without a word from the daemon when that exceeds the timeout, else None.

        Only a welcomed worker can tell silence from a daemon that is still starting.
        """
        timeout = self.opts.daemon_timeout_s
        if not self.welcomed or timeout <= 0:
            return None
        quiet = now - self.last_heard
        return quiet if quiet > timeout else None
