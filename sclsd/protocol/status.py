"""Status socket (stream Unix socket, read-only): :class:`StatusRequest` /
:class:`MetricsRequest` answered by :class:`StatusReply` / :class:`MetricsReply`."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from .common import LossReason, WorkerStateName, _Msg


class StatusRequest(_Msg, tag="status"):
    """Ask for the daemon's state as a :class:`StatusReply`."""


class MetricsRequest(_Msg, tag="metrics"):
    """Ask for Prometheus text exposition as a :class:`MetricsReply`."""


StatusMsg = StatusRequest | MetricsRequest


class WorkerStatus(msgspec.Struct, forbid_unknown_fields=True):
    """One registered worker, as the status socket shows it."""

    id: str
    engine: str
    model: str
    device: str
    pid: int
    state: WorkerStateName
    load_s: float
    """Estimated seconds of work queued on the worker (the offloader's view)."""
    batches_inflight: int
    """Batches sent and not yet answered."""
    queued_batches: int
    """Batches in the worker's local queue (its last heartbeat)."""
    busy: bool
    """Serving a batch (its last heartbeat)."""
    batches_done: int
    tokens_done: int
    heartbeat_age_s: float
    """Seconds since the worker was last heard from."""
    kv_cache_usage: float = 0.0
    """KV cache in use, 0 to 1: under static batches what the batch it serves and the KV it
    keeps take of its M_ava; under slice grants what the grant policy reserves of its budget
    (docs/operations.md, Metrics)."""


class WorkerLosses(msgspec.Struct, forbid_unknown_fields=True):
    """A worker the daemon dropped at least once since it started, and why."""

    id: str
    count: int
    """Times it was dropped (a spawned worker whose process was killed or ended restarts)."""
    by_reason: dict[LossReason, int]
    last_reason: LossReason
    last_why: str
    """The last drop, in words (as the daemon's log says it at warning)."""
    last_age_s: float
    """Seconds since the last drop."""


class LoadingWorker(msgspec.Struct, forbid_unknown_fields=True):
    """A worker the daemon spawned that has not registered yet (it is loading its model)."""

    id: str
    pid: int
    age_s: float
    """Seconds since it was spawned."""
    step: str = ""
    """Its latest loading step, as it logged it ("" before the first)."""
    state: Literal["loading", "restarting", "given_up"] = "loading"
    """``restarting``: its process ended and the daemon starts it again after a back-off;
    ``given_up``: it failed too often at start and is not restarted (``pid`` is then the
    process that ended)."""


class EstimatedVsMeasured(msgspec.Struct, forbid_unknown_fields=True):
    est_s: float
    measured_s: float


class EstimatorError(msgspec.Struct, forbid_unknown_fields=True):
    """Measured minus estimated batch serving time over the latest batches."""

    batches: int
    mean_error_s: float | None
    mean_abs_error_s: float | None
    last: list[EstimatedVsMeasured]


class Limits(msgspec.Struct, forbid_unknown_fields=True):
    max_queued_requests: int
    max_queued_tokens: int
    max_partial_frame_bytes: int = 0
    """Budget of the bytes all half-sent frames may hold (0: not reported)."""
    max_partial_frame_bytes_per_uid: int = 0
    """The same for the frames of one peer uid."""
    max_input: int = 0
    """``model.max_input``: the most prompt tokens a request may have (0: not reported);
    ``sclsd-http`` refuses longer prompts by their length before tokenizing them."""


class StatusSnapshot(msgspec.Struct, forbid_unknown_fields=True):
    """The daemon's state, built in one place (``sclsd.daemon.status``) and read by the
    status socket, ``sclsctl status/top`` and the Prometheus gauges."""

    version: str
    protocol: int
    uptime_s: float
    draining: bool
    model: str
    policy: str
    slice_len: int
    interval_s: float
    """Current scheduling interval T."""
    pool_size: int
    """Requests waiting in the pool for a slice."""
    live_requests: int
    running_requests: int
    """Requests in batches on workers."""
    admitting: int
    """Requests between their frame and admission (tokenizing, or waiting for their grammar's check)."""
    queued_tokens: int
    """Prompt tokens of live requests."""
    limits: Limits
    connections: int
    metrics_http: str | None
    workers: list[WorkerStatus]
    estimator: dict[str, Any]
    """The serving-time estimator's coefficients (``sclsd.core.estimator``)."""
    estimator_error: EstimatorError
    counters: dict[str, int]
    """Scheduler and daemon event counts since start (docs/operations.md lists them)."""
    serving: bool = True
    """False when no worker can serve (e.g. local workers crash-looping) or while the daemon
    is ``starting``: see ``why``."""
    why: str | None = None
    starting: bool = False
    """The daemon listens but does not serve yet (loading the tokenizer, downloading the
    model): ``generate`` is answered with error ``starting``."""
    loading: list[LoadingWorker] = []
    """Spawned workers that have not registered yet."""
    waiting_requests: int = 0
    """Live requests no worker has started yet (in the pool, or in a batch still waiting in a
    worker's queue): the gateway's TotalQueuedRequests."""
    started_requests: int = 0
    """Live requests a worker has started (served now, or between slices): the gateway's
    TotalRunningRequests. ``waiting_requests + started_requests == live_requests``."""
    kv_cache_usage: float = 0.0
    """KV cache in use over all workers, 0 to 1 (used over capacity, summed)."""
    partial_frame_bytes: int = 0
    """Bytes held now in half-sent frames on the client and status sockets (bounded by
    ``limits.max_partial_frame_bytes``)."""
    expected_workers: int = 0
    """Workers the daemon's config starts (``workers.spawn``); readiness waits for them all.
    0: the workers are started elsewhere."""
    worker_losses: list[WorkerLosses] = []
    """Every worker dropped since the daemon started, with why (``sclsctl status``)."""
    tokenizer: str | None = None
    """The directory of the model's tokenizer files, as ``AutoTokenizer.from_pretrained``
    takes it: what load generators need as ``--tokenizer`` / ``--processor`` to count
    tokens as the daemon does (``sclsctl tokenizer``). None for the ``fake`` model, while
    the daemon starts, or for a tokenizer built in memory."""


class StatusReply(_Msg, tag="status_reply"):
    """Snapshot of the daemon."""

    status: StatusSnapshot


class MetricsReply(_Msg, tag="metrics_reply"):
    text: str
