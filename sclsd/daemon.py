"""The sclsd daemon: lifecycle, admission, scheduling loop, results, drain.

One process, one event loop (uvloop when available). The loop only receives,
dispatches by message type, steps the scheduler and sends; tokenizing and
detokenizing run in a thread pool.

Guarantees (docs/operations.md): every accepted request ends with exactly one
``done`` or ``error``; a request is refused at once (``overloaded``) rather
than queued past ``daemon.max_queued_requests`` / ``max_queued_tokens``;
SIGTERM drains (``draining`` for new requests, ``daemon.drain_timeout_s`` for
those in flight, ``error: shutdown`` for what is left, exit 0) and a second
SIGTERM/SIGINT ends the drain at once.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import os
import resource
import signal
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from . import protocol as P
from .api import Conn, FrameServer
from .config import Config, ConfigError, load, override
from .core.request import Request
from .core.scheduler import BatchOutcome, RowOutcome, Scheduler
from .tokenizer import Detokenizer, Tokenizer

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


class Daemon:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.clock = time.monotonic
        self.started = self.clock()
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="sclsd-tok")
        self.tok: Tokenizer | None = None
        self.ctx: dict[str, ReqCtx] = {}
        self.queued_tokens = 0
        #: Requests between frame and admission (tokenizing): counted against the bounds
        #: so a flood of text prompts cannot queue unbounded tokenizer work.
        self.admitting = 0
        self.draining = False
        self._drain_task: asyncio.Task[None] | None = None
        self._signals = 0
        self.wake = asyncio.Event()
        self.stopped = asyncio.Event()
        self._ids = itertools.count(1)
        self.sched = self._make_scheduler()
        from .metrics import Metrics
        from .workers import WorkerHub

        self.metrics = Metrics(self)
        self.hub = WorkerHub(cfg, on_register=self._on_register, on_result=self._on_result,
                             on_dead=self._on_dead)
        d = cfg.daemon
        # Admin messages (drain): root and our own uid unless the config names the admins.
        self.admin_uids = set(d.admin_uids) if d.admin_uids else {0, os.geteuid()}
        common = dict(max_frame=d.max_frame_bytes, max_buffer=d.max_conn_buffer_bytes,
                      mode=d.socket_mode, group=d.socket_group, backlog=d.listen_backlog)
        self.api = FrameServer("api", d.socket, P.client_decoder, self._on_client,
                               on_close=self._on_conn_closed, allowed_uids=d.allowed_uids, **common)
        from .sdnotify import Notifier
        from .status import StatusHandler

        self.notifier = Notifier.from_env()
        self.status = StatusHandler(self)
        self.status_server = FrameServer("status", d.status_socket, P.status_decoder,
                                          self.status.handle, allowed_uids=d.status_allowed_uids,
                                          **common)
        self._metrics_http: Any = None

    # ------------------------------------------------------------------ setup

    def _make_scheduler(self) -> Scheduler:
        from .core.policy import make_policy
        from .cost import DaemonCost

        s = self.cfg.scheduler
        policy = make_policy(s.policy, slice_len=s.slice_len, max_gen=self.cfg.model.max_gen,
                             batch_size=s.batch_size, gamma=s.gamma_s, lam=s.lam)
        self.cost = DaemonCost.initial(self.cfg)
        return Scheduler(policy, self.cost, max_failures=s.max_failures)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        log.info("sclsd starting: config=%s model=%s policy=%s slice_len=%d workers=%d engine=%s",
                 self.cfg.source, self.cfg.model.name, self.cfg.scheduler.policy,
                 self.cfg.scheduler.slice_len, self.cfg.workers.spawn, self.cfg.workers.engine)
        from . import tokenizer

        t0 = time.monotonic()
        self.tok = await loop.run_in_executor(self.pool, tokenizer.load, self.cfg.model.name)
        log.info("tokenizer for %s loaded in %.1fs", self.cfg.model.name, time.monotonic() - t0)
        await self.hub.start()
        await self.api.start()
        await self.status_server.start()
        if self.cfg.daemon.metrics_http:
            self._metrics_http = self.metrics.serve_http(self.cfg.daemon.metrics_http, loop)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.begin_drain, sig)
        # systemd's ExecReload convention is SIGHUP, whose default action would kill us.
        loop.add_signal_handler(signal.SIGHUP, lambda: log.warning(
            "SIGHUP ignored: configuration changes take effect on restart"))
        notifier = self.notifier
        notifier.ready(f"serving on {self.cfg.daemon.socket}")
        watchdog = asyncio.create_task(notifier.watchdog_loop(), name="watchdog")
        sched = asyncio.create_task(self._sched_loop(), name="scheduler")
        try:
            await self._run_until_stopped([sched, watchdog])
        finally:
            # Even when a background task failed: every live request still gets its
            # terminal event before the connections close.
            for rid in list(self.ctx):
                self._end_with_error(rid, "internal", "the daemon failed; see its log")
            notifier.stopping()
            sched.cancel()
            watchdog.cancel()
            await self._shutdown()
        return 0

    async def _run_until_stopped(self, tasks: list[asyncio.Task[None]]) -> None:
        """Wait for the stop signal; a crashed background task stops the daemon loudly."""
        stop = asyncio.create_task(self.stopped.wait())
        while True:
            done, _ = await asyncio.wait([stop, *tasks], timeout=1.0,
                                         return_when=asyncio.FIRST_COMPLETED)
            self.hub.check_tasks()
            drain = self._drain_task
            if drain is not None and drain.done() and not drain.cancelled() and drain.exception():
                raise RuntimeError("the drain failed") from drain.exception()
            for t in done:
                if t is not stop and not t.cancelled() and t.exception() is not None:
                    raise RuntimeError(f"background task {t.get_name()} failed") from t.exception()
            tasks = [t for t in tasks if not t.done()]  # e.g. the watchdog returns when unset
            if stop in done:
                return

    # ------------------------------------------------------------------ drain / shutdown

    def begin_drain(self, sig: int | None = None) -> None:
        """Stop accepting, finish what is in flight (SIGTERM/SIGINT). A second signal
        ends the drain at once: what is left gets ``error: shutdown``."""
        self._signals += 1
        name = signal.Signals(sig).name if sig else "request"
        if self.draining:
            if self._signals > 1 and sig is not None:
                log.warning("second %s: ending %d requests now", name, len(self.ctx))
                self._finish_drain()
            return
        self.draining = True
        t = self.cfg.daemon.drain_timeout_s
        log.info("draining (%s): refusing new requests, finishing %d in flight within %.0fs",
                 name, len(self.ctx), t)
        self.notifier.stopping(f"draining {len(self.ctx)} requests (up to {t:.0f}s)")
        self._drain_task = asyncio.get_running_loop().create_task(self._drain(), name="drain")

    async def _drain(self) -> None:
        deadline = self.clock() + self.cfg.daemon.drain_timeout_s
        while self.ctx and self.clock() < deadline:
            await asyncio.sleep(0.05)
        self._finish_drain()

    def _finish_drain(self) -> None:
        if self.stopped.is_set():
            return
        left = list(self.ctx)
        if left:
            log.warning("drain ended with %d requests unfinished: ids=%s", len(left), ",".join(left))
        for rid in left:
            self._end_with_error(rid, "shutdown", "the daemon stopped before this request finished")
        self.stopped.set()

    async def _shutdown(self) -> None:
        await self.api.stop()
        await self.status_server.stop()
        await self.hub.stop()
        if self._metrics_http is not None:
            # shutdown() waits for the server thread's poll: not on the loop.
            await asyncio.get_running_loop().run_in_executor(None, self._metrics_http.shutdown)
        self.pool.shutdown(wait=False, cancel_futures=True)
        log.info("sclsd stopped")

    # ------------------------------------------------------------------ client API

    async def _on_client(self, conn: Conn, msg: Any) -> None:
        if isinstance(msg, P.Generate):
            self.admitting += 1
            try:
                await self._on_generate(conn, msg)
            finally:
                self.admitting -= 1
        elif isinstance(msg, P.Cancel):
            self._on_cancel(conn, msg)
        elif isinstance(msg, P.Ping):
            conn.send(P.Pong(nonce=msg.nonce))
        elif isinstance(msg, P.DrainWorker):
            self._on_drain_worker(conn, msg)

    @property
    def metrics_http_address(self) -> str | None:
        """``host:port`` of the Prometheus HTTP endpoint, when it runs."""
        return self._metrics_http.address if self._metrics_http is not None else None

    def is_admin(self, conn: Conn) -> bool:
        """May this connection send admin messages? (SO_PEERCRED uid in the admin set.)"""
        return conn.peer is not None and conn.peer.uid in self.admin_uids

    def _on_cancel(self, conn: Conn, msg: P.Cancel) -> None:
        # A client cancels its own requests only: ids are client-chosen and guessable.
        mine = msg.id in conn.rids
        if msg.any_connection and not mine:
            if not self.is_admin(conn):
                log.warning("conn=%d cancel id=%s of another connection refused: uid %s is not an admin",
                            conn.cid, msg.id, conn.peer and conn.peer.uid)
                conn.send(P.Error(code="forbidden", message="only an admin may cancel other "
                                  "connections' requests", id=msg.id))
                return
            mine = msg.id in self.ctx
        if not mine or not self._cancel(msg.id, "cancelled"):
            conn.send(P.Error(code="unknown_id", message=f"no live request {msg.id!r}", id=msg.id))
            return
        log.info("id=%s cancelled by conn=%d", msg.id, conn.cid)

    def _on_drain_worker(self, conn: Conn, msg: P.DrainWorker) -> None:
        verb = "resume" if msg.resume else "drain"
        if not self.is_admin(conn):
            log.warning("conn=%d %s worker=%s refused: uid %s is not an admin", conn.cid, verb, msg.worker,
                        conn.peer and conn.peer.uid)
            conn.send(P.Error(code="forbidden", message=f"only an admin may {verb} workers "
                              "(daemon.admin_uids)"))
            return
        ok = self.resume_worker(msg.worker) if msg.resume else self.drain_worker(msg.worker)
        if not ok:
            conn.send(P.Error(code="unknown_worker", message=f"no registered worker {msg.worker!r}"))
            return
        conn.send(P.WorkerStateReply(worker=msg.worker, state=self.worker_state(msg.worker),
                                     batches_inflight=len(self.sched.workers[msg.worker].batches)))

    def worker_state(self, wid: str) -> str:
        """active, draining (out of rotation, batches in flight) or drained."""
        ws = self.sched.workers[wid]
        if ws.active:
            return "active"
        return "draining" if ws.batches else "drained"

    def _refuse(self, conn: Conn, code: str, message: str, rid: str | None) -> None:
        self.metrics.refused(code)
        log.info("refused id=%s conn=%d code=%s: %s", rid, conn.cid, code, message)
        conn.send(P.Error(code=code, message=message, id=rid))

    def _overloaded(self, prompt_tokens: int) -> str | None:
        d = self.cfg.daemon
        # ``admitting`` includes the request being checked.
        if len(self.ctx) + self.admitting > d.max_queued_requests:
            return (f"{len(self.ctx)} requests queued (+{self.admitting - 1} being admitted), "
                    f"the limit is {d.max_queued_requests}; retry later")
        if self.queued_tokens + prompt_tokens > d.max_queued_tokens:
            return (f"{self.queued_tokens} prompt tokens queued, +{prompt_tokens} exceeds the limit "
                    f"of {d.max_queued_tokens}; retry later")
        return None

    async def _on_generate(self, conn: Conn, g: P.Generate) -> None:
        m = self.cfg.model
        rid = g.id or uuid.uuid4().hex[:16]
        if len(self.ctx) + self.admitting > self.cfg.daemon.max_queued_requests:
            # Refuse before any tokenizing work.
            return self._refuse(conn, "overloaded", self._overloaded(0) or "overloaded", g.id)
        forms = sum(x is not None for x in (g.prompt, g.prompt_ids, g.messages))
        if forms != 1:
            return self._refuse(conn, "bad_request", "give exactly one of prompt, prompt_ids, messages", g.id)
        if self.draining:
            return self._refuse(conn, "draining", "the daemon is shutting down", g.id)
        if rid in self.ctx:
            return self._refuse(conn, "duplicate_id", f"request id {rid!r} is already live", g.id)
        assert self.tok is not None
        if g.prompt_ids is not None:
            ids = g.prompt_ids
            vocab = self.tok.vocab_size
            if any(i >= vocab for i in ids):
                return self._refuse(conn, "bad_request", f"prompt_ids must be < vocab size {vocab}", g.id)
        else:
            # Tokenizing is blocking work: thread pool, never the loop.
            loop = asyncio.get_running_loop()
            try:
                if g.messages is not None:
                    msgs = [{"role": x.role, "content": x.content} for x in g.messages]
                    ids = await loop.run_in_executor(self.pool, self.tok.encode_chat, msgs)
                else:
                    ids = await loop.run_in_executor(self.pool, self.tok.encode, g.prompt)
            except Exception as exc:  # noqa: BLE001 - a tokenizer error is the request's fault
                return self._refuse(conn, "bad_request", f"cannot tokenize: {exc}", g.id)
            if conn.closed:
                return
            if self.draining:
                return self._refuse(conn, "draining", "the daemon is shutting down", g.id)
            if rid in self.ctx:
                return self._refuse(conn, "duplicate_id", f"request id {rid!r} is already live", g.id)
        if not ids:
            return self._refuse(conn, "bad_request", "empty prompt", g.id)
        if len(ids) > m.max_input:
            return self._refuse(conn, "prompt_too_long",
                                f"prompt has {len(ids)} tokens, the limit is {m.max_input}", g.id)
        why = self._overloaded(len(ids))
        if why is not None:
            return self._refuse(conn, "overloaded", why, g.id)
        now = self.clock()
        req = Request(
            rid=rid,
            prompt_len=len(ids),
            max_tokens=min(g.max_tokens, m.max_gen),
            arrival=now,
            priority=g.priority,
            deadline=None if g.timeout is None else now + g.timeout,
        )
        self.ctx[rid] = ReqCtx(req, conn, g, list(ids), detok=Detokenizer(stop=list(g.stop)))
        self.queued_tokens += len(ids)
        conn.rids.add(rid)
        conn.send(P.Accepted(id=rid, prompt_tokens=len(ids)))
        log.debug("accepted id=%s conn=%d prompt_tokens=%d max_tokens=%d timeout=%s", rid, conn.cid,
                  len(ids), req.max_tokens, g.timeout)
        self.sched.add(req, now)
        self.wake.set()

    def _on_conn_closed(self, conn: Conn) -> None:
        for rid in list(conn.rids):
            if rid in self.ctx:
                log.info("id=%s cancelled: conn=%d disconnected", rid, conn.cid)
                self._cancel(rid, "cancelled", notify=False)

    def _cancel(self, rid: str, reason: str, notify: bool = True) -> bool:
        req = self.sched.cancel(rid, self.clock(), reason)
        c = self.ctx.get(rid)
        if req is None or c is None:
            return False
        if notify:
            self._send_done(c, reason)
        else:
            self.metrics.finished(c, reason, self._timings(c, self.clock()))
            self._forget(c)
        return True

    # ------------------------------------------------------------------ scheduling loop

    async def _sched_loop(self) -> None:
        while True:
            self.wake.clear()
            now = self.clock()
            for req in self.sched.expire(now):
                c = self.ctx.get(req.rid)
                if c is not None:
                    log.info("id=%s timed out", req.rid)
                    self._send_done(c, "timeout")
            if self.sched.due(now):
                for batch in self.sched.schedule(now):
                    self._dispatch(batch)
            wait = 1.0
            if self.sched.pool and self.sched.active_workers():
                wait = min(wait, self.sched.next_at - now)
            nd = self.sched.next_deadline()
            if nd is not None:
                wait = min(wait, nd - now)
            if wait > 0:
                try:
                    await asyncio.wait_for(self.wake.wait(), wait)
                except asyncio.TimeoutError:
                    pass
            else:
                await asyncio.sleep(0)

    def _dispatch(self, batch: Any) -> None:
        rows = []
        for r in batch.requests:
            c = self.ctx[r.rid]
            g = c.gen
            rows.append(P.BatchRequest(
                rid=r.rid, token_ids=c.prompt_ids + c.out_ids, max_new_tokens=max(1, r.remaining),
                temperature=g.temperature, top_p=g.top_p, top_k=g.top_k, seed=g.seed,
                generated=r.num_generated, stop_token_ids=list(g.stop_token_ids), ignore_eos=g.ignore_eos,
            ))
        log.debug("batch=%d -> worker=%s n=%d L=%d est=%.3fs ids=%s", batch.bid, batch.worker,
                  batch.size, batch.input_len, batch.est_time, ",".join(r.rid for r in batch.requests))
        self.metrics.dispatched(batch)
        self.hub.send(batch.worker, P.BatchMsg(batch_id=batch.bid, slice_len=batch.slice_len, requests=rows))

    # ------------------------------------------------------------------ workers

    def _on_register(self, reg: P.Register) -> None:
        self.cost.on_register(reg)
        self.sched.add_worker(reg.worker_id)
        self.wake.set()

    def _on_dead(self, wid: str, why: str) -> None:
        back = self.sched.remove_worker(wid, self.clock())
        if back:
            log.warning("worker=%s lost with %d requests; re-queued: %s", wid, len(back),
                        ",".join(r.rid for r in back))
        self.cost.on_dead(wid)
        self.wake.set()

    def drain_worker(self, wid: str) -> bool:
        """Take a worker out of rotation: no new batches; those it holds finish normally."""
        if wid not in self.sched.workers:
            return False
        self.sched.set_active(wid, False)
        self.hub.drain(wid)
        log.info("worker=%s draining: no new batches, %d in flight", wid, len(self.sched.workers[wid].batches))
        return True

    def resume_worker(self, wid: str) -> bool:
        """Put a drained worker back into rotation."""
        if wid not in self.sched.workers:
            return False
        self.sched.set_active(wid, True)
        self.hub.resume(wid)
        log.info("worker=%s resumed", wid)
        self.wake.set()
        return True

    def _on_result(self, res: P.Result) -> None:
        batch = self.sched.batches.get(res.batch_id)
        if batch is None:
            log.info("result for unknown batch=%d from worker=%s ignored", res.batch_id, res.worker_id)
            return
        if batch.worker != res.worker_id:
            log.warning("result for batch=%d from worker=%s, but it was sent to worker=%s; ignored",
                        res.batch_id, res.worker_id, batch.worker)
            return
        if res.error is not None:
            log.error("worker=%s batch=%d failed: %s; ids=%s", res.worker_id, res.batch_id, res.error,
                      ",".join(r.rid for r in batch.requests))
            done = self.sched.on_result(BatchOutcome(res.batch_id, ok=False), self.clock())
            for r in done:
                c = self.ctx.get(r.rid)
                if c is not None:
                    self._send_done(c, "error")
            self.wake.set()
            return
        # Only rows of requests of this batch that are still live count, each once, and
        # never more tokens than the request's budget: a buggy or hostile worker cannot
        # write into another request's output.
        members = {r.rid: r for r in batch.requests}
        outputs: list[tuple[ReqCtx, P.RequestOutput]] = []
        seen: set[str] = set()
        for out in res.outputs:
            req = members.get(out.rid)
            c = self.ctx.get(out.rid)
            if req is None or c is None or c.req is not req or out.rid in seen:
                continue
            seen.add(out.rid)
            budget = max(0, req.remaining)
            if len(out.token_ids) > budget:
                out = P.RequestOutput(rid=out.rid, token_ids=out.token_ids[:budget], finish_reason="length")
            outputs.append((c, out))
        # Detokenizing is blocking work: decode in the pool, apply on the loop.
        work = [c.out_ids + out.token_ids for c, out in outputs]
        fut = asyncio.get_running_loop().run_in_executor(self.pool, self._decode_all, work)
        fut.add_done_callback(lambda f: self._apply_result(res, outputs, f))

    def _decode_all(self, seqs: list[list[int]]) -> list[str]:
        assert self.tok is not None
        return [self.tok.decode(s) for s in seqs]

    def _apply_result(self, res: P.Result, outputs: list[tuple[ReqCtx, P.RequestOutput]],
                      fut: asyncio.Future[list[str]]) -> None:
        try:
            texts = fut.result()
        except Exception:  # noqa: BLE001 - the batch is failed, not the daemon
            log.exception("detokenizing batch=%d failed; ids=%s", res.batch_id,
                          ",".join(c.req.rid for c, _ in outputs))
            self._fail_batch(res.batch_id)
            return
        if res.batch_id not in self.sched.batches:
            return  # its worker was declared dead meanwhile: requests already re-queued
        try:
            self._apply_outputs(res, outputs, texts)
        except Exception:
            # A bug here must not leave requests hanging: log it with the ids, fail the
            # batch (its requests are re-queued, up to scheduler.max_failures).
            log.exception("applying batch=%d failed; ids=%s", res.batch_id,
                          ",".join(c.req.rid for c, _ in outputs))
            self._fail_batch(res.batch_id)

    def _fail_batch(self, batch_id: int) -> None:
        for r in self.sched.on_result(BatchOutcome(batch_id, ok=False), self.clock()):
            c = self.ctx.get(r.rid)
            if c is not None:
                self._send_done(c, "error")
        self.wake.set()

    def _apply_outputs(self, res: P.Result, outputs: list[tuple[ReqCtx, P.RequestOutput]],
                       texts: list[str]) -> None:
        now = self.clock()
        rows: list[RowOutcome] = []
        deltas: list[tuple[ReqCtx, list[int], str]] = []
        for (c, out), full in zip(outputs, texts, strict=True):
            if self.ctx.get(c.req.rid) is not c:
                continue  # cancelled or timed out while we decoded: its row is ignored
            c.out_ids.extend(out.token_ids)
            final = out.finish_reason is not None
            new_text = c.detok.apply(full, final=final)
            reason = "stop" if c.detok.stopped else out.finish_reason
            rows.append(RowOutcome(out.rid, len(out.token_ids), reason))
            deltas.append((c, out.token_ids, new_text))
        stats = res.stats
        done = self.sched.on_result(
            BatchOutcome(res.batch_id, rows, elapsed=stats.prefill_s + stats.decode_s), now
        )
        self.metrics.batch_done(res)
        # Engine-side waste, summed for status (the replay benchmark reads these counters).
        counters = self.sched.counters
        counters["pad_tokens"] = counters.get("pad_tokens", 0) + stats.pad_tokens
        counters["invalid_tokens"] = counters.get("invalid_tokens", 0) + stats.invalid_tokens
        counters["batch_rows"] = counters.get("batch_rows", 0) + len(res.outputs)
        counters["results"] = counters.get("results", 0) + 1
        for c, ids, text in deltas:
            if c.gen.stream and (ids or text) and c.req.rid in self.ctx:
                c.conn.send(P.Delta(id=c.req.rid, token_ids=ids, text=text))
        for r in done:
            c = self.ctx.get(r.rid)
            if c is not None:
                self._send_done(c, r.finish_reason or "error")
        self.wake.set()

    # ------------------------------------------------------------------ terminal events

    def _timings(self, c: ReqCtx, now: float) -> P.Timings:
        r = c.req
        return P.Timings(
            queued_s=(r.first_dispatch if r.first_dispatch is not None else now) - r.arrival,
            ttft_s=None if r.first_token is None else r.first_token - r.arrival,
            e2e_s=now - r.arrival,
            slices=r.slices,
        )

    def _send_done(self, c: ReqCtx, reason: str) -> None:
        now = self.clock()
        r = c.req
        text = c.detok.text
        done = P.Done(
            id=r.rid,
            finish_reason=reason,  # type: ignore[arg-type]
            usage=P.Usage(prompt_tokens=len(c.prompt_ids), completion_tokens=len(c.out_ids)),
            timings=self._timings(c, now),
            text=None if c.gen.stream else text,
            token_ids=None if c.gen.stream else list(c.out_ids),
            worker=r.worker,
        )
        c.conn.send(done)
        self.metrics.finished(c, reason, done.timings)
        log.info("done id=%s reason=%s prompt=%d out=%d slices=%d e2e=%.3fs worker=%s",
                 r.rid, reason, len(c.prompt_ids), len(c.out_ids), r.slices, done.timings.e2e_s, r.worker)
        self._forget(c)

    def _end_with_error(self, rid: str, code: str, message: str) -> None:
        c = self.ctx.get(rid)
        if c is None:
            return
        self.sched.cancel(rid, self.clock(), "error")
        c.conn.send(P.Error(code=code, message=message, id=rid))
        self.metrics.finished(c, "error", self._timings(c, self.clock()))
        log.info("error id=%s code=%s", rid, code)
        self._forget(c)

    def _forget(self, c: ReqCtx) -> None:
        if self.ctx.pop(c.req.rid, None) is not None:
            self.queued_tokens -= len(c.prompt_ids)
        c.conn.rids.discard(c.req.rid)


# ---------------------------------------------------------------------- entry point


class OneLineFormatter(logging.Formatter):
    """One event, one line: newlines in messages, ids and tracebacks are escaped, so a
    client-chosen request id cannot forge log lines and the journal keeps an event whole.

    Under systemd (``$JOURNAL_STREAM`` set) the line starts with the syslog priority
    (``<3>`` …), which journald turns into the entry's level, and carries no timestamp
    (the journal has its own).
    """

    _PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3,
                 logging.CRITICAL: 2}

    def __init__(self, journal: bool) -> None:
        fmt = "%(name)s: %(message)s" if journal else "%(asctime)s %(levelname)s %(name)s: %(message)s"
        super().__init__(fmt)
        self.journal = journal

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        text = text.replace("\n", "\\n").replace("\r", "\\r")
        if self.journal:
            return f"<{self._PRIORITY.get(record.levelno, 6)}>{text}"
        return text


def setup_logging(level: str) -> None:
    """Log to stderr, one line per event (the journal's format under systemd)."""
    # At info the daemon logs a line per finished request: skip what our format never
    # shows (caller frame lookup, thread and process names) to keep a line cheap.
    logging._srcfile = None  # type: ignore[attr-defined]
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(OneLineFormatter(journal=bool(os.environ.get("JOURNAL_STREAM"))))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper()))


def raise_nofile(want: int) -> None:
    """Raise the soft limit on open files towards ``want`` (capped by the hard limit):
    every client connection is a descriptor, and the default soft limit is often 1024."""
    if want <= 0:
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, exc)
            return
    log.info("open-file limit %s (hard %s)", resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sclsd", description="LLM serving daemon with slice-level scheduling")
    p.add_argument("--config", help="TOML config file (default: built-in defaults)")
    p.add_argument("--socket", help="client API Unix socket path")
    p.add_argument("--status-socket", help="status Unix socket path")
    p.add_argument("--worker-endpoint", help="ZeroMQ endpoint for workers (ipc:// or tcp://)")
    p.add_argument("--engine", choices=["hf", "hf-cb", "fake"], help="engine of spawned workers")
    p.add_argument("--model", help="model spec or path")
    p.add_argument("--workers", type=int, help="number of local workers to spawn")
    p.add_argument("--slice-len", type=int, help="slice length S")
    p.add_argument("--policy", help="sls, so, pm, ab, lb or scls")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = load(args.config)
        cfg = override(
            cfg,
            daemon__socket=args.socket,
            daemon__status_socket=args.status_socket,
            daemon__worker_endpoint=args.worker_endpoint,
            daemon__log_level=args.log_level,
            workers__engine=args.engine,
            workers__spawn=args.workers,
            model__name=args.model,
            scheduler__slice_len=args.slice_len,
            scheduler__policy=args.policy,
        )
    except ConfigError as exc:
        print(f"sclsd: {exc}", file=sys.stderr)
        return 2
    setup_logging(cfg.daemon.log_level)
    raise_nofile(cfg.daemon.nofile_limit)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        runner = asyncio.run

    async def _main() -> int:
        return await Daemon(cfg).run()

    try:
        return runner(_main())
    except Exception:
        log.exception("sclsd failed")
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
