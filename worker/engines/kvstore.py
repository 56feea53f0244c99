"""KV kept across slices: a per-request store with a byte budget, and the cache surgery.

After a slice, the KV of every unfinished row is cut out of the batch's cache
(its real tokens only, padding dropped) and kept in a :class:`KVStore` under the
request id, least recently used evicted first when the store outgrows its
budget. When a later batch holds that request again, its entry is checked out:
the batch cache is re-assembled from the rows' entries, each left-padded to the
longest one, and the prefill computes only the tokens beyond what is held
(:func:`assemble_past`). One 2-D attention mask over ``[past | new]`` hides
every pad slot, wherever it sits, and positions come from that mask, so a row
sees exactly the keys and rotary phases it would have in one pass.

Memory beside the running batch comes first: before a batch the store shrinks
to what fits beside it. What does not fit moves to host memory when the store
has a host tier (``host_budget`` with a ``to_host`` copy: GPU workers), else it
is evicted; an entry in host memory is copied back into the batch cache when
its request returns (:func:`assemble_past` copies across devices).

**Cached prefixes** (``hf-static-cb``'s ``share_prefixes``): KV a finished row leaves, kept
under no request (:meth:`KVStore.keep_prefix`) for a later row of another request whose
context begins with the same tokens (:meth:`KVStore.prefix`: it copies the longest such
prefix in and prefills only the rest). They are nobody's: they use only the room kept KV
leaves in the device budget, go first (unsaved, never to host memory) whenever kept KV wants
room, are never reported evicted, a cached prefix that a newer one extends goes, and a release
of everything drops them.

The store itself needs no torch (the ``fake`` engine uses it with sizes only);
the cache functions import torch when called. Thread safety: the serve thread
takes and puts entries, the receive thread releases them (the daemon's
``release``), so every operation holds one lock; an entry released while its
batch runs is not put back afterwards.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from worker.engines.prefixes import MIN_PREFIX

#: Seconds without a turn out of device memory after which cached prefixes may hold more again
#: (:meth:`KVStore.regrow_prefixes`): a worker lives for days under systemd, and one burst that
#: ran the device out should not halve its prefix cache for the rest of its life.
PREFIX_REGROW_S = 600.0

log = logging.getLogger(__name__)

__all__ = [
    "KVReuse", "KVStore", "Retained", "assemble_past", "common_prefix", "cut_row", "cut_rows",
    "supports_reuse",
]


@dataclass(eq=False)
class Retained:
    """One request's kept KV."""

    tokens: list[int]
    """The context this KV covers: position ``i`` holds the KV of ``tokens[i]``."""
    nbytes: int
    """Memory the entry takes (its tensors, or the modelled size)."""
    kv: Any = None
    """Engine data: per layer ``(keys, values)``, each ``[1, heads, len(tokens), head_dim]``."""
    on_host: bool = False
    """Moved to host memory to make room on the device."""


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """Length of the longest common prefix of ``a`` and ``b``, at most ``limit``."""
    n = max(0, min(len(a), len(b), limit))
    if a[:n] == b[:n]:
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class KVStore:
    """Retained KV by request id, LRU within ``budget`` bytes on the device and
    ``host_budget`` bytes in host memory (see the module docstring)."""

    def __init__(self, budget: int, host_budget: int = 0,
                 to_host: Callable[[Retained], Retained] | None = None) -> None:
        self.budget = max(0, int(budget))
        self.host_budget = max(0, int(host_budget)) if to_host is not None else 0
        self._to_host = to_host
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, Retained] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._host_bytes = 0
        self._host_used = False
        self._out: set[str] = set()
        """Checked out by the running batch."""
        self._released_out: set[str] = set()
        """Released while checked out: not to be put back."""
        self._evicted: list[str] = []
        self._prefixes: OrderedDict[int, Retained] = OrderedDict()
        """Cached prefixes (nobody's), least recently used first, by a serial number."""
        self._by_head: dict[tuple[int, ...], set[int]] = {}
        self._serial = 0
        self.prefix_bytes = 0
        """Bytes the cached prefixes hold (on the device, counted in :attr:`nbytes`)."""
        self.prefix_limit = self.budget
        """Bytes the cached prefixes may hold at most, beside the room kept KV leaves: the
        budget, until a turn runs out of device memory (:meth:`shrink_prefixes`), and back
        towards it after :data:`PREFIX_REGROW_S` without one (:meth:`regrow_prefixes`)."""
        self._limited_at: float | None = None
        """When :attr:`prefix_limit` last changed below the budget (None: it is the budget)."""
        self.prefix_counts = {"kept": 0, "hits": 0, "tokens": 0, "dropped": 0}
        """Since the store began: prefixes kept, rows that took one and the tokens they took,
        prefixes dropped (for room, or extended by a newer one)."""

    # ------------------------------------------------------------------ queries

    @property
    def nbytes(self) -> int:
        """Bytes held on the device now."""
        return self._bytes

    @property
    def host_nbytes(self) -> int:
        """Bytes held in host memory now."""
        return self._host_bytes

    def on_host(self) -> list[str]:
        """Requests whose entry is in host memory."""
        with self._lock:
            return [rid for rid, e in self._entries.items() if e.on_host]

    def held(self) -> dict[str, int]:
        """Request id -> tokens held, least recently used first."""
        with self._lock:
            return {rid: len(e.tokens) for rid, e in self._entries.items()}

    # ------------------------------------------------------------------ serve thread

    def take(self, rid: str, context: list[int]) -> tuple[Retained | None, int]:
        """Check out ``rid``'s entry for a batch whose row has ``context``.

        Returns the entry and how many of its tokens the row can use: the common
        prefix with ``context``, at most ``len(context) - 1`` (the last token must
        be computed to give the next one's logits). The entry leaves the store either
        way; :meth:`put` keeps the row's new KV after the batch.
        """
        with self._lock:
            self._out.add(rid)
            e = self._pop(rid)
            if e is None:
                return None, 0
        used = common_prefix(e.tokens, context, len(context) - 1)
        return (e, used) if used > 0 else (None, 0)

    def usable(self, rid: str, context: list[int]) -> int:
        """How many tokens of ``rid``'s entry a row with ``context`` could use (as :meth:`take`
        counts them), the entry left where it is."""
        with self._lock:
            e = self._entries.get(rid)
        return 0 if e is None else common_prefix(e.tokens, context, len(context) - 1)

    def make_room(self, limit: int) -> None:
        """Move to host memory, or evict, least recently used entries until at most
        ``limit`` bytes are held on the device (the running batch needs the rest)."""
        with self._lock:
            self._shrink_to(max(0, limit))

    def put(self, rid: str, entry: Retained) -> bool:
        """Keep ``entry`` as the most recently used; False when it is not kept (released
        while its batch ran, or larger than the whole budget). Evicts to fit."""
        with self._lock:
            if rid in self._released_out or entry.nbytes > self.budget:
                return False
            self._pop(rid)
            self._shrink_to(self.budget - entry.nbytes)
            self._entries[rid] = entry
            self._bytes += entry.nbytes
            return True

    def done(self, rids: Iterable[str]) -> None:
        """The batch holding ``rids`` ended: they are no longer checked out."""
        with self._lock:
            for rid in rids:
                self._out.discard(rid)
                self._released_out.discard(rid)

    def keep_prefix(self, entry: Retained) -> bool:
        """Keep ``entry`` as a cached prefix, in the room kept KV leaves in the device budget
        (older prefixes go to make it, never a request's kept KV); a cached prefix that
        ``entry`` extends goes. False when it is not kept (too short, or no room)."""
        t = entry.tokens
        if len(t) < MIN_PREFIX:
            return False
        with self._lock:
            for key in list(self._by_head.get(tuple(t[:MIN_PREFIX]), ())):
                old = self._prefixes[key].tokens
                if len(old) <= len(t) and t[:len(old)] == old:
                    self._drop_prefix(key)
            if entry.nbytes > min(self.budget - (self._bytes - self.prefix_bytes), self.prefix_limit):
                return False
            while self._bytes + entry.nbytes > self.budget or self.prefix_bytes + entry.nbytes > self.prefix_limit:
                self._drop_prefix(next(iter(self._prefixes)))
            self._serial += 1
            self._prefixes[self._serial] = entry
            self._by_head.setdefault(tuple(t[:MIN_PREFIX]), set()).add(self._serial)
            self._bytes += entry.nbytes
            self.prefix_bytes += entry.nbytes
            self.prefix_counts["kept"] += 1
            return True

    def prefix(self, context: list[int], take: bool = False) -> tuple[Retained | None, int]:
        """The cached prefix sharing the longest head with ``context`` and how many of its tokens
        a row with that context can use (at least :data:`MIN_PREFIX`, at most all but the
        context's last token); ``(None, 0)`` when none can. ``take``: a row takes it now (it
        becomes the most recently used; its tensors stay valid while the row copies them,
        whatever the store drops meanwhile)."""
        limit = len(context) - 1
        if limit < MIN_PREFIX:
            return None, 0
        with self._lock:
            best, used = -1, 0
            for key in self._by_head.get(tuple(context[:MIN_PREFIX]), ()):
                n = common_prefix(self._prefixes[key].tokens, context, limit)
                if n > used:
                    best, used = key, n
            if best < 0:
                return None, 0
            entry = self._prefixes[best]
            if take:
                self._prefixes.move_to_end(best)
                self.prefix_counts["hits"] += 1
                self.prefix_counts["tokens"] += used
            return entry, used

    def free_room(self, nbytes: int, prefixes: bool = False) -> None:
        """Drop cached prefixes, least recently used first, until ``nbytes`` more fit in the
        device budget (and, for new ``prefixes``, within :attr:`prefix_limit`): before a copy
        into the store that needs the memory they hold."""
        with self._lock:
            while self._prefixes and (self._bytes + nbytes > self.budget
                                      or (prefixes and self.prefix_bytes + nbytes > self.prefix_limit)):
                self._drop_prefix(next(iter(self._prefixes)))

    def prefix_room(self) -> int:
        """Device bytes cached prefixes may hold: the budget less the kept KV, at most
        :attr:`prefix_limit`."""
        with self._lock:
            return max(0, min(self.budget - (self._bytes - self.prefix_bytes), self.prefix_limit))

    def shrink_prefixes(self, now: float) -> tuple[int, int]:
        """After a turn that ran out of device memory (at ``now``, monotonic seconds): drop
        every cached prefix (their memory is wanted elsewhere) and let them hold at most half
        of what they held then, so that a cache filling up again leaves the other half free
        (halved again at each such turn; a turn that found no prefix held changes nothing but
        the time, which restarts :meth:`regrow_prefixes`' wait). The prefixes dropped, and the
        limit."""
        with self._lock:
            if self.prefix_bytes:
                self.prefix_limit = min(self.prefix_limit, self.prefix_bytes // 2)
            if self.prefix_limit < self.budget:
                self._limited_at = now
            return self._drop_prefixes(), self.prefix_limit

    def regrow_prefixes(self, now: float) -> bool:
        """Once :data:`PREFIX_REGROW_S` passed since the limit last changed with no turn out of
        device memory (``now``, monotonic seconds): let cached prefixes hold twice as much, and
        at least an eighth of the budget more, up to the budget (from nothing to all of it in
        eight such waits); a turn that runs out again halves it again. Whether it grew."""
        with self._lock:
            if self._limited_at is None or now - self._limited_at < PREFIX_REGROW_S:
                return False
            self.prefix_limit = min(self.budget, max(2 * self.prefix_limit, self.prefix_limit + self.budget // 8))
            self._limited_at = None if self.prefix_limit >= self.budget else now
            return True

    def prefixes(self) -> list[int]:
        """The cached prefixes' lengths, least recently used first (tests, the log at close)."""
        with self._lock:
            return [len(e.tokens) for e in self._prefixes.values()]

    def take_evicted(self) -> list[str]:
        """Requests evicted since the last call (each once)."""
        with self._lock:
            out, self._evicted = self._evicted, []
            return out

    # ------------------------------------------------------------------ any thread

    def release(self, rids: Iterable[str] | None = None) -> None:
        """Drop the entries of ``rids`` (None: all, and every cached prefix), including ones a
        running batch holds."""
        with self._lock:
            if rids is None:
                self._drop_prefixes()
            targets = list(self._entries) + list(self._out) if rids is None else list(rids)
            for rid in targets:
                self._pop(rid)
                if rid in self._out:
                    self._released_out.add(rid)

    # ------------------------------------------------------------------ internals (locked)

    def _pop(self, rid: str) -> Retained | None:
        e = self._entries.pop(rid, None)
        if e is not None:
            if e.on_host:
                self._host_bytes -= e.nbytes
            else:
                self._bytes -= e.nbytes
        return e

    def _drop_prefixes(self) -> int:
        keys = list(self._prefixes)
        for key in keys:
            self._drop_prefix(key)
        return len(keys)

    def _drop_prefix(self, key: int) -> None:
        e = self._prefixes.pop(key)
        head = tuple(e.tokens[:MIN_PREFIX])
        keys = self._by_head[head]
        keys.discard(key)
        if not keys:
            del self._by_head[head]
        self._bytes -= e.nbytes
        self.prefix_bytes -= e.nbytes
        self.prefix_counts["dropped"] += 1

    def _shrink_to(self, limit: int) -> None:
        """Device bytes down to ``limit``: cached prefixes go first (least recently used
        first), then the least recently used device entries move to the host tier while it
        has room (its own oldest evicted to make it), else go."""
        while self._bytes > limit and self._prefixes:
            self._drop_prefix(next(iter(self._prefixes)))
        while self._bytes > limit:
            rid, e = next((k, v) for k, v in self._entries.items() if not v.on_host)
            if e.nbytes > self.host_budget or self._to_host is None:
                self._pop(rid)
                self._evicted.append(rid)
                continue
            moved = self._to_host(e)
            moved.on_host = True
            self._entries[rid] = moved  # same place in the LRU order
            self._bytes -= e.nbytes
            self._host_bytes += moved.nbytes
            # The first move at info (the host tier is in use), the others at debug.
            log.log(logging.DEBUG if self._host_used else logging.INFO,
                    "kept KV of %s moved to host memory (%d bytes; %d there now)", rid, moved.nbytes,
                    self._host_bytes)
            self._host_used = True
            while self._host_bytes > self.host_budget:
                old = next(k for k, v in self._entries.items() if v.on_host)
                self._pop(old)
                self._evicted.append(old)


# --------------------------------------------------------------------------- cache surgery


def supports_reuse(config: Any) -> bool:
    """True when the model's cache is plain full-attention layers (no sliding window, no
    shared or linear-attention layers): only those can be cut into rows and re-joined."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    try:
        layers = DynamicCache(config=config).layers
    except Exception:  # noqa: BLE001 - an architecture we cannot inspect is not reused
        return False
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def assemble_past(entries: list[Retained | None], used: list[int], config: Any) -> Any:
    """A batch cache from the rows' retained KV: row ``i`` holds the first ``used[i]``
    tokens of ``entries[i]``, left-padded with zeros to the longest; None when no row
    holds any (the caller masks the pad slots)."""
    from transformers import DynamicCache

    width = max(used, default=0)
    if width == 0:
        return None
    first = next(e for e, u in zip(entries, used, strict=True) if e is not None and u > 0)
    n = len(entries)
    data = []
    for layer, (k0, v0) in enumerate(first.kv):
        keys = k0.new_zeros((n, k0.shape[1], width, k0.shape[3]))
        values = v0.new_zeros((n, v0.shape[1], width, v0.shape[3]))
        for i, (e, u) in enumerate(zip(entries, used, strict=True)):
            if e is not None and u > 0:
                k, v = e.kv[layer]
                keys[i, :, width - u :, :] = k[0, :, :u, :]
                values[i, :, width - u :, :] = v[0, :, :u, :]
        data.append((keys, values))
    return DynamicCache(ddp_cache_data=data, config=config)


def cut_row(cache: Any, row: int, mask_row: Any) -> tuple[list[tuple[Any, Any]], int]:
    """Row ``row``'s KV from a batch cache, only at the columns ``mask_row`` marks real.

    Returns per layer ``(keys, values)`` as new ``[1, heads, tokens, head_dim]`` tensors
    (they do not keep the batch's tensors alive) and their size in bytes.
    """
    idx = mask_row.nonzero().squeeze(-1)
    kv: list[tuple[Any, Any]] = []
    nbytes = 0
    for layer in cache.layers:
        k = layer.keys[row : row + 1].index_select(2, idx)
        v = layer.values[row : row + 1].index_select(2, idx)
        kv.append((k, v))
        nbytes += k.numel() * k.element_size() + v.numel() * v.element_size()
    return kv, nbytes


def cut_rows(cache: Any, rows: list[int], mask: Any) -> list[tuple[list[tuple[Any, Any]], int]]:
    """The KV of every row in ``rows`` from a batch cache, only at the columns ``mask`` (``[batch
    rows, columns]``) marks real: per row, per layer ``(keys, values)`` as ``[1, heads, tokens,
    head_dim]`` tensors, and their size in bytes.

    One copy of the mask to the host (the only wait on the device) and one copy of the columns
    back; then a gather per row, layer and K or V, so that each row's tensors own their memory:
    the store drops entries one at a time, and rows cut as views of one gather for all of them
    kept all of its memory on the device until the last of them went, past the bytes the store
    counts (4.5 GiB over a store's budget on an H200, which the next prefill then lacked)."""
    if not rows:
        return []
    sel = mask[rows].to("cpu")  # the one wait: which columns are real, per row
    counts = sel.sum(-1).tolist()
    dev = cache.layers[0].keys.device
    cols = sel.nonzero()[:, 1].to(dev, non_blocking=True).split(counts)
    out: list[tuple[list[tuple[Any, Any]], int]] = []
    for r, idx in zip(rows, cols, strict=True):
        kv = [(layer.keys[r].index_select(1, idx).unsqueeze(0), layer.values[r].index_select(1, idx).unsqueeze(0))
              for layer in cache.layers]
        out.append((kv, sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)))
    return out


class KVReuse:
    """A torch engine's use of a :class:`KVStore`: check rows out before a batch, keep the
    unfinished rows' KV after it.

    ``delta`` is the engine's KV bytes per token and ``limit`` the memory of a batch (M_ava).
    With ``beside`` (the eager path) the batch and the retained caches share that memory:
    before a batch the store shrinks to what fits beside it. Without (the static path) the
    batch has memory of its own and the store its own budget.
    """

    def __init__(self, store: KVStore, delta: int, limit: int, beside: bool = True) -> None:
        self.store = store
        self.delta = delta
        self.limit = limit
        self.beside = beside

    def take(self, batch: Any) -> tuple[list[Retained | None], list[int]]:
        """Check out the rows' retained KV: ``(entries, tokens usable per row)``.

        When the re-assembled cache (longest held prefix + longest new part + the slice)
        would need more than ``limit``, the batch prefills in full instead.
        """
        reqs = batch.requests
        n = len(reqs)
        got = [self.store.take(r.rid, r.token_ids) for r in reqs]
        if not batch.kv_reuse:  # the daemon asks for full prefills: what was kept is dropped
            got = [(None, 0)] * n
        taken = [e for e, _ in got]
        used = [u for _, u in got]
        fresh = max(len(r.token_ids) - u for r, u in zip(reqs, used, strict=True))
        need = (max(used) + fresh + batch.slice_len) * n * self.delta
        if any(used) and need > self.limit:
            taken, used = [None] * n, [0] * n
            need = (max(len(r.token_ids) for r in reqs) + batch.slice_len) * n * self.delta
        if self.beside:
            self.store.make_room(self.limit - need)
        return taken, used

    def keep(self, rows: list[tuple[str, list[int], list[int], bool]], cache: Any,
             mask: Any) -> list[int]:
        """Keep the KV of every unfinished row ``(rid, context, generated, done)``; returns
        the tokens kept per row (0: none)."""
        kept = [0] * len(rows)
        live = [i for i, (_, _, out, done) in enumerate(rows) if out and not done]
        for i, (kv, nbytes) in zip(live, cut_rows(cache, live, mask), strict=True):
            rid, context, out, _ = rows[i]
            # The last token was sampled, never fed: its KV does not exist yet.
            tokens = list(context) + out[:-1]
            if kv and kv[0][0].shape[2] != len(tokens):
                raise RuntimeError(f"row {rid!r}: the cache holds {kv[0][0].shape[2]} tokens, "
                                   f"its context {len(tokens)}")
            if self.store.put(rid, Retained(tokens, nbytes, kv)):
                kept[i] = len(tokens)
        return kept
