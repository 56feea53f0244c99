"""``prompt_logprobs`` from ``generate`` to the engine and back: asked of a request's first
slice only, delivered once (the first delta of a streaming request, else ``done``), with
each token's text; refused by name where the workers' engines do not compute them."""

from __future__ import annotations

from typing import Any

import pytest

from sclsd import protocol as P
from sclsd.tokenizer import ByteTokenizer
from worker.engines.fake import FakeEngine

from .conftest import Harness, RecConn

PROMPT = [5, 6, 7, 70, 71, 72, 100]


@pytest.mark.parametrize("policy", ["scls", "scls-cb"])
def test_the_prompts_logprobs_come_once_with_their_texts(daemon, policy: str) -> None:
    continuous = policy == "scls-cb"

    async def body(h: Harness) -> None:
        w = h.transport.connect("w0", FakeEngine(decode_s=0.0, batching="continuous" if continuous else "static"),
                                auth=h.server.fleet.secret or "")
        await h.registered("w0")
        conn = RecConn()
        # 20 tokens: three slices of 8, so the request's later rows must not ask again.
        await h.submit(conn, id="a", prompt_ids=PROMPT, max_tokens=20, ignore_eos=True, prompt_logprobs=3)
        await h.submit(conn, id="s", prompt_ids=PROMPT, max_tokens=20, ignore_eos=True, prompt_logprobs=0,
                       logprobs=True, stream=True)
        await h.submit(conn, id="plain", prompt_ids=PROMPT, max_tokens=4, ignore_eos=True)
        await h.finished(conn, "a", "s", "plain")
        tok = ByteTokenizer()
        (done,) = conn.terminal("a")
        assert done.timings.slices == 3
        plps = done.prompt_logprobs
        assert plps is not None and [e.chosen.id for e in plps] == PROMPT[1:]
        assert all(e.chosen.token == tok.decode([e.chosen.id]) for e in plps)
        assert all(len(e.top) == 3 and e.top[0].id == e.chosen.id for e in plps)  # the fake's likeliest
        assert all(t.token == tok.decode([t.id]) for e in plps for t in e.top)
        deltas = conn.events("s", P.Delta)
        carried = [d for d in deltas if d.prompt_logprobs is not None]
        assert carried == [deltas[0]]
        assert [e.chosen.id for e in carried[0].prompt_logprobs or []] == PROMPT[1:]
        assert all(e.top == [] for e in carried[0].prompt_logprobs or [])
        assert len([e for d in deltas for e in d.logprobs or []]) == 20
        (sdone,) = conn.terminal("s")
        assert sdone.prompt_logprobs is None
        (plain,) = conn.terminal("plain")
        assert plain.prompt_logprobs is None and b"prompt_logprobs" not in P.encode(plain)
        # Only each request's first row asked for them (a worker computes them in its prefill).
        rows = [r for b in w.served for r in b.requests]
        asked = [(r.rid, r.generated) for r in rows if r.prompt_logprobs is not None]
        assert len(asked) == 2 and all(g == 0 for _, g in asked), asked
        later = [r for b in w.served for r in b.requests if r.generated > 0] + [c for b in w.served for c in b.cont]
        assert later  # the requests did come back for more slices

    sections: dict[str, Any] = {"scheduler": {"policy": "scls-cb", "slice_len": 8}} if continuous else {}
    daemon(body, **sections)


def test_workers_that_do_not_compute_them_refuse_it_by_name(daemon) -> None:
    async def body(h: Harness) -> None:
        conn = RecConn()
        w = h.transport.connect("w0", FakeEngine(decode_s=0.0), auth=h.server.fleet.secret or "", register=False)
        w.register(caps=P.EngineCaps())  # an engine that does not say it computes them
        await h.registered("w0")
        await h.submit(conn, id="p", prompt_ids=PROMPT, max_tokens=4, prompt_logprobs=1)
        await h.submit(conn, id="ok", prompt_ids=PROMPT, max_tokens=4)
        await h.finished(conn, "p", "ok")
        (err,) = conn.terminal("p")
        assert isinstance(err, P.Error) and err.code == "bad_request"
        assert err.message.startswith("prompt_logprobs: ") and "do not compute" in err.message
        assert isinstance(conn.terminal("ok")[0], P.Done)

    daemon(body)


def test_a_result_leaves_out_what_the_tokens_parts_carried() -> None:
    from worker.serve import result_rows

    lps = [P.TokenLogprobs(P.Logprob(6, -1.0))]
    out = P.RequestOutput(rid="r", token_ids=[1, 2, 3], prompt_logprobs=lps)
    assert result_rows([out], {"r": 0})[0].prompt_logprobs == lps  # nothing streamed: the result carries them
    (rest,) = result_rows([out], {"r": 2})
    assert rest.token_ids == [3] and rest.prompt_logprobs == []


def test_the_worker_stream_keeps_them_on_the_rows_first_part() -> None:
    from worker.serve import TokenStream

    sent: list[P.Tokens] = []
    clock = [0.0]
    ts = TokenStream(lambda b: sent.append(P.worker_decoder.decode(b)), "w0", interval=1.0, clock=lambda: clock[0])
    lps = [P.TokenLogprobs(P.Logprob(6, -1.0)), P.TokenLogprobs(P.Logprob(7, -2.0))]
    ts(1, [P.RequestOutput(rid="r", token_ids=[1], prompt_logprobs=lps)])  # a batch's first: at once
    ts(1, [P.RequestOutput(rid="r", token_ids=[2])])
    ts(1, [P.RequestOutput(rid="q", token_ids=[5], prompt_logprobs=lps[:1])])  # pending, with r's next
    ts(1, [P.RequestOutput(rid="r", token_ids=[3])])
    clock[0] = 2.0
    ts.flush(clock[0])
    first, second = (m.batches[0].outputs for m in sent)
    assert first[0].prompt_logprobs == lps
    by = {o.rid: o for o in second}
    assert by["r"].token_ids == [2, 3] and by["r"].prompt_logprobs == [] and by["q"].prompt_logprobs == lps[:1]
