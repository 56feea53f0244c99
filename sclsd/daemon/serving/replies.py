"""Replies: the one place that accepts requests and ends them.

Every accepted request is in the :class:`~sclsd.daemon.serving.table.RequestTable`
until it gets exactly one terminal event: ``done`` (:meth:`Replies.finish`) or
``error`` (:meth:`Replies.fail`); :meth:`Replies.cancel` ends one on the
client's wish. Each of them takes the request out of the table (and out of
the scheduler, where it still is), so no second terminal event can follow;
each ending is recorded as an :class:`~sclsd.daemon.serving.effects.Ended`.
"""

from __future__ import annotations

import logging

from ... import protocol as P
from ...core.request import FinishReason
from ...core.scheduler_api import SchedulerInterface
from .dispatch import DispatchBook
from .effects import Client, Effects, Ended
from .events import ClientEvents
from .table import Entry, RequestTable

log = logging.getLogger("sclsd")

__all__ = ["Replies"]


class Replies:
    """Accepts requests and sends their events (see the module docstring)."""

    def __init__(self, table: RequestTable, sched: SchedulerInterface, events: ClientEvents,
                 dispatch: DispatchBook) -> None:
        self.table = table
        self.sched = sched
        self.events = events
        self.dispatch = dispatch
        """Where the KV a cancel lets go of is released, and records forgotten."""

    def accept(self, e: Entry, out: Effects) -> None:
        """The request is live, its client hears ``accepted``, the pool has it."""
        self.table.add(e)
        out.send(e.client, P.Accepted(id=e.client_id, prompt_tokens=len(e.prompt_ids)))
        self.sched.add(e.req, e.req.arrival)

    def delta(self, e: Entry, ids: list[int], text: str, out: Effects) -> None:
        """New tokens ``ids`` (the tail of the output) and their text, for a live request."""
        if self.table.holds(e):
            self.delta_of_live(e, ids, text, out)

    def delta_of_live(self, e: Entry, ids: list[int], text: str, out: Effects) -> None:
        """:meth:`delta` for a request the caller knows is live."""
        ev = self.events.delta(e, ids, text)
        if ev is not None:
            out.send(e.client, ev)

    # ------------------------------------------------------------------ terminal events

    def finish(self, e: Entry, reason: FinishReason, now: float, out: Effects) -> None:
        """End ``e`` with ``done``. The scheduler must already have let go of it (it
        finished, failed for good, timed out or was cancelled there)."""
        if not self.table.holds(e):
            return
        done = self.events.done(e, reason, now)
        out.send(e.client, done)
        self._end(e, reason, done.timings, out)
        r = e.req
        log.info("done id=%s reason=%s prompt=%d out=%d slices=%d e2e=%.3fs worker=%s%s",
                 r.rid, reason, len(e.prompt_ids), len(e.out.ids), r.slices, done.timings.e2e_s,
                 r.worker, "" if e.gen.user is None else f" user={e.gen.user!r}")

    def fail(self, rid: str, code: P.ErrorCode, message: str, now: float, out: Effects) -> None:
        """End a live request with ``error`` (a daemon-side failure or shutdown)."""
        e = self.table.get(rid)
        if e is None:
            return
        cancelled = self.sched.cancel(rid, now, "error")
        if cancelled is not None:
            self.dispatch.apply(cancelled.releases, out)
        out.send(e.client, P.Error(code=code, message=message, id=e.client_id))
        self._end(e, "error", self.events.timings(e, now), out, code)
        log.info("error id=%s code=%s", rid, code)

    def failed(self, e: Entry, message: str, now: float, out: Effects,
               code: P.ErrorCode = "engine_error") -> None:
        """End ``e`` with ``error`` ``code``, the scheduler having let go of it: ``engine_error``
        when its batches failed ``scheduler.max_failures`` + 1 times; ``bad_request`` when an
        engine could not serve its row (its grammar), which no retry would change."""
        if not self.table.holds(e):
            return
        out.send(e.client, P.Error(code=code, message=message, id=e.client_id))
        # The metrics count engine_error as "error" (its batches failed), the rest by code.
        self._end(e, "error", self.events.timings(e, now), out, None if code == "engine_error" else code)
        log.info("error id=%s code=%s: %s", e.rid, code, message)

    def cancel(self, rid: str, reason: FinishReason, now: float, out: Effects,
               notify: bool = True) -> bool:
        """End a live request on the client's wish (``notify=False``: the client is gone)."""
        e = self.table.get(rid)
        cancelled = None if e is None else self.sched.cancel(rid, now, reason)
        if e is None or cancelled is None:
            return False
        self.dispatch.apply(cancelled.releases, out)
        if notify:
            self.finish(e, reason, now, out)
        else:
            self._end(e, reason, self.events.timings(e, now), out)
        return True

    def client_gone(self, client: Client, now: float, out: Effects) -> None:
        """A client that disconnects cancels its requests (it hears nothing more)."""
        for rid in sorted(self.table.of_client(client)):
            self.cancel(rid, "cancelled", now, out, notify=False)

    def fail_all(self, code: P.ErrorCode, message: str, now: float, out: Effects) -> list[str]:
        """End every live request with ``error``; returns their ids."""
        left = self.table.ids()
        for rid in left:
            self.fail(rid, code, message, now, out)
        return left

    def _end(self, e: Entry, reason: FinishReason, t: P.Timings, out: Effects,
             code: str | None = None) -> None:
        self.table.remove(e)
        # Its worker drops its record, and its row if one is still running: the work stops.
        self.dispatch.ended(e.rid, e.req.batch_id, out)
        out.ended.append(Ended(e.rid, reason, len(e.prompt_ids), len(e.out.ids), t,
                               started=e.started_at is not None, code=code,
                               token_gaps=tuple(e.token_gaps)))
