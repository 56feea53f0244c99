"""The discrete-event simulator: the daemon's scheduler on a virtual clock.

Events sit in one heap ordered by (time, sequence): request arrivals,
scheduling ticks at ``sched.next_at`` and batch completions. After every
event the loop asks the scheduler ``due(now)`` and, when it is, runs
``schedule(now)``, drops the KV the round releases and hands each batch to its
worker's FIFO queue — exactly what the daemon does with a real clock. A
completion feeds ``on_result(outcome, now)``, drops the KV it releases and
starts the worker's next batch.

The policies of the ablation ladder (sls, so, pm, ab, lb, scls) and the two
oracles run here; the continuous-batching baselines have their own loop in
:mod:`sclsd.sim.ils` because they bypass the slice scheduler by definition.
The settings and the result of a run are in :mod:`sclsd.sim.common`.

With KV reuse each worker keeps its unfinished rows' KV after a slice
(:class:`~sclsd.sim.retained_kv.RetainedKV`: device room beside the running batch,
then host memory, LRU evictions reported to the scheduler) and a batch
prefills only what its worker does not hold. A request's first token is
recorded when the prefill that produces it ends (tokens are streamed).
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import replace
from typing import Any

from ..core.decisions import Releases
from ..core.policy import GRANT_POLICIES, Policy, make_policy
from ..core.scheduler import Batch, BatchOutcome, Scheduler
from ..eval.metrics import BatchStats
from .common import SimConfig, SimResult, make_requests, progress_bar, record_of
from .oracle import make_oracle_policy, make_static_oracle_policy
from .retained_kv import RetainedKV
from .workers import Noise, Served, SimPayload, SimWorker, serve_ragged, serve_static
from .workload import Workload

_ARRIVAL, _DONE, _TICK = 0, 1, 2


class StaticSimulation:
    """Slice-level (and sequence-level) scheduling: core's Scheduler, cost-model workers."""

    def __init__(self, cfg: SimConfig, workload: Workload, policy: Policy | None = None) -> None:
        self.cfg = cfg
        prof = cfg.effective_profile
        self.est = prof.estimator
        if policy is None:
            policy = _policy(cfg)
        self.ragged = cfg.policy == "oracle"
        max_total = cfg.max_input + cfg.max_gen
        self.sched = Scheduler(policy, prof.cost(cfg.zeta, max_total=max_total))
        # The physical memory: the same predicate with no safety margin (ζ = 1).
        self.real_mem = prof.cost(zeta=1.0, max_total=max_total)
        self.delta = prof.kv_bytes_per_token
        self.host_link = prof.host_link_bytes_per_s
        self.workers = {f"w{k}": SimWorker(f"w{k}") for k in range(cfg.workers)}
        for wid, w in self.workers.items():
            self.sched.add_worker(wid)
            if policy.kv_reuse:
                host = (prof.host_kv_bytes or 0.0) if self.host_link else 0.0
                w.store = RetainedKV(self.delta, cfg.kv_token_capacity * self.delta, host)
        self.host_copy_s = 0.0
        self.requests = make_requests(workload, cfg.max_gen)
        self.noise = Noise(cfg.noise, cfg.seed)
        self.stats = BatchStats()
        self.oom_events = 0
        self.model_s = 0.0  # noise-free serving seconds, all workers
        self.prefill_s = 0.0  # ... of which prefill (re-prefills of later slices included)
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = itertools.count()

    def _push(self, t: float, kind: int, obj: Any) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, obj))

    def run(self) -> SimResult:
        t0 = time.perf_counter()
        sched = self.sched
        for r in self.requests:
            self._push(r.arrival, _ARRIVAL, r)
        bar = progress_bar(len(self.requests), self.cfg.progress, self.cfg.policy)
        events = 0
        tick_at = float("-inf")
        heap = self._heap
        while heap:
            now, _, kind, obj = heapq.heappop(heap)
            events += 1
            if kind == _ARRIVAL:
                sched.add(obj, now)
            elif kind == _DONE:
                bar.update(self._complete(obj, now))
            if sched.due(now):
                rnd = sched.schedule(now)
                if not rnd.batches and not sched.batches and sched.pool:
                    # Nothing runs and nothing was started: no later event can change that.
                    raise RuntimeError(f"the policy stalled at t={now:.3f} with {len(sched.pool)} queued")
                self._release(rnd.releases)
                for batch in rnd.batches:
                    self._dispatch(batch, now)
            at = sched.next_at
            if at != tick_at and at != float("inf"):
                # One pending tick per round: a round that finds the pool empty pushes none,
                # and the next arrival then schedules at once (as the daemon does). With the
                # gap bound a result may bring the next round forward (a streaming request due).
                tick_at = at
                self._push(max(at, now), _TICK, None)
        bar.close()
        if sched.live:  # every request completes, or the simulator has a bug
            raise RuntimeError(f"simulation ended with {len(sched.live)} live requests")
        return SimResult(
            config=self.cfg,
            requests=[record_of(r) for r in self.requests],
            batches=self.stats,
            worker_completion={w: s.last_completion for w, s in self.workers.items()},
            oom_events=self.oom_events,
            events=events,
            wall_s=time.perf_counter() - t0,
            extra={
                "busy_s": {w: s.busy_time for w, s in self.workers.items()},
                "prefill_share": self.prefill_s / self.model_s if self.model_s else 0.0,
                "kv_evictions": sum(w.store.evictions for w in self.workers.values() if w.store is not None),
                "host_copy_share": self.host_copy_s / self.model_s if self.model_s else 0.0,
            },
        )

    # ------------------------------------------------------------------ workers

    def _dispatch(self, batch: Batch, now: float) -> None:
        w = self.workers[batch.worker]  # type: ignore[index]
        w.queue.append(batch)
        if not w.busy:
            self._start(w, now)

    def _start(self, w: SimWorker, now: float) -> None:
        batch = w.queue.popleft()
        if self.ragged:
            served = serve_ragged(batch, self.est)
        elif w.store is not None:
            held, copy_s = self._checkout(w, batch)
            served = serve_static(batch, self.est, held, copy_s)
            self.host_copy_s += copy_s
        else:
            served = serve_static(batch, self.est)
        if self._would_oom(batch, served):
            self.oom_events += 1
        self.model_s += served.time
        self.prefill_s += served.prefill
        factor = self.noise()
        elapsed = served.time * factor
        first = now + served.prefill * factor  # the prefill's end: every row's first token
        n, width = batch.size, served.width or batch.input_len
        for r, own, row in zip(batch.requests, served.prefill_tokens, served.rows, strict=True):
            r.payload.count_prefill(own)
            if r.first_token is None:
                r.first_token = first
            if row.new_tokens:
                self._stream(r.payload, first, n, width, row.new_tokens, factor)
        w.busy = True
        w.busy_time += elapsed
        self._push(now + elapsed, _DONE, (w, batch, served, elapsed))

    def _stream(self, p: SimPayload, first: float, n: int, width: int, m: int,
                factor: float) -> None:
        """The slice's ``m`` tokens of one row as a streaming client receives them: the first
        when the prefill ends, then one per decoding iteration (iteration j of a batch of
        ``n`` rows over ``width`` padded positions costs tau(width + j, n)). The longest gap
        inside the slice is its last iteration (tau grows with the context). For the
        oracle's ragged batches ``width`` is the longest input and ``n`` every row: an upper
        bound, as rows leave."""
        last = first + self.est.t_decode(n, width, m - 1) * factor
        within = self.est.tau_decode(width + m - 1, n) * factor if m > 1 else None
        p.received(first, last, within)

    def _checkout(self, w: SimWorker, batch: Batch) -> tuple[list[int], float]:
        """The KV ``w`` holds for the batch's rows, and the seconds to copy it back from host.

        As the real worker does, a batch whose re-assembled cache (longest held
        prefix + longest new part + the slice) would not fit prefills in full.
        """
        store = w.store
        assert store is not None
        reqs = batch.requests
        n, S = len(reqs), batch.slice_len
        held = [min(store.tokens(r.rid), r.input_len - 1) for r in reqs]
        width = batch.input_len
        if any(held):
            new = max(1, max(r.input_len - h for r, h in zip(reqs, held, strict=True)))
            if max(held) + new + S > self.cfg.kv_token_capacity / n:
                for r in reqs:
                    store.drop(r.rid)
                held = [0] * n
            else:
                width = max(held) + new
        co = store.checkout([r.rid for r in reqs], (width + S) * n * self.delta)
        self.sched.kv_evicted(w.wid, co.evicted)
        copy_s = co.host_bytes / self.host_link if self.host_link else 0.0
        return held, copy_s

    def _release(self, released: Releases) -> None:
        """Workers drop the KV the scheduler no longer counts on (its request moved, ended)."""
        for rel in released:
            store = self.workers[rel.worker].store
            if store is not None:
                for rid in rel.rids:
                    store.drop(rid)

    def _would_oom(self, batch: Batch, served: Served) -> bool:
        if self.ragged:
            return served.kv_tokens > self.cfg.kv_token_capacity
        return self.real_mem.oom(batch.size, served.width, served.iterations)

    def _complete(self, item: tuple[SimWorker, Batch, Served, float], now: float) -> int:
        w, batch, served, elapsed = item
        w.busy = False
        w.last_completion = now
        for r, pad, inv in zip(batch.requests, served.pad, served.invalid, strict=True):
            p: SimPayload = r.payload
            p.pad_tokens += pad
            p.invalid_tokens += inv
        self.stats.add(batch.size, served.early_return)
        evicted: list[str] = []
        if w.store is not None:
            # Keep each unfinished row's KV: its context but the token sampled last.
            keep = []
            for r, row in zip(batch.requests, served.rows, strict=True):
                if row.finish_reason is None:
                    row.kv_tokens = r.input_len + row.new_tokens - 1
                    keep.append((r.rid, row.kv_tokens))
            evicted = w.store.put(keep)
        done = self.sched.on_result(BatchOutcome(batch.bid, served.rows, elapsed=elapsed), now)
        self._release(done.releases)
        self.sched.kv_evicted(w.wid, evicted)
        if w.queue:
            self._start(w, now)
        return len(done.ended)


def _policy(cfg: SimConfig) -> Policy:
    """The policy ``cfg`` names, with its switches."""
    est = cfg.profile.estimator
    if cfg.policy == "oracle":
        policy = make_oracle_policy(
            est, token_budget=cfg.kv_token_budget, max_gen=cfg.max_gen, gamma=cfg.gamma_s, lam=cfg.lam
        )
    elif cfg.policy == "oracle-static":
        policy = make_static_oracle_policy(est, max_gen=cfg.max_gen, gamma=cfg.gamma_s, lam=cfg.lam)
    else:
        return make_policy(
            cfg.policy,
            slice_len=cfg.slice_len,
            max_gen=cfg.max_gen,
            batch_size=cfg.batch_size,
            gamma=cfg.gamma_s,
            lam=cfg.lam,
            work_conserving=cfg.work_conserving,
            kv_reuse=cfg.kv_reuse,
            max_slice_gap_s=cfg.max_slice_gap_s,
        )
    # The oracles never slice, so there is no KV to reuse; rounds may still be work-conserving.
    return replace(policy, work_conserving=cfg.work_conserving)


def simulate(cfg: SimConfig, workload: Workload) -> SimResult:
    """Run one simulation of ``cfg.policy`` on ``workload`` until every request completes."""
    if cfg.policy.startswith("ils-"):
        from .ils import ILSSimulation

        return ILSSimulation(cfg, workload).run()
    if cfg.policy in GRANT_POLICIES:
        from .cb import CBSimulation

        return CBSimulation(cfg, workload).run()
    return StaticSimulation(cfg, workload).run()
