"""``hf-cb``: transformers' own continuous batching, the iteration-level (ILS) baseline.

Same model and library as ``hf``; the difference is the batching. Requests are
handed to transformers' ``ContinuousBatchingManager`` (paged KV cache, a
background generation thread that admits new requests at every iteration), so
a request joins the running batch as soon as it arrives on the worker and
leaves it as soon as it finishes: no padding, no invalid tokens.

The worker runtime drives it through :meth:`HFCBEngine.run_continuous` (new
batches are admitted while earlier ones still generate); :meth:`serve` is the
blocking one-batch form used by tools such as the profiler.

Decoding is greedy only: transformers' manager takes sampling settings per
manager, not per request, and this engine exists to measure batching, so a
batch asking for sampling is refused with an error rather than served wrongly.
Each request's tokens are capped at ``min(max_new_tokens, slice_len)``, so the
engine also serves slices (finish_reason None when the slice ended first).
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sclsd.protocol import BatchMsg, BatchStats, RequestOutput
from worker.engines.base import Emit as EngineEmit
from worker.engines.hf import HFEngine, peak_memory

log = logging.getLogger(__name__)

#: ``take`` returns this when no batch is waiting.
EMPTY = object()

Take = Callable[[float | None], Any]
Emit = Callable[[BatchMsg, "list[RequestOutput] | None", "BatchStats | None", "str | None"], None]


class GreedyOnlyError(ValueError):
    """A batch asked for sampling, which this engine does not serve."""


@dataclass
class _Pending:
    batch: BatchMsg
    started: float
    caps: dict[str, int]
    outputs: dict[str, RequestOutput] = field(default_factory=dict)


class HFCBEngine(HFEngine):
    """Continuous-batching engine over transformers' ``init_continuous_batching``."""

    name = "hf-cb"
    continuous = True

    def __init__(self, *args: Any, poll_s: float = 0.005, **kwargs: Any) -> None:
        # transformers' paged cache owns the KV here: nothing is kept across slices.
        kwargs["kv_reuse"] = False
        super().__init__(*args, **kwargs)
        from transformers import GenerationConfig

        self.poll_s = poll_s
        self.gen_config = GenerationConfig(
            do_sample=False,
            max_new_tokens=1024,
            eos_token_id=self.eos[0] if self.eos else -1,
            pad_token_id=self.pad_id,
        )

    # ------------------------------------------------------------------ one batch

    def serve(
        self, batch: BatchMsg, emit: EngineEmit | None = None
    ) -> tuple[list[RequestOutput], BatchStats]:
        """Serve one batch to completion (blocking). Tokens arrive with the result only:
        ``emit`` is never called."""
        done: list[tuple[list[RequestOutput] | None, BatchStats | None, str | None]] = []
        items: list[Any] = [batch, None]

        def take(timeout: float | None) -> Any:
            return items.pop(0) if items else None

        def collect(b: BatchMsg, outs: Any, stats: Any, error: str | None) -> None:
            done.append((outs, stats, error))

        self.run_continuous(take, collect)
        outs, stats, error = done[0]
        if error is not None:
            raise RuntimeError(error)
        assert outs is not None and stats is not None
        return outs, stats

    # ------------------------------------------------------------------ continuous

    def run_continuous(self, take: Take, emit: Emit) -> None:
        """Admit batches from ``take`` and ``emit`` each one's outputs when all its rows finish.

        ``take(timeout)`` returns a :class:`BatchMsg`, :data:`EMPTY` when none
        came within ``timeout`` (None: wait), or None to stop once every
        admitted request has finished. Returns after that stop; raises if the
        generation thread dies (the worker exits and the daemon re-queues).
        """
        mgr = self.model.init_continuous_batching(generation_config=self.gen_config)
        mgr.start()
        pending: dict[int, _Pending] = {}
        owner: dict[str, tuple[int, str]] = {}
        stopping = False
        try:
            while True:
                if not stopping:
                    item = take(None if not owner else 0.0)
                    while item is not EMPTY:
                        if item is None:
                            stopping = True
                            break
                        self._admit(mgr, item, pending, owner, emit)
                        item = take(0.0)
                if stopping and not owner:
                    return
                self._collect(mgr, pending, owner, emit)
        finally:
            mgr.stop(block=True, timeout=30)

    def _admit(self, mgr: Any, batch: BatchMsg, pending: dict[int, _Pending],
               owner: dict[str, tuple[int, str]], emit: Emit) -> None:
        if any(r.temperature > 0 for r in batch.requests):
            emit(batch, None, None, "hf-cb serves greedy decoding only (temperature 0)")
            return
        p = _Pending(batch, time.perf_counter(), {})
        pending[batch.batch_id] = p
        for r in batch.requests:
            cap = min(r.max_new_tokens, batch.slice_len)
            p.caps[r.rid] = cap
            stops = [] if r.ignore_eos else list(self.eos)
            stops += [t for t in r.stop_token_ids if t not in stops]
            key = f"{batch.batch_id}/{r.rid}"
            owner[key] = (batch.batch_id, r.rid)
            mgr.add_request(
                input_ids=list(r.token_ids),
                request_id=key,
                max_new_tokens=cap,
                eos_token_id=stops if stops else -1,
            )

    def _collect(self, mgr: Any, pending: dict[int, _Pending],
                 owner: dict[str, tuple[int, str]], emit: Emit) -> None:
        res = mgr.get_result(timeout=self.poll_s)
        while res is not None:
            if res.is_finished() and res.request_id in owner:
                bid, rid = owner.pop(res.request_id)
                p = pending[bid]
                toks = [int(t) for t in res.generated_tokens]
                cap = p.caps[rid]
                req = next(r for r in p.batch.requests if r.rid == rid)
                if len(toks) >= req.max_new_tokens:
                    reason: str | None = "length"
                elif len(toks) >= cap:
                    reason = None  # the slice ended first
                else:
                    reason = "stop"
                p.outputs[rid] = RequestOutput(rid=rid, token_ids=toks, finish_reason=reason)  # type: ignore[arg-type]
                if len(p.outputs) == len(p.batch.requests):
                    del pending[bid]
                    self._emit_done(p, emit)
            res = mgr.get_result(timeout=0)
        if not mgr.is_running():
            raise RuntimeError("continuous batching generation thread stopped unexpectedly")

    def _emit_done(self, p: _Pending, emit: Emit) -> None:
        outs = [p.outputs[r.rid] for r in p.batch.requests]
        elapsed = time.perf_counter() - p.started
        stats = BatchStats(
            prefill_s=0.0,
            decode_s=elapsed,  # prefill and decode interleave with other requests: one wall time
            iterations=max((len(o.token_ids) for o in outs), default=0),
            pad_tokens=0,
            invalid_tokens=0,
            peak_memory=peak_memory(self.device),
            batch_size=len(outs),
            input_len=max((len(r.token_ids) for r in p.batch.requests), default=0),
        )
        emit(p.batch, outs, stats, None)


def queue_take(q: queue.Queue[Any]) -> Take:
    """A ``take`` over the worker's local queue of ``(batch, queued_at)`` items."""

    def take(timeout: float | None) -> Any:
        try:
            item = q.get(timeout=timeout) if timeout != 0.0 else q.get_nowait()
        except queue.Empty:
            return EMPTY
        return None if item is None else item[0]

    return take
