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
        if policy == "scls-cb":
            _prompt_logprobs_come_back(d.sock)
    finally:
        assert d.stop() == 0, d.log_text()


def _prompt_logprobs_come_back(sock: str) -> None:
    """A request's prompt log-probabilities, computed by a worker process in its prefill,
    reach the client once: with a streaming request's first delta, a plain one's done."""
    from sclsd import protocol as P
    from sclsd.client import Client, Delta, Done

    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365] * 4  # chunked on a capped CPU
    with Client(sock) as c:
        (done,) = [e for e in c.generate(prompt_ids=prompt, max_tokens=9, temperature=0, ignore_eos=True,
                                         stream=False, prompt_logprobs=2) if isinstance(e, Done)]
        events = list(c.generate(prompt_ids=prompt, max_tokens=9, temperature=0, ignore_eos=True,
                                 stream=True, prompt_logprobs=2))
    plps = done.prompt_logprobs
    assert plps is not None and [e.chosen.id for e in plps] == prompt[1:]
    assert all(len(e.top) == 2 and e.top[0].logprob >= e.top[1].logprob for e in plps)
    assert all(e.chosen.logprob <= e.top[0].logprob <= 0 for e in plps)
    assert {e.chosen.token for e in plps if e.chosen.id == 9690} == {"system"}  # with its text
    deltas = [e for e in events if isinstance(e, Delta)]
    carried = [d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None]
    assert len(carried) == 1 and [e.chosen.id for e in carried[0]] == prompt[1:]
    # The same values as the first request's, but for the library's batching (cells, neighbours).
    assert max(abs(a.chosen.logprob - b.chosen.logprob) for a, b in zip(carried[0], plps, strict=True)) < 1e-3
    assert isinstance(events[-1], P.Done) and events[-1].prompt_logprobs is None
