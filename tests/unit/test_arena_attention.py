"""``hf-static-cb``'s ``decode_attention = "flex"`` on the CPU (tiny random Llama): the block
mask of a step follows its rows' positions; FlexAttention through it gives SDPA's output over
each row's own columns; the engine serves ``hf``'s greedy tokens with rows of many lengths
joining and leaving, its decode steps going through FlexAttention and its prefills through
SDPA. Its speed is the card's to measure (``sclsd-bench gpu-check --preset flex``)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from sclsd.engine_options import check_option  # noqa: E402
from sclsd.protocol import BatchMsg  # noqa: E402
from unit.arena_common import contexts, hf_engine, make, one_pass, req  # noqa: E402
from unit.test_cancel_rows import done_of, run_until, tokens_of  # noqa: E402
from worker.engines import arena_attention as A  # noqa: E402

_bids = itertools.count(7700)


class _Model:
    """What :func:`~worker.engines.arena_attention.use` touches of a model: its config."""

    class config:  # noqa: N801 - as transformers names it
        _attn_implementation = "sdpa"


def test_the_block_mask_follows_each_rows_position() -> None:
    """Row i sees columns <= pos[i]: its whole blocks before, the block holding pos[i] partly
    (none when pos[i] ends a block), nothing after; rewritten in place as pos moves."""
    pos = torch.tensor([0, 127, 128, 300, 383, 383]).view(6, 1)
    live = torch.tensor([5])
    A.use(_Model())
    rb = A.RowBlocks(pos, 6, 384, live, A.row_mask(pos.view(-1)))
    rb.update()
    # The sixth row is the bucket's dummy (its slot's last column): its last block only.
    assert rb.full.view(-1).tolist() == [0, 1, 1, 2, 3, 0] and rb.part.view(-1).tolist() == [1, 0, 1, 1, 0, 1]
    assert rb.mask.to_dense().view(6, 3).tolist() == [[1, 0, 0], [1, 0, 0], [1, 1, 0], [1, 1, 1], [1, 1, 1],
                                                      [0, 0, 1]]
    pos[:5].add_(1).clamp_(max=383)
    live.fill_(6)  # the rows change: six real rows now
    rb.update()
    assert rb.mask.to_dense().view(6, 3).tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 0], [1, 1, 1], [1, 1, 1],
                                                      [1, 1, 1]]
    assert _Model.config._attn_implementation == A.NAME
    with pytest.raises(ValueError, match="whole blocks"):
        A.RowBlocks(pos, 6, 320, live, A.row_mask(pos.view(-1)))


def test_flex_attention_gives_sdpas_output_over_each_rows_own_columns() -> None:
    """The same attention as SDPA with the step's boolean mask (grouped heads), while the
    columns after a row's position hold garbage it must not see; a query of more than one
    token (a prefill) goes to SDPA with its mask."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    g = torch.Generator().manual_seed(3)
    n, heads, kv_heads, c, d = 3, 4, 2, 256, 16
    pos = torch.tensor([5, 130, 255]).view(n, 1)
    A.use(_Model())
    rb = A.RowBlocks(pos, n, c, torch.tensor([n]), A.row_mask(pos.view(-1)))
    rb.update()
    q = torch.randn(n, heads, 1, d, generator=g)
    k, v = torch.randn(n, kv_heads, c, d, generator=g), torch.randn(n, kv_heads, c, d, generator=g)
    seen = torch.arange(c).view(1, 1, 1, c) <= pos.view(n, 1, 1, 1)
    k[~seen.expand(n, kv_heads, 1, c).squeeze(2)] = 1e4  # a column past a row's token would swamp it
    out, _ = A.attention(torch.nn.Module(), q, k, v, rb.mask, scaling=0.25)
    ref = sdpa(q, k, v, attn_mask=seen, scale=0.25, enable_gqa=True).transpose(1, 2)
    assert out.shape == (n, 1, heads, d) and torch.allclose(out, ref, atol=1e-5)
    q2 = torch.randn(n, heads, 2, d, generator=g)
    causal = torch.arange(c).view(1, 1, 1, c) <= (pos.view(n, 1, 1, 1) + torch.arange(2).view(1, 1, 2, 1))
    layer = torch.nn.Module()
    layer.num_key_value_groups = heads // kv_heads  # what transformers' SDPA reads of an attention layer
    out2, _ = A.attention(layer, q2, k, v, causal, scaling=0.25)
    assert torch.allclose(out2, sdpa(q2, k, v, attn_mask=causal, scale=0.25, enable_gqa=True).transpose(1, 2),
                          atol=1e-5)


def test_the_recompile_limit_holds_in_the_thread_that_attends() -> None:
    """torch's settings are per thread: the limit that lets every bucket shape compile is set
    in the thread that attends (the worker's serve thread), not only where the engine was built."""
    import threading

    import torch._dynamo

    A.use(_Model(), shapes=50)
    seen: list[int] = []

    def attend() -> None:
        before = torch._dynamo.config.recompile_limit
        A._limits()
        seen.extend((before, torch._dynamo.config.recompile_limit))

    t = threading.Thread(target=attend)
    t.start()
    t.join()
    assert seen[0] < 50 + A.RECOMPILE_MARGIN <= seen[1]


def test_a_failing_flex_falls_back_to_sdpa_once_and_says_why(monkeypatch, caplog) -> None:
    """FlexAttention failing (its compile, on a box whose torch cannot) does not fail the rows:
    that step and every later one attend with SDPA over the same columns, and the reason is
    logged once; a new engine tries FlexAttention again."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    tried = {"n": 0}

    def broken(cuda: bool) -> Any:
        tried["n"] += 1
        raise RuntimeError("no kernel for this card\nmore detail")

    pos = torch.tensor([3, 200]).view(2, 1)
    A.use(_Model())
    monkeypatch.setattr(A, "_flex", broken)
    rb = A.RowBlocks(pos, 2, 256, torch.tensor([2]), A.row_mask(pos.view(-1)))
    rb.update()
    q, k, v = torch.randn(2, 2, 1, 8), torch.randn(2, 2, 256, 8), torch.randn(2, 2, 256, 8)
    seen = torch.arange(256).view(1, 1, 1, 256) <= pos.view(2, 1, 1, 1)
    with caplog.at_level("ERROR", logger="worker"):
        for _ in range(3):
            out, _ = A.attention(torch.nn.Module(), q, k, v, rb.mask, scaling=0.5)
            assert torch.allclose(out, sdpa(q, k, v, attn_mask=seen, scale=0.5).transpose(1, 2), atol=1e-6)
    assert tried["n"] == 1 and A.failed() == "RuntimeError: no kernel for this card"
    assert caplog.text.count('decode_attention = "flex" failed (RuntimeError: no kernel for this card)') == 1
    A.use(_Model())
    assert A.failed() is None


def test_the_engine_with_flex_decode_gives_hf_tokens_with_rows_joining_and_leaving(monkeypatch) -> None:
    """Rows of 5 to 150 tokens, one joining while the others run (slots of 128 and 256
    columns: whole blocks), each ending at its own length: every row's greedy tokens are
    ``hf``'s one pass, and every decode step went through FlexAttention."""
    calls = {"flex": 0}
    real = A._flex

    def counted(cuda: bool) -> Any:
        calls["flex"] += 1
        return real(cuda)

    monkeypatch.setattr(A, "_flex", counted)
    # Buckets of 4 rows: three rows run beside a dummy, which FlexAttention gives one block.
    eng = make(static_buckets=True, graph_batch_sizes="4", graph_cache_tokens="128,256", decode_attention="flex")
    assert eng.static.flex
    ctxs = contexts(3, 5, 150, seed=11)
    lens = (12, 30, 20)
    eng.submit(BatchMsg(batch_id=next(_bids), slice_len=40,
                        requests=[req(f"r{i}", c, n) for i, (c, n) in enumerate(zip(ctxs[:2], lens, strict=False))]))
    seen = run_until(eng, lambda s: len(tokens_of(s, "r0")) >= 4)
    eng.submit(BatchMsg(batch_id=next(_bids), slice_len=40, requests=[req("r2", ctxs[2], lens[2])]))
    seen += run_until(eng, lambda s: len(done_of(s)) == 2)
    hf = hf_engine()
    for i, (c, n) in enumerate(zip(ctxs, lens, strict=True)):
        assert tokens_of(seen, f"r{i}") == one_pass(hf, [c], n)[0]
    layers = int(eng.config.num_hidden_layers)
    assert calls["flex"] >= layers * eng.rows.tally.steps > 0  # every layer of every step
    eng.close()


def test_flex_runs_in_bucket_shapes_and_off_cuda_needs_them() -> None:
    """Each step shape compiles a kernel on the CPU: flex runs batches in bucket shapes unless
    told otherwise, and without buckets off CUDA the engine refuses to start, saying why."""
    eng = make(decode_attention="flex", graph_batch_sizes="2", graph_cache_tokens="128")
    assert eng.static.bucketing and eng.static.buckets() == [(2, 128)]
    eng.close()
    with pytest.raises(ValueError, match="leave static_buckets on"):
        make(decode_attention="flex", static_buckets=False)


def test_the_option_takes_sdpa_or_flex_on_hf_static_cb_only() -> None:
    assert check_option("hf-static-cb", "decode_attention", "flex") is None
    assert "must be one of sdpa, flex" in str(check_option("hf-static-cb", "decode_attention", "paged"))
    assert "does not take it" in str(check_option("hf-cb", "decode_attention", "flex"))
