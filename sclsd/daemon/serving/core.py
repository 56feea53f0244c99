"""The serving core: every request's life in the daemon, as plain calls that return effects.

Its entry points take what happened (a request submitted or cancelled, a
client gone, a worker joined, a worker's message, a worker lost, detokenized
text, the scheduling step, the heartbeat tick) with the time, change the
daemon's state, and return an :class:`~sclsd.daemon.serving.effects.Effects`
saying what to send where. No sockets, no event loop, no clock inside: the
shell (:mod:`sclsd.daemon.server`) feeds the inputs in and delivers the
effects, so the core's tests are synchronous calls.

The parts, by responsibility:

- :class:`~.table.RequestTable`: the one table of live requests; each entry
  owns its :class:`~sclsd.core.request.Request` and its :class:`~.output.Output`.
- :class:`~.replies.Replies`: accepting and ending requests (exactly one
  terminal event each); :class:`~.events.ClientEvents` builds the events.
- :class:`~.membership.Membership`: which workers serve, and who is lost.
- :class:`~.dispatch.DispatchBook`: batches sent, their acknowledgements and
  deadlines, KV releases; :class:`~.records.Records`: which worker holds which
  request's record, so its later rows go as deltas.
- :class:`~.streaming.Streaming`: ``tokens`` messages (streamed tokens).
- :class:`~.results.Results`: ``result`` messages (a slice's end).
- the scheduler (:class:`~sclsd.core.scheduler_api.SchedulerInterface`): what
  runs where and when.

A result's way through, top to bottom: :meth:`ServingCore.worker_message`
→ :meth:`Results.on_result <.results.Results.on_result>` checks it and asks
for its text (a :class:`~.results.ResultJob` in ``Effects.decode``) →
:meth:`ServingCore.decoded` → :meth:`Results.apply <.results.Results.apply>`:
outputs grow, the scheduler applies the batch's outcome, and
:class:`~.replies.Replies` sends the deltas and the terminal events.
"""

from __future__ import annotations

import logging
from typing import Any

from ... import protocol as P
from ...config import Config
from ...core.request import Request
from ...core.scheduler_api import SchedulerInterface
from ...tokenizer import Detokenizer, Tokenizer
from .dispatch import DispatchBook
from .effects import Client, DecodeJob, Effects
from .events import ClientEvents, PromptNamesJob
from .membership import Membership, WorkerCosts
from .output import Output
from .prefixes import PrefixRoutes
from .records import Records
from .replies import Replies
from .results import ResultJob, Results
from .streaming import Streaming, TokensJob
from .table import Entry, RequestTable

log = logging.getLogger("sclsd")

__all__ = ["ServingCore", "fair_group"]


def fair_group(client: Client, uid: int | None, pid: int | None, gen: P.Generate) -> tuple[str, str, str]:
    """Whose turn a request takes (:mod:`sclsd.core.grant_queue`): users take turns, then each
    user's processes, then each process's groups: the one it names (``generate.group``; one
    HTTP front end's end users, each request's ``n`` choices), else its connection and
    ``user``. Named groups are scoped to the process: no client takes another's turns."""
    own = gen.group if gen.group is not None else f"conn {hash(client)}/{gen.user or ''}"
    return (f"uid {uid}", f"pid {pid}", own)


class ServingCore:
    """The daemon's state and decisions, I/O-free (see the module docstring)."""

    def __init__(self, cfg: Config, sched: SchedulerInterface, cost: WorkerCosts, tok: Tokenizer) -> None:
        self.cfg = cfg
        self.sched = sched
        self.tok = tok
        self.table = RequestTable()
        self.records = Records()
        self.members = Membership(cfg, sched, cost, tok)
        self.dispatch = DispatchBook(cfg, sched, self.table, self.members, self.records)
        self.routes = PrefixRoutes()
        self.replies = Replies(self.table, sched, ClientEvents(tok), self.dispatch)
        self.streaming = Streaming(sched, self.table, self.replies, self.dispatch)
        self.results = Results(sched, self.table, self.replies, self.dispatch, self.streaming, cost, self.routes)

    # ------------------------------------------------------------------ clients

    def submit(self, client: Client, uid: int | None, gen: P.Generate, rid: str,
               prompt_ids: list[int], now: float, pid: int | None = None) -> Effects:
        """Accept an admitted request (admission checked it): ``accepted``, then the pool.
        ``uid`` and ``pid``: the client's user and process (its peer credentials), the first
        levels of its group's turns."""
        out = Effects()
        if rid in self.table:  # admission refuses these; never two requests of one id
            out.send(client, P.Error(code="duplicate_id", message=f"request id {rid!r} is already live",
                                     id=rid))
            return out
        m = self.cfg.model
        req = Request(
            rid=rid,
            prompt_len=len(prompt_ids),
            max_tokens=m.max_tokens(gen.max_tokens, gen.min_tokens),
            arrival=now,
            priority=gen.priority,
            deadline=None if gen.timeout is None else now + gen.timeout,
            group=fair_group(client, uid, pid, gen),
        )
        hint = self.routes.hint(prompt_ids) if self.cfg.scheduler.prefix_routing else None
        if hint is not None:
            req.prefix_worker, req.prefix_tokens = hint
        output = Output(Detokenizer(stop=list(gen.stop), keep_stop=gen.include_stop_str), self.tok)
        self.replies.accept(Entry(req, client, uid, gen, list(prompt_ids), output), out)
        log.debug("accepted id=%s prompt_tokens=%d max_tokens=%d timeout=%s user=%s", rid,
                  len(prompt_ids), req.max_tokens, gen.timeout, gen.user)
        out.wake = True
        return out

    def cancel(self, rid: str, now: float, *, requester: Client, any_client: bool = False) -> Effects:
        """``requester`` cancels ``rid``: its own request, or anyone's with ``any_client`` (an
        admin). The request's client gets ``done`` (cancelled); the requester ``unknown_id``
        when there is no such live request of its own."""
        out = Effects()
        mine = any_client or self.table.owns(requester, rid)
        if not mine or not self.replies.cancel(rid, "cancelled", now, out):
            out.send(requester, P.Error(code="unknown_id", message=f"no live request {rid!r}", id=rid))
        return out

    def owns(self, client: Client, rid: str) -> bool:
        """Whether ``rid`` is a live request of ``client``."""
        return self.table.owns(client, rid)

    def client_gone(self, client: Client, now: float) -> Effects:
        """A client disconnected: its requests are cancelled, without events."""
        out = Effects()
        self.replies.client_gone(client, now, out)
        return out

    def fail(self, rid: str, code: P.ErrorCode, message: str, now: float) -> Effects:
        """End one live request with ``error`` (a daemon-side failure)."""
        out = Effects()
        self.replies.fail(rid, code, message, now, out)
        return out

    def fail_all(self, code: P.ErrorCode, message: str, now: float) -> Effects:
        """End every live request with ``error`` (shutdown, no workers left)."""
        out = Effects()
        self.replies.fail_all(code, message, now, out)
        return out

    # ------------------------------------------------------------------ workers

    def join_refusal(self, reg: P.Register) -> str | None:
        """Why an authenticated worker may not join, if it may not (its model or engine)."""
        return self.members.refusal(reg)

    def worker_joined(self, reg: P.Register, now: float) -> Effects:
        """An authenticated worker that fits registered: it serves from now on, unless the
        cost model cannot use its report (``Effects.refused``). A worker of the same id must
        have been lost first (:meth:`worker_lost`)."""
        out = Effects()
        self.records.worker_gone(reg.worker_id)  # a new registration: it holds no record
        self.routes.join(reg.worker_id, reg.caps.shared_prefixes)
        self.members.join(reg, now, out)
        return out

    def worker_rejoined(self, wid: str, now: float) -> Effects:
        """Member ``wid`` registered again on its own connection (our Welcome was late):
        welcomed again, nothing lost."""
        out = Effects()
        self.members.rewelcome(wid, now, out)
        return out

    def worker_message(self, wid: str, msg: P.WorkerMsg, now: float) -> Effects:
        """A member's heartbeat, acknowledgement, streamed tokens or result."""
        out = Effects()
        self.members.heard(wid, msg, now)
        if isinstance(msg, P.Heartbeat):
            astray = self.dispatch.heartbeat(wid, msg, now)
            if astray:
                self._lose(wid, f"batch={astray[0]} was sent to it and it does not have it", "lost_batch",
                           now, out)
        elif isinstance(msg, P.BatchAck):
            self.dispatch.acked(wid, msg.batch_id, now)
        elif isinstance(msg, P.Tokens):
            self.streaming.on_tokens(msg, now, out)
        elif isinstance(msg, P.Result):
            self.members.room(wid, msg.rows)
            self.results.on_result(msg, now, out)
        return out

    def decoded(self, job: DecodeJob, texts: Any, now: float) -> Effects:
        """What a job from ``Effects.decode`` gave (its texts, or named prompt log-probabilities),
        or why it failed. Jobs must come back in the order they were asked for: a request's
        deltas keep their order."""
        out = Effects()
        if isinstance(job, PromptNamesJob):
            if isinstance(texts, BaseException):  # the ids and values still go, without texts
                log.warning("naming the prompt's log-probabilities failed (%r); id=%s", texts, job.entry.rid)
                texts = job.lps
            job.entry.prompt_logprobs = texts
        elif isinstance(job, TokensJob):
            if isinstance(texts, BaseException):
                log.warning("detokenizing streamed tokens failed (%r); ids=%s", texts,
                            ",".join(e.rid for e, _ in job.chunks))
            self.streaming.apply(job, None if isinstance(texts, BaseException) else texts, now, out)
        elif isinstance(job, ResultJob):
            self.results.apply(job, texts, now, out)
        else:
            raise TypeError(f"not a job of this core: {job!r}")
        return out

    def worker_lost(self, wid: str, why: str, reason: P.LossReason, now: float) -> Effects:
        """A member is gone (:data:`~sclsd.protocol.LossReason`): its batches go back to the
        pool; what it streamed to clients stands."""
        out = Effects()
        self._lose(wid, why, reason, now, out)
        return out

    def drain_worker(self, wid: str, resume: bool, requester: Client) -> Effects:
        """Take a member out of rotation (or back in); ``requester`` hears its state."""
        out = Effects()
        released = self.members.resume(wid, out) if resume else self.members.drain(wid, out)
        if released is not None:
            self.dispatch.apply(released, out)
            out.send(requester, P.WorkerStateReply(worker=wid, state=self.members.state(wid),
                                                   batches_inflight=self.members.inflight(wid)))
        else:
            out.send(requester, P.Error(code="unknown_worker", message=f"no registered worker {wid!r}"))
        return out

    def _lose(self, wid: str, why: str, reason: P.LossReason, now: float, out: Effects) -> None:
        self.records.worker_gone(wid)
        self.routes.forget(wid)
        removed = self.members.leave(wid, why, reason, now, out)
        if removed is not None:
            self.dispatch.apply(removed.releases, out)
            for r in removed.ended:
                e = self.table.get(r.rid)
                if e is not None:
                    self.replies.failed(e, f"it was on {r.worker_losses} workers that died while "
                                        f"serving it (the last: {wid}, {why})", now, out)
            self.streaming.settle(None, now, out)

    # ------------------------------------------------------------------ time

    def step(self, now: float) -> tuple[Effects, float]:
        """Time out what is overdue and run a scheduling round when one is due. Returns the
        effects and the seconds until the next step is needed (unless something changes)."""
        out = Effects()
        sched = self.sched
        expired = sched.expire(now)
        self.dispatch.apply(expired.releases, out)
        for req in expired.requests:
            e = self.table.get(req.rid)
            if e is not None:
                log.info("id=%s timed out", req.rid)
                self.replies.finish(e, "timeout", now, out)
        if sched.due(now):
            rnd = sched.schedule(now)
            self.dispatch.apply(rnd.releases, out)  # before the batches: a moved request's KV
            for batch in rnd.batches:
                self.dispatch.dispatch(batch, now, out)
        wait = 1.0
        if sched.pool and sched.active_workers():
            wait = min(wait, sched.next_at - now)
        nd = sched.next_deadline()
        if nd is not None:
            wait = min(wait, nd - now)
        return out, wait

    def tick(self, now: float, judge: bool = True) -> Effects:
        """Once per heartbeat interval: silent workers are lost, the others get a keepalive;
        then workers holding a batch that made no progress are lost.

        ``judge`` False (the shell's tick came late: the daemon's own loop was held up)
        loses nobody: the workers' messages of that time are still waiting to be read, so
        their silence would be the daemon's, not theirs."""
        out = Effects()
        for wid in list(self.members.workers):
            quiet = self.members.silent_for(wid, now) if judge else None
            if quiet is not None:
                self._lose(wid, f"no heartbeat for {quiet:.1f}s", "silent", now, out)
            else:
                out.tell(wid, P.Keepalive())
        if judge:
            for wid, why in self.dispatch.stalled(now):
                self._lose(wid, why, "stalled", now, out)
        return out
