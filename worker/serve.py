"""The worker's serve thread: the loop that drives the engine, and what it sends.

The receive thread (:mod:`worker.runtime`) queues each batch as it arrives, its
continued rows already turned back into whole rows from the worker's records
(:class:`~worker.rows.RowBook`), in order with the ``release`` and ``forget`` messages
that drop records. :class:`ServeLoop` owns the engine's loop: it submits queued batches
while the engine has room (:meth:`~worker.engines.base.Engine.submit`), polls it
(:meth:`~worker.engines.base.Engine.poll`) and dispatches each event by type. New tokens
are coalesced into :class:`~sclsd.protocol.Tokens` messages (:class:`TokenStream`); each
batch's end becomes a :class:`~sclsd.protocol.Result`, and its rows' tokens grow their
records. Both go out through the PAIR the receive thread reads, so they keep their order.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import msgspec

from sclsd import protocol as P
from worker.engines.base import BatchDone, CancelMarks, Engine, Event, NewTokens
from worker.rows import RowBook

__all__ = ["MAX_ERROR_CHARS", "NOTHING", "POLL_S", "STREAM_INTERVAL_S", "Holding", "ServeLoop", "State", "Take",
           "TokenStream", "drive", "result_rows"]

log = logging.getLogger("worker")

#: Longest engine error text sent back to the daemon.
MAX_ERROR_CHARS = 2000
#: Least time between two Tokens messages of one batch.
STREAM_INTERVAL_S = 0.02
#: Longest a busy continuous engine waits for tokens before the loop looks at the queue again.
POLL_S = 0.005
#: What :meth:`ServeLoop.take` returns when no batch came within its timeout.
NOTHING: Final = object()


class TokenStream:
    """Coalesces the engine's new tokens (its :class:`~worker.engines.base.NewTokens` events) of
    every running batch into
    :class:`~sclsd.protocol.Tokens` messages: a batch's first tokens go at once (with
    whatever else is pending), the rest at most every ``interval`` seconds, all batches in
    one message. Each row's part says where it starts in the slice
    (``RequestOutput.start``). Tokens still pending when a batch ends go with its Result
    (:meth:`end` says how many of each row's went before: :func:`result_rows`)."""

    def __init__(self, send: Callable[[bytes], None], worker_id: str,
                 interval: float = STREAM_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.send = send
        self.worker_id = worker_id
        self.interval = interval
        self.clock = clock
        self.pending: dict[int, dict[str, P.RequestOutput]] = {}
        self.sent_rows: dict[int, dict[str, int]] = {}
        """Per running batch, each row's tokens sent so far."""
        self.next_at = float("-inf")
        self.sent = 0
        """Tokens messages sent."""

    def __call__(self, batch_id: int, outputs: list[P.RequestOutput]) -> None:
        rows = self.pending.setdefault(batch_id, {})
        first = batch_id not in self.sent_rows
        sent = self.sent_rows.setdefault(batch_id, {})
        for o in outputs:
            acc = rows.get(o.rid)
            if acc is None:
                rows[o.rid] = P.RequestOutput(rid=o.rid, token_ids=list(o.token_ids), start=sent.get(o.rid, 0),
                                              finish_reason=o.finish_reason, logprobs=list(o.logprobs),
                                              prompt_logprobs=o.prompt_logprobs)
            else:
                acc.token_ids.extend(o.token_ids)
                acc.logprobs.extend(o.logprobs)
                if o.prompt_logprobs and not acc.prompt_logprobs:
                    acc.prompt_logprobs = o.prompt_logprobs
                acc.finish_reason = o.finish_reason
        now = self.clock()
        if first or now >= self.next_at:
            self.flush(now)

    def flush(self, now: float) -> None:
        """Send what is pending, one message for all batches."""
        parts = []
        for b, rows in self.pending.items():
            if rows:
                sent = self.sent_rows[b]
                for o in rows.values():
                    sent[o.rid] = o.start + len(o.token_ids)
                parts.append(P.BatchTokens(batch_id=b, outputs=list(rows.values())))
        self.pending = {}
        if parts:
            self.next_at = now + self.interval
            self.sent += 1
            self.send(P.encode(P.Tokens(worker_id=self.worker_id, batches=parts)))

    def end(self, batch_id: int) -> dict[str, int]:
        """Batch ``batch_id`` ended: its pending tokens go with its Result instead. Returns
        how many tokens of each row went out in ``tokens`` messages."""
        self.pending.pop(batch_id, None)
        return self.sent_rows.pop(batch_id, {})


def result_rows(outputs: list[P.RequestOutput], sent: dict[str, int]) -> list[P.RequestOutput]:
    """A Result's rows from the engine's ``outputs`` (every token of the slice): each row's
    tokens after the ``sent[rid]`` that ``tokens`` messages carried, ``start`` saying so (and
    its ``prompt_logprobs`` only if no such message carried any of its tokens)."""
    rows = []
    for o in outputs:
        k = min(sent.get(o.rid, 0), len(o.token_ids))
        # Tokens parts that went out carried the row's first part, and with it its prompt's
        # log-probabilities: the result does not send them again.
        rows.append(o if k == 0 else msgspec.structs.replace(
            o, token_ids=o.token_ids[k:], start=k, logprobs=o.logprobs[k:] if o.logprobs else [],
            prompt_logprobs=[]))
    return rows


@dataclass
class State:
    """What both threads read: the receive thread sets the first three, the serve thread ``busy``."""

    draining: bool = False
    stopping: bool = False
    stop_deadline: float = 0.0
    busy: bool = False


class Holding:
    """The batches the worker holds (queued or running) and when its engine last made
    progress; written by both threads, hence the lock."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._held: set[int] = set()
        self._progress_at = clock()

    def add(self, batch_id: int) -> None:
        """A batch was queued (an idle engine's clock starts with it)."""
        with self._lock:
            if not self._held:
                self._progress_at = self.clock()
            self._held.add(batch_id)

    def discard(self, batch_id: int) -> None:
        """A batch ended, or was handed back unserved."""
        with self._lock:
            self._held.discard(batch_id)

    def progressed(self) -> None:
        """The engine took a batch, produced tokens or ended a batch."""
        with self._lock:
            self._progress_at = self.clock()

    def report(self) -> tuple[list[int], float]:
        """(the batches held, seconds since the engine's last progress; 0 when none held)."""
        with self._lock:
            held = sorted(self._held)
            return held, (max(0.0, self.clock() - self._progress_at) if held else 0.0)


#: ``take(timeout)``: the next batch; :data:`NOTHING` when none came within ``timeout`` seconds
#: (None: wait for one); None to stop once every batch taken has ended.
Take = Callable[[float | None], "P.BatchMsg | object | None"]


def drive(engine: Engine, take: Take, on_event: Callable[[Event], None]) -> None:
    """The engine's loop: submit batches from ``take`` while the engine has room, poll it while
    it is busy and hand each event to ``on_event``; returns once ``take`` said stop (None) and
    every batch taken has ended. An idle engine waits in ``take``; a busy one only looks."""
    stopping = False
    while True:
        while not stopping and engine.has_room():
            item = take(0.0 if engine.busy() else None)
            if item is NOTHING:
                break
            if item is None:
                stopping = True
                break
            assert isinstance(item, P.BatchMsg)
            engine.submit(item)
        if not engine.busy():
            if stopping:
                return
            continue
        for ev in engine.poll(POLL_S):
            on_event(ev)


class ServeLoop:
    """The serve thread's work (see the module docstring); ``send`` takes encoded messages."""

    def __init__(self, engine: Engine, batches: queue.Queue[tuple[P.BatchMsg, float] | None],
                 holding: Holding, rows: RowBook, state: State, worker_id: str,
                 send: Callable[[bytes], None], cancels: CancelMarks | None = None) -> None:
        self.engine = engine
        self.cancels = cancels if cancels is not None else CancelMarks()
        """Rows the daemon cancelled (the receive thread marks them): dropped as their batch is taken."""
        self.dropped: dict[int, tuple[list[P.RequestOutput], dict[str, int]]] = {}
        """Per batch in flight, the rows dropped before it started (they join its Result) and
        their budgets in the slice."""
        self.batches = batches
        self.holding = holding
        self.rows = rows
        self.state = state
        self.wid = worker_id
        self.send = send
        self.tokens = TokenStream(send, worker_id)
        """Every running batch's tokens, coalesced."""
        self.waited: dict[int, float] = {}
        """Per batch in flight, its time in the local queue."""

    def run(self) -> None:
        """The engine's loop until a stop is queued and every batch taken has ended; an engine
        failure ends the process."""
        try:
            self.loop()
        except Exception:
            # Admitted requests cannot be answered any more: exit, and the daemon re-queues
            # them when it sees the process (or its heartbeats) gone.
            log.exception("engine %s failed; exiting", self.engine.name)
            os._exit(1)
        finally:
            self.state.busy = False

    def loop(self) -> None:
        """:func:`drive` over the local queue, the events to :meth:`stream` and :meth:`done`."""
        drive(self.engine, self.take, self.on_event)

    def on_event(self, ev: Event) -> None:
        """Dispatch one engine event by its type."""
        if isinstance(ev, NewTokens):
            self.stream(ev.batch_id, ev.outputs)
        elif isinstance(ev, BatchDone):
            self.done(ev.batch, ev.outputs, ev.stats, None)
        else:
            self.done(ev.batch, None, None, ev.error)

    def take(self, timeout: float | None) -> P.BatchMsg | object | None:
        """The next batch (rows whole) less the rows the daemon cancelled meanwhile (a batch
        left with none ends here, unserved); :data:`NOTHING` when none came in time (None:
        wait for one), None to stop."""
        while True:
            try:
                item = self.batches.get(timeout=timeout) if timeout != 0.0 else self.batches.get_nowait()
            except queue.Empty:
                return NOTHING
            if item is None:
                return None
            batch, queued_at = item
            self.waited[batch.batch_id] = time.monotonic() - queued_at
            self.state.busy = True
            self.holding.progressed()
            gone = self.cancels.take_for(batch.batch_id)
            if not gone:
                return batch
            left = [r for r in batch.requests if r.rid not in gone]
            self.dropped[batch.batch_id] = (
                [P.RequestOutput(rid=r.rid, token_ids=[], finish_reason="cancelled")
                 for r in batch.requests if r.rid in gone],
                {r.rid: min(r.max_new_tokens, batch.slice_len) for r in batch.requests if r.rid in gone})
            if left:
                return msgspec.structs.replace(batch, requests=left)
            self.done(batch, [], P.BatchStats(), None)

    def stream(self, batch_id: int, outputs: list[P.RequestOutput]) -> None:
        """A running batch's new tokens."""
        self.holding.progressed()
        self.tokens(batch_id, outputs)

    def done(self, batch: P.BatchMsg, outputs: list[P.RequestOutput] | None, stats: P.BatchStats | None,
             error: str | None) -> None:
        """A batch's outcome: its Result; its rows' tokens grow their records."""
        sent = self.tokens.end(batch.batch_id)
        wait = self.waited.pop(batch.batch_id, 0.0)
        self.state.busy = bool(self.waited)
        self.holding.progressed()
        self.holding.discard(batch.batch_id)
        # Evictions ride on the result, in order: the daemon applies a result after
        # detokenizing it off its loop, so a message of their own could overtake the result
        # that reported the KV kept.
        evicted = self.engine.take_evicted()
        dropped, caps = self.dropped.pop(batch.batch_id, ([], {}))
        if outputs is not None and stats is not None:
            outputs = outputs + dropped
            stats = _with_cancels(batch, outputs, stats, caps)
        if error is not None or outputs is None or stats is None:
            text = (error or "the engine returned no outputs")[:MAX_ERROR_CHARS]
            log.warning("batch=%d failed: %s", batch.batch_id, text)
            res = P.Result(worker_id=self.wid, batch_id=batch.batch_id, error=text, kv_evicted=evicted)
        else:
            stats = msgspec.structs.replace(stats, queue_wait_s=wait)
            self.rows.served(outputs)
            log.debug("batch=%d done: n=%d L=%d iterations=%d prefill=%.3fs decode=%.3fs",
                      batch.batch_id, stats.batch_size, stats.input_len, stats.iterations,
                      stats.prefill_s, stats.decode_s)
            res = P.Result(worker_id=self.wid, batch_id=batch.batch_id, outputs=result_rows(outputs, sent),
                           stats=stats, kv_evicted=evicted, rows=self.engine.rows_now())
        self.send(P.encode(res))


def _with_cancels(batch: P.BatchMsg, outputs: list[P.RequestOutput], stats: P.BatchStats,
                  dropped: dict[str, int]) -> P.BatchStats:
    """``stats`` counting the rows of ``batch`` a cancel ended and the tokens they did not
    generate (each row's budget in the slice, less what it had made; ``dropped``: the budgets
    of rows dropped before the batch started)."""
    cancelled = [o for o in outputs if o.finish_reason == "cancelled"]
    if not cancelled:
        return stats
    caps = {r.rid: min(r.max_new_tokens, batch.slice_len) for r in batch.requests} | dropped
    saved = sum(max(0, caps.get(o.rid, 0) - len(o.token_ids)) for o in cancelled)
    return msgspec.structs.replace(stats, cancelled_rows=len(cancelled), saved_tokens=saved)
