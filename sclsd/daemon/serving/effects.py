"""What the serving core asks its shell to do: one typed record per entry point.

Every entry point of :class:`~sclsd.daemon.serving.core.ServingCore` returns an
:class:`Effects`: the events for client connections and the messages for
workers, in the order they must go out; the workers it dropped; the
detokenizing it needs (run off the event loop, then handed back to
:meth:`~sclsd.daemon.serving.core.ServingCore.decoded`); what the metrics
record; whether the scheduling loop should look again. The core never
performs any of it.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from ... import protocol as P
from ...core.request import FinishReason
from ...tokenizer import decode_many

__all__ = ["Client", "DecodeJob", "Effects", "Ended", "Lost", "TextJob"]

#: Whoever submitted a request: the shell's connection, opaque to the core (it only hands
#: it back with the events for it).
Client = Hashable


@dataclass(frozen=True, slots=True)
class Ended:
    """A request got its terminal event (for the metrics)."""

    rid: str
    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    timings: P.Timings
    started: bool = False
    """A worker started it (``timings.queued_s`` is its time until then)."""
    code: str | None = None
    """The error code, when it ended with ``error`` (shutdown, no_workers, internal, ...)."""
    token_gaps: tuple[tuple[float, int], ...] = ()
    """(seconds since the previous arrival of its tokens, tokens that arrived), each arrival
    after the first: the inter-token latencies."""


@dataclass(frozen=True, slots=True)
class Lost:
    """A worker the core dropped: the shell forgets its connection, counts the drop by
    ``reason`` and, when ``kill``, kills its local process if it has one (a spawned worker
    restarts). A worker that lives and will register again by itself is never killed."""

    wid: str
    why: str
    reason: P.LossReason

    @property
    def kill(self) -> bool:
        """Whether this drop ends the worker's process: only when the process is hung
        (silent, stalled) or cannot be reached; otherwise it has exited already, or it is
        alive and registers again by itself (docs/operations.md, Workers)."""
        return self.reason in ("silent", "stalled", "unreachable")


class DecodeJob(Protocol):
    """Tokenizer work to run off the loop (:meth:`run`); what it returns goes back to the
    core with the job, in the order the jobs were asked for."""

    def size(self) -> int:
        """About how many tokens it works on (a small job may run at once, on the loop)."""
        ...

    def run(self, tok: Any) -> Any:
        """The work, with the daemon's tokenizer (in a pool thread, or at once when small)."""
        ...


class TextJob:
    """A :class:`DecodeJob` of token ids to detokenize (``seqs``; ``keep_special[i]``: the
    text of ``seqs[i]`` keeps the special tokens, where the request's ``skip_special_tokens``
    is false): the texts, in order."""

    __slots__ = ()
    seqs: list[list[int]]
    keep_special: list[bool]

    def size(self) -> int:
        return sum(map(len, self.seqs))

    def run(self, tok: Any) -> list[str]:
        return decode_many(tok, self.seqs, self.keep_special)


@dataclass(slots=True)
class Effects:
    """What one entry point of the core decided (see the module docstring)."""

    to_clients: list[tuple[Client, P.ServerMsg]] = field(default_factory=list)
    """Events for client connections, in order."""
    to_workers: list[tuple[str, P.DaemonToWorkerMsg]] = field(default_factory=list)
    """Messages for workers (by worker id), in order. A send that fails is reported
    back (:meth:`~sclsd.daemon.serving.core.ServingCore.worker_lost`)."""
    lost: list[Lost] = field(default_factory=list)
    """Workers dropped (their batches are back in the pool already)."""
    decode: list[DecodeJob] = field(default_factory=list)
    """Detokenizing to run off the loop; its texts go back to ``decoded`` in this order."""
    ended: list[Ended] = field(default_factory=list)
    """Requests that got their terminal event."""
    batch_seconds: list[float] = field(default_factory=list)
    """Measured serving time of each batch whose result was applied."""
    refused: str | None = None
    """Why a worker's registration was refused (``worker_joined`` only)."""
    wake: bool = False
    """Something changed that the scheduling loop should look at."""
    forget: dict[str, list[str]] = field(default_factory=dict)
    """Per worker, requests whose records it should drop: a batch for that worker in
    ``to_workers`` carries those forgotten before it (``BatchMsg.forget``); the rest go as
    one :class:`~sclsd.protocol.Forget` after ``to_workers`` (:meth:`worker_messages`)."""
    cancel: dict[str, list[P.CancelRow]] = field(default_factory=dict)
    """Per worker, rows of batches in flight whose requests ended here: one
    :class:`~sclsd.protocol.CancelRows` after ``to_workers``, so after every batch they name."""

    def send(self, client: Client, event: P.ServerMsg) -> None:
        self.to_clients.append((client, event))

    def tell(self, wid: str, msg: P.DaemonToWorkerMsg) -> None:
        self.to_workers.append((wid, msg))

    def forget_on(self, wid: str, rid: str) -> None:
        """Worker ``wid`` should drop ``rid``'s record."""
        self.forget.setdefault(wid, []).append(rid)

    def cancel_row(self, wid: str, batch_id: int, rid: str) -> None:
        """Worker ``wid`` should end ``rid``'s row of batch ``batch_id``."""
        self.cancel.setdefault(wid, []).append(P.CancelRow(batch_id, rid))

    def worker_messages(self) -> Iterator[tuple[str, P.DaemonToWorkerMsg]]:
        """Every message for workers, in the order they go out: ``to_workers``, then each
        worker's :class:`~sclsd.protocol.Forget` and :class:`~sclsd.protocol.CancelRows`."""
        yield from self.to_workers
        for wid, rids in self.forget.items():
            if rids:
                yield wid, P.Forget(rids=rids)
        for wid, rows in self.cancel.items():
            yield wid, P.CancelRows(rows=rows)
