"""The checks of ``sclsd-bench chaos`` catch what they are there for: a duplicate terminal
event, a duplicated delta, wrong tokens, a request never ended, a ``cancelled`` end nobody
asked for or whose tokens are not a prefix of the reference (the run itself:
``tests/integration/test_chaos.py``)."""

from __future__ import annotations

import asyncio
import random

import msgspec
import pytest

from sclsd import protocol as P
from sclsd.bench.chaos import ChaosClient, Workload, _Req
from sclsd.bench.chaos_checks import (
    TIES,
    Finished,
    LlamaReference,
    Tally,
    Tolerance,
    check_prompt,
    check_tokens,
    pick_margin,
    reference_tokens,
)


class _Sink:
    def __init__(self) -> None:
        self.frames: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.frames.append(data)


def _done(rid: str, n: int, token_ids: list[int] | None = None, reason: str = "length") -> P.Done:
    return P.Done(id=rid, finish_reason=reason,  # type: ignore[arg-type]
                  usage=P.Usage(prompt_tokens=3, completion_tokens=n),
                  timings=P.Timings(queued_s=0.0, e2e_s=0.1, ttft_s=0.05, slices=1), token_ids=token_ids)


def test_the_checks_count_duplicates_wrong_tokens_and_lost_requests() -> None:
    async def main() -> tuple[Tally, ChaosClient]:
        tally = Tally()
        c = ChaosClient("t", asyncio.StreamReader(), _Sink(), tally, 8, random.Random(1))  # type: ignore[arg-type]
        loop = asyncio.get_running_loop()
        specs = {rid: P.Generate(id=rid, prompt_ids=[5, 6, 7], max_tokens=6, temperature=0.0, ignore_eos=True,
                                 stream=stream)
                 for rid, stream in (("ok", True), ("dup", True), ("bad", True), ("whole", False), ("lost", True))}
        for rid, spec in specs.items():
            c.inflight[rid] = _Req(spec, loop.time())
            await c.slots.acquire()
        ref = reference_tokens([5, 6, 7], 6, True)
        for rid in specs:
            c._event(P.Accepted(id=rid, prompt_tokens=3))
        c._event(P.Delta(id="ok", token_ids=ref[:4], text=""))
        c._event(P.Delta(id="ok", token_ids=ref[4:], text=""))
        c._event(_done("ok", 6))
        c._event(P.Delta(id="dup", token_ids=ref, text=""))
        c._event(_done("dup", 6))
        c._event(_done("dup", 6))  # a second terminal event
        c._event(P.Delta(id="dup", token_ids=ref[:1], text=""))  # a delta after it
        c._event(P.Delta(id="bad", token_ids=ref[:3] + ref[2:5], text=""))  # a slice's tokens twice
        c._event(_done("bad", 6))
        c._event(_done("whole", 6, token_ids=ref))
        c._event(P.Error(code="bad_frame", message="?"))  # no request's
        return tally, c

    tally, c = asyncio.run(main())
    check_tokens(tally, [reference_tokens(list(f.spec.prompt_ids or ()), 6, True) for f in tally.finished])
    assert (tally.done, tally.duplicated, tally.wrong, tally.unexpected) == (4, 2, 1, 1), tally
    assert list(c.inflight) == ["lost"]


def test_a_cancel_is_sent_when_due_and_a_cancelled_end_must_be_asked_for_and_a_prefix() -> None:
    async def main() -> tuple[Tally, ChaosClient, _Sink]:
        tally = Tally()
        sink = _Sink()
        c = ChaosClient("t", asyncio.StreamReader(), sink, tally, 8, random.Random(1),  # type: ignore[arg-type]
                        Workload(cancels=1.0))
        loop = asyncio.get_running_loop()
        after = {"asked": 2, "short": 2, "unasked": 0, "wrongcut": 2, "whole": 1, "raced": 6}
        for rid, n in after.items():
            spec = P.Generate(id=rid, prompt_ids=[5, 6, 7], max_tokens=6, temperature=0.0, ignore_eos=True,
                              stream=rid != "whole")
            c.inflight[rid] = _Req(spec, loop.time(), cancel_after=n)
            await c.slots.acquire()
            c._event(P.Accepted(id=rid, prompt_tokens=3))
        ref = reference_tokens([5, 6, 7], 6, True)
        assert [r for r in after if c.inflight[r].cancel_sent] == ["whole"]  # not streamed: cancelled at once
        c._event(P.Delta(id="asked", token_ids=ref[:1], text=""))
        assert not c.inflight["asked"].cancel_sent  # one token of the two it waits for
        c._event(P.Delta(id="asked", token_ids=ref[1:3], text=""))
        assert c.inflight["asked"].cancel_sent
        c._event(_done("asked", 3, reason="cancelled"))
        c._event(P.Delta(id="short", token_ids=ref[:2], text=""))
        c._event(_done("short", 6, reason="cancelled"))  # counted 6, streamed 2
        c._event(P.Delta(id="unasked", token_ids=ref[:2], text=""))
        c._event(_done("unasked", 2, reason="cancelled"))  # the client never cancelled it
        c._event(P.Delta(id="wrongcut", token_ids=[ref[0], ref[2]], text=""))
        c._event(_done("wrongcut", 2, reason="cancelled"))
        c._event(_done("whole", 0, token_ids=[], reason="cancelled"))
        # A cancel sent while the request's own end was on its way: the daemon's unknown_id
        # answers it, once; after a cancelled end, none may come.
        c._event(P.Delta(id="raced", token_ids=ref, text=""))
        c._event(_done("raced", 6))
        late = P.Error(code="unknown_id", message="no live request", id="raced")
        c._event(late)
        c._event(late)
        c._event(P.Error(code="unknown_id", message="no live request", id="asked"))
        return tally, c, sink

    tally, c, sink = asyncio.run(main())
    assert len(sink.frames) == 5  # the cancels of asked, short, wrongcut, whole and raced
    check_tokens(tally, [reference_tokens([5, 6, 7], 6, True)] * len(tally.finished))
    assert (tally.done, tally.cancelled, tally.wrong) == (6, 5, 3), tally
    assert (tally.late_cancels, tally.duplicated) == (1, 2), tally
    wrong = [p.split(" ")[0] for p in tally.examples if not p.startswith("Error")]
    assert sorted(wrong) == ["short", "unasked", "wrongcut"], tally.examples


def test_a_difference_at_a_near_tie_is_counted_apart_and_any_other_is_wrong() -> None:
    spec = P.Generate(id="s", prompt_ids=[5, 6, 7], max_tokens=4, temperature=0.8, seed=3)
    want = [10, 11, 12, 13]
    tally = Tally(finished=[
        Finished(spec, True, [10, 11, 99, 98], 4, "length", False),  # differs at 2, a near tie there
        Finished(spec, True, [10, 99, 98, 97], 4, "length", False),  # differs at 1, a clear pick there
        Finished(spec, True, [10, 11, 99, 98], 3, "length", False),  # miscounted: wrong whatever the pick
    ])
    asked: list[int] = []

    def margin(f: Finished, first: int) -> float:
        asked.append(first)
        return TIES.draw / 10 if first == 2 else 0.3

    check_tokens(tally, [want] * 3, margin)
    assert (tally.near_ties, tally.wrong) == (1, 2), tally
    assert asked == [2, 1]  # the miscounted one is wrong without asking
    assert "first difference at token 2" in tally.ties[0] and "1.0e-05 from the reference's" in tally.ties[0]


def test_the_prompt_logprobs_check_wants_them_once_for_every_prompt_token() -> None:
    def lps(ids: list[int], k: int = 2, lp: float = -1.0) -> list[P.TokenLogprobs]:
        return [P.TokenLogprobs(P.Logprob(i, lp), [P.Logprob(i, lp), P.Logprob(7, lp - 1)][:k]) for i in ids]

    asked = P.Generate(id="a", prompt_ids=[5, 6, 7], prompt_logprobs=2)
    plain = P.Generate(id="p", prompt_ids=[5, 6, 7])
    one = P.Generate(id="o", prompt_ids=[5], prompt_logprobs=2)
    right = [(asked, [lps([6, 7])], "length"), (asked, [], "cancelled"), (asked, [lps([6, 7])], "cancelled"),
             (plain, [], "stop"), (one, [], "length")]
    wrong = [(asked, [], "length"),  # never came
             (asked, [lps([6, 7]), lps([6, 7])], "length"),  # twice (a retried first slice's too)
             (asked, [lps([5, 6])], "length"),  # shifted by one
             (asked, [lps([6])], "stop"),  # a token short
             (asked, [lps([6, 7], k=1)], "length"),  # fewer alternatives than asked
             (asked, [lps([6, 7], lp=0.5)], "length"),
             (plain, [lps([6, 7])], "length")]  # not asked
    for spec, got, reason in right:
        t = Tally()
        check_prompt(t, spec, got, reason)
        assert t.prompt_wrong == 0, (spec.id, got, reason)
    for spec, got, reason in wrong:
        t = Tally()
        check_prompt(t, spec, got, reason)
        assert t.prompt_wrong == 1 and t.examples, (spec.id, got, reason)


def test_a_pick_is_measured_by_how_far_it_is_from_the_references() -> None:
    """Greedy: how much less likely than the most likely token; seeded: how far the draw lies
    from the picked token's span of the cumulative distribution. A token next to the right one
    is near, any other far, however close the right pick was to its neighbours."""
    import math

    import torch

    from worker.engines.sampling import uniform

    logp = torch.tensor([math.log(0.5), math.log(0.3), math.log(0.1) - 1e-5, math.log(0.1)])
    x = logp.view(1, -1)
    greedy = P.Generate(id="g", prompt_ids=[1], temperature=0.0)
    assert pick_margin(x, greedy, 0, 0) == 0.0
    assert pick_margin(x, greedy, 0, 1) == pytest.approx(math.log(0.5 / 0.3))
    # Token 2 is within 1e-5 of token 3, but the right pick is token 0: far.
    assert not TIES.near(greedy, pick_margin(x, greedy, 0, 2))
    seeded = P.Generate(id="s", prompt_ids=[1], temperature=1.0, seed=11)
    u = uniform(11, 4)
    probs = torch.softmax(x[0], -1, dtype=torch.float64)
    cdf = probs.cumsum(-1)
    drawn = int(torch.searchsorted(cdf, torch.tensor([u], dtype=torch.float64), right=True))
    assert pick_margin(x, seeded, 4, drawn) == 0.0
    for tok in range(4):
        lo = float(cdf[tok - 1]) if tok else 0.0
        want = max(0.0, lo - u, u - float(cdf[tok]))
        assert pick_margin(x, seeded, 4, tok) == pytest.approx(want)
    # With a nucleus, a token at its edge may be in one engine's and not in the other's: near.
    nucleus = P.Generate(id="n", prompt_ids=[1], temperature=1.0, seed=11, top_p=0.8 + 1e-4)
    assert pick_margin(x, nucleus, 4, 2) == pytest.approx(1e-4, abs=2e-6)  # outside the nucleus here
    bounds = Tolerance(greedy_nats=0.5, draw=0.01)
    assert bounds.near(greedy, 0.4) and not bounds.near(seeded, 0.4) and bounds.near(seeded, 0.01)


def test_llamas_reference_logits_are_those_its_one_pass_picks_from() -> None:
    pytest.importorskip("ik_llama_cpp")
    ref = LlamaReference()
    try:
        prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646]
        spec = P.Generate(id="r", prompt_ids=prompt, max_tokens=6, temperature=0.0, ignore_eos=True)
        (toks,) = ref.tokens([spec])
        assert len(toks) == 6
        for i, tok in enumerate(toks):
            x = ref.logits([*prompt, *toks[:i]])
            assert int(x.argmax()) == tok and pick_margin(x, spec, i, tok) == 0.0
        # With a grammar: the pass follows it, and a pick is measured among the tokens it allows.
        from sclsd import models
        from sclsd.bench.chaos import GRAMMARS

        words = msgspec.structs.replace(spec, structured=GRAMMARS[0], max_tokens=8)
        (toks,) = ref.tokens([words])
        text = models.load_tokenizer("tiny-random").decode(toks)
        assert text.strip() and set(text) <= set("abcdefghijklmnopqrstuvwxyz "), text
        digit = models.load_tokenizer("tiny-random").encode("7", add_special_tokens=False)[0]
        for i, tok in enumerate(toks):
            assert ref.margin(words, [*prompt, *toks[:i]], i, tok) == 0.0
            assert ref.margin(words, [*prompt, *toks[:i]], i, digit) == float("inf")
    finally:
        ref.close()


def test_make_bench_runs_chaos_on_fake_and_llama_workers() -> None:
    from sclsd.bench import all as bench_all
    from sclsd.bench.chaos import ENGINES

    assert bench_all.STEPS["chaos"][:2] == ["sclsd.bench.cli", "chaos"]
    llama = bench_all.STEPS["chaos-llama"]
    assert llama[:2] == ["sclsd.bench.cli", "chaos"] and llama[llama.index("--engine") + 1] == "llama" in ENGINES


def test_engine_options_reach_the_workers_config_and_bad_ones_are_refused(tmp_path, capsys) -> None:
    import argparse

    from sclsd.bench import chaos

    assert [chaos.option(o) for o in ("share_prefixes=true", "max_rows = 8", "kv_host_bytes=0.5", "x=a b")] == [
        ("share_prefixes", True), ("max_rows", 8), ("kv_host_bytes", 0.5), ("x", "a b")]
    work = Workload(engine="llama", options=(("share_prefixes", True),))
    assert chaos.sections(2, 0.0, tmp_path / "p.json", work=work)["workers"]["options"] == {"share_prefixes": True}
    assert "options" not in chaos.sections(2, 0.0, tmp_path / "p.json", work=Workload(engine="llama"))["workers"]
    p = argparse.ArgumentParser()
    chaos.add_arguments(p)
    for argv, why in ((["--engine", "llama", "--option", "share_prefixes"], "must be KEY=VALUE"),
                      (["--option", "decode_s=1"], "for the real engines")):
        assert chaos.run(p.parse_args(argv)) == 2
        assert why in capsys.readouterr().err


def test_requests_take_the_common_prefixes_and_grammars_in_their_shares() -> None:
    from sclsd.bench.chaos import GRAMMARS, PREFIXES

    async def specs(work: Workload) -> list[P.Generate]:
        c = ChaosClient("t", asyncio.StreamReader(), _Sink(), Tally(), 8, random.Random(2), work)  # type: ignore[arg-type]
        return [c._next()[0] for _ in range(400)]

    def begins(s: P.Generate) -> bool:
        return any(tuple(s.prompt_ids or ())[:40] == p for p in PREFIXES)

    every = asyncio.run(specs(Workload(engine="llama", common=1.0, structured=1.0)))
    assert all(begins(s) and s.structured in GRAMMARS and not s.ignore_eos for s in every)
    assert {s.structured.kind for s in every if s.structured} == {g.kind for g in GRAMMARS}
    some = asyncio.run(specs(Workload(engine="llama", common=0.3, structured=0.1)))
    assert 0.2 < sum(map(begins, some)) / 400 < 0.4 and 0.05 < sum(s.structured is not None for s in some) / 400 < 0.15
    fake = asyncio.run(specs(Workload(engine="fake", common=0.3, structured=1.0)))
    assert not any(s.structured for s in fake)  # the fake engine enforces no grammar
