"""The static arena of ``hf-static-cb``: rows that join and leave between decode steps, each
writing its own column.

``hf``'s static path (:mod:`worker.engines.static_cache`) serves one batch at a time: every
row is left-padded to one width and all rows write the same column at each step (one
counter). Continuous batching needs rows of different lengths side by side, joining and
leaving between steps, so here each row has a position of its own:

**Layout.** The running rows live in the arena's first slots as ``[n, heads, c, head_dim]``
views (:class:`~worker.engines.static_cache.KVArena`), ``c`` the geometry's columns. A row's
KV is left-aligned in its slot, unpadded: column ``j`` holds the KV of its token ``j``, so its
position id is its column. Row ``i`` starts at the same place whatever ``n`` is, so rows join
and leave without moving the others; only a change of ``c`` moves them all (:meth:`RowRunner.relayout`,
in chunks ordered so that no row is overwritten before it is read). Rows paused between grants
keep their KV in slots after the running ones; when rows leave, join, pause or resume, the
few that must change slots are copied (:meth:`RowRunner.permute`, in the order
:func:`~worker.engines.arena_slots.order_moves` gives).

**Per-row writes.** :class:`RowLayer` is transformers' ``StaticLayer`` whose ``update``
scatters each row's new keys and values to that row's own columns (``cols``, a ``[n, q]``
tensor) instead of one counter's. A decode step (:class:`RowStep`) reads its columns from
the static ``pos`` buffer, builds its mask from it (row ``i`` sees columns ``<= pos[i]``:
everything before its current token is its own real KV) and advances ``pos`` itself, so
its replay as a CUDA graph needs nothing from the host while the rows stay the same.
Bucket rows beyond the running ones are dummies: they write their slot's last column
(free memory, or a column its row overwrites before it can see it).

**Newcomers** are prefilled apart (:meth:`RowRunner.prefill`), straight into their slots, in
chunks of at most ``prefill_chunk_tokens`` tokens: every context token but the last (a
row's held KV, copied in first, covers the start), right-padded, each row's tokens at
their own columns. The last context token is the row's input to its first decode step,
which gives its first token; so a row resumed from kept KV needs no prefill at all. A
newcomer asking for its prompt's log-probabilities (its request's first grant: its whole
context but the last token prefilled, positions 0 to L - 2) gets them from each chunk's last
hidden states (:class:`~worker.engines.hf_model.HiddenTap`), through the model's head, while
the chunk's other rows cost nothing more.

**Buckets and graphs** are ``hf``'s: on CUDA one decode step per (batch bucket, cache
bucket) is captured at warm-up (:class:`~worker.engines.static_cache.StaticRunner`'s
warm-up with this module's step), checked against its eager body, and the geometry's
``c`` is always a cache bucket where one fits, so that rows of any lengths find a graph.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from worker.engines.arena_attention import RowBlocks, fits, row_mask, use
from worker.engines.arena_slots import Op
from worker.engines.hf_model import PromptScore, maybe_tap
from worker.engines.static_cache import DecodeStep, StaticRunner, StepPlan

log = logging.getLogger("worker")

__all__ = ["RELAYOUT_BYTES", "Geometry", "RowLayer", "RowRunner", "RowStep"]

#: Most bytes of one layer's keys (or values) a relayout copies at once (its temporary buffer).
RELAYOUT_BYTES = 64 * 2**20


def _static_layer() -> type:
    from transformers.cache_utils import StaticLayer

    return StaticLayer


class RowLayer:
    """A cache layer over arena views ``[n, heads, c, head_dim]`` whose writes go to each row's
    own columns ``cols`` (``[n, q]``, long, on the device), not to a shared counter. Built by
    :func:`row_cache` (a subclass of transformers' ``StaticLayer``, made once)."""

    cols: Any

    def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        n, h, q, d = key_states.shape
        idx = self.cols.view(n, 1, q, 1).expand(n, h, q, d)
        keys: Any = self.keys  # type: ignore[attr-defined]
        values: Any = self.values  # type: ignore[attr-defined]
        keys.scatter_(2, idx, key_states)
        values.scatter_(2, idx, value_states)
        return keys, values


_ROW_LAYER: type | None = None


def row_layer_class() -> type:
    """:class:`RowLayer` mixed into transformers' ``StaticLayer`` (imported when first needed)."""
    global _ROW_LAYER
    if _ROW_LAYER is None:
        _ROW_LAYER = type("ArenaRowLayer", (RowLayer, _static_layer()), {})
    return _ROW_LAYER


def row_cache(views: Sequence[tuple[Any, Any]], cols: Any) -> Any:
    """A transformers ``Cache`` of per-row-write layers over ``views`` (per layer ``(keys,
    values)``, ``[n, heads, c, head_dim]``), writing at ``cols``."""
    from transformers.cache_utils import Cache

    cls = row_layer_class()
    layers = []
    for k, v in views:
        layer = cls(max_cache_len=k.shape[2])
        layer.keys, layer.values = k, v
        layer.dtype, layer.device = k.dtype, k.device
        layer.batch_size, layer.num_heads = k.shape[0], k.shape[1]
        layer.k_head_dim = layer.v_head_dim = k.shape[3]
        layer.is_initialized = True
        layer.cols = cols
        layers.append(layer)
    return Cache(layers=list[Any](layers))


class RowStep(DecodeStep):
    """One decode step over slots ``[0, n)`` of geometry ``c``: each row feeds ``ids[i]`` at
    column ``pos[i]`` and sees its columns up to it; ``pos`` advances in the step (module
    docstring). Captured on CUDA as :class:`~worker.engines.static_cache.DecodeStep` is."""

    def __init__(self, runner: StaticRunner, n: int, c: int) -> None:  # noqa: D107 - as the base's
        import torch

        assert isinstance(runner, RowRunner)
        self.runner = runner
        self.n, self.c = n, c
        self.ids = runner.ids[:n]
        self.pos = runner.pos[:n]
        self.cache = row_cache(runner.slot_views(0, n, c), self.pos)
        self.cols = torch.arange(c, device=runner.device).view(1, 1, 1, c)
        self.mask: Any = None  # the mask follows from pos, inside the step
        self.blocks = RowBlocks(self.pos, n, c, runner.live, runner.sees) if runner.flex and fits(c) else None
        """FlexAttention's block mask (``decode_attention = "flex"``), else an SDPA mask."""
        self.graph: Any = None
        self.logits: Any = None
        self.bucket = False

    def body(self) -> Any:
        """Run the model on every row's token at its own column, advance the columns (dummies
        stay at their slot's last)."""
        r = self.runner
        if self.blocks is not None:
            self.blocks.update()
            mask = self.blocks.mask
        else:
            mask = r.attention_mask(self.cols <= self.pos.view(self.n, 1, 1, 1))
        out = r.model(input_ids=self.ids, attention_mask=mask, position_ids=self.pos,
                      past_key_values=self.cache, use_cache=True)
        self.pos.add_(1).clamp_(max=self.c - 1)
        return out.logits[:, -1, :]

    def probe(self, ids: Any, past: int) -> None:
        """The graph check's inputs: every row feeds ``ids`` at column ``past`` (every row real)."""
        self.ids.copy_(ids)
        self.pos.fill_(past)
        assert isinstance(self.runner, RowRunner)
        self.runner.live.fill_(self.n)


@dataclass(frozen=True)
class Geometry:
    """Where the running rows are: ``c`` columns per slot, and the step ``plan`` of their rows."""

    c: int
    plan: StepPlan
    bucket: bool = False
    """The step is a bucket's (prepared at warm-up: a captured graph on CUDA)."""


class RowRunner(StaticRunner):
    """The arena, buckets and decode steps of ``hf-static-cb`` (module docstring)."""

    step_class = RowStep

    def __init__(self, *args: Any, max_rows: int = 0, flex: bool = False, **kwargs: Any) -> None:
        """:class:`~worker.engines.static_cache.StaticRunner`'s arguments; ``max_rows``: most rows
        running at once (0: as many as the arena has slots); ``flex``: decode steps attend
        with FlexAttention over each row's own columns (:mod:`worker.engines.arena_attention`)."""
        import torch

        super().__init__(*args, **kwargs)
        self.flex = bool(flex)
        self.live = torch.zeros(1, dtype=torch.long, device=self.device)
        """The real rows of the step (the rest of its bucket are dummies): FlexAttention's
        block mask gives a dummy its slot's last block only."""
        self.sees = row_mask(self.pos.view(-1)) if self.flex else None
        """FlexAttention's mask function over this runner's positions (``flex``)."""
        if self.flex:
            use(self.model, len(self.bucket_shapes()))
        a = self.arena
        self.slot = a.heads * a.head_dim
        """Elements of one token's keys (or values) in one layer."""
        self.max_rows = min(int(self.ids.shape[0]), int(max_rows) or int(self.ids.shape[0]))

    # ------------------------------------------------------------------ geometry

    def reset_counters(self, column: int) -> None:
        """Also start every row's column at ``column`` (warm-up, captures)."""
        super().reset_counters(column)
        self.pos.fill_(column)

    def layout_columns(self, need: int) -> int:
        """Columns per slot for rows needing at most ``need``: the smallest cache bucket that
        holds it (few sizes: the rows move only when it changes), else ``need`` rounded up to
        64."""
        for c in self.cache_buckets:
            if c >= need:
                return c
        return -(-need // 64) * 64

    def geometry(self, rows: int, need: int, slots: int = 0, loose: bool = True) -> Geometry | None:
        """Where ``rows`` rows needing at most ``need`` columns each run, the arena holding
        ``slots`` rows in all (paused rows beside them): columns :meth:`layout_columns` (or
        ``need`` itself when that does not fit), the smallest prepared bucket of rows at those
        columns, else (``loose``) the rows' own shape; None when the arena cannot hold them."""
        if rows > self.max_rows:
            return None
        bucketing = self.bucketing and self.use_graphs
        for c in dict.fromkeys((self.layout_columns(need), need)):
            if not self.arena.fits(max(rows, slots), c):
                continue
            if bucketing:
                for n, bc in self.buckets():
                    if bc == c and n >= rows:
                        return Geometry(c, StepPlan(rows, n, c, self.steps[(n, c)].graph is not None), True)
            if (loose or not bucketing) and self.arena.fits(rows, c):
                return Geometry(c, StepPlan(rows, rows, c, False))
        return None

    def rows_at(self, c: int) -> int:
        """Most rows that step together at ``c`` columns per slot: what the arena holds there,
        and where batches run in bucket shapes, the largest bucket at ``c`` (rows in a bucket take
        no row that would step them outside one: :mod:`worker.engines.arena_join`); at most
        :attr:`max_rows`."""
        most = self.arena.tokens // max(1, c)
        if self.bucketing and self.use_graphs:
            most = max((n for n, bc in self.buckets() if bc == c), default=most)
        return max(1, min(self.max_rows, most))

    def plan(self, rows: int, need: int) -> StepPlan | None:
        """The step ``rows`` rows needing ``need`` columns decode in (:meth:`geometry`)."""
        g = self.geometry(rows, need)
        return None if g is None else g.plan

    # ------------------------------------------------------------------ views

    def slot_views(self, lo: int, hi: int, c: int) -> list[tuple[Any, Any]]:
        """Per layer ``(keys, values)`` of slots ``[lo, hi)`` at ``c`` columns, as
        ``[hi - lo, heads, c, head_dim]`` views."""
        a, per = self.arena, self.slot * c
        shape = (hi - lo, a.heads, c, a.head_dim)
        return [(k[lo * per:hi * per].view(shape), v[lo * per:hi * per].view(shape)) for k, v in a.kv]

    # ------------------------------------------------------------------ moving rows

    def relayout(self, lens: Sequence[int], old: int, new: int) -> None:
        """Rows in slots ``[0, len(lens))``, ``lens[i]`` columns of each written, move from
        ``old`` to ``new`` columns per slot. Growing, the last rows go first; shrinking, the
        first: a chunk's new place then never covers a row not moved yet, and each chunk is
        copied out before it is written back."""
        k = len(lens)
        if k == 0 or old == new:
            return
        width = max(1, min(max(lens), old, new))
        per_row = self.slot * width * self.arena.kv[0][0].element_size()
        step = max(1, RELAYOUT_BYTES // max(1, per_row))
        chunks = [(a, min(k, a + step)) for a in range(0, k, step)]
        if new > old:
            chunks.reverse()
        for lo, hi in chunks:
            w = max(1, min(max(lens[lo:hi]), old, new))
            src = self.slot_views(lo, hi, old)
            dst = self.slot_views(lo, hi, new)
            for (sk, sv), (dk, dv) in zip(src, dst, strict=True):
                tk, tv = sk[:, :, :w].clone(), sv[:, :, :w].clone()
                dk[:, :, :w].copy_(tk)
                dv[:, :, :w].copy_(tv)

    def move(self, src: int, dst: int, length: int, c: int) -> None:
        """Copy the first ``length`` columns of slot ``src`` to slot ``dst`` (``c`` columns per slot)."""
        if length <= 0 or src == dst:
            return
        a, b = self.slot_views(src, src + 1, c), self.slot_views(dst, dst + 1, c)
        for (sk, sv), (dk, dv) in zip(a, b, strict=True):
            dk[:, :, :length].copy_(sk[:, :, :length])
            dv[:, :, :length].copy_(sv[:, :, :length])

    def permute(self, ops: Sequence[Op], c: int) -> None:
        """Run :func:`~worker.engines.arena_slots.order_moves`'s copies between slots (``c``
        columns per slot), layer by layer, with one spare buffer of one row of one layer."""
        if not ops:
            return
        span = max(max(op.src, op.dst) for op in ops) + 1
        for k, v in self.slot_views(0, span, c):
            for t in (k, v):
                spare: Any = None
                for op in ops:
                    if op.kind == "move":
                        t[op.dst, :, :op.length].copy_(t[op.src, :, :op.length])
                    elif op.kind == "save":
                        spare = t[op.src, :, :op.length].clone()
                    else:
                        t[op.dst, :, :op.length].copy_(spare)

    def load(self, slot: int, c: int, kv: Sequence[tuple[Any, Any]], used: int) -> None:
        """Copy a kept entry's first ``used`` tokens (per layer ``[1, heads, T, head_dim]``,
        device or pinned host memory) into slot ``slot``'s first columns."""
        if used <= 0:
            return
        for (k, v), (ek, ev) in zip(self.slot_views(slot, slot + 1, c), kv, strict=True):
            k[:, :, :used].copy_(ek[:, :, :used], non_blocking=True)
            v[:, :, :used].copy_(ev[:, :, :used], non_blocking=True)

    def cut(self, slots: Sequence[int], lens: Sequence[int], rows: int, c: int) -> list[tuple[list[Any], int]]:
        """The KV of ``slots`` (their first ``lens`` columns) as new per-layer ``[1, heads, T,
        head_dim]`` tensors and their bytes; ``rows``: how many slots the views span.

        Each row's tensors own their memory, as :func:`worker.engines.kvstore.cut_rows`' do (the
        store drops entries one at a time; rows cut as views of one shared gather kept it all on
        the device until the last of them went). A row's columns here are its slot's first
        ``lens``, so a slice's copy per layer needs no mask or index."""
        views = self.slot_views(0, rows, c)
        out: list[tuple[list[Any], int]] = []
        for s, n in zip(slots, lens, strict=True):
            kv = [(k[s:s + 1, :, :n].clone(), v[s:s + 1, :, :n].clone()) for k, v in views]
            out.append((kv, sum(2 * k.numel() * k.element_size() for k, _ in kv)))
        return out

    # ------------------------------------------------------------------ prefill

    def prefill(self, lo: int, c: int, parts: Sequence[tuple[Sequence[int], int]],
                scores: Sequence[PromptScore | None] = ()) -> None:
        """Write the KV of ``parts[i] = (tokens, start)`` into slot ``lo + i`` at columns
        ``[start, start + len(tokens))``, in chunks of at most ``prefill_chunk_tokens`` tokens
        (module docstring). Pads write past their row's tokens (within its slot) and are
        never seen by a real token. ``scores[i]``: part ``i``'s prompt log-probabilities (its
        ``start`` 0: its tokens are its prompt's positions from 0), filled chunk by chunk from
        the model's last hidden states (None: it did not ask; such rows cost nothing more)."""
        import torch

        m = len(parts)
        width = max((len(t) for t, _ in parts), default=0)
        if m == 0 or width == 0:
            return
        dev = self.device
        ids = torch.full((m, width), self.pad_id, dtype=torch.long)
        cols = torch.empty((m, width), dtype=torch.long)
        for i, (toks, start) in enumerate(parts):
            if toks:
                ids[i, : len(toks)] = torch.tensor(list(toks), dtype=torch.long)
            cols[i] = torch.arange(start, start + width).clamp(max=c - 1)
        ids, cols = ids.to(dev), cols.to(dev)
        cache = row_cache(self.slot_views(lo, lo + m, c), cols[:, :0])
        keys = torch.arange(c, device=dev).view(1, 1, 1, c)
        chunk = width if self.prefill_chunk_tokens <= 0 else max(1, self.prefill_chunk_tokens // m)
        with maybe_tap(self.model, any(s is not None for s in scores)) as tap:
            for a in range(0, width, chunk):
                b = min(width, a + chunk)
                q = cols[:, a:b]
                for layer in cache.layers:
                    layer.cols = q
                mask = keys <= q.view(m, 1, b - a, 1)
                self.model(input_ids=ids[:, a:b], attention_mask=self.attention_mask(mask), position_ids=q,
                           past_key_values=cache, use_cache=True, logits_to_keep=1)
                if tap is not None:  # the chunk's tokens a..b-1 of each part: positions start + a..
                    for i, s in enumerate(scores):
                        if s is not None:
                            s.add(self.model, tap.hidden[i], parts[i][1] + a)

