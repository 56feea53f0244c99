"""What a driver (the daemon, the simulator) sees of a scheduler: the interface both
schedulers implement, each worker's state and the typed counts they report.

The scheduler owns its tables and counts; a driver reads them and never
writes them (:meth:`SchedulerInterface.stats` returns a copy).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    from .batch import Batch, BatchOutcome
    from .decisions import Applied, Cancelled, Expired, Releases, Removed, Round
    from .policy import Policy
    from .request import FinishReason, Request

__all__ = ["GrantStats", "SchedulerInterface", "SchedulerStats", "WorkerState"]

_S = TypeVar("_S", bound="SchedulerStats")


@dataclass(slots=True)
class WorkerState:
    """The scheduler's view of one worker: rotation, estimated load, counters."""

    wid: str
    active: bool = True
    load: float = 0.0
    """Estimated seconds of work queued on the worker (paper eq. 11)."""
    batches: set[int] = field(default_factory=set)
    batches_done: int = 0
    tokens_done: int = 0
    last_completion: float | None = None


@dataclass(slots=True)
class SchedulerStats:
    """Event counts since the scheduler started (the status socket's ``counters``)."""

    accepted: int = 0
    finished: int = 0
    cancelled: int = 0
    timed_out: int = 0
    failed: int = 0
    batches: int = 0
    slices: int = 0
    requeued: int = 0
    early_returns: int = 0
    """Batches whose rows all finished before the slice's last iteration (paper 4.2)."""

    def ended(self, reason: FinishReason, failed: bool = False) -> None:
        """Count a request's end: ``finished`` (stop, length: also a stop string or a budget
        its streamed tokens reached), ``cancelled`` (by its client, or an error here),
        ``timed_out``, or ``failed`` (its batches failed, or its row could not be served)."""
        if failed:
            self.failed += 1
        elif reason == "timeout":
            self.timed_out += 1
        elif reason in ("cancelled", "error"):
            self.cancelled += 1
        else:
            self.finished += 1

    def as_counters(self) -> dict[str, int]:
        """The counts by name, as the status snapshot carries them."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def copy(self: _S) -> _S:
        return dataclasses.replace(self)


@dataclass(slots=True)
class GrantStats(SchedulerStats):
    """The slice-grant scheduler's counts: those of every scheduler, plus its grants."""

    grants: int = 0
    migrations: int = 0
    """Grants placed on another worker than the one holding the request's KV."""


class SchedulerInterface(Protocol):
    """What a driver (the daemon, the simulator) sees of a scheduler; the slice scheduler
    (:class:`~sclsd.core.scheduler.Scheduler`) and the slice-grant scheduler
    (:class:`~sclsd.core.grant_scheduler.SliceGrantScheduler`) implement it.

    The driver reports arrivals, cancellations, workers and outcomes, asks for a
    round when one is :meth:`due` and sends the batches it returns. Each entry point
    returns what it decided (:mod:`sclsd.core.decisions`), the KV it released included:
    the driver tells each worker to drop what a returned value releases, once; nothing
    is left to poll for. Time is always an argument.
    The tables are the scheduler's: a driver reads them and never writes them.
    """

    policy: Policy
    interval: float
    """The current scheduling interval T (seconds)."""
    next_at: float
    """When the interval rule runs the next round (inf: on changes only)."""
    recent: deque[tuple[float, float]]
    """(estimated, measured) serving time of the latest batches."""

    @property
    def pool(self) -> Mapping[str, Request]:
        """Requests waiting for a slice."""
        ...

    @property
    def live(self) -> Mapping[str, Request]:
        """Requests not ended yet (in the pool or in a batch)."""
        ...

    @property
    def batches(self) -> Mapping[int, Batch]:
        """Batches on workers, until their outcome."""
        ...

    @property
    def workers(self) -> Mapping[str, WorkerState]:
        """Every registered worker's state, by id."""
        ...

    def stats(self) -> SchedulerStats:
        """A copy of the scheduler's event counts."""
        ...

    # workers
    def add_worker(self, wid: str, rows: int = 0) -> None:
        """A worker joined (or rejoined): no load, no KV. ``rows``: the most grants it may hold
        at once (its engine's rows and a lookahead; 0: unbounded). Slice rounds ignore it:
        their interval bounds what a worker queues."""
        ...

    def set_rows(self, wid: str, rows: int) -> None:
        """Worker ``wid`` may hold at most ``rows`` grants at once from now on (its engine's
        room changed; see :meth:`add_worker`). Slice rounds ignore it."""
        ...

    def set_active(self, wid: str, active: bool) -> Releases:
        """Take a worker out of rotation (drain) or back in; its batches keep running.
        Returns the KV released (a drained worker's kept KV the policy gives up)."""
        ...

    def remove_worker(self, wid: str, now: float, charged: bool = False) -> Removed:
        """A worker is gone: its batches' requests back in the pool, or ended (``FAILED``)
        when ``charged`` made one reach ``max_worker_losses``; the KV released."""
        ...

    def active_workers(self) -> list[str]:
        """Workers in rotation."""
        ...

    # requests
    def add(self, req: Request, now: float) -> None:
        """Accept a request into the pool."""
        ...

    def cancel(self, rid: str, now: float, reason: FinishReason = "cancelled") -> Cancelled | None:
        """End a live request now, and the KV released (None: not live; nothing changed); a
        batch holding it still runs."""
        ...

    def expire(self, now: float) -> Expired:
        """Cancel (``timeout``) the live requests whose deadline has passed."""
        ...

    def next_deadline(self) -> float | None:
        """The earliest deadline of a live request."""
        ...

    # rounds and outcomes
    def due(self, now: float) -> bool:
        """Whether a round should run now."""
        ...

    def schedule(self, now: float) -> Round:
        """Run a round: the batches to send, each with its worker set, and the KV released
        (requests that moved away from it)."""
        ...

    def on_result(self, outcome: BatchOutcome, now: float) -> Applied:
        """Apply a batch's outcome: the requests it ended, those re-queued, the KV released."""
        ...

    # what the daemon saw of a running slice (the result brings the rest)
    def generated(self, rid: str, k: int, now: float) -> None:
        """``k`` tokens of ``rid``'s running slice arrived at ``now`` (streamed): they count
        in its progress at once (``Request.num_generated``; the result adds only the rest)."""
        ...

    # retained KV
    def kv_evicted(self, wid: str, rids: Iterable[str]) -> None:
        """Worker ``wid`` dropped these requests' kept KV by itself (releases nothing)."""
        ...
