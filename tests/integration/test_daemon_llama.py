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

from .harness import complete_all, hf_reference, start_daemon

pytest.importorskip("ik_llama_cpp")

#: tiny-random in llama's fp16 cache: 256 bytes per token; 256 cells per worker.
CELLS = 256
SLICE = 4
PROMPTS = ["The capital of France is", "One, two, three,", "Hello", "A B C D E F G H",
           "Once upon a time there was", "Write a haiku", "1 2 3 4 5 6 7 8 9 10", "Why"]


@pytest.mark.parametrize("policy", ["scls-cb", "scls"])
def test_llama_workers_serve_hfs_tokens_in_slices_within_their_kv(tmp_path, policy: str) -> None:
    d = start_daemon(tmp_path, engine="llama", model="tiny-random", workers=2, policy=policy,
                     slice_len=SLICE, ready_timeout=300, worker_opts={"context_tokens": CELLS})
    try:
        done = asyncio.run(complete_all(d.sock, PROMPTS * 2, 13))
        want = hf_reference(PROMPTS * 2, 13)
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
