"""Daemon + hf workers on the tiny random Llama, end to end through the Unix socket."""

from __future__ import annotations

import asyncio

import pytest

from sclsd.client import AsyncClient, Client, Delta, Done

from .harness import start_daemon


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    d = start_daemon(tmp_path_factory.mktemp("hf"), engine="hf", model="tiny-random", workers=2,
                     slice_len=4, ready_timeout=180)
    yield d
    assert d.stop() == 0, d.log_text()


def test_sliced_greedy_equals_one_pass_through_the_daemon(daemon) -> None:
    """Served in slices of 4 (re-prefill of prompt + generated ids) or in one pass of 1024."""
    from sclsd import protocol as P
    from sclsd.tokenizer import load
    from worker.engines import create_engine

    tok = load("tiny-random")
    prompts = ["The capital of France is", "One, two, three,", "Hello"]
    with Client(daemon.sock, timeout=120) as c:
        served = [c.complete(prompt=p, max_tokens=13, temperature=0.0, ignore_eos=True) for p in prompts]
    engine = create_engine("hf", "tiny-random")
    rows = [P.BatchRequest(rid=str(i), token_ids=tok.encode(p), max_new_tokens=13, temperature=0.0,
                           ignore_eos=True) for i, p in enumerate(prompts)]
    outs, _ = engine.serve(P.BatchMsg(batch_id=1, slice_len=1024, requests=rows))
    for d, out in zip(served, outs, strict=True):
        assert d.finish_reason == "length"
        assert d.timings.slices == 4  # ceil(13 / 4)
        assert d.token_ids == out.token_ids
        assert d.text == tok.decode(out.token_ids)


def test_streaming_chat_and_seeded_sampling(daemon) -> None:
    async def run() -> tuple[list[str], Done, Done, Done]:
        async with AsyncClient(daemon.sock) as c:
            texts, done = [], None
            async for ev in c.stream(messages=[{"role": "user", "content": "Hi there"}], max_tokens=10,
                                     temperature=0.0, ignore_eos=True):
                if isinstance(ev, Delta):
                    texts.append(ev.text)
                elif isinstance(ev, Done):
                    done = ev
            a, b = await asyncio.gather(
                c.complete(prompt="Once upon a time", max_tokens=9, temperature=1.0, seed=1234, ignore_eos=True),
                c.complete(prompt="Once upon a time", max_tokens=9, temperature=1.0, seed=1234, ignore_eos=True),
            )
            assert done is not None
            return texts, done, a, b

    texts, done, a, b = asyncio.run(run())
    assert done.usage.completion_tokens == 10 and done.timings.slices == 3
    assert done.timings.ttft_s is not None and done.timings.ttft_s <= done.timings.e2e_s
    assert a.token_ids == b.token_ids  # same seed, same output, whichever batch each landed in


def test_status_shows_hf_workers_and_estimates(daemon) -> None:
    st = daemon.status()
    assert {w.engine for w in st.workers} == {"hf"}
    assert st.estimator_error.batches > 0
    assert sum(w.tokens_done for w in st.workers) > 0
