"""The bucket grid of the static path: which ``(n rows, c columns)`` decode steps a static
arena prepares and, with CUDA graphs, captures (:class:`~worker.engines.static_cache.StaticRunner`).

A batch runs in the smallest bucket that holds it, its spare rows dummies, so the grid trades
padding (rows and columns read for nothing) against the graphs to capture before a worker is
ready and the logits each keeps. The lists are options (``graph_batch_sizes``,
``graph_cache_tokens``); the shapes follow from them and the arena's size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sclsd.engine_options import parse_option

__all__ = ["DEFAULT_BATCH_SIZES", "DEFAULT_CACHE_TOKENS", "DEFAULT_CAPTURE_S", "cache_grid", "capture_order",
           "grid_shapes", "parse_sizes"]

#: Batch-size buckets captured by default (those the arena can hold with the smallest cache).
#: A batch of more rows than the largest bucket still runs, eagerly in its own shape.
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
#: Cache-length buckets captured by default (up to the model's context and the arena), steps
#: of 1.5× rather than 2×: the arena is a share of the KV memory, not a power of two, so a
#: grid of powers of two misses common shapes at its edge (7B on an 80 GB H100: 65,290 slots,
#: and (32 rows, 2048) needs 65,536, so 32 rows of 1024-token contexts found no graph; with
#: 1536 they do, and every batch bucket's largest cache bucket fills at least 2/3 of its rows'
#: share of the arena).
DEFAULT_CACHE_TOKENS = (256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
#: Seconds warm-up may spend capturing decode graphs after the first two, which carry the
#: one-time costs (0: no limit; :meth:`~worker.engines.static_cache.StaticRunner.warm_up`).
#: Each cache bucket's largest shape goes first (:func:`capture_order`), then the rest from the
#: most rows down, so what a cut leaves out are smaller batch buckets: a batch of fewer rows
#: runs in the next captured one (a few more rows of KV read), and rows of every width still
#: find a bucket of as many rows as before, never an eager step. The H100 captured 81 shapes in
#: 13.6 s, and a worker must be ready within 60 s of its start, load and graph check included
#: (docs/design.md §10).
DEFAULT_CAPTURE_S = 30.0


def parse_sizes(value: Any, name: str) -> tuple[int, ...]:
    """Bucket list option ``name`` (a ``sizes`` kind) as :func:`parse_option` types it:
    ascending, unique. ``sclsd-worker`` passes it typed; text (``"1,2,4"``, from an engine
    built directly or ``sclsd-worker profile --opt``) is parsed there too."""
    sizes: tuple[int, ...] = parse_option(name, value)
    return sizes


def cache_grid(cache_tokens: Sequence[int], max_context: int) -> tuple[int, ...]:
    """The cache buckets a model of ``max_context`` tokens (0: unknown) uses: those within it,
    at least the smallest."""
    if not cache_tokens:
        return ()
    limit = max_context if max_context > 0 else max(cache_tokens)
    return tuple(c for c in cache_tokens if c <= max(limit, min(cache_tokens)))


def grid_shapes(tokens: int, batch_sizes: Sequence[int], cache_buckets: Sequence[int],
                largest: int | None = None) -> list[tuple[int, int]]:
    """The ``(n, c)`` bucket shapes of an arena of ``tokens`` slots, ascending: at each cache
    bucket ``c``, every batch bucket that fits and, where the next batch size (up to ``largest``,
    by default the largest batch bucket) does not, the most rows that do (``tokens // c``)."""
    largest = max(batch_sizes, default=0) if largest is None else largest
    out: list[tuple[int, int]] = []
    for c in cache_buckets:
        fit = [n for n in batch_sizes if n * c <= tokens]
        out += [(n, c) for n in fit]
        most = tokens // c
        if fit and largest > most > max(fit):
            out.append((most, c))
    return sorted(out)


def capture_order(shapes: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The order warm-up captures ``shapes`` in: first each cache bucket's shape of the most rows
    (the most the arena steps together at that width), then the rest; each part from the most
    rows down (the first capture, the largest, sizes the shared memory pool). A budget that
    cuts the list leaves every width its largest bucket."""
    def key(nc: tuple[int, int]) -> tuple[int, int]:
        return -nc[0], -nc[1]

    heads = {c: max(n for n, bc in shapes if bc == c) for _, c in shapes}
    first = sorted(((n, c) for c, n in heads.items()), key=key)
    return first + sorted(set(shapes) - set(first), key=key)
