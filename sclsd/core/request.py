"""Request state as the scheduler sees it: lengths and times, no token ids."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal

#: Why a request ended: ``stop`` (EOS, a stop token or a stop string),
#: ``length`` (its ``max_tokens``), ``cancelled`` (the client or a disconnect),
#: ``timeout`` (its deadline) or ``error`` (its batch failed too often). Also
#: the wire type, :data:`sclsd.protocol.FinishReason`.
FinishReason = Literal["stop", "length", "cancelled", "timeout", "error"]


class State(str, Enum):
    """Life of a request. Terminal: FINISHED, CANCELLED, FAILED."""

    QUEUED = "queued"  # in the pool, waiting for a slice
    SCHEDULED = "scheduled"  # in a batch sent to a worker (queued there or running)
    FINISHED = "finished"
    CANCELLED = "cancelled"  # by the client, a disconnect or a timeout
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (State.FINISHED, State.CANCELLED, State.FAILED)


@dataclass(slots=True, eq=False)
class Request:
    """One request in the scheduler.

    ``payload`` is opaque to the policy: the daemon keeps token ids and
    sampling parameters there, the simulator the true output length (which the
    policy must never read).
    """

    rid: str
    prompt_len: int
    max_tokens: int
    arrival: float
    priority: int = 0
    deadline: float | None = None
    payload: Any = None
    num_generated: int = 0
    """Tokens generated so far and taken by the driver: every completed slice's, and those of
    the running slice already streamed (:meth:`SchedulerMechanism.generated
    <sclsd.core.mechanism.SchedulerMechanism.generated>`). Written there and when a slice's
    outcome is applied, nowhere else: the context and budget every part reads follow it."""
    slice_start: int = 0
    """``num_generated`` when its running (or latest) slice was dispatched."""
    state: State = State.QUEUED
    slices: int = 0
    group: tuple[str, ...] = ()
    """Whose request it is, for fair turns in line: a path whose levels take turns (the daemon's
    is the client's uid, its process, and its connection and user or its ``generate.group``)."""
    failures: int = 0
    worker_losses: int = 0
    """Workers that died while this request was in one of their batches."""
    first_dispatch: float | None = None
    first_token: float | None = None
    finished_at: float | None = None
    finish_reason: FinishReason | None = None
    worker: str | None = None
    batch_id: int | None = None
    pooled_at: float | None = None
    """When it last entered the pool (accepted, or back from a slice)."""
    kv_worker: str | None = None
    """The worker holding this request's KV from its last slice (None: no worker holds it)."""
    kv_tokens: int = 0
    """Tokens of context that KV covers (at most ``input_len - 1``: the last sampled
    token was never fed, so its KV does not exist yet)."""
    prefix_worker: str | None = None
    """A worker likely to hold a cached prefix of this request's prompt that another request
    left there (the driver's hint, from token ids the policy never sees; None: none known)."""
    prefix_tokens: int = 0
    """How many prompt tokens that prefix covers."""

    @property
    def input_len(self) -> int:
        """Context length of the next slice: prompt plus everything generated so far."""
        return self.prompt_len + self.num_generated

    @property
    def uncached_tail(self) -> int:
        """Tokens of the context ``kv_worker`` does not hold: what a batch there must prefill.

        At least 1: a forward needs one token to produce logits from.
        """
        return max(1, self.input_len - self.kv_tokens) if self.kv_worker is not None else self.input_len

    @property
    def slice_tokens(self) -> int:
        """Tokens of the running slice counted already (streamed ahead of its result)."""
        return self.num_generated - self.slice_start

    @property
    def remaining(self) -> int:
        """Tokens this request may still generate."""
        return self.max_tokens - self.num_generated
