"""A batch and a worker's answer for it: what passes between the scheduler and a worker.

These are plain data, shared by the scheduler (which makes batches and
applies outcomes), the offloaders (which place batches) and every driver of
the scheduler (the daemon, the simulator).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .request import FinishReason, Request


@dataclass(slots=True, eq=False)
class Batch:
    """Requests served together on one worker for at most ``slice_len`` iterations."""

    bid: int
    requests: list[Request]
    slice_len: int
    input_len: int
    """Batch input length L_i: the longest context in the batch (others are left-padded)."""
    est_time: float = 0.0
    """Estimated serving time; once the batch is placed, on its worker."""
    worker: str | None = None
    est_on: dict[str, float] = field(default_factory=dict)
    """Estimated serving time on the workers where it is not ``est_time``: those holding
    some rows' KV (KV reuse). Empty: the same estimate everywhere (the paper's model)."""

    def est_for(self, worker: str) -> float:
        """Estimated serving time of this batch on ``worker``."""
        return self.est_on.get(worker, self.est_time)

    @property
    def size(self) -> int:
        """Number of requests in the batch."""
        return len(self.requests)


@dataclass(slots=True)
class RowOutcome:
    """What one request got out of a slice."""

    rid: str
    new_tokens: int
    finish_reason: FinishReason | None = None
    """``stop`` or ``length`` when the request is done; None when the slice ended first."""
    kv_tokens: int = 0
    """Tokens of this row's context whose KV the worker keeps after the slice (0: none)."""
    failed: bool = False
    """The engine could not serve this row (its grammar could not be built): the request
    ends as failed, never retried, and the worker is not at fault."""


@dataclass(slots=True)
class BatchOutcome:
    """A worker's answer for one batch."""

    batch_id: int
    rows: list[RowOutcome] = field(default_factory=list)
    ok: bool = True
    """False when the engine failed: the batch's requests go back to the pool."""
    charged: bool = True
    """With ``ok`` False: the failure counts against each request (``max_failures``).
    False when the batch, not its requests, was at fault (its worker ran out of memory for
    a batch of several: smaller batches will do)."""
    elapsed: float | None = None
    """Measured serving time of the batch, for estimator error tracking."""
