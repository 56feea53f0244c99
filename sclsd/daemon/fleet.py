"""The worker fleet: who may serve, and what happens when a worker comes or goes.

Every message from a worker arrives here (:meth:`Fleet.on_message`) with the
transport's peer id. A worker becomes a member only by an authenticated
``register`` (the daemon's worker secret, or CURVE on the transport), whose
model must fit the daemon's tokenizer; only then is its peer mapped to its
worker id. Members heartbeat; the daemon sends each a ``keepalive`` as often.
A member is declared dead when its heartbeats stop, a send to it fails, it
registers again (restarted), or it leaves a batch unacknowledged or overdue
(:mod:`.dispatch` decides that): its batches go back to the pool.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable
from dataclasses import dataclass

from .. import protocol as P
from ..config import Config
from ..core.policy import GRANT_POLICIES
from ..core.scheduler_api import SchedulerInterface
from ..tokenizer import Tokenizer
from .cost import DaemonCost
from .transport.base import WorkerTransport

log = logging.getLogger("sclsd.workers")

#: Seconds between two Reregister messages to the same unknown peer.
REREGISTER_EVERY_S = 1.0


@dataclass(eq=False)
class WorkerInfo:
    wid: str
    peer: bytes
    reg: P.Register
    last_seen: float
    queued_batches: int = 0
    busy: bool = False
    registered_at: float = 0.0


class Fleet:
    """Registered workers by id and by peer (see the module docstring)."""

    def __init__(self, cfg: Config, transport: WorkerTransport, sched: SchedulerInterface, cost: DaemonCost,
                 tok: Tokenizer, clock: Callable[[], float], wake: Callable[[], None],
                 secret: str | None) -> None:
        self.cfg = cfg
        self.transport = transport
        self.sched = sched
        self.cost = cost
        self.tok = tok
        self.clock = clock
        self.wake = wake
        self.secret = secret
        self.workers: dict[str, WorkerInfo] = {}
        self.by_peer: dict[bytes, str] = {}
        self.refused = 0
        self._unknown_asked: dict[bytes, float] = {}
        # Set by the server: what a result (or a running batch's tokens) / an acknowledgement
        # means, and who kills a local process of a dead worker.
        self.on_result: Callable[[P.Result | P.Tokens], None] = lambda res: None
        self.on_ack: Callable[[str, int], None] = lambda wid, bid: None
        self.on_dead: list[Callable[[str, str], None]] = []

    # ------------------------------------------------------------------ messages

    def on_message(self, peer: bytes, msg: P.WorkerMsg) -> None:
        if isinstance(msg, P.Register):
            self._register(peer, msg)
            return
        wid = self.by_peer.get(peer)
        if wid is None or msg.worker_id != wid:
            if wid is not None:
                log.warning("worker=%s sent a %s as %r; dropped", wid, type(msg).__name__, msg.worker_id)
                return
            self._ask_reregister(peer, msg.worker_id, type(msg).__name__)
            return
        info = self.workers[wid]
        info.last_seen = self.clock()
        if isinstance(msg, P.Heartbeat):
            info.queued_batches = msg.queued_batches
            info.busy = msg.busy
        elif isinstance(msg, P.BatchAck):
            self.on_ack(wid, msg.batch_id)
        elif isinstance(msg, (P.Result, P.Tokens)):
            self.on_result(msg)

    def _ask_reregister(self, peer: bytes, wid: str, what: str) -> None:
        """A peer we do not know (declared dead, e.g. hung past the heartbeat timeout, but
        alive again) would otherwise heartbeat into the void forever: ask it to register."""
        now = self.clock()
        if now - self._unknown_asked.get(peer, -1e9) < REREGISTER_EVERY_S:
            return
        self._unknown_asked[peer] = now
        if len(self._unknown_asked) > 4096:  # bounded: peers come and go
            self._unknown_asked.clear()
        log.info("worker=%s unknown (%s received): asking it to register again", wid, what.lower())
        self.transport.send(peer, P.Reregister())

    def _refuse(self, peer: bytes, reg: P.Register, why: str) -> None:
        self.refused += 1
        log.warning("worker=%r pid=%d registration refused: %s", reg.worker_id, reg.pid, why)
        self.transport.send(peer, P.Shutdown())

    def _authentic(self, reg: P.Register) -> bool:
        if self.transport.authenticated:
            return True  # CURVE: the ZAP handler admitted the connection's key
        return self.secret is not None and hmac.compare_digest(reg.auth.encode(), self.secret.encode())

    def _mismatch(self, reg: P.Register) -> str | None:
        """Why this worker's model cannot serve the daemon's token ids, if it cannot."""
        vocab = self.tok.vocab_size
        if reg.vocab_size and reg.vocab_size < vocab:
            return (f"its vocabulary has {reg.vocab_size} tokens, the daemon's tokenizer "
                    f"({self.cfg.model.name}) {vocab}: is the worker running the same model?")
        if self.cfg.scheduler.policy in GRANT_POLICIES and reg.caps.batching != "continuous":
            return (f"engine {reg.engine!r} serves static batches; scheduler.policy "
                    f"{self.cfg.scheduler.policy!r} needs continuous batching (engine hf-cb)")
        eos = set(getattr(self.tok, "eos_token_ids", ()) or ())
        if eos and reg.eos_token_ids and not eos & set(reg.eos_token_ids):
            return f"its EOS ids {reg.eos_token_ids} are not the tokenizer's {sorted(eos)}"
        return None

    def _register(self, peer: bytes, reg: P.Register) -> None:
        wid = reg.worker_id
        if reg.protocol != P.PROTOCOL_VERSION:
            return self._refuse(peer, reg, f"speaks protocol {reg.protocol}, the daemon {P.PROTOCOL_VERSION}")
        if not self._authentic(reg):
            return self._refuse(peer, reg, "missing or wrong worker secret (daemon.worker_secret_file)")
        why = self._mismatch(reg)
        if why is not None:
            return self._refuse(peer, reg, why)
        old = self.by_peer.get(peer)
        if old is not None and old != wid:
            self.declare_dead(old, f"its connection registered as {wid}")
        if wid in self.workers:
            # An authenticated re-registration: the worker restarted or reconnected, and
            # whatever it held is gone.
            self.declare_dead(wid, "re-registered (restarted)")
        try:
            self.cost.on_register(reg)
        except Exception as exc:  # noqa: BLE001 - a peer's registration, not the daemon, is at fault
            return self._refuse(peer, reg, f"the daemon cannot use it: {exc}")
        self._unknown_asked.pop(peer, None)
        now = self.clock()
        self.workers[wid] = WorkerInfo(wid, peer, reg, now, registered_at=now)
        self.by_peer[peer] = wid
        self.sched.add_worker(wid)
        log.info("worker=%s registered engine=%s model=%s device=%s pid=%d kv_bytes_per_token=%d "
                 "mem_available=%d vocab=%d", wid, reg.engine, reg.model, reg.device, reg.pid,
                 reg.kv_bytes_per_token, reg.mem_available, reg.vocab_size)
        self.send(wid, P.Welcome(heartbeat_interval_s=self.cfg.daemon.heartbeat_interval_s))
        self.wake()

    # ------------------------------------------------------------------ membership

    def send(self, wid: str, msg: P.DaemonToWorkerMsg) -> bool:
        """Send to a member; a failed send declares it dead (its batches go back)."""
        info = self.workers.get(wid)
        if info is None:
            return False
        if self.transport.send(info.peer, msg):
            return True
        self.declare_dead(wid, f"unreachable: sending {type(msg).__name__} failed")
        return False

    def declare_dead(self, wid: str, why: str) -> None:
        info = self.workers.pop(wid, None)
        if info is None:
            return
        self.by_peer.pop(info.peer, None)
        log.warning("worker=%s lost: %s", wid, why)
        back = self.sched.remove_worker(wid, self.clock())
        if back:
            log.warning("worker=%s lost with %d requests; re-queued: %s", wid, len(back),
                        ",".join(r.rid for r in back))
        self.cost.on_dead(wid)
        for hook in self.on_dead:
            hook(wid, why)
        self.wake()

    def drain(self, wid: str) -> bool:
        """Take a worker out of rotation: no new batches; those it holds finish normally."""
        if wid not in self.workers:
            return False
        self.sched.set_active(wid, False)
        self.send(wid, P.Drain())
        log.info("worker=%s draining: no new batches, %d in flight", wid,
                 len(self.sched.workers[wid].batches) if wid in self.sched.workers else 0)
        return True

    def resume(self, wid: str) -> bool:
        """Put a drained worker back into rotation."""
        if wid not in self.workers:
            return False
        self.sched.set_active(wid, True)
        self.send(wid, P.Resume())
        log.info("worker=%s resumed", wid)
        self.wake()
        return True

    def state(self, wid: str) -> P.WorkerStateName:
        """active, draining (out of rotation, batches in flight) or drained."""
        ws = self.sched.workers[wid]
        if ws.active:
            return "active"
        return "draining" if ws.batches else "drained"

    def tick(self, now: float) -> None:
        """Once per heartbeat interval: keepalives out, silent workers declared dead."""
        timeout = self.cfg.daemon.heartbeat_timeout_s
        for wid, info in list(self.workers.items()):
            if now - info.last_seen > timeout:
                self.declare_dead(wid, f"no heartbeat for {now - info.last_seen:.1f}s")
            else:
                self.send(wid, P.Keepalive())

    def shutdown_all(self) -> None:
        """Ask every member to exit (daemon stopping)."""
        for wid in list(self.workers):
            info = self.workers[wid]
            self.transport.send(info.peer, P.Shutdown())
