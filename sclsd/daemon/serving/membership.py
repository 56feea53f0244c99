"""Worker membership: who may serve, what each worker told us, and who is lost.

A worker the shell authenticated joins (:meth:`Membership.join`) unless its
model cannot serve the daemon's token ids, its engine cannot serve the
configured policy, or the cost model cannot use its report; it then gets a
``welcome`` and the scheduler a worker. A member that sends ``register``
again on the same connection (its Welcome was slow to come) is welcomed
again and keeps everything (:meth:`Membership.rewelcome`). Members
heartbeat; the daemon sends each a ``keepalive`` as often. A member leaves
(:meth:`Membership.leave`) when it is lost, for one of the reasons of
:data:`sclsd.protocol.LossReason`: its process ended, its heartbeats
stopped, a batch it holds made no progress, a send to it failed, it
registered again on a new connection; its batches go back to the pool, and
the drop is logged at warning and kept per worker (:attr:`Membership.losses`,
shown by the status). Draining takes a member out of rotation without
touching the batches it holds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

from ... import protocol as P
from ...config import Config
from ...core.decisions import Releases, Removed
from ...core.policy import GRANT_POLICIES
from ...core.scheduler_api import SchedulerInterface
from ...tokenizer import Tokenizer
from .effects import Effects, Lost

log = logging.getLogger("sclsd.workers")

#: Drops that mean the worker died holding its batches (not a connection event): they count
#: against the requests it held, since one of them may be what killed it.
DIED: frozenset[P.LossReason] = frozenset({"exited", "silent", "stalled"})

__all__ = ["LossRecord", "Membership", "WorkerCosts", "WorkerInfo"]


class WorkerCosts(Protocol):
    """The cost model's side of membership: it learns each worker's memory and profile at
    register and forgets them when the worker is lost (the daemon's ``DaemonCost``)."""

    def on_register(self, reg: P.Register) -> None:
        """Take the worker's report into account; raises when it cannot be used."""
        ...

    def on_dead(self, wid: str) -> None: ...

    def on_oom(self, wid: str) -> None:
        """Worker ``wid`` ran out of memory: count on less of it from now on."""
        ...


@dataclass(eq=False)
class WorkerInfo:
    """What a member told the daemon: its registration and latest heartbeat."""

    wid: str
    reg: P.Register
    last_seen: float
    queued_batches: int = 0
    busy: bool = False
    registered_at: float = 0.0
    rows: int = 0
    """The rows its engine runs at once, as it last said (``Result.rows``; 0: ``caps.max_rows``)."""


@dataclass(eq=False)
class LossRecord:
    """How often a worker id was dropped, and the last time why."""

    count: int = 0
    by_reason: dict[P.LossReason, int] = field(default_factory=dict)
    last_reason: P.LossReason = "exited"
    last_why: str = ""
    last_at: float = 0.0


class Membership:
    """The registered workers (see the module docstring)."""

    def __init__(self, cfg: Config, sched: SchedulerInterface, cost: WorkerCosts, tok: Tokenizer) -> None:
        self.cfg = cfg
        self.sched = sched
        self.cost = cost
        self.tok = tok
        self.workers: dict[str, WorkerInfo] = {}
        self.losses: dict[str, LossRecord] = {}
        """Every worker id dropped since the daemon started (members or not)."""

    def __contains__(self, wid: object) -> bool:
        return wid in self.workers

    def room(self, wid: str, rows: int) -> None:
        """A member's result said its engine runs ``rows`` rows at once now (``Result.rows``;
        0: ``caps.max_rows``): the scheduler holds it to those rows and their lookahead."""
        info = self.workers.get(wid)
        if info is None:
            return
        cap = info.reg.caps.max_rows
        rows = min(rows, cap) if rows and cap else (rows or cap)
        if rows != (info.rows or cap):
            info.rows = rows
            self.sched.set_rows(wid, self.cfg.scheduler.grant_rows(rows))

    def refusal(self, reg: P.Register) -> str | None:
        """Why this worker cannot serve the daemon's requests, if it cannot."""
        vocab = self.tok.vocab_size
        if reg.vocab_size and reg.vocab_size < vocab:
            return (f"its vocabulary has {reg.vocab_size} tokens, the daemon's tokenizer "
                    f"({self.cfg.model.name}) {vocab}: is the worker running the same model?")
        if self.cfg.scheduler.policy in GRANT_POLICIES and reg.caps.batching != "continuous":
            return (f"engine {reg.engine!r} serves static batches; scheduler.policy "
                    f"{self.cfg.scheduler.policy!r} needs continuous batching (engine hf-cb or hf-static-cb)")
        eos = set(getattr(self.tok, "eos_token_ids", ()) or ())
        if eos and reg.eos_token_ids and not eos & set(reg.eos_token_ids):
            return f"its EOS ids {reg.eos_token_ids} are not the tokenizer's {sorted(eos)}"
        return None

    def join(self, reg: P.Register, now: float, out: Effects) -> None:
        """An authenticated worker that fits (see :meth:`refusal`) becomes a member; a report
        the cost model cannot use is refused (``out.refused``)."""
        wid = reg.worker_id
        assert wid not in self.workers, f"worker {wid} joins twice"
        try:
            self.cost.on_register(reg)
        except Exception as exc:  # noqa: BLE001 - a peer's registration, not the daemon, is at fault
            out.refused = f"the daemon cannot use it: {exc}"
            return
        self.workers[wid] = WorkerInfo(wid, reg, now, registered_at=now)
        self.sched.add_worker(wid, self.cfg.scheduler.grant_rows(reg.caps.max_rows))
        log.info("worker=%s registered engine=%s model=%s device=%s pid=%d kv_bytes_per_token=%d "
                 "mem_available=%d vocab=%d", wid, reg.engine, reg.model, reg.device, reg.pid,
                 reg.kv_bytes_per_token, reg.mem_available, reg.vocab_size)
        out.tell(wid, P.Welcome(heartbeat_interval_s=self.cfg.daemon.heartbeat_interval_s))
        out.wake = True

    def rewelcome(self, wid: str, now: float, out: Effects) -> None:
        """A member registered again on its own connection: it sent ``register`` before our
        Welcome reached it (a slow start, a busy machine). Nothing it holds is gone, so it is
        welcomed again and keeps its batches; dropping it would kill a healthy worker."""
        self.workers[wid].last_seen = now
        log.info("worker=%s registered again on the same connection: welcomed again", wid)
        out.tell(wid, P.Welcome(heartbeat_interval_s=self.cfg.daemon.heartbeat_interval_s))

    def leave(self, wid: str, why: str, reason: P.LossReason, now: float,
              out: Effects) -> Removed | None:
        """``wid`` is lost for ``reason``: its batches go back to the pool, the drop is
        logged and counted. Returns what the scheduler did: the requests back in the pool,
        those that end instead (a worker that died counts against those it held:
        ``scheduler.max_worker_losses``), for the caller to answer, and the KV released, for
        the caller to send; None if it was no member."""
        if self.workers.pop(wid, None) is None:
            return None
        rec = self.losses.setdefault(wid, LossRecord())
        rec.count += 1
        rec.by_reason[reason] = rec.by_reason.get(reason, 0) + 1
        rec.last_reason, rec.last_why, rec.last_at = reason, why, now
        lost = Lost(wid, why, reason)
        log.warning("worker=%s lost (%s): %s%s", wid, reason, why,
                    "; killing its process" if lost.kill else "")
        removed = self.sched.remove_worker(wid, now, charged=reason in DIED)
        back, ended = removed.requeued, removed.ended
        if back:
            log.warning("worker=%s lost with %d requests; re-queued: %s", wid, len(back),
                        ",".join(r.rid for r in back))
        if ended:
            log.warning("worker=%s lost with %d requests that were on %d workers that died: "
                        "they end (scheduler.max_worker_losses): %s", wid, len(ended),
                        self.cfg.scheduler.max_worker_losses, ",".join(r.rid for r in ended))
        self.cost.on_dead(wid)
        out.lost.append(lost)
        out.wake = True
        return removed

    def heard(self, wid: str, msg: P.WorkerMsg, now: float) -> None:
        """A member's message arrived (a heartbeat also says how busy it is)."""
        info = self.workers[wid]
        info.last_seen = now
        if isinstance(msg, P.Heartbeat):
            info.queued_batches = msg.queued_batches
            info.busy = msg.busy

    def silent_for(self, wid: str, now: float) -> float | None:
        """Seconds since ``wid`` was last heard from, when that is past the heartbeat timeout."""
        quiet = now - self.workers[wid].last_seen
        return quiet if quiet > self.cfg.daemon.heartbeat_timeout_s else None

    # ------------------------------------------------------------------ rotation

    def drain(self, wid: str, out: Effects) -> Releases | None:
        """Take a member out of rotation: no new batches; those it holds finish normally.
        Returns the KV the scheduler gave up (for the caller to send); None: no member."""
        if wid not in self.workers:
            return None
        released = self.sched.set_active(wid, False)
        out.tell(wid, P.Drain())
        log.info("worker=%s draining: no new batches, %d in flight", wid, self.inflight(wid))
        return released

    def resume(self, wid: str, out: Effects) -> Releases | None:
        """Put a drained member back into rotation; returns the KV the scheduler gave up
        (None: no member)."""
        if wid not in self.workers:
            return None
        released = self.sched.set_active(wid, True)
        out.tell(wid, P.Resume())
        log.info("worker=%s resumed", wid)
        out.wake = True
        return released

    def state(self, wid: str) -> P.WorkerStateName:
        """active, draining (out of rotation, batches in flight) or drained."""
        ws = self.sched.workers[wid]
        if ws.active:
            return "active"
        return "draining" if ws.batches else "drained"

    def inflight(self, wid: str) -> int:
        """Batches sent to ``wid`` and not answered."""
        ws = self.sched.workers.get(wid)
        return len(ws.batches) if ws is not None else 0

    def caps(self) -> list[P.EngineCaps]:
        """What the members said they can do (``Register.caps``)."""
        return [w.reg.caps for w in self.workers.values()]
