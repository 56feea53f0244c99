"""What the ``hf-static-cb`` tests share (not a test module): the engine on the tiny random
Llama, the ``hf`` engine it is held to, and requests served in one batch or in grants."""

from __future__ import annotations

import itertools
import random
from typing import Any

from sclsd.protocol import BatchMsg, BatchRequest
from worker.engines import create_engine
from worker.engines.arena_rows import RowRunner
from worker.engines.hf_static_cb import HFStaticCBEngine

BUDGET = 64 * 1024**2
DELTA = 512
"""KV bytes per token of ``tiny-random`` in fp32 (a budget of ``k * DELTA`` holds ``k`` tokens)."""
_bids = itertools.count(5000)


def make(**opts: Any) -> HFStaticCBEngine:
    """An ``hf-static-cb`` engine on ``tiny-random``, warmed up."""
    opts.setdefault("mem_budget", BUDGET)
    eng = create_engine("hf-static-cb", "tiny-random", threads=1, **opts)
    assert isinstance(eng, HFStaticCBEngine)
    eng.warm_up()
    return eng


def hf_engine() -> Any:
    """The ``hf`` engine whose tokens ``hf-static-cb`` must give (no kept KV)."""
    return create_engine("hf", "tiny-random", threads=1, mem_budget=BUDGET, kv_reuse=False)


def next_batch_id() -> int:
    return next(_bids)


def req(rid: str, ctx: list[int], n: int, **kw: Any) -> BatchRequest:
    """A greedy row (unless ``temperature`` is given) that runs to ``n`` tokens."""
    kw.setdefault("temperature", 0.0)
    kw.setdefault("ignore_eos", True)
    return BatchRequest(rid=rid, token_ids=ctx, max_new_tokens=n, **kw)


def serve(engine: Any, reqs: list[BatchRequest], s: int, kv_reuse: bool = True) -> tuple[list[Any], Any]:
    """One batch of ``reqs`` in a slice of ``s`` tokens, served alone."""
    return engine.serve(BatchMsg(batch_id=next(_bids), slice_len=s, requests=reqs, kv_reuse=kv_reuse))


def one_pass(hf: Any, ctxs: list[list[int]], n: int) -> list[list[int]]:
    """``n`` greedy tokens of each context, in one batch on ``hf``."""
    outs, _ = serve(hf, [req(f"h{i}", c, n) for i, c in enumerate(ctxs)], n, kv_reuse=False)
    return [o.token_ids for o in outs]


def contexts(n: int, lo: int, hi: int, seed: int = 1) -> list[list[int]]:
    """``n`` random contexts of ``lo`` to ``hi - 1`` tokens."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def runner(tokens: int = 4096) -> RowRunner:
    """An arena of ``tokens`` token slots for a 3-layer model, without a model (moves only)."""
    import torch
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100)
    return RowRunner(None, cfg, torch.device("cpu"), torch.float32, tokens, 0, (1, 2, 4), (16, 32, 64))
