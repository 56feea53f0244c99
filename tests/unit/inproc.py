"""An in-process transport: workers are engines in the daemon's own process.

For unit tests of the daemon (``tests/unit/daemon/``): admission, scheduling,
results, worker death and drain run without processes or sockets. Messages
still go through the protocol codec both ways, so a test sees exactly what a
ZeroMQ worker would send and receive. Engines run synchronously on the loop,
which suits the ``fake`` engine with its zero-cost default profile; a test can
hold a worker's batches and release them one by one, make it stop
acknowledging, or kill it; a batch's ``queue_wait_s`` is the time it was held, as a
worker reports the time a batch waited in its local queue. The engine's streamed tokens go out as ``tokens``
messages (one per ``emit``, uncoalesced); with ``hold_results`` a batch's tokens
are sent while its ``result`` waits for :meth:`InprocWorker.finish`, as if the
slice were still running. ``release`` reaches the engine as it would a worker, and
batches reach it whole, from the worker's records (:class:`~worker.rows.RowBook`), as
the real worker's serve thread hands them over.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from typing import Any

import msgspec

from sclsd import protocol as P
from sclsd.daemon.transport.base import WorkerSink
from worker.rows import RowBook, UnknownRows
from worker.serve import result_rows


def stamped(outputs: list[P.RequestOutput], sent: dict[str, int]) -> list[P.RequestOutput]:
    """An engine's ``emit`` as a ``tokens`` part: each row starts where its previous part
    ended (``sent``, per row, grows), as the worker's stream says."""
    parts = []
    for o in outputs:
        parts.append(msgspec.structs.replace(o, start=sent.get(o.rid, 0)))
        sent[o.rid] = sent.get(o.rid, 0) + len(o.token_ids)
    return parts


class InprocWorker:
    """One in-process worker: an engine behind a peer id (see the module docstring)."""

    def __init__(self, transport: InprocTransport, peer: bytes, wid: str, engine: Any,
                 auth: str, hold: bool, ack: bool, hold_results: bool = False) -> None:
        self.transport = transport
        self.peer = peer
        self.wid = wid
        self.engine = engine
        self.auth = auth
        self.hold = hold
        self.ack = ack
        self.alive = True
        #: Every message the daemon sent to this worker, decoded, in order.
        self.received: list[P.DaemonToWorkerMsg] = []
        #: Batches held back (``hold=True``) until :meth:`release`.
        self.held: list[P.BatchMsg] = []
        self.hold_results = hold_results
        #: Results held back (``hold_results=True``) until :meth:`finish`.
        self.held_results: list[P.Result] = []
        #: Batch id -> when it arrived (its wait until served is its ``queue_wait_s``).
        self.arrived: dict[int, float] = {}
        self.got = asyncio.Event()
        """Set whenever a message arrives (tests clear it and wait)."""
        self.rows = RowBook()
        #: Every batch as the engine took it (rows whole), in order.
        self.served: list[P.BatchMsg] = []

    def register(self, **overrides: Any) -> None:
        """Send ``Register`` built from the engine's info (fields overridable)."""
        self.rows.drop()  # a new registration: the daemon knows nothing we hold
        info = self.engine.info()
        fields: dict[str, Any] = dict(
            worker_id=self.wid, engine=info.engine, model=info.model, device=info.device,
            kv_bytes_per_token=info.kv_bytes_per_token, mem_available=info.mem_available,
            pid=os.getpid(), eos_token_ids=list(info.eos_token_ids),
            vocab_size=getattr(info, "vocab_size", 0), auth=self.auth, profile=self.engine.profile(),
            caps=info.caps,
        )
        fields.update(overrides)
        self.send(P.Register(**fields))

    def heartbeat(self, queued: int = 0, busy: bool = False, stalled_s: float = 0.0) -> None:
        """Send a heartbeat naming the batches held back (``hold=True``): those that arrived
        and are not served yet, moving ``stalled_s`` ago."""
        self.send(P.Heartbeat(worker_id=self.wid, queued_batches=queued, busy=busy,
                              batches=[b.batch_id for b in self.held], stalled_s=stalled_s))

    def send(self, msg: Any) -> None:
        """Deliver a worker message to the daemon (through the codec), on the next loop
        turn as a socket would: never re-entering the daemon's code that sent to us."""
        if self.alive:
            asyncio.get_running_loop().call_soon(self.transport.deliver, self.peer, P.encode(msg))

    def receive(self, body: bytes) -> None:
        if not self.alive:
            return
        msg = P.to_worker_decoder.decode(body)
        self.received.append(msg)
        self.got.set()
        if isinstance(msg, P.BatchMsg):
            try:
                msg = self.rows.expand(msg)  # on arrival, as a worker's receive thread does
            except UnknownRows as exc:
                self.send(P.Result(worker_id=self.wid, batch_id=msg.batch_id, error=str(exc), unknown=exc.rids))
                return
            self.served.append(msg)
            self.arrived[msg.batch_id] = time.monotonic()
            if self.ack:
                self.send(P.BatchAck(worker_id=self.wid, batch_id=msg.batch_id))
            if self.hold:
                self.held.append(msg)
            else:
                self.serve(msg)
        elif isinstance(msg, P.Release):
            self.rows.drop(msg.rids)
            self.engine.release(msg.rids)
        elif isinstance(msg, P.Forget):
            self.rows.drop(msg.rids)

    def serve(self, batch: P.BatchMsg) -> None:
        """Run one batch on the engine and send its Result."""
        if not self.alive:
            return
        sent: dict[str, int] = {}

        def emit(outputs: list[P.RequestOutput]) -> None:
            self.send(P.Tokens(worker_id=self.wid, batches=[P.BatchTokens(batch_id=batch.batch_id,
                                                                          outputs=stamped(outputs, sent))]))

        waited = time.monotonic() - self.arrived.pop(batch.batch_id, time.monotonic())
        try:
            outputs, stats = self.engine.serve(batch, emit)
            stats = msgspec.structs.replace(stats, queue_wait_s=waited)
            self.rows.served(outputs)
            res = P.Result(worker_id=self.wid, batch_id=batch.batch_id, outputs=result_rows(outputs, sent), stats=stats,
                           kv_evicted=self.engine.take_evicted())
        except Exception as exc:  # noqa: BLE001 - reported to the daemon as the worker would
            res = P.Result(worker_id=self.wid, batch_id=batch.batch_id, error=str(exc),
                           kv_evicted=self.engine.take_evicted())
        if self.hold_results:
            self.held_results.append(res)
        else:
            self.send(res)

    def finish(self, n: int | None = None) -> int:
        """Send up to ``n`` held results (all by default); returns how many."""
        take = self.held_results[: n if n is not None else len(self.held_results)]
        del self.held_results[: len(take)]
        for res in take:
            self.send(res)
        return len(take)

    def release(self, n: int | None = None) -> int:
        """Serve up to ``n`` held batches (all by default); returns how many."""
        take = self.held[: n if n is not None else len(self.held)]
        del self.held[: len(take)]
        for b in take:
            self.serve(b)
        return len(take)

    def batches(self) -> list[P.BatchMsg]:
        """The batches the daemon sent, as they came (continued rows as deltas)."""
        return [m for m in self.received if isinstance(m, P.BatchMsg)]

    def kill(self) -> None:
        """The worker vanishes: it sends nothing more and sends to it fail."""
        self.alive = False


class InprocTransport:
    """A :class:`~.base.WorkerTransport` whose workers live in this process."""

    def __init__(self, authenticated: bool = False) -> None:
        self.authenticated = authenticated
        self.bad_messages = 0
        self.sink: WorkerSink | None = None
        self.workers: dict[bytes, InprocWorker] = {}
        self._peers = itertools.count(1)
        #: Peers whose sends are refused, as a full ZeroMQ pipe would (tests of item "lost sends").
        self.refuse_sends: set[bytes] = set()

    async def start(self, sink: WorkerSink) -> None:
        self.sink = sink

    def connect(self, wid: str, engine: Any, *, auth: str = "", hold: bool = False, ack: bool = True,
                register: bool = True, hold_results: bool = False) -> InprocWorker:
        """A new worker connection (a fresh peer id), registering at once by default."""
        peer = f"inproc-{next(self._peers)}".encode()
        w = InprocWorker(self, peer, wid, engine, auth, hold, ack, hold_results)
        self.workers[peer] = w
        if register:
            w.register()
        return w

    def deliver(self, peer: bytes, body: bytes) -> None:
        try:
            msg = P.worker_decoder.decode(body)
        except P.DecodeError:
            self.bad_messages += 1
            return
        assert self.sink is not None
        self.sink.on_message(peer, msg)

    def send(self, peer: bytes, msg: P.DaemonToWorkerMsg) -> bool:
        w = self.workers.get(peer)
        if w is None or not w.alive or peer in self.refuse_sends:
            return False
        asyncio.get_running_loop().call_soon(w.receive, P.encode(msg))
        return True

    def spawn_args(self, wid: str) -> list[str]:
        return []

    def check(self) -> None:
        return None

    async def stop(self) -> None:
        for w in self.workers.values():
            w.alive = False
