"""The ``llama`` engine under the daemon: slice grants (``scls-cb``) and static slices
(``scls``) to real worker processes running llama.cpp on tiny-random's GGUF, end to end
through the Unix socket.

The workers' KV cells are made few (``context_tokens``) so that the grant policy's memory
predicate, not the load, limits what runs; tiny-random's GGUF holds ``hf``'s weights, so
every request's greedy tokens, served in grants beside others, are ``hf``'s in one pass.
"""

from __future__ import annotations

import asyncio

import pytest

from sclsd import protocol as P
from sclsd.client import AsyncClient

from .harness import start_daemon

pytest.importorskip("ik_llama_cpp")

#: tiny-random in llama's fp16 cache: 256 bytes per token; 256 cells per worker.
CELLS = 256
SLICE = 4
PROMPTS = ["The capital of France is", "One, two, three,", "Hello", "A B C D E F G H",
           "Once upon a time there was", "Write a haiku", "1 2 3 4 5 6 7 8 9 10", "Why"]


def _reference(prompts: list[str], max_tokens: int) -> list[list[int]]:
    """Greedy tokens of the static ``hf`` engine in one pass."""
    from sclsd.tokenizer import load
    from worker.engines import create_engine

    tok = load("tiny-random")
    engine = create_engine("hf", "tiny-random")
    rows = [P.BatchRequest(rid=str(i), token_ids=tok.encode(p), max_new_tokens=max_tokens,
                           temperature=0.0, ignore_eos=True) for i, p in enumerate(prompts)]
    outs, _ = engine.serve(P.BatchMsg(batch_id=1, slice_len=1024, requests=rows))
    return [o.token_ids for o in outs]


async def _complete_all(sock: str, prompts: list[str], max_tokens: int) -> list[P.Done]:
    async with AsyncClient(sock) as c:
        return list(await asyncio.gather(*(
            c.complete(prompt=p, max_tokens=max_tokens, temperature=0.0, ignore_eos=True) for p in prompts)))


@pytest.mark.parametrize("policy", ["scls-cb", "scls"])
def test_llama_workers_serve_hfs_tokens_in_slices_within_their_kv(tmp_path, policy: str) -> None:
    d = start_daemon(tmp_path, engine="llama", model="tiny-random", workers=2, policy=policy,
                     slice_len=SLICE, ready_timeout=300, worker_opts={"context_tokens": CELLS})
    try:
        done = asyncio.run(_complete_all(d.sock, PROMPTS * 2, 13))
        want = _reference(PROMPTS * 2, 13)
        for got, ids in zip(done, want, strict=True):
            assert got.finish_reason == "length" and got.timings.slices >= 4  # ceil(13 / 4) slices
            assert got.token_ids == ids
        st = d.status()
        assert st.policy == policy and {w.engine for w in st.workers} == {"llama"}
        c = st.counters
        assert c.get("preemptions", 0) == 0
        if policy == "scls-cb":
            # The memory predicate bound what ran: the engines never held more than it allowed.
            assert 0 < c["kv_peak_tokens"] <= int(0.9 * CELLS)
        assert c["reused_tokens"] > 0  # slices resumed the KV their predecessors kept
    finally:
        assert d.stop() == 0, d.log_text()
