"""Run engines in a test through the worker's own loop (:func:`worker.serve.drive`)."""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import Any

from sclsd import protocol as P
from worker.engines.base import BatchDone, Engine, Event, NewTokens
from worker.serve import NOTHING, Take, drive

#: ``done(batch, outputs, stats, error)``: a batch's end (outputs and stats, or the error).
Done = Callable[[P.BatchMsg, "list[P.RequestOutput] | None", "P.BatchStats | None", "str | None"], None]
#: ``stream(batch_id, outputs)``: a running batch's new tokens.
Stream = Callable[[int, "list[P.RequestOutput]"], None]


def queue_take(q: queue.Queue[Any]) -> Take:
    """A ``take`` over a queue of batches (None in the queue: stop)."""

    def take(timeout: float | None) -> Any:
        try:
            return q.get(timeout=timeout) if timeout != 0.0 else q.get_nowait()
        except queue.Empty:
            return NOTHING

    return take


def dispatch(done: Done, stream: Stream | None = None) -> Callable[[Event], None]:
    """An ``on_event`` that calls ``done`` at each batch's end and ``stream`` with its tokens."""

    def on_event(ev: Event) -> None:
        if isinstance(ev, NewTokens):
            if stream is not None:
                stream(ev.batch_id, ev.outputs)
        elif isinstance(ev, BatchDone):
            done(ev.batch, ev.outputs, ev.stats, None)
        else:
            done(ev.batch, None, None, ev.error)

    return on_event


def run(engine: Engine, take: Take, done: Done, stream: Stream | None = None) -> None:
    """:func:`drive` ``engine`` over ``take``, each batch's end to ``done``, its tokens to ``stream``."""
    drive(engine, take, dispatch(done, stream))


def run_batches(engine: Engine, batches: list[P.BatchMsg]) -> list[tuple[P.BatchMsg, Any, Any, str | None]]:
    """Queue ``batches`` and a stop, run the loop to its end: each batch's (batch, outputs,
    stats, error), in the order they ended."""
    q: queue.Queue[Any] = queue.Queue()
    for b in batches:
        q.put(b)
    q.put(None)
    ends: list[tuple[P.BatchMsg, Any, Any, str | None]] = []
    run(engine, queue_take(q), lambda b, outs, stats, err: ends.append((b, outs, stats, err)))
    return ends
