"""The Engine interface every worker engine implements (hf, hf-cb, deepspeed, fake).

Two optional capabilities beyond serving a batch:

* **Streaming.** ``serve(batch, emit)`` calls ``emit(outputs)`` from its decode
  loop with the tokens generated since the previous call, one
  :class:`~sclsd.protocol.RequestOutput` per row that has new tokens
  (:class:`TokenCursor` does that bookkeeping). The returned outputs still hold
  every token of the slice: the worker sends the daemon only those its stream
  did not carry (:func:`worker.serve.result_rows`).
* **Retained KV.** An engine may keep an unfinished request's KV after its slice
  (reported per row as ``RequestOutput.kv_tokens``); :meth:`Engine.release` drops
  it on the daemon's word and :meth:`Engine.take_evicted` lists what the engine
  dropped by itself to make room.

The worker drives every engine the same way, through :meth:`Engine.run`: batches come
from a ``take`` function and each one's outcome goes to ``done``. A static engine serves
them one at a time (the default :meth:`Engine.run`, over :meth:`Engine.serve`); a
continuous engine (``caps.batching == "continuous"``) overrides :meth:`Engine.run` to
admit new batches while earlier ones still generate.

A row the engine cannot serve fails alone: its grammar matcher cannot be built
(:class:`~worker.engines.grammar.GrammarError`) and the row's output carries the error
(``RequestOutput.error``) while the others are served; the daemon ends that request and
retries it nowhere (:meth:`Engine.serve_rows` for static engines).
"""

from __future__ import annotations

import enum
import logging
import queue
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import msgspec

from sclsd.protocol import BatchMsg, BatchStats, EngineCaps, RequestOutput
from worker.engines.grammar import GrammarError, row_error

log = logging.getLogger("worker")

#: Receives the tokens a running batch generated since the last call (see the module docstring).
Emit = Callable[[list[RequestOutput]], None]
class Empty(enum.Enum):
    """What ``take`` returns when no batch came within its timeout (one value: :data:`EMPTY`)."""

    EMPTY = "empty"


EMPTY: Final = Empty.EMPTY
#: ``take(timeout)``: the next batch; :data:`EMPTY` when none came within ``timeout`` seconds
#: (None: wait for one); None to stop once every admitted batch is done.
Take = Callable[[float | None], "BatchMsg | Literal[Empty.EMPTY] | None"]
#: ``done(batch, outputs, stats, error)``: a batch's outcome, outputs and stats or an error text.
Done = Callable[[BatchMsg, "list[RequestOutput] | None", "BatchStats | None", "str | None"], None]
#: ``stream(batch_id, outputs)``: a running batch's new tokens.
Stream = Callable[[int, "list[RequestOutput]"], None]


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
    """Serves one batch at a time, for at most ``batch.slice_len`` decoding iterations.

    ``serve`` is called from the worker's serve thread only; engines need not
    be thread-safe.
    """

    name: str = "base"

    @abstractmethod
    def info(self) -> EngineInfo:
        """Describe the loaded model and the memory it leaves for KV cache."""

    @abstractmethod
    def serve(
        self, batch: BatchMsg, emit: Emit | None = None
    ) -> tuple[list[RequestOutput], BatchStats]:
        """Run the batch; return one output per request (same order) and stats.

        Each row stops at EOS (unless ignore_eos), at a stop token, or after
        its ``max_new_tokens``; the batch stops after ``slice_len`` iterations
        or when every row has stopped. ``emit``, when given, hears new tokens as
        they are generated (an engine may also call it never, or only at the end).
        """

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

    def warm_up(self, progress: Callable[[str], None] | None = None) -> None:  # noqa: B027 - optional
        """Before the worker registers: whatever makes the first batches as fast as the later
        ones (capturing graphs, first calls of kernels); ``progress`` hears each step."""

    def run(self, take: Take, done: Done, stream: Stream | None = None) -> None:
        """Serve batches from ``take`` until it returns None, reporting each to ``done``.

        Static engines serve one batch at a time; a batch that raises is reported with the
        error text and the engine goes on with the next. Continuous engines override this.
        """
        while True:
            batch = take(None)
            if batch is None:
                return
            if batch is EMPTY:
                continue
            emit: Emit | None = None
            if stream is not None:
                def emit(outputs: list[RequestOutput], bid: int = batch.batch_id) -> None:
                    stream(bid, outputs)
            try:
                outputs, stats = self.serve_rows(batch, emit)
            except Exception as exc:  # the worker outlives a failing batch
                log.exception("batch=%d failed", batch.batch_id)
                done(batch, None, None, f"{type(exc).__name__}: {exc}")
                continue
            done(batch, outputs, stats, None)

    def serve_rows(self, batch: BatchMsg, emit: Emit | None = None) -> tuple[list[RequestOutput], BatchStats]:
        """:meth:`serve`, failing rows alone: a row whose grammar cannot be built
        (:class:`~worker.engines.grammar.GrammarError`, raised before any token) is left out
        and answered with its error (``RequestOutput.error``), and the rest is served."""
        failed: list[RequestOutput] = []
        while True:
            try:
                outputs, stats = self.serve(batch, emit)
            except GrammarError as exc:
                if not any(r.rid == exc.rid for r in batch.requests):
                    raise
                log.warning("batch=%d: %s; the rest of the batch is served", batch.batch_id, exc)
                failed.append(row_error(exc))
                batch = msgspec.structs.replace(batch, requests=[r for r in batch.requests if r.rid != exc.rid])
                continue
            return outputs + failed, stats

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

    def close(self) -> None:  # noqa: B027 - optional hook, deliberately not abstract
        """Release resources (optional)."""


class TokenCursor:
    """Turns a batch's growing per-row outputs into ``emit`` calls of only the new tokens."""

    __slots__ = ("rids", "emit", "sent")

    def __init__(self, rids: list[str], emit: Emit | None) -> None:
        self.rids = rids
        self.emit = emit
        self.sent = [0] * len(rids)

    def push(
        self, outs: list[list[int]], reasons: list[Any], logprobs: list[list[Any]] | None = None
    ) -> None:
        """Emit what each row generated beyond what was already emitted (no call if nothing).

        ``logprobs``: per row, aligned with ``outs`` (rows that asked for them).
        """
        if self.emit is None:
            return
        new: list[RequestOutput] = []
        for i, toks in enumerate(outs):
            k = self.sent[i]
            if len(toks) > k:
                lps = logprobs[i][k : len(toks)] if logprobs is not None else []
                new.append(RequestOutput(rid=self.rids[i], token_ids=toks[k:],
                                         finish_reason=reasons[i], logprobs=lps))  # fmt: skip
                self.sent[i] = len(toks)
        if new:
            self.emit(new)


def queue_take(q: queue.Queue[BatchMsg | None]) -> Take:
    """A ``take`` over a queue of batches (None in the queue: stop)."""

    def take(timeout: float | None) -> BatchMsg | Literal[Empty.EMPTY] | None:
        try:
            return q.get(timeout=timeout) if timeout != 0.0 else q.get_nowait()
        except queue.Empty:
            return EMPTY

    return take
