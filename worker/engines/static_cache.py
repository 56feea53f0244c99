"""The static-cache path of ``hf``: a slice's KV in memory allocated once, its decode step
captured as a CUDA graph.

A slice is a static batch with a known bound: ``N`` rows whose contexts grow by at most
``S - 1`` tokens after a prefill of width ``W``. Its KV therefore fits a static cache of
``N × (W + S - 1)`` token slots, and its decode step has fixed shapes, which is what CUDA
graphs need (docs/design.md §10: the eager step is bound by Python and kernel launches, not by
the card).

**Arena.** :class:`KVArena` allocates, once, per layer, keys and values as flat buffers of
``tokens`` token slots. A batch of ``n`` rows and cache length ``c`` uses the first
``n · c`` slots as ``[n, kv_heads, c, head_dim]`` views, wrapped as transformers'
``StaticLayer``s (a :class:`~transformers.Cache` of them): the model writes each new
token's KV at the column a per-layer counter names and attends over the whole view
through a 4-D boolean mask (additive for eager attention: :meth:`StaticRunner.attention_mask`). Row ``i`` starts at the same place whatever ``n`` is, so a
prefill of the batch's ``N`` real rows and the decode of its bucket of ``n >= N`` rows
share their memory. The arena is the batch's memory, all of it: the worker reports its
size as M_ava, and the daemon never sends a batch it cannot hold.

**Layout.** As on the eager path, rows are left-padded: held KV (kept from an earlier
slice) ends at column ``past``, the prefill writes columns ``[past, W)``, decode step
``k`` writes column ``W + k``. ``key_real`` marks the columns holding a row's real
tokens; a pad query sees only its own column (it must see something, or SDPA gives NaN,
and a NaN value behind a masked column still poisons the weighted sum).

**Buckets and graphs.** On CUDA, :class:`StaticRunner` captures one decode step per
(batch bucket ``n``, cache bucket ``c``) that fits the arena, from the largest down,
sharing one memory pool. A batch runs in the smallest captured bucket that holds it
(extra rows are dummies: their outputs are never read); a batch outside every bucket
runs the same step eagerly over the same arena. Captures stop after ``graph_capture_s``
seconds (:data:`DEFAULT_CAPTURE_S`), so that a grid larger than the card captures in time
cannot hold the worker past its start budget: the shapes not reached, smaller batch buckets
(each width's largest goes first), leave the grid and their batches run in the next captured
bucket. The step reads its inputs from static
buffers (token ids, positions, mask, the column counter) and advances them itself, so a
replay is all a decode iteration costs the host. Prefill stays eager, in chunks of at
most ``prefill_chunk_tokens`` tokens, which bounds its activation memory.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sclsd.engine_options import parse_option
from worker.engines.static_grid import (
    DEFAULT_BATCH_SIZES,
    DEFAULT_CACHE_TOKENS,
    DEFAULT_CAPTURE_S,
    cache_grid,
    capture_order,
    grid_shapes,
    parse_sizes,
)

log = logging.getLogger("worker")

#: The warm-up's clock (tests replace it to spend the capture budget).
clock = time.perf_counter

#: ``chunk_done(col, starts)``: a prefill's forward pass over the columns from ``col`` of its
#: block of new tokens just ran, where row ``i``'s new tokens start at column ``starts[i]``
#: (left padding before them). ``hf``'s prompt log-probabilities read the pass's hidden states.
ChunkDone = Callable[[int, Sequence[int]], None]

#: Rows whose sampling logits the activation reserve covers at least: the arena admits far
#: more rows than the largest bucket (hundreds of short rows), all sampled in one step.
RESERVE_ROWS = 512
#: Prefill tokens the activation reserve covers on an eager path, which does not chunk (a guess).
EAGER_RESERVE_TOKENS = 16384


def as_switch(name: str, value: Any, auto: bool) -> bool:
    """On/off option ``name`` (a ``bool`` or ``switch`` kind) as :func:`parse_option` types
    it, ``"auto"`` meaning ``auto``; text is parsed there, as for :func:`parse_sizes`."""
    on = parse_option(name, value)
    return auto if on == "auto" else bool(on)


def activation_reserve(config: Any, dtype: Any, tokens: int, rows: int) -> int:
    """Device bytes a forward pass needs beside the weights and the KV: activations of a
    prefill of ``tokens`` tokens (hidden states, attention projections and the MLP's three
    intermediates), the logits of ``rows`` rows as sampling uses them (fp32 and fp64
    copies), and 1 GiB for library workspaces and captured graphs."""
    import torch

    h = int(config.hidden_size)
    inter = int(getattr(config, "intermediate_size", 0) or 4 * h)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    width = torch.tensor([], dtype=dtype).element_size()
    return tokens * (6 * h + 3 * inter) * width + rows * vocab * 4 * 8 + 2**30


@dataclass(frozen=True)
class StaticOptions:
    """The static-cache options of a torch engine, checked (see :meth:`parse`)."""

    on: bool
    graphs: bool
    share: float
    batch_sizes: tuple[int, ...]
    cache_tokens: tuple[int, ...]
    prefill_chunk_tokens: int
    buckets: bool | None = None
    """Run batches in bucket shapes without graphs too (None: only with graphs)."""
    capture_budget_s: float = DEFAULT_CAPTURE_S
    """Seconds the decode graphs' captures may take at warm-up (0: no limit)."""

    @property
    def reserve_tokens(self) -> int:
        """Prefill tokens one forward pass may hold (the activation reserve's size): a chunk
        on the static path, :data:`EAGER_RESERVE_TOKENS` for the eager one."""
        return self.prefill_chunk_tokens if self.on and self.prefill_chunk_tokens > 0 else EAGER_RESERVE_TOKENS

    @property
    def reserve_rows(self) -> int:
        """Rows whose sampling logits the activation reserve covers (:data:`RESERVE_ROWS` at
        least: any batch the arena admits is served, bucket or not)."""
        return max(max(self.batch_sizes), RESERVE_ROWS)

    @classmethod
    def parse(cls, device_type: str, default: bool, static_cache: Any, cuda_graphs: Any, share: Any,
              batch_sizes: Any, cache_tokens: Any, prefill_chunk_tokens: Any,
              buckets: Any = None, capture_s: Any = None) -> StaticOptions:
        """``static_cache`` and ``cuda_graphs``: true, false or auto (on with CUDA, for engines
        whose ``default`` is on); ``share``: the part of the KV memory the arena takes, the
        rest keeping KV across slices; the bucket lists; ``prefill_chunk_tokens``: most tokens
        per prefill forward pass (0: no chunks; default 8192 on CUDA, none on the CPU);
        ``buckets``: pad batches to the bucket shapes even without graphs (None: with them);
        ``capture_s``: seconds the graphs' captures may take (None: :data:`DEFAULT_CAPTURE_S`).
        Each is checked and typed by :func:`~sclsd.engine_options.parse_option` (typed
        values as ``sclsd-worker`` passes them, or their text)."""
        cuda = device_type == "cuda"
        on = as_switch("static_cache", static_cache, default and cuda)
        graphs = as_switch("cuda_graphs", cuda_graphs, cuda)
        if graphs and not cuda:  # asked for: auto is off without CUDA
            raise ValueError("cuda_graphs: CUDA graphs need a CUDA device")
        frac: float = parse_option("static_share", share)
        chunk: int = (8192 if cuda else 0) if prefill_chunk_tokens is None else parse_option(
            "prefill_chunk_tokens", prefill_chunk_tokens)
        sizes = DEFAULT_BATCH_SIZES if batch_sizes is None else parse_sizes(batch_sizes, "graph_batch_sizes")
        lens = DEFAULT_CACHE_TOKENS if cache_tokens is None else parse_sizes(cache_tokens, "graph_cache_tokens")
        pad = None if buckets is None else as_switch("static_buckets", buckets, False)
        budget: float = DEFAULT_CAPTURE_S if capture_s is None else parse_option("graph_capture_s", capture_s)
        return cls(on, graphs and on, frac, sizes, lens, chunk, pad, budget)

    def graph_outputs(self, config: Any, dtype: Any, kv_bytes: int, delta: int, max_context: int) -> int:
        """Device bytes the captured decode steps' logits keep (each graph's output lives as long
        as its step: one ``[n, vocab]`` tensor per bucket shape) in an arena of ``share`` of
        ``kv_bytes``; 0 without graphs. Taken from the KV memory before the arena is sized, which
        makes the arena smaller and its grid no larger, so the bound holds (7B in fp16: 0.35 GiB
        over the default grid in an H200's arena; the activation reserve's 1 GiB for workspaces
        and graphs did not count them)."""
        if not self.graphs:
            return 0
        import torch

        tokens = int(self.share * kv_bytes) // max(1, delta)
        shapes = grid_shapes(tokens, self.batch_sizes, cache_grid(self.cache_tokens, max_context))
        width = torch.tensor([], dtype=dtype).element_size()
        return sum(n for n, _ in shapes) * int(getattr(config, "vocab_size", 0) or 0) * width

    def runner(self, model: Any, config: Any, device: Any, dtype: Any, kv_bytes: int, delta: int,
               pad_id: int, max_context: int) -> StaticRunner:
        """The runner whose arena takes ``share`` of ``kv_bytes``."""
        tokens = int(self.share * kv_bytes) // max(1, delta)
        if tokens < 1:
            raise ValueError(f"no memory for a static cache: {kv_bytes} bytes of KV memory, "
                             f"{delta} bytes per token")
        return StaticRunner(model, config, device, dtype, tokens, pad_id, self.batch_sizes,
                            self.cache_tokens, self.graphs, self.prefill_chunk_tokens, max_context,
                            self.buckets, self.capture_budget_s)


#: Attention implementations the static path's 4-D mask is right for: SDPA takes it as a
#: boolean mask, eager attention as an additive one (:meth:`StaticRunner.attention_mask`);
#: flash attention and the paged kernels take no 4-D mask at all.
STATIC_ATTENTION = ("sdpa", "eager")


def attention_kind(config: Any) -> str:
    """The attention implementation a loaded model runs (``sdpa`` when it does not say)."""
    return str(getattr(config, "_attn_implementation", None) or "sdpa")


def layer_shape(config: Any) -> tuple[int, int, int]:
    """``(layers, kv_heads, head_dim)`` of a decoder config."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return int(config.num_hidden_layers), int(kv_heads), int(head_dim)


def zeros(n: int, dtype: Any, device: Any) -> Any:
    """``n`` zeros of ``dtype`` on ``device``. In host memory they are an anonymous mapping,
    whose pages the kernel gives zeroed and commits only when written, so a CPU worker's arena
    (most of its memory budget) costs the memory its rows have used, not all of it at start
    (``torch.zeros`` writes every page)."""
    import mmap

    import torch

    if torch.device(device).type != "cpu" or n == 0:
        return torch.zeros(n, dtype=dtype, device=device)
    size = torch.tensor([], dtype=dtype).element_size()
    # The tensor holds a reference to the mapping: it lives as long as the tensor does.
    return torch.frombuffer(mmap.mmap(-1, n * size), dtype=dtype, count=n)


class KVArena:
    """Per-layer flat key and value buffers of ``tokens`` token slots (module docstring)."""

    def __init__(self, config: Any, tokens: int, dtype: Any, device: Any) -> None:
        import torch

        self.layers, self.heads, self.head_dim = layer_shape(config)
        self.tokens = int(tokens)
        self.dtype = dtype
        self.device = device
        slot = self.heads * self.head_dim
        # Zeros: a slot never written is still a finite number.
        self.kv = [(zeros(self.tokens * slot, dtype, device), zeros(self.tokens * slot, dtype, device))
                   for _ in range(self.layers)]  # fmt: skip
        #: Where each layer writes next (one element per layer: ``StaticLayer`` advances its own).
        self.counters = torch.zeros(self.layers, dtype=torch.long, device=device)
        self.nbytes = 2 * self.layers * self.tokens * slot * torch.tensor([], dtype=dtype).element_size()

    def fits(self, n: int, c: int) -> bool:
        return n * c <= self.tokens

    def views(self, n: int, c: int) -> list[tuple[Any, Any]]:
        """Per layer ``(keys, values)`` as ``[n, heads, c, head_dim]`` views of the arena."""
        size = n * self.heads * c * self.head_dim
        shape = (n, self.heads, c, self.head_dim)
        return [(k[:size].view(shape), v[:size].view(shape)) for k, v in self.kv]

    def cache(self, n: int, c: int) -> Any:
        """A transformers ``Cache`` of ``StaticLayer``s over :meth:`views` ``(n, c)``."""
        from transformers.cache_utils import Cache, StaticLayer

        layers = []
        for i, (k, v) in enumerate(self.views(n, c)):
            layer = StaticLayer(max_cache_len=c)
            layer.keys, layer.values = k, v
            layer.dtype, layer.device = k.dtype, k.device
            layer.batch_size, layer.num_heads = n, self.heads
            layer.k_head_dim = layer.v_head_dim = self.head_dim
            layer.cumulative_length = self.counters[i]  # a view: the layer advances the arena's counter
            layer.is_initialized = True
            layers.append(layer)
        return Cache(layers=list[Any](layers))


@dataclass(frozen=True)
class StepPlan:
    """Where a batch of ``rows`` runs: ``n`` rows (a bucket, or ``rows`` itself) of cache
    length ``c``; ``graph``: its decode step is a captured graph."""

    rows: int
    n: int
    c: int
    graph: bool


class DecodeStep:
    """One decode step over arena views ``(n, c)``: static inputs, the step body, and on CUDA
    its captured graph."""

    def __init__(self, runner: StaticRunner, n: int, c: int) -> None:
        self.runner = runner
        self.n, self.c = n, c
        self.cache = runner.arena.cache(n, c)
        self.ids = runner.ids[:n]
        self.pos = runner.pos[:n]
        self.mask = runner.mask_flat[: n * c].view(n, 1, 1, c)
        self.graph: Any = None
        self.logits: Any = None
        self.bucket = False
        """Prepared at warm-up as a bucket (batches of fewer rows or columns run in it)."""

    def body(self) -> Any:
        """Open this step's column to every row, run the model (which writes the column's KV
        and advances the layer counters), advance positions and the column."""
        r = self.runner
        self.mask.index_fill_(3, r.col, True)
        out = r.model(input_ids=self.ids, attention_mask=r.attention_mask(self.mask), position_ids=self.pos,
                      past_key_values=self.cache, use_cache=True)
        self.pos.add_(1)
        r.col.add_(1)
        return out.logits[:, -1, :]

    def capture(self, pool: Any) -> None:
        """Record :meth:`body` as a CUDA graph (after warm-up runs on a side stream, as CUDA
        graphs require); replays then reuse its output tensor ``logits``."""
        import torch

        stream = torch.cuda.Stream(device=self.runner.device)
        stream.wait_stream(torch.cuda.current_stream(self.runner.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.runner.reset_counters(0)
                self.body()
        torch.cuda.current_stream(self.runner.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        self.runner.reset_counters(0)
        with torch.cuda.graph(graph, pool=pool):
            self.logits = self.body()
        self.graph = graph

    def run(self) -> Any:
        """One decode iteration: replay the graph, or run the body eagerly."""
        if self.graph is not None:
            self.graph.replay()
            return self.logits
        return self.body()

    def probe(self, ids: Any, past: int) -> None:
        """Load the inputs of the graph check (:func:`worker.engines.graph_check.verify`): every
        row feeds ``ids`` (``[n, 1]``) after ``past`` real columns."""
        m = self.mask.view(self.n, self.c)
        m.zero_()
        m[:, :past] = True
        self.ids.copy_(ids)
        self.pos.fill_(past)
        self.runner.reset_counters(past)


class StaticRunner:
    """The arena, the bucketed decode steps and the static inputs of the static-cache path."""

    #: The decode step of a bucket (``hf-static-cb`` has steps whose rows write their own columns).
    step_class: type[DecodeStep] = DecodeStep

    def __init__(self, model: Any, config: Any, device: Any, dtype: Any, arena_tokens: int, pad_id: int,
                 batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
                 cache_tokens: Sequence[int] = DEFAULT_CACHE_TOKENS,
                 graphs: bool = False, prefill_chunk_tokens: int = 0, max_context: int = 0,
                 buckets: bool | None = None, capture_budget_s: float = DEFAULT_CAPTURE_S) -> None:
        import torch

        self.model = model
        self.device = device
        self.pad_id = pad_id
        self.prefill_chunk_tokens = int(prefill_chunk_tokens)
        self.arena = KVArena(config, arena_tokens, dtype, device)
        self.cache_buckets = cache_grid(cache_tokens, max_context)
        smallest = min(self.cache_buckets, default=1)
        self.batch_buckets = tuple(n for n in batch_sizes if self.arena.fits(n, smallest))
        self.largest_batch = max(batch_sizes, default=0)
        """The largest batch bucket asked for, held by the arena or not (:meth:`bucket_shapes`)."""
        # Static inputs, shared by every step (each uses a prefix). As many rows as the arena
        # admits (a row takes at least one slot), not the largest bucket: a batch of more rows
        # runs eagerly in its own shape over these same buffers.
        rows = self.arena.tokens
        self.ids = torch.full((rows, 1), pad_id, dtype=torch.long, device=device)
        self.pos = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.mask_flat = torch.zeros(self.arena.tokens, dtype=torch.bool, device=device)
        self.col = torch.zeros(1, dtype=torch.long, device=device)
        self.additive = attention_kind(config) == "eager"
        """The model's attention adds its mask (eager) rather than selecting with it (SDPA)."""
        self.mask_values = (torch.zeros((), dtype=dtype, device=device),
                            torch.full((), torch.finfo(dtype).min, dtype=dtype, device=device))
        self.graphs_on = bool(graphs)
        self.graphs_requested = bool(graphs) and self.device.type == "cuda"
        """Graphs were asked for (kept or not: :meth:`captured` says which are)."""
        self.bucketing = self.graphs_on if buckets is None else bool(buckets)
        """Batches run in bucket shapes (always with graphs; without, only when asked: tests)."""
        self.use_graphs = True
        """False: :meth:`plan` passes the bucket steps by (the warm-up's check)."""
        self.steps: dict[tuple[int, int], DecodeStep] = {}
        self.capture_s = 0.0
        self.capture_budget_s = float(capture_budget_s)
        """Seconds the captures may take at warm-up (0: no limit; :data:`DEFAULT_CAPTURE_S`)."""
        self.uncaptured = 0
        """Bucket shapes the warm-up left out of the grid when its captures ran out of time."""

    # ------------------------------------------------------------------ buckets

    def captured(self) -> list[tuple[int, int]]:
        """The ``(n, c)`` buckets with a captured graph, ascending."""
        return sorted(k for k, s in self.steps.items() if s.graph is not None)

    def buckets(self) -> list[tuple[int, int]]:
        """The ``(n, c)`` bucket steps prepared at warm-up (captured or not), ascending."""
        return sorted(k for k, s in self.steps.items() if s.bucket)

    def bucket_shapes(self) -> list[tuple[int, int]]:
        """The ``(n, c)`` shapes warm-up prepares, ascending: at each cache bucket ``c``, every
        batch bucket the arena holds there and, where the next batch bucket asked for does not
        fit, the most rows that do (``tokens // c``). Without that fill, rows between the two
        (33 to 42 at 1,536 columns in an H100's arena for a 7B, where 48 rows do not fit) would
        step in no bucket: eagerly, at several times a captured step's cost."""
        return grid_shapes(self.arena.tokens, self.batch_buckets, self.cache_buckets, self.largest_batch)

    def plan(self, rows: int, need: int) -> StepPlan | None:
        """Where a batch of ``rows`` needing ``need`` cache columns runs: the bucket of fewest
        slots that holds it, else its own shape; None when the arena cannot hold it at all."""
        # The bucket of fewest slots (n·c): the step reads all of them. On a grid of sizes that is
        # the smallest batch bucket's smallest cache bucket; a fill bucket (bucket_shapes) holds
        # more rows than the batch bucket below it, but only at its wide cache bucket.
        held = [(n * c, n, c) for n, c in (self.buckets() if self.use_graphs else ()) if n >= rows and c >= need]
        if held:
            _, n, c = min(held)
            return StepPlan(rows, n, c, self.steps[(n, c)].graph is not None)
        if self.arena.fits(rows, need):
            return StepPlan(rows, rows, need, False)
        return None

    def step_for(self, plan: StepPlan) -> DecodeStep:
        key = (plan.n, plan.c)
        step = self.steps.get(key)
        if step is None:
            # An uncaptured shape: an eager step over the same arena (kept while few).
            if len(self.steps) > 256:
                self.steps = {k: s for k, s in self.steps.items() if s.bucket}
            step = self.steps[key] = self.step_class(self, plan.n, plan.c)
        return step

    def drop_graphs(self) -> None:
        """Forget every bucket step: decode runs eagerly, in each batch's own shape."""
        self.steps = {}
        self.graphs_on = self.bucketing = False

    def attention_mask(self, mask: Any) -> Any:
        """``mask`` (boolean, True: attend) as the model's attention takes it: as is for SDPA,
        additive (0 or the dtype's lowest) for eager attention, which adds a 4-D mask to the
        scores (a boolean one would add 0 or 1 and hide nothing)."""
        import torch

        if not self.additive:
            return mask
        return torch.where(mask, *self.mask_values)

    def reset_counters(self, column: int) -> None:
        self.arena.counters.fill_(column)
        self.col.fill_(column)

    # ------------------------------------------------------------------ warm-up

    def capturing(self) -> bool:
        """Whether warm-up captures the bucket steps as CUDA graphs."""
        return self.graphs_on and self.device.type == "cuda"

    def warm_up(self, progress: Callable[[str], None] | None = None) -> None:
        """Prepare a decode step per bucket the arena holds and, with graphs, capture each
        (:func:`~worker.engines.static_grid.capture_order`, one shared memory pool) until
        :attr:`capture_budget_s` is spent: the shapes not reached leave the grid
        (:meth:`_cut_grid`)."""
        import torch

        t0 = clock()
        todo = capture_order(self.bucket_shapes())
        if not self.bucketing:
            todo = []
        capture = self.capturing()
        pool = torch.cuda.graph_pool_handle() if capture else None
        # The budget counts from the end of the second capture: the first ones carry the
        # one-time costs (CUDA's and the libraries' set-up; with FlexAttention its compiles,
        # the first shape's and the dynamic one), which no cut of the grid would save.
        since: float | None = None
        with torch.inference_mode():
            for i, (n, c) in enumerate(todo, 1):
                if capture and since is not None and 0 < self.capture_budget_s < clock() - since:
                    self._cut_grid(todo[i - 1:], clock() - since)
                    break
                step = self.step_class(self, n, c)
                step.bucket = True
                if capture:
                    try:
                        step.capture(pool)
                    except Exception as exc:  # noqa: BLE001 - eager steps still serve; say why
                        log.warning("warming: cannot capture the decode step of batch %d, cache %d "
                                    "(%s: %s); decode runs eagerly", n, c, type(exc).__name__, exc)
                        self.drop_graphs()
                        break
                self.steps[(n, c)] = step
                since = clock() if i == 2 else since
                if progress is not None and capture and (i == len(todo) or i % 4 == 0):
                    progress(f"warming: captured {i}/{len(todo)} decode graphs (batch {n}, cache {c})")
            self.reset_counters(0)
            self.mask_flat.zero_()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.capture_s = clock() - t0

    def _cut_grid(self, left: Sequence[tuple[int, int]], spent: float) -> None:
        """The captures ran out of time (``spent`` seconds since the second) with the shapes
        ``left`` (smaller batch buckets) not reached: they leave the grid, and so would a cache
        bucket with no shape left (each width's largest went first), so that rows take the next
        captured bucket rather than step outside every one (eager on CUDA)."""
        self.uncaptured = len(left)
        self.cache_buckets = tuple(c for c in self.cache_buckets if any(bc == c for _, bc in self.steps))
        self.batch_buckets = tuple(n for n in self.batch_buckets if any(bn == n for bn, _ in self.steps))
        log.warning("warming: the decode graphs' captures took %.1f s of their %.0f s (graph_capture_s): %d "
                    "smaller bucket shapes of %d left out, batches of fewer rows run in the next captured bucket",
                    spent, self.capture_budget_s, len(left), len(left) + len(self.steps))


class StaticRun:
    """One batch on the static path: its prefill into the arena, then decode steps."""

    def __init__(self, runner: StaticRunner, plan: StepPlan) -> None:
        self.runner = runner
        self.plan = plan
        self.key_real: Any = None
        self.width = 0
        """W: the prefill's last column + 1 (held past + the longest new part)."""
        self.step: DecodeStep | None = None

    def prefill(self, reqs: Sequence[Any], taken: Sequence[Any], used: Sequence[int],
                chunk_done: ChunkDone | None = None) -> Any:
        """Copy the rows' held KV into the arena, prefill the rest in column chunks; returns the
        ``[rows, vocab]`` logits of every row's last token. ``chunk_done``: told after each
        chunk's forward pass its first column and where each row's new tokens start, both in
        the block of new tokens (the prompt's log-probabilities, read from the pass)."""
        import torch

        r, plan = self.runner, self.plan
        n, c = plan.rows, plan.c
        dev = r.device
        past = max(used, default=0)
        fresh = [len(q.token_ids) - u for q, u in zip(reqs, used, strict=True)]
        width = max(fresh)
        self.width = w_all = past + width
        ids = torch.full((n, width), r.pad_id, dtype=torch.long)
        real = torch.zeros((n, c), dtype=torch.bool)
        for i, q in enumerate(reqs):
            ids[i, width - fresh[i]:] = torch.tensor(q.token_ids[used[i]:], dtype=torch.long)
            real[i, past - used[i]:past] = True
            real[i, w_all - fresh[i]:w_all] = True
        # Positions count real tokens only (pads repeat their left neighbour's, masked anyway).
        pos = (real[:, :w_all].long().cumsum(-1) - 1).clamp(min=0)[:, past:]
        self.key_real = real = real.to(dev)
        ids, pos = ids.to(dev), pos.to(dev)
        if past:
            views = r.arena.views(n, c)
            for i, (e, u) in enumerate(zip(taken, used, strict=True)):
                if e is None or u <= 0:
                    continue
                for (k, v), (ek, ev) in zip(views, e.kv, strict=True):
                    k[i, :, past - u:past].copy_(ek[0, :, :u], non_blocking=True)
                    v[i, :, past - u:past].copy_(ev[0, :, :u], non_blocking=True)
        r.reset_counters(past)
        cache = r.arena.cache(n, c)
        chunk = width if r.prefill_chunk_tokens <= 0 else max(1, r.prefill_chunk_tokens // n)
        cols = torch.arange(c, device=dev)
        out: Any = None
        starts = [width - f for f in fresh]
        for a in range(0, width, chunk):
            b = min(width, a + chunk)
            q_cols = torch.arange(past + a, past + b, device=dev)
            mask = real[:, None, None, :] & (cols[None, None, None, :] <= q_cols[None, None, :, None])
            mask[:, 0, torch.arange(b - a, device=dev), q_cols] = True  # a pad query sees itself
            out = r.model(input_ids=ids[:, a:b], attention_mask=r.attention_mask(mask), position_ids=pos[:, a:b],
                          past_key_values=cache, use_cache=True, logits_to_keep=1)
            if chunk_done is not None:
                chunk_done(a, starts)
        return out.logits[:, -1, :]

    def decode(self, tokens: Any, positions: Sequence[int]) -> Any:
        """Feed each row's latest token (``[rows]`` on the device); returns the next logits
        (``[n, vocab]``: the bucket's rows, the first ``rows`` real). ``positions``: each
        row's position for its first decode step (its context length)."""
        import torch

        r, plan = self.runner, self.plan
        if self.step is None:
            self.step = step = r.step_for(plan)
            m = step.mask.view(plan.n, plan.c)
            m.zero_()
            m[: plan.rows].copy_(self.key_real)
            step.ids.fill_(r.pad_id)
            step.pos.zero_()
            step.pos[: plan.rows, 0].copy_(torch.tensor(list(positions), dtype=torch.long), non_blocking=True)
            r.reset_counters(self.width)
        step = self.step
        step.ids[: plan.rows, 0].copy_(tokens)
        return step.run()

    def keep_view(self, fed: int) -> tuple[Any, Any]:
        """``(cache, mask)`` for cutting rows out after a slice whose decode fed ``fed`` tokens:
        the rows' arena views and a ``[rows, c]`` mask of their real columns."""
        plan = self.plan
        mask = self.key_real.clone()
        mask[:, self.width:self.width + fed] = True
        return self.runner.arena.cache(plan.rows, plan.c), mask
