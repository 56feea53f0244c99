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

**Prefixes shared between requests** (``share_prefixes``, off by default: a shared prefix's KV
was computed in other steps than a fresh prefill's, so on quantised weights a seeded request
may draw otherwise where two tokens are that close; docs/benchmarks.md measures what it gives
and costs). A row that ended and keeps nothing for its request
leaves its KV as a *cached prefix* (:attr:`KVSlots.cached`, least recently used first) when
it holds at least :data:`MIN_PREFIX` tokens, another of the recent rows began with the same
:data:`MIN_PREFIX` tokens (:attr:`KVSlots.heads`: where no two requests begin alike nothing is
cached) and a sequence of the context is to spare, within
a budget of cells (:data:`CACHE_SHARE` of the context's; the least recently used go): a row
of another request whose context starts with the same tokens (a chat's system prompt and
earlier turns, a prompt asked for ``n`` choices, an evaluation's context before each of its
continuations) starts from a copy of that prefix (``llama_kv_cache_seq_cp``: its cells gain
the row's sequence, no compute, no memory) and feeds only the rest. Cached prefixes are
nobody's: the daemon does not know them and reserves every row's whole context, so they go
first, unsaved, whenever running rows or kept KV want cells or sequences
(:meth:`KVSlots.spill`, :meth:`KVSlots.start`), and a release of everything drops them.
A row that scores its prompt (``prompt_logprobs``) takes none: every position's logits are
computed in its own prefill.

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

from worker.engines.prefixes import MIN_PREFIX, RecentHeads

__all__ = ["MIN_PREFIX", "Kept", "KVSlots", "SeqContext"]

#: The cells cached prefixes may hold, as a share of the context's (at least :data:`MIN_PREFIX`
#: times 16): every decode attends over the cells up to the highest one in use, other
#: sequences' masked, so cells held for nobody make every step of the running rows dearer.
CACHE_SHARE = 1 / 32


class SeqContext(Protocol):
    """What :class:`KVSlots` uses of :class:`~worker.engines.llama_lib.Context`."""

    n_ctx: int
    n_seq: int

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> bool: ...

    def save(self, seq: int) -> bytes: ...

    def load(self, data: bytes, seq: int) -> bool: ...

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None: ...


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

    def __init__(self, ctx: SeqContext, host_bytes: int, share_prefixes: bool = False) -> None:
        self.ctx = ctx
        self.host_limit = host_bytes
        self.share_prefixes = share_prefixes
        self.cache_cells = max(16 * MIN_PREFIX, int(ctx.n_ctx * CACHE_SHARE))
        """The most cells the cached prefixes hold (:data:`CACHE_SHARE`)."""
        self.cached: OrderedDict[int, list[int]] = OrderedDict()
        """Cached prefixes: sequence -> the tokens whose KV it holds (least recently used first)."""
        self.heads = RecentHeads()
        """The heads of the rows started lately: a finished row's KV is cached only where
        another began alike (:mod:`worker.engines.prefixes`)."""
        self.shared = 0
        """Rows that started from a cached prefix, and the tokens they took from one, since the
        engine started."""
        self.shared_tokens = 0
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
                self.dead.extend(self.cached)  # nobody's: gone with everything else
                self.cached.clear()
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

    def cached_tokens(self) -> int:
        """Cells the cached prefixes hold (some of them shared with running rows)."""
        with self.lock:
            return sum(len(t) for t in self.cached.values())

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

    def start(self, rid: str, tokens: list[int], share: bool = True) -> tuple[int, int] | None:
        """A row of ``rid`` (:meth:`take`) with context ``tokens`` starts: its sequence and how many of
        ``tokens`` it holds KV for already (kept KV resumed, else with ``share`` a cached prefix
        copied; at most ``len(tokens) - 1``); None when no sequence is free (:meth:`spill` frees one)."""
        with self.lock:
            if rid not in self.kept:
                return self._start_fresh(tokens, share)
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
                    self._drop_cached(1)
                if not self.free:
                    return None
                seq = self.free.pop()
            return seq, used

    def end(self, rid: str, seq: int, tokens: list[int] | None, fed: list[int] | None = None) -> int:
        """A row of ``rid`` in ``seq`` (-1: it never started) ended: keep its KV of ``tokens``
        for the request (None: not), else cache it as a prefix of ``fed`` (the tokens whose KV
        the sequence holds; None: drop it). Returns the tokens kept (0 when not kept, or
        released since it came in)."""
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
                if fed is not None and self._cache(seq, fed):
                    return 0
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
            while self.cached and (self._resident() > cells or len(self.free) < seqs):
                self._drop_cached(len(self.free) + 1)
                moved = True
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
            self.cached.clear()
            self.host_bytes = 0

    # ------------------------------------------------------------------ internals (lock held)

    def _resident(self) -> int:
        return (sum(len(k.tokens) for k in self.kept.values() if k.seq is not None)
                + sum(len(t) for t in self.cached.values()))

    def _start_fresh(self, tokens: list[int], share: bool) -> tuple[int, int] | None:
        """A row with no KV kept for its request: a free sequence, with the longest cached
        prefix of ``tokens`` copied into it (at least :data:`MIN_PREFIX` tokens)."""
        src, used = -1, 0
        if share and self.share_prefixes and len(tokens) > MIN_PREFIX:
            self.heads.seen(tokens)
            for s, t in self.cached.items():
                n = min(common_prefix(t, tokens), len(tokens) - 1)
                if n > used:
                    src, used = s, n
            if used < MIN_PREFIX:
                src, used = -1, 0
        if not self.free:
            self._drop_cached(1, keep=src)
        if not self.free:
            return None
        seq = self.free.pop()
        if src >= 0:
            self.ctx.seq_cp(src, seq, 0, used)
            # What rows share is what is worth keeping: the prefix keeps that much (a system
            # prompt shared by different questions shrinks to it), and the row's own context
            # is cached at its end.
            if used < len(self.cached[src]):
                self.ctx.seq_rm(src, used, -1)
                self.cached[src] = self.cached[src][:used]
            self.cached.move_to_end(src)
            self.shared += 1
            self.shared_tokens += used
        return seq, used

    def _cache(self, seq: int, fed: list[int]) -> bool:
        """Keep ``seq``'s KV of ``fed`` as a cached prefix, if it is long enough and a sequence
        stays free for rows (the sequences are the running rows' first); else False. A cached
        prefix that is a prefix of this one goes (this one serves every row it served)."""
        if not self.share_prefixes or not self.heads.shared(fed):
            return False  # nobody began alike lately: nobody is likely to
        for s, t in list(self.cached.items()):
            if len(t) <= len(fed) and fed[:len(t)] == t:
                del self.cached[s]
                self.ctx.seq_rm(s)
                self.free.append(s)
        if not self.free:
            return False
        if len(fed) > self.cache_cells:  # its head only, within the budget
            fed = fed[:self.cache_cells]
            self.ctx.seq_rm(seq, len(fed), -1)
        self.cached[seq] = list(fed)
        while sum(len(t) for t in self.cached.values()) > self.cache_cells:  # least recently used go
            s = next(iter(self.cached))
            del self.cached[s]
            self.ctx.seq_rm(s)
            self.free.append(s)
        return True

    def _drop_cached(self, free: int, keep: int = -1) -> None:
        """Drop cached prefixes, least recently used first (never ``keep``), until ``free``
        sequences are free or none is left."""
        for s in list(self.cached):
            if len(self.free) >= free:
                return
            if s == keep:
                continue
            del self.cached[s]
            self.ctx.seq_rm(s)
            self.free.append(s)

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
