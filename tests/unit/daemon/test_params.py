"""The parameters OpenAI-style clients send, from ``generate`` to the engine and back:
logprobs, penalties, min-p, stop strings across slices, the max_tokens limit, chat
templates, ``user``."""

from __future__ import annotations

import logging
import math
import random
from typing import Any

import pytest

from sclsd import protocol as P
from sclsd.daemon.serving.output import kept_tokens
from sclsd.tokenizer import ByteTokenizer
from worker.engines.fake import FakeEngine

from .conftest import Harness, RecConn, held

SLICE = 8  # conftest's scheduler.slice_len


def reference(prompt: list[int], n: int) -> list[int]:
    """The fake engine's greedy tokens for ``prompt`` (the same in slices or in one pass)."""
    outs, _ = FakeEngine().serve(P.BatchMsg(batch_id=1, slice_len=n, requests=[P.BatchRequest(
        rid="r", token_ids=list(prompt), max_new_tokens=n, temperature=0.0, ignore_eos=True)]))
    return outs[0].token_ids


def first_hit(ids: list[int], stop: str) -> int:
    """Smallest k with ``stop`` in the text of ``ids[:k]`` (the definition, by brute force)."""
    tok = ByteTokenizer()
    return next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k]))


def straddling_stop() -> tuple[list[int], list[int], str]:
    """A prompt whose output has printable ASCII at the last token of slice 1 and the first
    of slice 2, and the stop string made of those two characters (first seen there)."""
    rng = random.Random(5)
    for _ in range(2000):
        prompt = [rng.randrange(3, 256) for _ in range(6)]
        ids = reference(prompt, 3 * SLICE)
        a, b = ids[SLICE - 1] % 256, ids[SLICE] % 256
        if 32 < a < 127 and 32 < b < 127:
            stop = chr(a) + chr(b)
            if first_hit(ids, stop) == SLICE + 1:
                return prompt, ids, stop
    raise AssertionError("no prompt found")  # pragma: no cover


# ---------------------------------------------------------------------- daemon


def test_logprobs_come_with_every_token_and_its_text(daemon) -> None:
    async def body(h: Harness) -> None:
        h.worker("w0")
        await h.registered("w0")
        conn = RecConn()
        await h.submit(conn, id="a", prompt_ids=[5, 6, 7], max_tokens=20, ignore_eos=True,
                       logprobs=True, top_logprobs=3)
        await h.submit(conn, id="s", prompt_ids=[5, 6, 7], max_tokens=20, ignore_eos=True,
                       logprobs=True, top_logprobs=2, stream=True)
        await h.submit(conn, id="plain", prompt_ids=[5, 6, 7], max_tokens=20, ignore_eos=True)
        await h.finished(conn, "a", "s", "plain")
        (done,) = conn.terminal("a")
        assert done.usage.completion_tokens == 20 and len(done.logprobs) == 20
        tok = ByteTokenizer()
        for tid, e in zip(done.token_ids, done.logprobs, strict=True):
            assert e.chosen.id == tid and e.chosen.token == tok.decode([tid])
            assert len(e.top) == 3 and e.top[0].id == tid  # the fake engine's chosen is its likeliest
            assert [x.logprob for x in e.top] == sorted((x.logprob for x in e.top), reverse=True)
        deltas = conn.events("s", P.Delta)
        streamed = [e for d in deltas for e in d.logprobs or []]
        assert [e.chosen.id for e in streamed] == [t for d in deltas for t in d.token_ids]
        assert all(len(e.top) == 2 for e in streamed) and len(streamed) == 20
        # Old clients never see the new field.
        (plain,) = conn.terminal("plain")
        assert plain.logprobs is None and b"logprobs" not in P.encode(plain)

    daemon(body)


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_across_a_slice_boundary_ends_there_and_usage_counts_kept_tokens(
        daemon, stream: bool) -> None:
    prompt, ids, stop = straddling_stop()
    full = ByteTokenizer().decode(ids[: 2 * SLICE])
    text = full[: full.find(stop)]

    async def body(h: Harness) -> None:
        h.worker("w0")
        await h.registered("w0")
        conn = RecConn()
        await h.submit(conn, id="r", prompt_ids=prompt, max_tokens=3 * SLICE, ignore_eos=True,
                       stop=[stop], stream=stream, logprobs=True)
        await h.finished(conn, "r")
        (done,) = conn.terminal("r")
        assert done.finish_reason == "stop"
        # It did not end in the first slice: streamed, it ends as the stop string appears in
        # its second (cut short there, not counted); else at that slice's result.
        assert done.timings.slices == (1 if stream else 2)
        assert done.usage.completion_tokens == SLICE + 1  # up to the token completing the stop
        if stream:
            deltas = conn.events("r", P.Delta)
            assert "".join(d.text for d in deltas) == text
            assert [t for d in deltas for t in d.token_ids] == ids[: SLICE + 1]
            assert len([e for d in deltas for e in d.logprobs or []]) == SLICE + 1
        else:
            assert done.text == text and done.token_ids == ids[: SLICE + 1]
            assert len(done.logprobs) == SLICE + 1

    daemon(body)


def test_kept_tokens_matches_the_definition_for_any_known_prefix() -> None:
    tok = ByteTokenizer()
    rng = random.Random(3)
    for _ in range(200):
        ids = [rng.choice(b"abcab xyz") for _ in range(rng.randrange(1, 60))]
        stop = rng.choice(["ab", "b x", "zz", "a"])
        if stop not in tok.decode(ids):
            continue
        want = first_hit(ids, stop)
        for known in range(0, want):
            assert kept_tokens(ids, [stop], known, tok) == want
    assert kept_tokens([1, 2, 3], ["x"], 0, None) == 3  # no tokenizer: keep everything


def test_max_tokens_above_the_limit_is_refused_or_capped_as_asked(daemon) -> None:
    async def body(h: Harness) -> None:
        h.worker("w0")
        await h.registered("w0")
        conn = RecConn()
        await h.submit(conn, id="strict", max_tokens=100, cap_max_tokens=False, ignore_eos=True)
        await h.submit(conn, id="capped", max_tokens=100, ignore_eos=True)
        await h.submit(conn, id="unset", max_tokens=None, ignore_eos=True)
        await h.finished(conn, "strict", "capped", "unset")
        (err,) = conn.terminal("strict")
        assert isinstance(err, P.Error) and err.code == "bad_request"
        assert err.message.startswith("max_tokens:") and "32" in err.message
        for rid in ("capped", "unset"):
            (done,) = conn.terminal(rid)
            assert done.finish_reason == "length" and done.usage.completion_tokens == 32

    daemon(body, model={"max_gen": 32})


def test_an_open_max_tokens_gets_the_configured_default(daemon) -> None:
    """``max_tokens = null`` (what sclsd-http sends for a body without it) generates up to
    ``model.default_max_tokens``, not ``model.max_gen``; at least the request's
    ``min_tokens``; a number the client gives is still its own, lowered to the limit."""
    async def body(h: Harness) -> None:
        h.worker("w0")
        await h.registered("w0")
        conn = RecConn()
        await h.submit(conn, id="open", max_tokens=None, ignore_eos=True)
        await h.submit(conn, id="open-min", max_tokens=None, min_tokens=13, ignore_eos=True)
        await h.submit(conn, id="given", max_tokens=20, ignore_eos=True)
        await h.submit(conn, id="above", max_tokens=100, ignore_eos=True)
        await h.finished(conn, "open", "open-min", "given", "above")
        for rid, tokens in (("open", 6), ("open-min", 13), ("given", 20), ("above", 32)):
            (done,) = conn.terminal(rid)
            assert isinstance(done, P.Done), (rid, done)
            assert (done.finish_reason, done.usage.completion_tokens) == ("length", tokens), rid

    daemon(body, model={"max_gen": 32, "default_max_tokens": 6})


class _NoTemplate(ByteTokenizer):
    """A transformers-like tokenizer whose ``tok`` has no chat template."""

    class _Inner:
        chat_template = None

    tok = _Inner()


def test_chat_messages_need_a_chat_template(daemon) -> None:
    async def body(h: Harness) -> None:
        h.worker("w0")
        await h.registered("w0")
        conn = RecConn()
        msgs = [P.ChatMessage(role="user", content="hi")]
        await h.submit(conn, id="ok", messages=msgs, max_tokens=4)  # the byte tokenizer's own format
        await h.finished(conn, "ok")
        h.server.admission.tok = _NoTemplate()
        await h.submit(conn, id="no", messages=msgs, max_tokens=4)
        await h.submit(conn, id="text", prompt="hi", max_tokens=4)
        await h.finished(conn, "no", "text")
        assert isinstance(conn.terminal("ok")[0], P.Done)
        (err,) = conn.terminal("no")
        assert err.code == "bad_request" and err.message.startswith("messages:")
        assert "chat template" in err.message
        assert isinstance(conn.terminal("text")[0], P.Done)

    daemon(body)


def test_user_is_logged_with_the_request(daemon, caplog: pytest.LogCaptureFixture) -> None:
    async def body(h: Harness) -> None:
        h.worker("w0")
        await h.registered("w0")
        conn = RecConn()
        await h.submit(conn, id="u", max_tokens=4, user="alice@example")
        await h.finished(conn, "u")

    with caplog.at_level(logging.INFO, logger="sclsd"):
        daemon(body)
    assert any("done id=1:u " in r.getMessage() and "user='alice@example'" in r.getMessage()
               for r in caplog.records)


def test_batch_rows_carry_the_sampling_parameters(daemon) -> None:
    async def body(h: Harness) -> None:
        w = h.worker("w0", hold=True)
        await h.registered("w0")
        conn = RecConn()
        await h.submit(conn, id="p", max_tokens=4, temperature=0.7, min_p=0.1, presence_penalty=0.5,
                       frequency_penalty=-0.25, repetition_penalty=1.2, top_logprobs=4,
                       stop_token_ids=[9])
        await held(w)
        (row,) = w.held[0].requests
        assert (row.min_p, row.presence_penalty, row.frequency_penalty, row.repetition_penalty) == (
            0.1, 0.5, -0.25, 1.2)
        assert row.logprobs and row.top_logprobs == 4 and row.stop_token_ids == [9]
        w.release()
        await h.finished(conn, "p")

    daemon(body)


def test_min_tokens_logit_bias_and_structured_output_are_checked_and_reach_the_rows(daemon) -> None:
    async def body(h: Harness) -> None:
        conn = RecConn()
        # Before any worker registered: the configured engine (fake) decides; it has no grammars.
        await h.submit(conn, id="s0", structured=P.Structured(kind="json_object"))
        (err,) = conn.terminal("s0")
        assert err.code == "bad_request" and "do not enforce grammars" in err.message
        w = h.transport.connect("w0", FakeEngine(vocab=300, decode_s=0.0), auth=h.server.fleet.secret or "",
                                hold=True, register=False)
        w.register(caps=P.EngineCaps(grammar=True))  # as a torch engine says it
        await h.registered("w0")
        for rid, fields, why in [
            ("m", dict(min_tokens=9, max_tokens=4), "more than max_tokens"),
            ("b", dict(logit_bias={5000: 1.0}), "not below the vocabulary size"),
            ("j", dict(structured=P.Structured(kind="json_schema", value="{not json")), "json_schema"),
            ("r", dict(structured=P.Structured(kind="regex", value="[a-z")), "regex"),
        ]:
            await h.submit(conn, id=rid, **fields)
            await conn.wait_for(lambda r=rid: bool(conn.terminal(r)))  # a grammar: answered once checked
            (err,) = conn.terminal(rid)
            assert err.code == "bad_request" and why in err.message, err
        await h.submit(conn, id="ok", max_tokens=4, min_tokens=2, logit_bias={65: -100.0},
                       structured=P.Structured(kind="json_schema", value='{"type": "object"}'))
        await held(w)
        (row,) = w.held[0].requests
        assert row.min_tokens == 2 and row.logit_bias == {65: -100.0}
        assert row.grammar is not None and '"json_schema"' in row.grammar and "whitespace_flexible" in row.grammar
        w.release()

    daemon(body)


def test_the_daemon_lists_its_generate_features_in_pong(daemon) -> None:
    async def body(h: Harness) -> None:
        conn = RecConn()
        h.server.on_client(conn, P.Ping(nonce=7))
        await conn.wait_for(lambda: any(isinstance(m, P.Pong) for m in conn.sent))
        (pong,) = [m for m in conn.sent if isinstance(m, P.Pong)]
        assert pong.nonce == 7 and set(pong.features) == set(P.GENERATE_FEATURES)

    daemon(body)


# ---------------------------------------------------------------------- sampling

torch = pytest.importorskip("torch")

from worker.engines.sampling import BatchSampler, filter_logits  # noqa: E402


def sampler(rows: list[tuple[list[int], int, dict[str, Any]]], vocab: int = 5) -> BatchSampler:
    """A batch sampler over rows ``(context, generated, BatchRequest fields)``."""
    reqs = []
    for i, (ids, generated, kw) in enumerate(rows):
        kw = {"temperature": 0.0, **kw}
        reqs.append(P.BatchRequest(rid=f"r{i}", token_ids=ids, max_new_tokens=8, generated=generated, **kw))
    return BatchSampler(reqs, [1] * len(reqs), vocab, "cpu", steps=4)


def pick(s: BatchSampler, logits: Any) -> list[int]:
    return s.sample(logits).start().result(s)[0]


def test_presence_and_frequency_penalties_count_every_generated_token_across_slices() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0, 0.0]])
    # Token 1 was generated twice in earlier slices (the tail of the context); token 3 is
    # only in the prompt: the OpenAI penalties ignore the prompt.
    s = sampler([([3, 3, 1, 1], 2, dict(presence_penalty=0.5, frequency_penalty=0.4))])
    # 3.0 - (2 * 0.4 + 0.5) = 1.7 < 2.0
    assert pick(s, logits) == [2]
    s = sampler([([3, 3, 1, 1], 2, dict(presence_penalty=0.5, frequency_penalty=0.1))])
    assert pick(s, logits) == [1]  # 3.0 - 0.7 = 2.3 > 2.0
    # Tokens of this slice count too: the row picks 1 twice, then the penalty moves it.
    s = sampler([([3], 0, dict(frequency_penalty=0.6))])
    assert pick(s, logits) == [1] and pick(s, logits) == [1]
    assert pick(s, logits) == [2]  # 3.0 - 1.2 = 1.8


def test_repetition_penalty_covers_the_prompt_and_the_output() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.0, -1.0, 0.0]])
    s = sampler([([1, 4], 0, dict(repetition_penalty=2.0))])  # 3.0 / 2 = 1.5 < 2.0
    assert pick(s, logits) == [2]
    x = s.penalize(torch.tensor([[0.0, 3.0, 2.0, -1.0, -2.0]]))
    assert x.tolist() == [[0.0, 1.5, 1.0, -1.0, -4.0]]  # 2 was just picked; negatives are multiplied


def test_min_p_drops_tokens_less_likely_than_a_share_of_the_best() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    one = torch.ones(1)
    x = filter_logits(torch.log(probs), one, torch.zeros(1, dtype=torch.long), one, torch.tensor([0.2]))
    kept = [i for i, v in enumerate(x[0].tolist()) if v != float("-inf")]
    assert kept == [0, 1, 2]  # 0.05 < 0.2 * 0.5


def test_top_k_and_top_p_per_row_in_one_batch() -> None:
    logp = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]] * 3))
    x = filter_logits(logp, torch.ones(3), torch.tensor([2, 0, 0]), torch.tensor([1.0, 0.65, 1.0]),
                      torch.zeros(3))
    alive = [[i for i, v in enumerate(row) if v != float("-inf")] for row in x.tolist()]
    # top-k 2; top-p 0.65 keeps 0.4 and 0.3 (0.4 < 0.65 before the second); no cut.
    assert alive == [[0, 1], [0, 1], [0, 1, 2, 3]]


def test_a_row_draws_the_same_tokens_whatever_its_neighbours_and_its_slice() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    hot = dict(temperature=0.9, top_p=0.95, seed=11)
    alone = sampler([([1, 2], 3, hot)], vocab=50)
    batched = sampler([([9], 0, dict(temperature=0.0)), ([1, 2], 3, hot), ([7], 5, dict(temperature=1.3))],
                      vocab=50)
    a = [pick(alone, logits[i:i + 1])[0] for i in range(4)]
    b = [pick(batched, torch.stack([logits[5], logits[i], logits[4]]))[1] for i in range(4)]
    assert a == b
    # A later slice starts at generated + drawn: the same stream continues.
    later = sampler([([1, 2, *a[:2]], 5, hot)], vocab=50)
    assert [pick(later, logits[i:i + 1])[0] for i in (2, 3)] == a[2:]


def test_logprobs_are_the_log_softmax_of_the_model_logits() -> None:
    logits = torch.tensor([[1.0, 4.0, 2.0, 3.0], [0.5, 0.5, 9.0, 0.0]])
    s = sampler([([1], 1, dict(logprobs=True, top_logprobs=2, presence_penalty=2.0)), ([1], 0, {})], vocab=4)
    tokens, lps = s.sample(logits).start().result(s)
    assert lps[1] is None
    p = lps[0]
    assert tokens[0] == 3  # the penalty moved the choice, not the reported distribution
    lsm = torch.log_softmax(logits[0], dim=-1)
    assert math.isclose(p.chosen.logprob, float(lsm[3]), rel_tol=1e-6) and p.chosen.id == 3
    assert [a.id for a in p.top] == [1, 3]
    assert math.isclose(p.top[0].logprob, float(lsm[1]), rel_tol=1e-6)
    s = sampler([([1], 0, {}), ([1], 0, {})], vocab=4)
    assert s.sample(logits).start().result(s)[1] == [None, None]


@pytest.fixture(scope="module")
def hf_engine() -> Any:
    from worker.engines import create_engine

    return create_engine("hf", "tiny-random", threads=1, mem_budget=123 * 1024**2, kv_reuse=False)


def test_hf_penalties_in_slices_equal_one_pass(hf_engine: Any) -> None:
    """The row carries its whole context and ``generated``: penalties see every earlier token,
    so serving in slices gives what one pass gives."""
    # Plain greedy output of this prompt repeats its first token at index 22; the penalties
    # (counted across slices) must prevent that, in one pass and in slices of 7 alike.
    prompt = [random.Random(2).randrange(3, 49152) for _ in range(9)]
    n = 30

    def serve(ctx: list[int], budget: int, gen: int, slice_len: int, **kw: Any) -> list[int]:
        outs, _ = hf_engine.serve(P.BatchMsg(batch_id=1, slice_len=slice_len, requests=[P.BatchRequest(
            rid="r", token_ids=ctx, max_new_tokens=budget, generated=gen, temperature=0.0,
            ignore_eos=True, **kw)]))
        return outs[0].token_ids

    pen = dict(presence_penalty=2.0, frequency_penalty=2.0, repetition_penalty=1.3)
    plain = serve(prompt, n, 0, n)
    assert len(set(plain)) < n  # the premise: plain greedy repeats a token
    whole = serve(prompt, n, 0, n, **pen)
    assert len(set(whole)) == n and whole != plain
    pieces: list[int] = []
    while len(pieces) < n:
        pieces += serve(prompt + pieces, n - len(pieces), len(pieces), 7, **pen)
    assert pieces == whole


def test_hf_logprobs_match_the_greedy_choice(hf_engine: Any) -> None:
    outs, _ = hf_engine.serve(P.BatchMsg(batch_id=1, slice_len=6, requests=[P.BatchRequest(
        rid="r", token_ids=[5, 6, 7, 8], max_new_tokens=6, temperature=0.0, ignore_eos=True,
        logprobs=True, top_logprobs=5)]))
    out = outs[0]
    assert len(out.logprobs) == len(out.token_ids) == 6
    for tid, e in zip(out.token_ids, out.logprobs, strict=True):
        assert e.chosen.id == tid == e.top[0].id and e.chosen.logprob == e.top[0].logprob <= 0.0
        assert len(e.top) == 5


def test_logit_bias_moves_greedy_rows_and_bans_tokens() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0, 0.0]] * 2)
    s = sampler([([1], 0, dict(logit_bias={2: 1.5})), ([1], 0, dict(logit_bias={1: -100.0, 2: -100.0}))])
    assert pick(s, logits) == [2, 3]  # 2.0 + 1.5 beats 3.0; 1 and 2 banned
    lp = sampler([([1], 0, dict(logit_bias={2: 1.5}, logprobs=True))])
    _, (e,) = lp.sample(logits[:1]).start().result(lp)
    assert e.chosen.id == 2 and math.isclose(e.chosen.logprob, float(torch.log_softmax(logits[0], -1)[2]),
                                             rel_tol=1e-6)  # the model's log-probability, unbiased


def test_min_tokens_holds_the_stop_tokens_back_across_slices() -> None:
    logits = torch.tensor([[0.0, 1.0, 9.0, 0.0, 0.0]])  # token 2 (the EOS here) would win
    reqs = [P.BatchRequest(rid="m", token_ids=[1, 3], max_new_tokens=8, generated=1, temperature=0.0,
                           min_tokens=3)]
    s = BatchSampler(reqs, [1], 5, "cpu", steps=4, eos=[2])
    # generated 1 before this slice: tokens 2 and 3 of the request may not be EOS, the 4th may.
    assert [pick(s, logits)[0] for _ in range(3)] == [1, 1, 2]
    stop = [P.BatchRequest(rid="s", token_ids=[1], max_new_tokens=8, temperature=0.0, min_tokens=1,
                           stop_token_ids=[1], ignore_eos=True)]
    s = BatchSampler(stop, [1], 5, "cpu", steps=2, eos=[2])
    assert pick(s, logits) == [2]  # EOS ignored, so allowed; the stop token 1 was not even likely
    s = BatchSampler(stop, [1], 5, "cpu", steps=2, eos=[2])
    assert pick(s, torch.tensor([[0.0, 9.0, 0.0, 5.0, 0.0]])) == [3]  # stop token 1 held back


def test_hf_applies_min_tokens_and_logit_bias(hf_engine: Any) -> None:
    base = dict(rid="r", token_ids=[5, 6, 7, 8], max_new_tokens=6, temperature=0.0)
    (plain,), _ = hf_engine.serve(P.BatchMsg(batch_id=1, slice_len=6, requests=[P.BatchRequest(
        **base, ignore_eos=True)]))
    first = plain.token_ids[0]
    # Make the first token a stop token: without min_tokens the row ends at once...
    (stopped,), _ = hf_engine.serve(P.BatchMsg(batch_id=2, slice_len=6, requests=[P.BatchRequest(
        **base, ignore_eos=True, stop_token_ids=[first])]))
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    # ...with min_tokens = 3 it may not, and a ban moves the choice elsewhere.
    (held,), _ = hf_engine.serve(P.BatchMsg(batch_id=3, slice_len=6, requests=[P.BatchRequest(
        **base, ignore_eos=True, stop_token_ids=[first], min_tokens=3)]))
    assert held.token_ids[0] != first and len(held.token_ids) >= 3
    (banned,), _ = hf_engine.serve(P.BatchMsg(batch_id=4, slice_len=6, requests=[P.BatchRequest(
        **base, ignore_eos=True, logit_bias={first: -100.0})]))
    assert first not in banned.token_ids


def test_the_cpu_draw_from_candidates_draws_what_the_whole_vocabulary_draws(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.engines import sampling as S

    gen = torch.Generator().manual_seed(11)
    vocab = 32 * S.CUT_CANDIDATES  # room for both tries of candidates (256, then 2,048)
    # Rows settled by 256 candidates, by 2,048, by none (drawn over the whole vocabulary); rows
    # of integer logits (ties at every floor); a row with all but 9 tokens masked and no cut.
    peaked, medium, flat = (torch.randn(8, vocab, generator=gen) * s for s in (6.0, 1.5, 0.1))
    ties = torch.round(torch.randn(8, vocab, generator=gen) * 3)
    masked = torch.full((1, vocab), float("-inf"))
    masked[0, torch.randperm(vocab, generator=gen)[:9]] = torch.randn(9, generator=gen)
    # A row whose k-th value (k = the candidates) is tied with thousands of tokens past them.
    plateau = torch.zeros((1, vocab))
    plateau[0, torch.randperm(vocab, generator=gen)[:100]] = 1.0
    x = torch.cat([peaked, medium, flat, ties, masked, plateau])
    n = x.shape[0]
    pick = torch.randint(0, 4, (n,), generator=gen)
    temperature = torch.tensor([0.7, 1.0, 1.0, 1.3])[pick]
    top_k = torch.tensor([0, 0, 50, 0])[torch.randint(0, 4, (n,), generator=gen)]
    top_p = torch.tensor([0.95, 0.8, 1.0, 0.99])[pick]
    min_p = torch.tensor([0.0, 0.0, 0.05, 0.0])[torch.randint(0, 4, (n,), generator=gen)]
    top_p[-2:] = 1.0
    top_k[-2:] = torch.tensor([0, S.CUT_CANDIDATES])
    min_p[-1] = 0.0
    full_rows: list[int] = []
    draw_full = S._draw_full

    def counted(x: torch.Tensor, *a: object) -> torch.Tensor:
        full_rows.append(int(x.shape[0]))
        return draw_full(x, *a)  # type: ignore[arg-type]

    for temps in (temperature, torch.ones(n)):
        cuts = (bool(((top_k > 0) & (top_k < vocab)).any()), bool((top_p < 1).any()), bool((min_p > 0).any()))
        for _ in range(40):
            u = torch.rand(n, generator=gen, dtype=torch.float64)
            want = S._draw_full(x, u, temps, top_k, top_p, min_p, cuts)
            with monkeypatch.context() as m:
                m.setattr(S, "_draw_full", counted)
                got = S.inverse_transform(x, u, temps, top_k, top_p, min_p, cuts)
            assert torch.equal(got, want)
    # The candidates drew every peaked, medium and masked row (17); the flat rows and the plateau
    # always took the long way, and so may the tied ones.
    assert all(9 <= rows <= n - 17 for rows in full_rows), full_rows


def test_the_cpu_cut_from_candidates_keeps_what_a_full_sort_keeps() -> None:
    from worker.engines.sampling import CUT_CANDIDATES, _cut_candidates, _cut_sorted

    gen = torch.Generator().manual_seed(5)
    vocab = 4 * CUT_CANDIDATES
    # Peaked rows (a trained model's: the nucleus among the candidates) and flat ones (a random
    # model's: the candidates' mass short of top-p, so those rows are sorted in full).
    x = torch.cat([torch.randn(12, vocab, generator=gen) * 6, torch.randn(6, vocab, generator=gen) * 0.1])
    n = x.shape[0]
    top_k = torch.tensor([0, 5, 0, 40, 2 * CUT_CANDIDATES, 0, vocab, 1, 0, 3, 0, 0] + [0, 7, 0, 0, 600, 0])
    top_p = torch.tensor([0.95, 1.0, 0.5, 0.9, 0.99, 1.0, 0.8, 0.3, 0.999, 1.0, 0.6, 0.97]
                         + [0.95, 0.9, 1.0, 0.5, 0.99, 0.2])
    for any_k, any_p in ((True, True), (True, False), (False, True)):
        got = _cut_candidates(x, top_k, top_p, any_k, any_p)
        want = _cut_sorted(x, top_k, top_p, any_k, any_p)
        assert torch.equal(got == float("-inf"), want == float("-inf")), (any_k, any_p)
        assert torch.equal(got[got != float("-inf")], x[got != float("-inf")])
        # Peaked rows alone (every row settled by the first candidates: no copy, no second
        # pass), and a vocabulary too small for candidates (sorted in full).
        for rows, width in ((slice(0, 12), vocab), (slice(None), 2 * CUT_CANDIDATES)):
            xs, ks, ps = x[rows, :width], top_k[rows].clamp(max=width), top_p[rows]
            got = _cut_candidates(xs, ks, ps, any_k, any_p)
            assert torch.equal(got, _cut_sorted(xs, ks, ps, any_k, any_p)), (any_k, any_p, width)
    kept = (_cut_candidates(x, top_k, top_p, True, True) != float("-inf")).sum(dim=1)
    assert kept[1] == 5 and kept[7] == 1 and kept[5] == vocab  # the cuts did cut, and top-p 1 keeps all
    assert int(kept[12:].max()) > CUT_CANDIDATES  # flat rows: their nucleus is past the candidates
    assert n == len(top_k) == len(top_p)
