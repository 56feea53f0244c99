"""The Engine interface every worker engine implements (hf, hf-cb, deepspeed, fake).

An engine is driven from outside; the worker's serve thread owns the loop
(:class:`worker.serve.ServeLoop`)::

    while running:
        while engine.has_room():      # a batch waiting in the worker's queue
            engine.submit(batch)      # rows whole; never raises for the batch's content
        for event in engine.poll(t):  # advance the work (at most ``t`` s of waiting)
            NewTokens   -> a Tokens message (coalesced)
            BatchDone   -> a Result with the rows' outputs and stats
            BatchFailed -> a Result with the error
    engine.release(rids)              # from the receive thread, at any time
    engine.cancel(rows)               # likewise: (batch id, rid) rows end at the next step

Every submitted batch ends with exactly one :class:`BatchDone` or :class:`BatchFailed`,
after the :class:`NewTokens` events of its rows. A static engine
(:class:`SliceEngine`) holds one batch at a time and runs one decoding iteration per
:meth:`Engine.poll`; a continuous one (``caps.batching == "continuous"``) takes batches
while earlier ones generate and says how long it may wait for tokens.

Two optional capabilities beyond serving a batch:

* **Streaming.** :class:`NewTokens` holds the tokens generated since the batch's previous
  event, one :class:`~sclsd.protocol.RequestOutput` per row that has new ones
  (:class:`TokenCursor` does that bookkeeping). :class:`BatchDone` still holds every token
  of the slice: the worker sends the daemon only those its stream did not carry
  (:func:`worker.serve.result_rows`).
* **Retained KV.** An engine may keep an unfinished request's KV after its slice
  (reported per row as ``RequestOutput.kv_tokens``); :meth:`Engine.release` drops it on
  the daemon's word and :meth:`Engine.take_evicted` lists what the engine dropped by
  itself to make room.

**Cancels reach the engine.** :meth:`Engine.cancel` names rows (batch id, request id) whose
requests ended in the daemon: each engine ends them in its next :meth:`Engine.poll`, before
it computes anything more for them: a row not started yet ends at once, a running row leaves
the step (a static batch stops early once every row ended), each with ``finish_reason``
``cancelled`` and nothing kept. The batch still ends with one :class:`BatchDone`.

A row the engine cannot serve fails alone: its grammar matcher cannot be built
(:class:`~worker.engines.grammar.GrammarError`) and the row's output carries the error
(``RequestOutput.error``) while the others are served; the daemon ends that request and
retries it nowhere.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from sclsd.protocol import BatchMsg, BatchRequest, BatchStats, EngineCaps, RequestOutput
from worker.engines.grammar import GrammarError, row_error

__all__ = ["BatchDone", "BatchFailed", "CancelMarks", "Emit", "Engine", "EngineInfo", "Event", "ModelUnsupported",
           "NewTokens", "SliceEngine", "Steps", "TokenCursor"]

log = logging.getLogger("worker")

#: Hears the new tokens of the batch :meth:`Engine.serve` runs (one output per row that has some).
Emit = Callable[[list[RequestOutput]], None]


class ModelUnsupported(ValueError):
    """The engine cannot serve this model (its layers, its attention), though another engine
    can; raised by the constructor once what it loaded is freed. A worker whose engine ``auto``
    chose loads ``sclsd.defaults.AUTO_FALLBACK``'s engine then."""


@dataclass(frozen=True, slots=True)
class NewTokens:
    """Tokens a running batch generated since its previous event, one output per row with new ones
    (``finish_reason`` set on a row's last part when it finished)."""

    batch_id: int
    outputs: list[RequestOutput]


@dataclass(frozen=True, slots=True)
class BatchDone:
    """A batch ended: one output per row, in the batch's order, with every token of the slice."""

    batch: BatchMsg
    outputs: list[RequestOutput]
    stats: BatchStats


@dataclass(frozen=True, slots=True)
class BatchFailed:
    """A batch could not be served (none of its rows' outputs count): ``error`` says why."""

    batch: BatchMsg
    error: str
    exc: BaseException | None = None
    """The exception behind ``error``, when there was one (:meth:`Engine.serve` raises it)."""


#: What :meth:`Engine.poll` returns.
Event = NewTokens | BatchDone | BatchFailed
#: A static engine's batch, one decoding iteration per step: each ``next`` yields the
#: outputs with new tokens (possibly none), and the generator returns every row's output
#: and the batch's stats (:meth:`SliceEngine.steps`).
Steps = Generator[list[RequestOutput], None, tuple[list[RequestOutput], BatchStats]]


class CancelMarks:
    """Rows the daemon cancelled, from the thread that hears it to the one that serves: (batch id,
    request id) pairs under a lock. Naming the batch keeps a later batch of the same request id
    (a client may reuse an id once its request ended) out of reach."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._marks: set[tuple[int, str]] = set()

    def add(self, rows: Iterable[tuple[int, str]]) -> None:
        """Mark ``rows`` cancelled."""
        with self._lock:
            self._marks.update(rows)

    def take(self) -> set[tuple[int, str]]:
        """Every mark, once."""
        with self._lock:
            out, self._marks = self._marks, set()
        return out

    def take_for(self, batch_id: int) -> set[str]:
        """The rids marked in ``batch_id``, once; marks of earlier batches are dropped too (a
        worker takes its batches in the order they came, so nothing can match them any more)."""
        with self._lock:
            if not self._marks:
                return set()
            mine = {rid for bid, rid in self._marks if bid == batch_id}
            self._marks = {(bid, rid) for bid, rid in self._marks if bid > batch_id}
        return mine

    def clear(self) -> None:
        with self._lock:
            self._marks.clear()


#: Guards the lazy creation of an engine's :class:`CancelMarks` (engines have no common __init__).
_MARKS_LOCK = threading.Lock()


class _CancellableRow(Protocol):
    """A static engine's row on the host: its request and why it finished (None: running)."""

    req: BatchRequest
    reason: Any


@dataclass
class EngineInfo:
    """Facts a worker reports to the daemon at register."""

    engine: str
    model: str
    device: str
    kv_bytes_per_token: int
    """Δ: bytes of KV cache per token (2 · layers · kv_heads · head_dim · dtype bytes)."""
    mem_available: int
    """M_ava: bytes available for KV cache after weights and engine overhead."""
    eos_token_ids: list[int] = field(default_factory=list)
    vocab_size: int = 0
    """Token ids the model accepts (0: unknown); the daemon checks its tokenizer against it,
    so engines report what ``len(tokenizer)`` gives for their model."""
    caps: EngineCaps = field(default_factory=EngineCaps)
    """What the engine can do (sent as ``Register.caps``; the daemon reads only this)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Facts for the logs (dtype, load time, library versions); nothing decides on them."""


class Engine(ABC):
    """Serves batches, each for at most ``batch.slice_len`` decoding iterations (see the module
    docstring). Each row stops at EOS (unless ignore_eos), at a stop token, or after its
    ``max_new_tokens``.

    :meth:`submit` and :meth:`poll` are called from the worker's serve thread only;
    :meth:`release` may come from another thread while a batch runs.
    """

    name: str = "base"

    @abstractmethod
    def info(self) -> EngineInfo:
        """Describe the loaded model and the memory it leaves for KV cache."""

    @abstractmethod
    def has_room(self) -> bool:
        """Whether :meth:`submit` may take another batch now (a batch that finds no room waits
        in the worker's queue, where its wait is measured as ``queue_wait_s``)."""

    @abstractmethod
    def submit(self, batch: BatchMsg) -> None:
        """Take ``batch`` (its rows whole). What is wrong with it (an empty context, ids
        outside the vocabulary) comes back from :meth:`poll` as :class:`BatchFailed`."""

    @abstractmethod
    def busy(self) -> bool:
        """Whether a submitted batch has not ended yet (its end not returned by :meth:`poll`)."""

    @abstractmethod
    def poll(self, timeout: float) -> list[Event]:
        """Advance the submitted batches and return what happened since the last call,
        waiting at most ``timeout`` seconds for it when nothing is ready (a static engine runs
        one iteration instead). Raises only when the engine itself broke: the worker then exits
        and the daemon serves its requests elsewhere."""

    @staticmethod
    def check_batch(batch: BatchMsg, vocab: int | None = None) -> None:
        """Refuse a malformed batch before any work: an empty context, or ids outside ``vocab``."""
        for r in batch.requests:
            if not r.token_ids:
                raise ValueError(f"request {r.rid!r} has an empty context")
            if vocab is not None:
                bad = [t for t in r.token_ids if t >= vocab]
                if bad:
                    raise ValueError(f"request {r.rid!r}: token id {bad[0]} outside vocab {vocab}")

    def serve(self, batch: BatchMsg, emit: Emit | None = None) -> tuple[list[RequestOutput], BatchStats]:
        """Serve ``batch`` alone to its end (blocking) and return its outputs and stats; ``emit``
        hears its new tokens as they come. For an idle engine (the profiler, benchmarks,
        tests); a batch that fails raises its error."""
        if self.busy():
            raise RuntimeError(f"{self.name}: serve() needs an idle engine")
        self.submit(batch)
        while True:
            for ev in self.poll(0.05):
                if isinstance(ev, NewTokens):
                    if emit is not None:
                        emit(ev.outputs)
                elif isinstance(ev, BatchDone):
                    return ev.outputs, ev.stats
                else:
                    raise ev.exc if ev.exc is not None else RuntimeError(ev.error)

    def warm_up(self, progress: Callable[[str], None] | None = None) -> None:  # noqa: B027 - optional
        """Before the worker registers: whatever makes the first batches as fast as the later
        ones (capturing graphs, first calls of kernels); ``progress`` hears each step."""

    def profile(self) -> dict[str, Any] | None:
        """An estimator profile (``sclsd.core.profiles.Profile.to_dict()``) this engine knows
        exactly, sent at register when none is given on the command line; None otherwise."""
        return None

    def release(self, rids: Iterable[str] | None = None) -> None:  # noqa: B027 - optional hook
        """Drop the retained KV of ``rids`` (None: of every request). Called from the worker's
        receive thread while a batch may be running: engines that retain KV make it safe."""

    def take_evicted(self) -> list[str]:
        """Requests whose retained KV the engine dropped by itself since the last call."""
        return []

    def rows_now(self) -> int:
        """The rows it can run at once now, where that depends on what runs (``Result.rows``);
        0: ``caps().max_rows`` whatever runs."""
        return 0

    _cancel_marks: CancelMarks | None = None

    @property
    def cancels(self) -> CancelMarks:
        """The rows cancelled and not applied yet (see :meth:`cancel`)."""
        marks = self._cancel_marks
        if marks is None:
            with _MARKS_LOCK:
                if self._cancel_marks is None:
                    self._cancel_marks = CancelMarks()
                marks = self._cancel_marks
        return marks

    def cancel(self, rows: Iterable[tuple[int, str]]) -> None:
        """End these rows (batch id, request id) of the batches submitted here: their requests
        ended in the daemon. Any thread: the marks are applied by the engine's next
        :meth:`poll` (each engine does, before computing anything more for those rows); a row
        it does not hold is ignored (the worker's queue drops rows not submitted yet)."""
        self.cancels.add(rows)

    def close(self) -> None:  # noqa: B027 - optional hook, deliberately not abstract
        """Release resources (optional)."""


class SliceEngine(Engine):
    """Static batching: one batch at a time, one decoding iteration per :meth:`poll`.

    Subclasses write a batch's service as a generator (:meth:`steps`); this class runs it a
    step per poll and turns what it yields, returns or raises into events. A row whose grammar
    cannot be built (:class:`~worker.engines.grammar.GrammarError`, raised before any token)
    is answered with its error and the batch starts again without it; any other exception
    fails the batch, and the engine goes on with the next.
    """

    _batch: BatchMsg | None = None
    """The batch submitted, as given (None: idle)."""
    _rows: BatchMsg | None = None
    """The rows being served: ``_batch`` less those that failed alone."""
    _gen: Steps | None = None
    """The running batch's steps (None: not started, or started again without a failed row)."""
    _failed: list[RequestOutput]
    _ending: frozenset[str] = frozenset()
    """Rows of the running batch cancelled since its last step (:meth:`end_cancelled`)."""

    @abstractmethod
    def steps(self, batch: BatchMsg) -> Steps:
        """Serve ``batch`` for at most ``slice_len`` iterations, yielding after each the rows'
        new tokens (:class:`TokenCursor`); returns one output per row (same order) and stats."""

    def has_room(self) -> bool:
        """Room for a batch while none is running."""
        return self._batch is None

    def busy(self) -> bool:
        """Whether a batch is running."""
        return self._batch is not None

    def submit(self, batch: BatchMsg) -> None:
        """Start ``batch`` (its first step runs at the next :meth:`poll`)."""
        if self._batch is not None:
            raise RuntimeError(f"{self.name}: batch {self._batch.batch_id} is still running")
        self._batch = self._rows = batch
        self._gen, self._failed = None, []

    def poll(self, timeout: float) -> list[Event]:
        """Run one step of the running batch (``timeout`` is not needed: a step is work)."""
        batch, rows = self._batch, self._rows
        if batch is None or rows is None:
            return []
        if marks := self.cancels.take():
            self._ending = self._ending | {rid for bid, rid in marks if bid == batch.batch_id}
        if self._gen is None and self._ending:
            # Cancelled before the batch started: those rows are not computed at all.
            gone = [r.rid for r in rows.requests if r.rid in self._ending]
            self._ending = frozenset()
            if gone:
                self._failed += [RequestOutput(rid=rid, token_ids=[], finish_reason="cancelled") for rid in gone]
                rows = self._rows = msgspec.structs.replace(
                    rows, requests=[r for r in rows.requests if r.rid not in gone])
                if not rows.requests:
                    return [BatchDone(batch, self._end(), BatchStats())]
        try:
            if self._gen is None:
                self._gen = self.steps(rows)
            new = next(self._gen)
        except StopIteration as stop:
            outputs, stats = stop.value
            return [BatchDone(batch, outputs + self._end(), stats)]
        except GrammarError as exc:
            if not any(r.rid == exc.rid for r in rows.requests):
                return [self._fail(batch, exc)]
            log.warning("batch=%d: %s; the rest of the batch is served", batch.batch_id, exc)
            self._failed.append(row_error(exc))
            self._rows = msgspec.structs.replace(rows, requests=[r for r in rows.requests if r.rid != exc.rid])
            self._gen = None
            return []
        except Exception as exc:  # noqa: BLE001 - the worker outlives a failing batch
            return [self._fail(batch, exc)]
        return [NewTokens(batch.batch_id, new)] if new else []

    def end_cancelled(self, rows: Sequence[_CancellableRow]) -> None:
        """Finish the running batch's rows cancelled since the last call (``reason``
        ``cancelled``): subclasses call this after each step's yield, before the next step."""
        if self._ending:
            for r in rows:
                if r.reason is None and r.req.rid in self._ending:
                    r.reason = "cancelled"
            self._ending = frozenset()

    def _end(self) -> list[RequestOutput]:
        """The running batch ended: the rows that failed alone."""
        failed = self._failed
        self._batch = self._rows = self._gen = None
        self._failed = []
        self._ending = frozenset()
        return failed

    def _fail(self, batch: BatchMsg, exc: BaseException) -> BatchFailed:
        log.error("batch=%d failed", batch.batch_id, exc_info=exc)
        self._end()
        return BatchFailed(batch, f"{type(exc).__name__}: {exc}", exc)


class TokenCursor:
    """Turns a batch's growing per-row outputs into the new tokens of each step."""

    __slots__ = ("rids", "sent")

    def __init__(self, rids: list[str]) -> None:
        self.rids = rids
        self.sent = [0] * len(rids)

    def new(
        self, outs: list[list[int]], reasons: list[Any], logprobs: list[list[Any]] | None = None,
        prompt: list[list[Any]] | None = None,
    ) -> list[RequestOutput]:
        """What each row generated beyond what an earlier call returned (rows with nothing new
        are left out). ``logprobs``: per row, aligned with ``outs`` (rows that asked for them);
        ``prompt``: per row, its prompt's log-probabilities, sent with its first tokens."""
        new: list[RequestOutput] = []
        for i, toks in enumerate(outs):
            k = self.sent[i]
            if len(toks) > k:
                lps = logprobs[i][k : len(toks)] if logprobs is not None else []
                plps = prompt[i] if prompt is not None and k == 0 else []
                new.append(RequestOutput(rid=self.rids[i], token_ids=toks[k:],
                                         finish_reason=reasons[i], logprobs=lps, prompt_logprobs=plps))  # fmt: skip
                self.sent[i] = len(toks)
        return new
