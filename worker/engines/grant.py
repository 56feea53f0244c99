"""A grant in flight on a continuous-batching engine (``fake`` continuous, ``llama``,
``hf-static-cb``): its rows' outputs as they end and its prefill accounting, and the stats
its :class:`~worker.engines.base.BatchDone` carries. No device and no torch here.

A grant is a batch of the daemon's (:class:`~sclsd.protocol.BatchMsg`): its rows join the
engine's running set and leave it one by one; the grant ends once all its rows have.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sclsd.protocol import BatchMsg, BatchStats, RequestOutput

__all__ = ["Grant", "grant_stats", "rows_memory"]


@dataclass(eq=False)
class Grant:
    """A batch in flight: its rows' outputs as they end, its prefill accounting."""

    batch: BatchMsg
    started: float
    left: int
    """Rows not ended yet (waiting or running)."""
    outputs: dict[str, RequestOutput] = field(default_factory=dict)
    prefill_s: float = 0.0
    """Its share of the steps its rows prefilled in."""
    prefill_tokens: int = 0
    reused_tokens: int = 0

    @property
    def batch_id(self) -> int:
        return self.batch.batch_id


def grant_stats(g: Grant, now: float, peak_memory: int, kv_peak: int) -> tuple[list[RequestOutput], BatchStats]:
    """A grant's outputs in its batch's order and its stats: no padding and no invalid
    tokens (rows leave as they end); its prefill is what its own rows' joining took, the
    rest of its wall time decoding."""
    reqs = g.batch.requests
    outs = [g.outputs[r.rid] for r in reqs]
    elapsed = now - g.started
    stats = BatchStats(prefill_s=min(g.prefill_s, elapsed), decode_s=max(0.0, elapsed - g.prefill_s),
                       iterations=max((len(o.token_ids) for o in outs), default=0), peak_memory=peak_memory,
                       batch_size=len(outs), input_len=max((len(r.token_ids) for r in reqs), default=0),
                       prefill_tokens=g.prefill_tokens, reused_tokens=g.reused_tokens, kv_peak_tokens=kv_peak)
    return outs, stats


def rows_memory(g: Grant, kv_bytes: int) -> int:
    """The KV bytes of a grant's rows at their end (context and output), for engines that
    do not measure a device's peak."""
    return sum(len(r.token_ids) + len(g.outputs[r.rid].token_ids) for r in g.batch.requests) * kv_bytes
