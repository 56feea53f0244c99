"""The live-request table: the one place that ends requests.

Every accepted request is in :class:`LiveRequests` until it gets exactly one
terminal event: ``done`` (:meth:`LiveRequests.finish`) or ``error``
(:meth:`LiveRequests.fail`); :meth:`LiveRequests.cancel` ends one on the
client's wish. Each of them removes the request from the table and from the
scheduler, so no second terminal event can follow.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from .. import protocol as P
from ..core.request import FinishReason, Request
from ..core.scheduler import Scheduler
from ..tokenizer import Detokenizer
from .metrics import Metrics
from .sockets import Conn

log = logging.getLogger("sclsd")


@dataclass(eq=False)
class ReqCtx:
    """What the daemon keeps per live request beyond the scheduler's view."""

    req: Request
    conn: Conn
    gen: P.Generate
    prompt_ids: list[int]
    out_ids: list[int] = field(default_factory=list)
    detok: Detokenizer = field(default_factory=Detokenizer)

    @property
    def rid(self) -> str:
        return self.req.rid

    @property
    def uid(self) -> int | None:
        """The client's uid (SO_PEERCRED), for the per-uid admission share."""
        return self.conn.peer.uid if self.conn.peer is not None else None


class LiveRequests:
    """Accepted requests by id, the bounds' counters, and their terminal events."""

    def __init__(self, sched: Scheduler, metrics: Metrics, clock: Callable[[], float]) -> None:
        self.sched = sched
        self.metrics = metrics
        self.clock = clock
        self.ctx: dict[str, ReqCtx] = {}
        #: Prompt tokens of live requests (``daemon.max_queued_tokens``).
        self.queued_tokens = 0
        #: Live requests and their prompt tokens per client uid (``daemon.uid_share``).
        self.by_uid: dict[int | None, tuple[int, int]] = {}
        #: Set while no request is live (the drain waits for it).
        self.idle = asyncio.Event()
        self.idle.set()

    def __len__(self) -> int:
        return len(self.ctx)

    def __contains__(self, rid: object) -> bool:
        return rid in self.ctx

    def get(self, rid: str) -> ReqCtx | None:
        return self.ctx.get(rid)

    def add(self, conn: Conn, gen: P.Generate, req: Request, prompt_ids: list[int]) -> ReqCtx:
        """Accept: the request is live, the client hears ``accepted``, the pool has it."""
        c = ReqCtx(req, conn, gen, prompt_ids, detok=Detokenizer(stop=list(gen.stop)))
        self.ctx[req.rid] = c
        self.idle.clear()
        self._count(c, +1)
        conn.rids.add(req.rid)
        conn.send(P.Accepted(id=req.rid, prompt_tokens=len(prompt_ids)))
        self.sched.add(req, req.arrival)
        return c

    def delta(self, c: ReqCtx, ids: list[int], text: str) -> None:
        """New tokens of a streaming request (nothing for a non-streaming one)."""
        if c.gen.stream and (ids or text) and self.ctx.get(c.rid) is c:
            c.conn.send(P.Delta(id=c.rid, token_ids=ids, text=text))

    # ------------------------------------------------------------------ terminal events

    def finish(self, c: ReqCtx, reason: FinishReason) -> None:
        """End ``c`` with ``done``. The scheduler must already have let go of it (it
        finished, failed for good, timed out or was cancelled there)."""
        if self.ctx.get(c.rid) is not c:
            return
        now = self.clock()
        r = c.req
        done = P.Done(
            id=r.rid,
            finish_reason=reason,
            usage=P.Usage(prompt_tokens=len(c.prompt_ids), completion_tokens=len(c.out_ids)),
            timings=self._timings(c, now),
            text=None if c.gen.stream else c.detok.text,
            token_ids=None if c.gen.stream else list(c.out_ids),
            worker=r.worker,
        )
        c.conn.send(done)
        self._end(c, reason, done.timings)
        log.info("done id=%s reason=%s prompt=%d out=%d slices=%d e2e=%.3fs worker=%s",
                 r.rid, reason, len(c.prompt_ids), len(c.out_ids), r.slices, done.timings.e2e_s, r.worker)

    def fail(self, rid: str, code: P.ErrorCode, message: str) -> None:
        """End a live request with ``error`` (a daemon-side failure or shutdown)."""
        c = self.ctx.get(rid)
        if c is None:
            return
        self.sched.cancel(rid, self.clock(), "error")
        c.conn.send(P.Error(code=code, message=message, id=rid))
        self._end(c, "error", self._timings(c, self.clock()))
        log.info("error id=%s code=%s", rid, code)

    def cancel(self, rid: str, reason: FinishReason = "cancelled", notify: bool = True) -> bool:
        """End a live request on the client's wish (``notify=False``: the client is gone)."""
        c = self.ctx.get(rid)
        if c is None or self.sched.cancel(rid, self.clock(), reason) is None:
            return False
        if notify:
            self.finish(c, reason)
        else:
            self._end(c, reason, self._timings(c, self.clock()))
        return True

    def conn_closed(self, conn: Conn) -> None:
        """A client that disconnects cancels its requests."""
        for rid in list(conn.rids):
            if rid in self.ctx:
                log.info("id=%s cancelled: conn=%d disconnected", rid, conn.cid)
                self.cancel(rid, "cancelled", notify=False)

    def fail_all(self, code: P.ErrorCode, message: str) -> list[str]:
        """End every live request with ``error`` (shutdown); returns their ids."""
        left = list(self.ctx)
        for rid in left:
            self.fail(rid, code, message)
        return left

    # ------------------------------------------------------------------ internals

    def _timings(self, c: ReqCtx, now: float) -> P.Timings:
        r = c.req
        return P.Timings(
            queued_s=(r.first_dispatch if r.first_dispatch is not None else now) - r.arrival,
            ttft_s=None if r.first_token is None else r.first_token - r.arrival,
            e2e_s=now - r.arrival,
            slices=r.slices,
        )

    def _end(self, c: ReqCtx, reason: FinishReason, t: P.Timings) -> None:
        if self.ctx.pop(c.rid, None) is not None:
            self._count(c, -1)
            if not self.ctx:
                self.idle.set()
        c.conn.rids.discard(c.rid)
        self.metrics.finished(reason, len(c.prompt_ids), len(c.out_ids), t)

    def _count(self, c: ReqCtx, sign: int) -> None:
        n = len(c.prompt_ids)
        self.queued_tokens += sign * n
        reqs, toks = self.by_uid.get(c.uid, (0, 0))
        reqs, toks = reqs + sign, toks + sign * n
        if reqs:
            self.by_uid[c.uid] = (reqs, toks)
        else:
            self.by_uid.pop(c.uid, None)
