"""Keeping KV at a slice's end: every kept row cut out with one gather per layer (not a device
wait and ``2 × layers`` copies per row), host copies into one buffer allocated once, and the
host tier's default size."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch.overrides import TorchFunctionMode  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from worker.engines.hf import DEFAULT_HOST_KV_BYTES, default_host_bytes, to_host  # noqa: E402
from worker.engines.kvstore import KVReuse, KVStore, Retained, cut_row, cut_rows  # noqa: E402

LAYERS, HEADS, COLS, DIM = 4, 2, 10, 3


def batch_cache(rows: int) -> tuple[Any, Any]:
    """A cache of ``rows`` rows with distinct values and a mask with a different set of real
    columns per row (left padding and holes)."""
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(rows, HEADS, COLS, DIM, generator=gen), torch.randn(rows, HEADS, COLS, DIM, generator=gen))
            for _ in range(LAYERS)]
    mask = torch.zeros(rows, COLS, dtype=torch.bool)
    for i in range(rows):
        mask[i, i % 4:] = True
        mask[i, (i + 5) % COLS] = False
    return DynamicCache(ddp_cache_data=data), mask


class Calls(TorchFunctionMode):
    """Counts the torch calls that gather or read back: index ops and the mask's nonzero."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in ("__getitem__", "index_select", "nonzero", "item", "tolist"):
            self.n += 1
        return func(*args, **(kwargs or {}))


def test_cut_rows_equals_cutting_each_row():
    cache, mask = batch_cache(6)
    rows = [0, 2, 3, 5]
    got = cut_rows(cache, rows, mask)
    for i, (kv, nbytes) in zip(rows, got, strict=True):
        ref, ref_bytes = cut_row(cache, i, mask[i])
        assert nbytes == ref_bytes
        for (k, v), (rk, rv) in zip(kv, ref, strict=True):
            assert k.shape == rk.shape == (1, HEADS, int(mask[i].sum()), DIM)
            assert torch.equal(k, rk) and torch.equal(v, rv)
    assert cut_rows(cache, [], mask) == []


@pytest.mark.parametrize("rows", [2, 16])
def test_keeping_rows_reads_back_once_and_each_row_owns_its_memory(rows):
    """A slice end reads the mask back once whatever its rows, then gathers each row's columns
    into memory of its own (one gather per row, layer and K or V, the price of it): what the store counts for
    an entry is what it holds, so dropping one gives its memory back (as views of one gather
    for all rows, an entry held all of theirs until the last went)."""
    cache, mask = batch_cache(rows)
    keep = KVReuse(KVStore(10**9), delta=1, limit=10**9, beside=False)
    batch = [(f"r{i}", [1] * (int(mask[i].sum()) - 1), [7, 8], False) for i in range(rows)]
    with Calls() as calls:
        kept = keep.keep(batch, cache, mask)
    assert kept == [int(mask[i].sum()) for i in range(rows)]
    assert calls.n <= 4 * LAYERS * rows + 8, calls.n  # a row's view and its gather, per K and V
    for kv, nbytes in cut_rows(cache, list(range(rows)), mask):
        assert sum(k.untyped_storage().nbytes() + v.untyped_storage().nbytes() for k, v in kv) == nbytes
    held = keep.store.held()
    assert held == {f"r{i}": int(mask[i].sum()) for i in range(rows)}


def test_to_host_copies_into_one_buffer():
    cache, mask = batch_cache(3)
    (kv, nbytes), = cut_rows(cache, [1], mask)
    moved = to_host(Retained([1, 2], nbytes, kv))
    flat = [t for pair in moved.kv for t in pair]
    assert len({t.untyped_storage().data_ptr() for t in flat}) == 1  # one allocation
    assert moved.on_host and moved.nbytes == nbytes
    for (k, v), (hk, hv) in zip(kv, moved.kv, strict=True):
        assert torch.equal(k, hk) and torch.equal(v, hv)


def test_host_tier_default_is_capped():
    """On CUDA the host tier is the KV memory, within 16 GiB and a quarter of RAM: an 80 GB
    H100's ~66 GB of KV memory no longer pins ~66 GB of host memory."""
    kv = 66 * 10**9
    assert default_host_bytes("cuda", kv, ram=512 * 2**30) == DEFAULT_HOST_KV_BYTES == 16 * 2**30
    assert default_host_bytes("cuda", kv, ram=32 * 2**30) == 8 * 2**30
    assert default_host_bytes("cuda", 2 * 2**30, ram=512 * 2**30) == 2 * 2**30
    assert default_host_bytes("cpu", kv, ram=512 * 2**30) == 0
