"""The worker's two threads: receive (owns the ZeroMQ DEALER) and serve (runs the engine).

Layout (paper section 4.1, docs/design.md section 2)::

    daemon ROUTER <──DEALER── receive thread ──local queue──▶ serve thread ── engine.submit / poll
                                   ▲                                 │
                                   └──────── inproc PAIR ◀───────────┘ (encoded Result)

ZeroMQ sockets are not thread-safe, so each socket has one owner: the DEALER
(:class:`worker.link.DaemonLink`) and the receiving end of the PAIR belong to
the receive thread (the caller of :meth:`WorkerRuntime.run`), the sending end
of the PAIR to the serve thread. The PAIR wakes the receive thread's poll the
moment a result is ready, so a result is never delayed by a poll timeout.

Tokens stream while a batch runs: each poll's new tokens (the engine's
:class:`~worker.engines.base.NewTokens` events) go to a :class:`~worker.serve.TokenStream`, which coalesces them into :class:`~sclsd.protocol.Tokens`
messages (the first at once, then at most one per ``STREAM_INTERVAL_S``) sent
through the same PAIR, so they always precede the batch's Result. Retained KV
is the engine's: a :class:`~sclsd.protocol.Release` from the daemon drops some
at once (from the receive thread), a :class:`~sclsd.protocol.CancelRows` ends rows whose
requests ended in the daemon (queued ones are dropped when the serve thread takes their
batch, running ones leave the engine's next step: :meth:`Engine.cancel
<worker.engines.base.Engine.cancel>`), every new registration drops all of it (the
daemon has forgotten what this worker held), and each Result lists what the
engine evicted.

Requests are sent whole once: the receive thread turns each batch's continued rows
(deltas) back into whole rows from the worker's records (:class:`~worker.rows.RowBook`)
as it arrives, in order with the ``release`` and ``forget`` messages that drop records,
and the serve thread grows each record by the tokens its row generated; a batch that
continues a request with no record here is answered at once with ``Result.unknown``
(the daemon then sends it whole).

The receive thread acknowledges every batch it queues (:class:`~sclsd.protocol.BatchAck`),
so the daemon knows which batches reached the worker, and every heartbeat names the
batches the worker holds with the seconds since the engine last made progress (took a
batch, produced tokens, ended a batch): the daemon judges a batch by that, never by its
age, so a slow engine on a busy machine is never taken for a hung one. When the daemon falls
silent for ``daemon_timeout_s`` the queued batches are dropped (the daemon has
given them back to its pool by then) and the link starts over on a new
connection; a batch already running still sends its result there.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Any

import zmq

from sclsd import protocol as P
from worker.engines.base import CancelMarks, Engine
from worker.link import DaemonLink, RuntimeOptions
from worker.rows import RowBook, UnknownRows
from worker.serve import Holding, ServeLoop, State

__all__ = ["RuntimeOptions", "WorkerRuntime"]

log = logging.getLogger("worker")

#: Fault injection for tests: seconds the first Register of the process takes to build, as
#: a slow first import or a busy machine makes it (0 or unset: none).
REGISTER_DELAY_ENV = "SCLSD_WORKER_REGISTER_DELAY_S"


class WorkerRuntime:
    """Runs one engine behind a DEALER socket until shutdown (see the module docstring)."""

    def __init__(self, engine: Engine, opts: RuntimeOptions) -> None:
        self.engine = engine
        self.opts = opts
        self.state = State()
        self.ctx = zmq.Context()
        self.link = DaemonLink(self.ctx, opts, self._register_msg)
        self.batches: queue.Queue[tuple[P.BatchMsg, float] | None] = queue.Queue()
        self.holding = Holding()
        self.cancels = CancelMarks()
        """Rows the daemon cancelled whose batches may still wait in the local queue."""
        self.rows = RowBook()
        """The requests this worker holds records of (later rows come as deltas)."""
        # What the engine is and can do, computed once before the first Register (its first
        # call may import libraries: slow on a busy machine, so not while registering).
        self.info = engine.info()
        self.profile = opts.profile or engine.profile()
        self._register_delay = float(os.environ.get(REGISTER_DELAY_ENV) or 0)
        self._inproc = f"inproc://results-{id(self)}"
        self._stop_requested = threading.Event()
        self._abandon = threading.Event()
        self._stop_reason = ""

    # ------------------------------------------------------------------ control

    def request_stop(self, reason: str, abandon: bool = False) -> None:
        """Ask the worker to exit after the running batch, or at once with ``abandon``.

        Safe to call from a signal handler or another thread.
        """
        self._stop_reason = reason
        self._stop_requested.set()
        if abandon:
            self._abandon.set()

    def _register_msg(self) -> P.Register:
        # A (re-)registration means the daemon knows nothing of what we hold.
        self.engine.release()
        self.rows.drop()
        self.cancels.clear()
        if self._register_delay > 0:
            log.warning("%s: building the first register takes %.1fs more", REGISTER_DELAY_ENV,
                        self._register_delay)
            time.sleep(self._register_delay)
            self._register_delay = 0.0
        info = self.info
        return P.Register(
            worker_id=self.opts.worker_id,
            engine=info.engine,
            model=info.model,
            device=info.device,
            kv_bytes_per_token=info.kv_bytes_per_token,
            mem_available=info.mem_available,
            pid=os.getpid(),
            eos_token_ids=list(info.eos_token_ids),
            vocab_size=info.vocab_size,
            auth=self.opts.auth,
            profile=self.profile,
            caps=info.caps,
        )

    # ------------------------------------------------------------------ serve thread

    def _serve_loop(self) -> None:
        """The serve thread (:class:`~worker.serve.ServeLoop`), sending through its end of the PAIR."""
        pair = self.ctx.socket(zmq.PAIR)
        pair.setsockopt(zmq.LINGER, 0)
        pair.connect(self._inproc)
        try:
            ServeLoop(self.engine, self.batches, self.holding, self.rows, self.state,
                      self.opts.worker_id, pair.send, self.cancels).run()
        finally:
            pair.close()

    # ------------------------------------------------------------------ receive thread

    def _refuse(self, batch: P.BatchMsg, why: str) -> None:
        """Answer a batch we will not serve with an error, so its requests go back to the pool."""
        log.warning("batch=%d refused: %s", batch.batch_id, why)
        self.holding.discard(batch.batch_id)
        res = P.Result(worker_id=self.opts.worker_id, batch_id=batch.batch_id, error=why)
        self.link.send(res, keep=True)

    def _drop_queued(self) -> int:
        """Empty the local queue of batches not started; a stop marker stays. Returns the count."""
        dropped = 0
        while True:
            try:
                item = self.batches.get_nowait()
            except queue.Empty:
                return dropped
            if item is None:
                self.batches.put(None)
                return dropped
            self.holding.discard(item[0].batch_id)
            dropped += 1

    def _begin_stop(self, why: str) -> None:
        st = self.state
        if st.stopping:
            return
        st.stopping = True
        st.stop_deadline = time.monotonic() + self.opts.shutdown_timeout_s
        log.info("stopping (%s): finishing the running batch", why)
        # Batches not started are handed back rather than silently dropped.
        while True:
            try:
                item = self.batches.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                self._refuse(item[0], "worker shutting down")
        self.batches.put(None)

    def _on_message(self, msg: Any) -> None:
        st = self.state
        if isinstance(msg, P.BatchMsg):
            if st.stopping:
                self._refuse(msg, "worker shutting down")
            elif st.draining:
                self._refuse(msg, "worker draining")
            else:
                try:
                    # Here, in order with the release and forget messages that drop records.
                    msg = self.rows.expand(msg)
                except UnknownRows as exc:
                    # Not served: the daemon sends these requests whole next time, uncharged.
                    log.warning("batch=%d refused: %s", msg.batch_id, exc)
                    self.link.send(P.Result(worker_id=self.opts.worker_id, batch_id=msg.batch_id,
                                            error=str(exc), unknown=exc.rids), keep=True)
                    return
                self.holding.add(msg.batch_id)
                self.batches.put((msg, time.monotonic()))
                # Kept in order behind earlier messages; the Result, which comes through
                # the outbox too, can only follow it.
                ack = P.BatchAck(worker_id=self.opts.worker_id, batch_id=msg.batch_id)
                self.link.send(ack, keep=True)
        elif isinstance(msg, P.Release):
            self.rows.drop(msg.rids)
            self.engine.release(msg.rids)
        elif isinstance(msg, P.Forget):
            self.rows.drop(msg.rids)
        elif isinstance(msg, P.CancelRows):
            # Their requests ended in the daemon: a queued row is dropped when the serve thread
            # takes its batch, a running one leaves the engine's next step; nothing is kept.
            rows = [(c.batch_id, c.rid) for c in msg.rows]
            rids = [c.rid for c in msg.rows]
            self.rows.drop(rids)
            self.cancels.add(rows)
            self.engine.cancel(rows)
            self.engine.release(rids)
        elif isinstance(msg, P.Drain):
            if not st.draining:
                log.info(
                    "draining: finishing %d queued batches, taking no more", self.batches.qsize()
                )
            st.draining = True
        elif isinstance(msg, P.Resume):
            if st.draining:
                log.info("resumed: taking batches again")
            st.draining = False
        elif isinstance(msg, P.Reregister):
            # The daemon declared us dead (e.g. we hung past its heartbeat timeout) and
            # already gave our batches back to the pool: drop the queued ones, register again.
            dropped = self._drop_queued()
            log.warning("daemon asks us to register again (dropped %d queued batches)", dropped)
            self.link.unregister()
        elif isinstance(msg, P.Shutdown):
            self._begin_stop("shutdown from the daemon")
        # Keepalive needs no handling: receiving it is the point (see DaemonLink.receive).

    def _on_silence(self, quiet: float) -> None:
        """The daemon said nothing for too long: it re-queued our batches; start over."""
        dropped = self._drop_queued()
        log.warning(
            "no message from the daemon for %.1fs (--daemon-timeout %.1fs): dropped %d queued "
            "batches; reconnecting and registering again",
            quiet,
            self.opts.daemon_timeout_s,
            dropped,
        )
        self.link.reopen()

    def _poller(self, results: zmq.Socket) -> zmq.Poller:
        poller = zmq.Poller()
        poller.register(self.link.sock, zmq.POLLIN)
        poller.register(self.link.monitor, zmq.POLLIN)
        poller.register(results, zmq.POLLIN)
        return poller

    def run(self) -> int:
        """Run until shutdown; returns the process exit code (0 on a clean stop)."""
        opts, st, link = self.opts, self.state, self.link
        results = self.ctx.socket(zmq.PAIR)
        results.setsockopt(zmq.LINGER, 0)
        results.bind(self._inproc)  # bind before the serve thread connects
        link.open()
        server = threading.Thread(target=self._serve_loop, name="serve", daemon=True)
        server.start()

        poller = self._poller(results)
        generation = link.generation
        next_beat = time.monotonic()
        abandoned = False
        try:
            while True:
                now = time.monotonic()
                if self._stop_requested.is_set() and not st.stopping:
                    self._begin_stop(self._stop_reason)
                if st.stopping:
                    if not server.is_alive() and (not link.outbox or now > st.stop_deadline):
                        break
                    if now > st.stop_deadline or self._abandon.is_set():
                        log.warning("running batch abandoned")
                        abandoned = True
                        break
                elif link.silent_for(now) is not None:
                    # Read what is already waiting first: the verdict must not race a
                    # keepalive that arrived during the last loop.
                    for msg in link.receive():
                        self._on_message(msg)
                    quiet = link.silent_for(time.monotonic())
                    if quiet is not None:
                        self._on_silence(quiet)
                if link.generation != generation:
                    poller, generation = self._poller(results), link.generation
                link.maybe_register(now)
                link.flush()
                # Behind what the outbox holds, never ahead: a heartbeat that does not name a
                # batch must not overtake that batch's ack or result.
                if link.welcomed and now >= next_beat and not link.outbox:
                    held, stalled = self.holding.report()
                    beat = P.Heartbeat(
                        worker_id=opts.worker_id,
                        queued_batches=self.batches.qsize(),
                        busy=st.busy,
                        batches=held,
                        stalled_s=round(stalled, 3),
                    )
                    link.send(beat)
                    next_beat = now + link.heartbeat_s

                timeout = opts.poll_ms
                if (st.stopping and server.is_alive()) or (link.connected and not link.registered):
                    # Short naps while a batch winds down or the handshake completes.
                    timeout = min(timeout, 20)
                if link.welcomed:
                    timeout = max(0, min(timeout, int((next_beat - now) * 1000) + 1))
                for s, _ in poller.poll(timeout):
                    if s is link.sock:
                        for msg in link.receive():
                            self._on_message(msg)
                    elif s is results:
                        while True:
                            try:
                                body = results.recv(flags=zmq.NOBLOCK)
                            except zmq.Again:
                                break
                            link.outbox.append(body)
                        link.flush()
                    elif s is link.monitor:
                        link.on_monitor()
        finally:
            if link.outbox:
                log.warning("%d messages could not be delivered", len(link.outbox))
            results.close(0)
            # An abandoned serve thread may still hold its PAIR: do not wait for it.
            link.close(0 if abandoned else None)
            if not abandoned:
                self.ctx.term()
        log.info("exiting")
        return 0
