"""The ``llama`` engine's KV: which sequence of the context each request holds, the KV kept
between slices (in the context, or moved to host memory), and releases from any thread.

The context has ``n_seq`` sequences and ``n_ctx`` KV cells (:class:`~worker.engines.llama_lib.Context`).
A running row holds one sequence. When its slice ends before its request does (``kv_reuse``),
its KV stays in that sequence, *kept* for the request (:class:`Kept`, keyed by request id):
the request's next row resumes it and feeds only the tokens the KV lacks. Kept KV leaves
the context when its cells or its sequence are wanted by running rows: it is saved to
host memory (``llama_state_seq_get_data``, :meth:`Context.save`) and loaded back into a
free sequence when the request returns (any sequence: the saved state carries positions,
not cells). Host copies are bounded by ``host_bytes``; past it the least recently kept go
first, reported as evicted (:meth:`KVSlots.take_evicted`), and so does kept KV that does not
fit at all.

A row resumes kept KV only for its common prefix with the row's context (the whole of it,
usually: a request's context grows by what it generated); the KV past that prefix is cut
(``llama_kv_cache_seq_rm`` from a position on). At least the last context token is always
fed, so the row's first pick has logits.

Threads: :meth:`KVSlots.release` comes from the worker's receive thread while the serve
thread steps the context. It drops host copies at once and marks kept sequences; the serve
thread removes their KV at its next step (:meth:`KVSlots.apply_releases`), and a row that
runs when its release comes is released when it ends (:meth:`KVSlots.end`). Every other
method is the serve thread's; all of them hold the one lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

__all__ = ["Kept", "KVSlots", "SeqContext"]


class SeqContext(Protocol):
    """What :class:`KVSlots` uses of :class:`~worker.engines.llama_lib.Context`."""

    n_ctx: int
    n_seq: int

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> bool: ...

    def save(self, seq: int) -> bytes: ...

    def load(self, data: bytes, seq: int) -> bool: ...


@dataclass(eq=False)
class Kept:
    """A request's KV kept between slices: of ``tokens`` (positions 0..len-1), in sequence
    ``seq`` of the context, or saved in ``data`` (``seq`` None)."""

    tokens: list[int]
    seq: int | None
    data: bytes | None = None


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


class KVSlots:
    """The context's sequences and the kept KV (see the module docstring)."""

    def __init__(self, ctx: SeqContext, host_bytes: int) -> None:
        self.ctx = ctx
        self.host_limit = host_bytes
        self.lock = threading.Lock()
        self.free: list[int] = list(range(ctx.n_seq - 1, -1, -1))
        self.kept: OrderedDict[str, Kept] = OrderedDict()
        """Least recently kept first."""
        self.host_bytes = 0
        self.running: dict[str, int] = {}
        """Rows taken and not ended (waiting or running): request id -> how many (a request
        runs once, but the daemon may send it again before its row here ended)."""
        self.release_at_end: set[str] = set()
        self.dead: list[int] = []
        """Sequences of released kept KV, to remove at the serve thread's next step."""
        self.evicted: list[str] = []
        self.moved = 0
        """Kept KV saved to host memory, and loaded back, since the engine started."""

    # ------------------------------------------------------------------ any thread

    def release(self, rids: Iterable[str] | None) -> None:
        """Drop the kept KV of ``rids`` (None: all); a running row's goes when it ends."""
        with self.lock:
            names = list(self.kept) if rids is None else list(rids)
            if rids is None:
                self.release_at_end.update(self.running)
            for rid in names:
                k = self.kept.pop(rid, None)
                if k is not None:
                    self._forget(k)
                elif rid in self.running:
                    self.release_at_end.add(rid)

    def take_evicted(self) -> list[str]:
        with self.lock:
            out, self.evicted = self.evicted, []
        return out

    def held(self) -> dict[str, int]:
        """Request id -> KV tokens kept for it (in the context or on the host)."""
        with self.lock:
            return {rid: len(k.tokens) for rid, k in self.kept.items()}

    def resident_tokens(self) -> int:
        """Cells the kept KV in the context holds."""
        with self.lock:
            return sum(len(k.tokens) for k in self.kept.values() if k.seq is not None)

    # ------------------------------------------------------------------ the serve thread

    def take(self, rid: str) -> None:
        """A row of ``rid`` came in (a release from now on applies when it ends)."""
        with self.lock:
            self.running[rid] = self.running.get(rid, 0) + 1

    def apply_releases(self) -> None:
        """Remove the KV of the sequences released since the last call."""
        with self.lock:
            dead, self.dead = self.dead, []
            for seq in dead:
                self.ctx.seq_rm(seq)
                self.free.append(seq)

    def start(self, rid: str, tokens: list[int]) -> tuple[int, int] | None:
        """A row of ``rid`` (:meth:`take`) with context ``tokens`` starts: its sequence and how many of
        ``tokens`` it holds KV for already (kept KV resumed, at most ``len(tokens) - 1``);
        None when no sequence is free (:meth:`spill` frees one)."""
        with self.lock:
            k = self.kept.pop(rid, None)
            seq, used = None, 0
            if k is not None:
                used = min(common_prefix(k.tokens, tokens), len(tokens) - 1)
                if used == 0:
                    self._forget(k)
                elif k.seq is not None:
                    seq = k.seq
                    if used < len(k.tokens):
                        self.ctx.seq_rm(seq, used, -1)
                elif self.free:
                    seq = self.free.pop()
                    self.host_bytes -= len(k.data or b"")
                    if self.ctx.load(k.data or b"", seq):
                        self.moved += 1
                        if used < len(k.tokens):
                            self.ctx.seq_rm(seq, used, -1)
                    else:  # no room for it now: served fresh
                        self.ctx.seq_rm(seq)
                        used = 0
                else:
                    self.kept[rid] = k  # put back: the caller spills and asks again
                    self.kept.move_to_end(rid, last=False)
                    return None
            if seq is None:
                if not self.free:
                    return None
                seq = self.free.pop()
            return seq, used

    def end(self, rid: str, seq: int, tokens: list[int] | None) -> int:
        """A row of ``rid`` in ``seq`` (-1: it never started) ended: keep its KV of ``tokens``
        (None: drop it). Returns the tokens kept (0 when dropped, or released since it came in)."""
        with self.lock:
            n = self.running.get(rid, 0) - 1
            if n > 0:
                self.running[rid] = n
            else:
                self.running.pop(rid, None)
            released = rid in self.release_at_end
            if n <= 0:
                self.release_at_end.discard(rid)
            if seq < 0:
                return 0
            if tokens is None or released or not tokens:
                self.ctx.seq_rm(seq)
                self.free.append(seq)
                return 0
            old = self.kept.pop(rid, None)  # only if the rid ran twice at once: newest wins
            if old is not None:
                self._forget(old)
            self.kept[rid] = Kept(list(tokens), seq)
            return len(tokens)

    def spill(self, cells: int, seqs: int) -> bool:
        """Move kept KV out of the context, least recently kept first, until ``cells`` cells
        and ``seqs`` sequences are free of it (or none is left in the context); True when
        something moved. Saved to host memory while ``host_bytes`` allows, else dropped."""
        with self.lock:
            moved = False
            for rid in list(self.kept):
                k = self.kept[rid]
                if k.seq is None:
                    continue
                resident = sum(len(x.tokens) for x in self.kept.values() if x.seq is not None)
                if resident <= cells and len(self.free) >= seqs:
                    break
                data = self.ctx.save(k.seq)
                self.ctx.seq_rm(k.seq)
                self.free.append(k.seq)
                k.seq = None
                moved = True
                if len(data) > self.host_limit:
                    del self.kept[rid]
                    self.evicted.append(rid)
                    continue
                k.data = data
                self.host_bytes += len(data)
                self.moved += 1
                self._trim_host()
            return moved

    def clear(self) -> None:
        """The context is gone: everything kept is dropped (reported as evicted)."""
        with self.lock:
            self.evicted.extend(self.kept)
            self.kept.clear()
            self.host_bytes = 0

    # ------------------------------------------------------------------ internals (lock held)

    def _forget(self, k: Kept) -> None:
        if k.seq is not None:
            self.dead.append(k.seq)
        else:
            self.host_bytes -= len(k.data or b"")

    def _trim_host(self) -> None:
        for rid in list(self.kept):
            if self.host_bytes <= self.host_limit:
                return
            k = self.kept[rid]
            if k.seq is None:
                del self.kept[rid]
                self.host_bytes -= len(k.data or b"")
                self.evicted.append(rid)
