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
    pos = torch.tensor([0, 127, 128, 300, 383]).view(5, 1)
    A.use(_Model(), pos)
    rb = A.RowBlocks(pos, 5, 384)
    rb.update()
    assert rb.full.view(-1).tolist() == [0, 1, 1, 2, 3] and rb.part.view(-1).tolist() == [1, 0, 1, 1, 0]
    assert rb.mask.to_dense().view(5, 3).tolist() == [[1, 0, 0], [1, 0, 0], [1, 1, 0], [1, 1, 1], [1, 1, 1]]
    pos.add_(1).clamp_(max=383)
    rb.update()
    assert rb.mask.to_dense().view(5, 3).tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 0], [1, 1, 1], [1, 1, 1]]
    assert _Model.config._attn_implementation == A.NAME
    with pytest.raises(ValueError, match="whole blocks"):
        A.RowBlocks(pos, 5, 320)


def test_flex_attention_gives_sdpas_output_over_each_rows_own_columns() -> None:
    """The same attention as SDPA with the step's boolean mask (grouped heads), while the
    columns after a row's position hold garbage it must not see; a query of more than one
    token (a prefill) goes to SDPA with its mask."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    g = torch.Generator().manual_seed(3)
    n, heads, kv_heads, c, d = 3, 4, 2, 256, 16
    pos = torch.tensor([5, 130, 255]).view(n, 1)
    A.use(_Model(), pos)
    rb = A.RowBlocks(pos, n, c)
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


def test_the_engine_with_flex_decode_gives_hf_tokens_with_rows_joining_and_leaving(monkeypatch) -> None:
    """Rows of 5 to 150 tokens, one joining while the others run (slots of 128 and 256
    columns: whole blocks), each ending at its own length: every row's greedy tokens are
    ``hf``'s one pass, and every decode step went through FlexAttention."""
    calls = {"flex": 0}
    real = A._flex

    def counted() -> Any:
        calls["flex"] += 1
        return real()

    monkeypatch.setattr(A, "_flex", counted)
    eng = make(static_buckets=True, graph_batch_sizes="2,4", graph_cache_tokens="128,256", decode_attention="flex")
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
    assert calls["flex"] >= layers * eng.steps > 0  # every layer of every step
    eng.close()


def test_the_option_takes_sdpa_or_flex_on_hf_static_cb_only() -> None:
    assert check_option("hf-static-cb", "decode_attention", "flex") is None
    assert "must be one of sdpa, flex" in str(check_option("hf-static-cb", "decode_attention", "paged"))
    assert "does not take it" in str(check_option("hf-cb", "decode_attention", "flex"))
