"""The live-request table: the one place that ends requests.

Every accepted request is in :class:`LiveRequests` until it gets exactly one
terminal event: ``done`` (:meth:`LiveRequests.finish`) or ``error``
(:meth:`LiveRequests.fail`); :meth:`LiveRequests.cancel` ends one on the
client's wish. Each of them removes the request from the table and from the
scheduler, so no second terminal event can follow.

A request that ends at a stop string keeps only the tokens up to the one that
completed it: its ``delta`` token ids, its ``done`` token ids and logprobs and
its usage count those (the text is cut where the stop string starts). The
count is found when the stop appears, with a few decodes of a window of at most
a slice plus the stop string's length.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from .. import protocol as P
from ..core.request import FinishReason, Request
from ..core.scheduler_api import SchedulerInterface
from ..tokenizer import Detokenizer, Tokenizer
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
    tok: Tokenizer | None = None
    """The daemon's tokenizer: token texts for logprobs, the tokens kept at a stop string."""
    logprobs: list[P.TokenLogprobs] = field(default_factory=list)
    """Of ``out_ids``, in order, as far as workers sent them (requests with logprobs)."""
    sent_logprobs: int = 0
    """Entries of ``logprobs`` already sent in deltas."""
    stop_free: int = 0
    """Leading tokens of ``out_ids`` known not to complete a stop string."""
    kept: int | None = None
    """Tokens kept once a stop string ended the request (None: none did)."""
    inbound: list[tuple[list[int], list[P.TokenLogprobs]]] = field(default_factory=list)
    """Streamed tokens (and logprobs) on their way to ``out_ids`` (being detokenized), one
    chunk per ``tokens`` message."""
    streamed: int = 0
    """Tokens of the running slice (batch ``streamed_bid``) taken from its ``tokens``
    messages; its result adds only what follows them."""
    streamed_bid: int | None = None
    streamed_reason: FinishReason | None = None
    """The worker said the row finished in a ``tokens`` message (kept in case no result comes)."""

    @property
    def rid(self) -> str:
        return self.req.rid

    @property
    def uid(self) -> int | None:
        """The client's uid (SO_PEERCRED), for the per-uid admission share."""
        return self.conn.peer.uid if self.conn.peer is not None else None


class LiveRequests:
    """Accepted requests by id, the bounds' counters, and their terminal events."""

    def __init__(self, sched: SchedulerInterface, metrics: Metrics, clock: Callable[[], float]) -> None:
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
        #: Token id -> text, for logprobs (bounded by the vocabulary).
        self._texts: dict[int, str] = {}
        #: Called with each request as it ends, after its terminal event (dispatch releases
        #: the KV a worker keeps for it).
        self.on_end: list[Callable[[ReqCtx], None]] = []

    def __len__(self) -> int:
        return len(self.ctx)

    def __contains__(self, rid: object) -> bool:
        return rid in self.ctx

    def get(self, rid: str) -> ReqCtx | None:
        return self.ctx.get(rid)

    def add(self, conn: Conn, gen: P.Generate, req: Request, prompt_ids: list[int],
            tok: Tokenizer | None = None) -> ReqCtx:
        """Accept: the request is live, the client hears ``accepted``, the pool has it."""
        c = ReqCtx(req, conn, gen, prompt_ids, detok=Detokenizer(stop=list(gen.stop)), tok=tok)
        self.ctx[req.rid] = c
        self.idle.clear()
        self._count(c, +1)
        conn.rids.add(req.rid)
        conn.send(P.Accepted(id=req.rid, prompt_tokens=len(prompt_ids)))
        self.sched.add(req, req.arrival)
        return c

    def delta(self, c: ReqCtx, ids: list[int], text: str) -> None:
        """New tokens ``ids`` (the tail of ``c.out_ids``) and text: sent to a streaming
        request's client (trimmed at a stop string); notes where a stop string ended it."""
        if self.ctx.get(c.rid) is not c:
            return
        if c.detok.stop:
            ids = self._stop_cut(c, ids)
        if not c.gen.stream:
            return
        lps = None
        if c.gen.logprobs or c.gen.top_logprobs:
            upto = len(c.logprobs) if c.kept is None else min(c.kept, len(c.logprobs))
            lps = self._named(c, c.logprobs[c.sent_logprobs:upto]) or None
            c.sent_logprobs = max(c.sent_logprobs, upto)
        if ids or text or lps:
            c.conn.send(P.Delta(id=c.rid, token_ids=ids, text=text, logprobs=lps))

    # ------------------------------------------------------------------ terminal events

    def finish(self, c: ReqCtx, reason: FinishReason) -> None:
        """End ``c`` with ``done``. The scheduler must already have let go of it (it
        finished, failed for good, timed out or was cancelled there)."""
        if self.ctx.get(c.rid) is not c:
            return
        if c.detok.stopped and c.detok.stop:
            self._stop_cut(c, [])
            assert c.kept is not None
            del c.out_ids[c.kept:]
            del c.logprobs[c.kept:]
        now = self.clock()
        r = c.req
        wants_lps = (c.gen.logprobs or c.gen.top_logprobs) and not c.gen.stream
        done = P.Done(
            id=r.rid,
            finish_reason=reason,
            usage=P.Usage(prompt_tokens=len(c.prompt_ids), completion_tokens=len(c.out_ids)),
            timings=self._timings(c, now),
            text=None if c.gen.stream else c.detok.text,
            token_ids=None if c.gen.stream else list(c.out_ids),
            worker=r.worker,
            logprobs=self._named(c, c.logprobs) if wants_lps else None,
        )
        c.conn.send(done)
        self._end(c, reason, done.timings)
        log.info("done id=%s reason=%s prompt=%d out=%d slices=%d e2e=%.3fs worker=%s%s",
                 r.rid, reason, len(c.prompt_ids), len(c.out_ids), r.slices, done.timings.e2e_s, r.worker,
                 "" if c.gen.user is None else f" user={c.gen.user!r}")

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

    def _stop_cut(self, c: ReqCtx, ids: list[int]) -> list[int]:
        """Of the newest tokens ``ids``, those before or completing a stop string."""
        n = len(c.out_ids)
        if not c.detok.stopped:
            c.stop_free = n
            return ids
        if c.kept is None:
            c.kept = kept_tokens(c.out_ids, c.detok.stop, c.stop_free, c.tok)
        return ids[: max(0, c.kept - (n - len(ids)))]

    def _named(self, c: ReqCtx, lps: list[P.TokenLogprobs]) -> list[P.TokenLogprobs]:
        """``lps`` with each token's text filled in (cached per id: a vocabulary's worth)."""
        if c.tok is None:
            return lps
        texts = self._texts
        decode = c.tok.decode

        def named(x: P.Logprob) -> P.Logprob:
            t = texts.get(x.id)
            if t is None:
                t = texts[x.id] = decode([x.id])
            return P.Logprob(x.id, x.logprob, t)

        return [P.TokenLogprobs(named(e.chosen), [named(a) for a in e.top]) for e in lps]

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
        for hook in self.on_end:
            hook(c)

    def _count(self, c: ReqCtx, sign: int) -> None:
        n = len(c.prompt_ids)
        self.queued_tokens += sign * n
        reqs, toks = self.by_uid.get(c.uid, (0, 0))
        reqs, toks = reqs + sign, toks + sign * n
        if reqs:
            self.by_uid[c.uid] = (reqs, toks)
        else:
            self.by_uid.pop(c.uid, None)


def kept_tokens(ids: list[int], stops: list[str], stop_free: int, tok: Tokenizer | None) -> int:
    """How many of ``ids`` to keep when the text of ``ids`` contains a stop string: up to and
    including the token that completed it (the first ``stop_free`` are known not to).

    Binary search over decodes of a window that starts a stop string's worth of tokens
    before ``stop_free`` (the stop cannot start earlier): cheap, and monotone in its end.
    """
    n = len(ids)
    if tok is None or n <= stop_free:
        return n
    # A character is at most 4 byte-level tokens; special tokens decode to nothing.
    start = max(0, stop_free - 4 * max(len(s) for s in stops) - 8)

    def hit(k: int) -> bool:
        text = tok.decode(ids[start:k])
        return any(s in text for s in stops)

    lo, hi = stop_free, n
    if not hit(hi):
        return n  # a tokenizer that rewrites earlier text: keep everything rather than guess
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if hit(mid):
            hi = mid
        else:
            lo = mid
    return hi
