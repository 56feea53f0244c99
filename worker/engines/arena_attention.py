"""Decode attention that reads each row's own columns: ``hf-static-cb``'s
``decode_attention = "flex"``.

**Why.** A decode step of the arena (:class:`~worker.engines.arena_rows.RowStep`) hands the
model ``n`` slots of ``c`` columns, ``c`` a cache bucket at least the widest row's context and
slice, and SDPA reads all ``n × c`` columns of keys and values through a 4-D mask. At
saturation most of that is padding: the rows are of many lengths, the bucket rounds the widest
up, and a bucket's spare rows are dummies. On the card that is bandwidth: 512 KiB of KV per
column for a 7B model in fp16, against 13 GB of weights read once per step (the engine's
account at close says how many columns a step read and what share were the rows' own).

**How.** PyTorch's FlexAttention (``torch.nn.attention.flex_attention``, compiled by
``torch.compile``: Triton on CUDA, C++ on the CPU) skips whole blocks of ``KV_BLOCK`` columns
that a block mask leaves out. :class:`RowBlocks` is one step's block mask: row ``i`` sees
columns ``<= pos[i]`` (the arena's layout: a row's KV is left-aligned, its current token at
column ``pos[i]``), so its blocks before ``(pos[i] + 1) // KV_BLOCK`` are full, the next one
partly seen (masked by :func:`row_mask`'s function) and the rest skipped. The mask's tensors are static
buffers that :meth:`RowBlocks.update` rewrites from ``pos`` on the device, inside the step,
so a captured step stays valid while the rows grow.

The model's attention implementation becomes :data:`NAME` (:func:`use`), registered with
transformers: a query of one token with a :class:`~torch.nn.attention.flex_attention.BlockMask`
runs FlexAttention, anything else (prefills, steps whose columns are not whole blocks) runs
transformers' own SDPA with its boolean mask, as before.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

log = logging.getLogger("worker")

__all__ = ["KV_BLOCK", "NAME", "RowBlocks", "attention", "failed", "fits", "row_mask", "use"]

#: The implementation name the model's config takes (registered with transformers by :func:`use`).
NAME = "sclsd_arena"
#: Columns per block of the block mask: a step's columns per slot must be a multiple of it.
KV_BLOCK = 128

#: Recompiles of the compiled FlexAttention allowed beyond one per bucket shape (torch's own
#: limit, 8, is below the shapes the CPU compiles one by one; past it torch raises).
RECOMPILE_MARGIN = 8

_compiled: dict[bool, Any] = {}
"""FlexAttention compiled, by whether its shapes are dynamic (CUDA) or not."""
_limit = 0
"""The recompile limit :func:`use` asked for (torch's settings are per thread: each thread that
attends sets it, :func:`_limits`)."""
_threads = threading.local()
_failed: str | None = None
"""Why FlexAttention failed since the last :func:`use`, if it did: decode attends with SDPA since."""


def fits(c: int) -> bool:
    """Whether a step of ``c`` columns per slot can run FlexAttention (whole blocks)."""
    return c > 0 and c % KV_BLOCK == 0


def row_mask(pos_all: Any) -> Any:
    """The mask function of a runner's steps: row ``b`` sees the columns up to its current
    token's, ``pos_all[b]``. ``pos_all`` is the runner's whole position buffer, flat (every
    step's rows are its first ``n``), so one function serves all its steps: the compiled
    kernel takes the tensor it reads as an input, not as part of its code."""

    def sees(b: Any, h: Any, q: Any, kv: Any) -> Any:
        del h, q
        return kv <= pos_all[b]

    return sees


def _flex(cuda: bool) -> Any:
    """FlexAttention, compiled once per process (the kernel is generated from the mask function
    and the shapes: on CUDA with dynamic shapes, a few graphs for every bucket; on the CPU,
    where inductor's template does not take them, one per shape)."""
    if cuda not in _compiled:
        import torch
        from torch.nn.attention.flex_attention import flex_attention

        _compiled[cuda] = torch.compile(flex_attention, dynamic=cuda, fullgraph=True)
    return _compiled[cuda]


def attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, dropout: float = 0.0,
              scaling: float | None = None, **kwargs: Any) -> tuple[Any, None]:
    """transformers' attention interface: FlexAttention for a decode step given a block mask,
    SDPA otherwise (module docstring); if FlexAttention fails (its compile, say), the step and
    every later one attend with SDPA and the reason is logged once. Returns ``([batch, q,
    heads, head_dim], None)``."""
    import torch
    from torch.nn.attention.flex_attention import BlockMask
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    global _failed
    if isinstance(attention_mask, BlockMask) and _failed is None:
        _limits()
        try:
            out = _flex(query.device.type == "cuda")(query, key, value, block_mask=attention_mask, scale=scaling,
                                                     enable_gqa=query.shape[1] != key.shape[1])
            return out.transpose(1, 2).contiguous(), None
        except Exception as exc:  # noqa: BLE001 - the rows are served all the same; say why, once
            _failed = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            log.error('decode_attention = "flex" failed (%s); decode attends with SDPA from now on', _failed)
    if isinstance(attention_mask, BlockMask):  # the boolean mask the block mask stands for
        n, c, dev = key.shape[0], key.shape[2], key.device
        zero = torch.zeros((), dtype=torch.long, device=dev)  # the head and the query: it reads neither
        attention_mask = attention_mask.mask_mod(torch.arange(n, device=dev).view(n, 1, 1, 1), zero, zero,
                                                 torch.arange(c, device=dev).view(1, 1, 1, c))
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, **kwargs)


def _limits() -> None:
    """Raise torch's recompile limits to :data:`_limit` in this thread, once (the serve thread
    attends, not the thread that built the engine)."""
    if getattr(_threads, "limit", 0) == _limit:
        return
    import torch._dynamo

    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, _limit)
    cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 2 * _limit)
    _threads.limit = _limit


def failed() -> str | None:
    """Why FlexAttention failed in this process (None: it has not)."""
    return _failed


def use(model: Any, shapes: int = 0) -> None:
    """Make ``model`` attend through :func:`attention` (and try FlexAttention again, had it
    failed); ``shapes``: the step shapes it may compile for (its buckets), which torch's
    recompile limit is raised to take."""
    global _failed, _limit
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    _limit = max(_limit, shapes + RECOMPILE_MARGIN)

    AttentionInterface.register(NAME, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)  # masks it is not given are SDPA's
    _failed = None
    model.config._attn_implementation = NAME


class RowBlocks:
    """The block mask of a decode step over slots ``[0, n)`` of ``c`` columns (module
    docstring); :attr:`mask` is what the step passes as its attention mask. ``pos``: the step's
    rows' positions (``[n, 1]``); ``sees``: the runner's :func:`row_mask`; ``live``: a
    one-element device tensor, the step's real rows (running or ended in it); the bucket's rows
    after them are dummies, whose outputs are never read: each sees its slot's last block only."""

    def __init__(self, pos: Any, n: int, c: int, live: Any, sees: Any) -> None:
        import torch
        from torch.nn.attention.flex_attention import BlockMask

        if not fits(c):
            raise ValueError(f"{c} columns per slot are not whole blocks of {KV_BLOCK}")
        blocks = c // KV_BLOCK
        dev = pos.device
        self.pos = pos
        self.limit = blocks - 1
        self.live = live
        self.rows = torch.arange(n, device=dev).view(n, 1, 1)
        i32 = torch.int32
        self.full = torch.zeros((n, 1, 1), dtype=i32, device=dev)
        self.full_idx = torch.arange(blocks, dtype=i32, device=dev).view(1, 1, 1, blocks).repeat(n, 1, 1, 1)
        self.part = torch.zeros((n, 1, 1), dtype=i32, device=dev)
        self.part_idx = torch.zeros((n, 1, 1, blocks), dtype=i32, device=dev)
        self.mask = BlockMask.from_kv_blocks(self.part, self.part_idx, self.full, self.full_idx,
                                             BLOCK_SIZE=(KV_BLOCK, KV_BLOCK), mask_mod=sees,
                                             seq_lengths=(1, c), compute_q_blocks=False)

    def update(self) -> None:
        """Rewrite the mask from ``pos`` and ``live`` (device ops only: a captured step replays
        them)."""
        import torch

        seen = self.pos.view(-1, 1, 1) + 1
        whole = seen // KV_BLOCK
        dummy = self.rows >= self.live
        self.full.copy_(whole.masked_fill(dummy, 0))
        self.part.copy_(((seen % KV_BLOCK) != 0) | dummy)
        self.part_idx[:, :, :, 0].copy_(torch.where(dummy, self.limit, whole.clamp(max=self.limit)))
