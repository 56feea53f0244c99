"""``policy = "scls-cb"``: the daemon hands slice grants to real ``hf-cb`` and ``hf-static-cb``
worker processes (tiny random Llama), end to end through the Unix socket.

The workers' KV budget is made small (``mem_budget_bytes``) so that the grant policy's
memory predicate, not the load, limits what runs: the engines' own report of the most KV
they ever held, and of preemptions, shows the reservation was never exceeded.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from sclsd import protocol as P
from sclsd.client import AsyncClient

from .harness import complete_all, hf_reference, start_daemon
from .opshelp import wait_for, workers_by_id

#: tiny-random: Δ = 512 bytes per token (fp32); 160 tokens of KV per worker, of which the
#: grants may reserve ζ = 0.9 of it: 144.
KV_TOKENS = 160
DELTA = 512
SLICE = 4
PROMPTS = ["The capital of France is", "One, two, three,", "Hello", "A B C D E F G H",
           "Once upon a time there was", "Write a haiku", "1 2 3 4 5 6 7 8 9 10", "Why"]


#: The grant engines, each with KV memory of KV_TOKENS for its grants: hf-cb's paged cache is
#: its memory budget; hf-static-cb's arena takes all of it (static_share 1) and its kept KV
#: gets as much again beside it (the daemon counts kept KV within M_ava).
ENGINES = {"hf-cb": {}, "hf-static-cb": {"static_share": 1.0, "kv_retain_bytes": KV_TOKENS * DELTA}}


@pytest.fixture(scope="module", params=sorted(ENGINES))
def daemon(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    engine = request.param
    d = start_daemon(tmp_path_factory.mktemp(engine), engine=engine, model="tiny-random", workers=2,
                     policy="scls-cb", slice_len=SLICE, ready_timeout=180, worker_opts=ENGINES[engine],
                     workers_cfg={"mem_budget_bytes": KV_TOKENS * DELTA})
    d.engine = engine
    yield d
    assert d.stop() == 0, d.log_text()


def test_grants_give_the_hf_engines_tokens_and_never_overcommit_kv(daemon) -> None:
    done = asyncio.run(complete_all(daemon.sock, PROMPTS * 2, 13))
    want = hf_reference(PROMPTS * 2, 13)
    for d, ids in zip(done, want, strict=True):
        assert d.finish_reason == "length"
        assert d.timings.slices == 4  # ceil(13 / 4) grants
        assert d.token_ids == ids
    st = daemon.status()
    assert st.policy == "scls-cb" and {w.engine for w in st.workers} == {daemon.engine}
    c = st.counters
    assert c["grants"] >= 4 * len(done)
    assert c.get("preemptions", 0) == 0
    budget = int(0.9 * KV_TOKENS)
    # 16 requests of up to ~27 tokens each: about 430 tokens wanted at once, 2 x 144 allowed.
    # The memory predicate bound what ran, and the engines never held more than it allowed.
    assert budget // 2 < c["kv_peak_tokens"] <= budget
    assert c["reused_tokens"] > 0  # grants resumed the KV their predecessors kept


def test_structured_output_min_tokens_and_logit_bias_across_grants(daemon) -> None:
    """Served by the grant engines, not refused: each grant resumes the request's grammar state."""
    import json

    pytest.importorskip("llguidance")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False}

    async def run() -> list[P.Done]:
        async with AsyncClient(daemon.sock) as c:
            return list(await asyncio.gather(
                c.complete(prompt="Answer in JSON:", max_tokens=40, temperature=0.0,
                           structured=P.Structured(kind="json_schema", value=json.dumps(schema))),
                c.complete(prompt="Yes or no?", max_tokens=10, temperature=0.0,
                           structured=P.Structured(kind="choice", value='["yes", "no", "maybe"]')),
                c.complete(prompt="Hello", max_tokens=12, temperature=0.0, min_tokens=9,
                           logit_bias={2: 100.0}),  # EOS heavily favoured: held back for 9 tokens
                c.complete(prompt="Hello", max_tokens=12, temperature=0.0, logit_bias={77: 100.0})))

    js, choice, held, forced = asyncio.run(run())
    assert js.finish_reason == "stop" and js.timings.slices > 1
    value = json.loads(js.text)
    assert set(value) == {"ok", "n"} and value["n"] in (1, 2, 3)
    assert choice.finish_reason == "stop" and choice.text in ("yes", "no", "maybe")
    assert held.finish_reason == "stop" and len(held.token_ids) == 10 and held.timings.slices == 3
    assert forced.token_ids == [77] * 12


def test_logprobs_and_seeds_across_grants(daemon) -> None:
    """The grant engines return log-probabilities over every grant, and a seed gives the same
    text twice (the grants' draws depend on the seed and the position only)."""
    # top_k: the two seeded rows may step in different batches, whose float noise can move a
    # draw over the whole vocabulary to a neighbouring id (test_hf_cb_logprobs' penalties).
    seeded = dict(prompt="Once upon a time there was", max_tokens=10, temperature=0.9, top_k=50, ignore_eos=True)

    async def run() -> list[P.Done]:
        async with AsyncClient(daemon.sock) as c:
            return list(await asyncio.gather(
                c.complete(prompt="The capital of France is", max_tokens=10, temperature=0.0,
                           ignore_eos=True, logprobs=True, top_logprobs=2),
                c.complete(**seeded, seed=11), c.complete(**seeded, seed=11), c.complete(**seeded, seed=12)))

    lp, first, again, other = asyncio.run(run())
    assert lp.timings.slices == 3 and lp.token_ids == hf_reference(["The capital of France is"], 10)[0]
    assert lp.logprobs is not None and len(lp.logprobs) == 10
    for e, tok in zip(lp.logprobs, lp.token_ids, strict=True):
        assert e.chosen.id == tok and len(e.top) == 2 and e.top[0].id == tok  # greedy: the likeliest
        assert e.top[0].logprob >= e.top[1].logprob and e.chosen.logprob < 0
    assert first.timings.slices == 3 and len(first.token_ids) == 10
    assert again.token_ids == first.token_ids and again.text == first.text
    assert other.token_ids != first.token_ids


def test_a_worker_killed_during_grants_loses_no_request(daemon) -> None:
    want = hf_reference(PROMPTS, 40)

    async def run() -> list[P.Done]:
        task = asyncio.ensure_future(complete_all(daemon.sock, PROMPTS, 40))
        w = await asyncio.to_thread(
            wait_for, lambda: (x := workers_by_id(daemon).get("w0")) and x.batches_inflight > 0 and x,
            60, "w0 busy", daemon)
        os.kill(w.pid, signal.SIGKILL)
        return await task

    done = asyncio.run(run())
    for d, ids in zip(done, want, strict=True):
        assert isinstance(d, P.Done) and d.finish_reason == "length"
        assert d.token_ids == ids  # the lost grant's tokens were dropped, not duplicated
