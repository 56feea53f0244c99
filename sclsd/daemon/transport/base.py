"""The seam between the daemon and its workers.

A transport moves typed messages between the daemon and worker *peers*: opaque
byte strings it assigns per connection (the ROUTER's routing ids). It never
decides what a message means: :class:`WorkerSink` (the daemon's server) does; its
fleet maps peers to worker ids only after a worker authenticated at registration.
"""

from __future__ import annotations

from typing import Protocol

from ... import protocol as P


class WorkerSink(Protocol):
    """Receives every decoded worker message with the peer it came from."""

    def on_message(self, peer: bytes, msg: P.WorkerMsg) -> None: ...


class WorkerTransport(Protocol):
    """What the daemon needs from a way of talking to workers."""

    bad_messages: int
    """Messages dropped before reaching the sink (undecodable, malformed frames)."""
    authenticated: bool
    """True when the transport itself authenticates peers (CURVE): then ``Register.auth``
    is not required."""

    async def start(self, sink: WorkerSink) -> None:
        """Bind and start delivering messages to ``sink``."""

    def send(self, peer: bytes, msg: P.DaemonToWorkerMsg) -> bool:
        """Hand ``msg`` to the transport for ``peer`` without blocking.

        True means the transport holds it for delivery; False means it could not take
        it (peer gone, or its queue full): the caller must put the work back.
        """

    def spawn_args(self, wid: str) -> list[str]:
        """Extra ``sclsd-worker`` flags a local worker ``wid`` needs to connect (keys)."""

    def check(self) -> None:
        """Raise the error of a background task that died (never swallow it)."""

    async def stop(self) -> None:
        """Stop delivering, close sockets."""
