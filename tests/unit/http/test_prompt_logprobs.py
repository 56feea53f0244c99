"""The prompt's log-probabilities through sclsd-http, as vLLM serves them: a completion's
``echo`` with ``logprobs`` (lm-evaluation-harness's ``local-completions``, perplexity
scripts) and vLLM's ``prompt_logprobs`` on both endpoints. The fake engine makes them up
stably, the prompt's own token always the likeliest; the byte tokenizer's ids are bytes."""

from __future__ import annotations

from typing import Any

import pytest

from sclsd import protocol as P
from sclsd.http import render
from sclsd.http.errors import ApiError
from sclsd.http.params import parse
from worker.engines.fake import FakeEngine

from .conftest import Front
from .test_app import sse

BASE = {"model": "fake", "temperature": 0, "ignore_eos": True}
USER = [{"role": "user", "content": "hi"}]


def lm_eval_parse(out: dict[str, Any], ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-evaluation-harness's ``LocalCompletionsAPI.parse_logprobs`` (0.4), as it reads an answer."""
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=lambda c: c["index"]), ctxlens, strict=True):
        assert ctxlen > 0
        logprobs = sum(choice["logprobs"]["token_logprobs"][ctxlen:-1])
        tokens_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        is_greedy = True
        for tok, top in zip(tokens_logprobs, top_logprobs, strict=True):
            if tok != max(top.values()):
                is_greedy = False
                break
        res.append((logprobs, is_greedy))
    return res


def check_echo_shape(choice: dict[str, Any], prompt: str, generated: int) -> dict[str, Any]:
    """An echoed choice's ``logprobs``: the prompt's tokens (bytes here), then the generated."""
    lp = choice["logprobs"]
    n = len(prompt.encode()) + generated
    assert [len(lp[k]) for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")] == [n] * 4
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(x is not None for x in lp["token_logprobs"][1:] + lp["top_logprobs"][1:])
    assert "".join(lp["tokens"][:len(prompt)]) == prompt
    assert choice["text"].startswith(prompt)
    # Offsets into the whole text: each prompt token's text is there (a generated token of the
    # fake may be a piece of a UTF-8 sequence, shown as U+FFFD: its offset only grows).
    off = lp["text_offset"]
    assert off[0] == 0 and off == sorted(off)
    assert off == [sum(map(len, lp["tokens"][:i])) for i in range(n)]
    for t, o in zip(lp["tokens"][:len(prompt)], off, strict=False):
        assert choice["text"][o:o + len(t)] == t
    for lp_, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True):
        assert lp_ <= 0 and lp_ in top.values()
    return lp


def test_echo_with_logprobs_covers_the_prompt_then_the_answer(front) -> None:
    async def body(f: Front) -> None:
        req = {**BASE, "prompt": "hello there", "max_tokens": 3}
        plain = (await f.http.post("/v1/completions", json={**req, "logprobs": 2})).json()["choices"][0]
        r = await f.http.post("/v1/completions", json={**req, "echo": True, "logprobs": 2})
        assert r.status_code == 200, r.text
        (choice,) = r.json()["choices"]
        assert choice["text"] == "hello there" + plain["text"]
        lp = check_echo_shape(choice, "hello there", 3)
        # The prompt's tokens: the fake's chosen token is the likeliest, with one more.
        for tok, top in zip(lp["tokens"][1:11], lp["top_logprobs"][1:11], strict=True):
            assert list(top)[0] == tok and len(top) == 2
            assert top[tok] == max(top.values())
        # The generated part is what a request without echo gets.
        for k in ("tokens", "token_logprobs", "top_logprobs"):
            assert lp[k][11:] == plain["logprobs"][k]
        assert lp["text_offset"][11:] == [o + 11 for o in plain["logprobs"]["text_offset"]]
        # The prompt's values are vLLM's prompt_logprobs of the same prompt.
        field = (await f.http.post("/v1/completions", json={**req, "prompt_logprobs": 0})).json()
        (fc,) = field["choices"]
        assert fc["logprobs"] is None and fc["prompt_logprobs"][0] is None
        ids = list(b"hello there")
        assert [e[str(t)]["logprob"] for e, t in zip(fc["prompt_logprobs"][1:], ids[1:], strict=True)] == \
            lp["token_logprobs"][1:11]
        # lm-eval's request and reading: context "hello", continuation " there", one token generated.
        one = (await f.http.post("/v1/completions", json={**req, "max_tokens": 1, "echo": True,
                                                           "logprobs": 1})).json()
        ((ll, greedy),) = lm_eval_parse(one, [5])
        assert greedy and ll == pytest.approx(sum(lp["token_logprobs"][5:11])) and ll < 0

    front(body)


def test_token_id_prompts_in_a_batch_as_lm_eval_sends_them(front) -> None:
    async def body(f: Front) -> None:
        prompts = [list(b"The cat sat"), list(b"A dog"), list(b"x")]  # one of a single token
        r = await f.http.post("/v1/completions", json={**BASE, "prompt": prompts, "max_tokens": 1,
                                                        "echo": True, "logprobs": 1, "seed": 1234})
        assert r.status_code == 200, r.text
        out = r.json()
        assert [c["index"] for c in out["choices"]] == [0, 1, 2]
        for choice, ids in zip(out["choices"], prompts, strict=True):
            check_echo_shape(choice, bytes(ids).decode(), 1)
        assert out["choices"][2]["logprobs"]["tokens"][0] == "x"
        assert out["usage"]["prompt_tokens"] == sum(map(len, prompts))
        # Context: all but the last two prompt tokens; the fake's prompt tokens are its likeliest.
        parsed = lm_eval_parse(out, [len(p) - 2 for p in prompts[:2]] + [1])
        assert [g for _, g in parsed] == [True, True, True]
        assert parsed[2][0] == 0  # nothing between the context and the generated token
        for (ll, _), choice in zip(parsed[:2], out["choices"][:2], strict=True):
            assert ll == pytest.approx(sum(choice["logprobs"]["token_logprobs"][-3:-1])) and ll < 0
        # Each prompt's log-probabilities are its own.
        a, b = (c["logprobs"]["token_logprobs"][1:3] for c in out["choices"][:2])
        assert a != b

    front(body)


def rows_that_asked(f: Front) -> list[P.BatchRequest]:
    return [r for w in f.h.transport.workers.values() for b in w.batches() for r in b.requests
            if r.prompt_logprobs is not None]


def test_n_choices_share_one_computation_of_their_prompts(front) -> None:
    async def body(f: Front) -> None:
        req = {**BASE, "prompt": ["hello", "world!"], "max_tokens": 2, "temperature": 1.0, "seed": 3,
               "n": 2, "echo": True, "logprobs": 1, "prompt_logprobs": 2}
        out = (await f.http.post("/v1/completions", json=req)).json()
        assert len(rows_that_asked(f)) == 2  # once per prompt, not per choice
        assert {r.prompt_logprobs for r in rows_that_asked(f)} == {2}
        ch = out["choices"]
        assert len(ch) == 4
        for i, prompt in enumerate(["hello", "hello", "world!", "world!"]):
            check_echo_shape(ch[i], prompt, 2)
        k = len("hello")
        for a, b in ((ch[0], ch[1]), (ch[2], ch[3])):
            assert a["logprobs"]["token_logprobs"][:k] == b["logprobs"]["token_logprobs"][:k]
            assert a["prompt_logprobs"] == b["prompt_logprobs"]
        assert ch[0]["prompt_logprobs"] != ch[2]["prompt_logprobs"]
        assert len(ch[0]["prompt_logprobs"]) == len("hello") and len(ch[2]["prompt_logprobs"]) == 6
        # logprobs 1 in the echo, 2 alternatives in the field.
        assert all(len(t) == 1 for t in ch[0]["logprobs"]["top_logprobs"][1:k])
        assert all(len(e) == 2 for e in ch[0]["prompt_logprobs"][1:])
        # best_of ranks its choices by what they generated; the prompt's go to every one shown.
        best = (await f.http.post("/v1/completions", json={**req, "n": 1, "best_of": 3})).json()
        assert len(rows_that_asked(f)) == 4
        assert [c["prompt_logprobs"] for c in best["choices"]] == [ch[0]["prompt_logprobs"],
                                                                    ch[2]["prompt_logprobs"]]
        check_echo_shape(best["choices"][1], "world!", 2)

    front(body)


def test_vllm_prompt_logprobs_on_completions_and_chat(front) -> None:
    async def body(f: Front) -> None:
        ids = list(b"abcdef")
        r = (await f.http.post("/v1/completions", json={**BASE, "prompt": ids, "max_tokens": 2,
                                                         "prompt_logprobs": 3})).json()
        (choice,) = r["choices"]
        assert choice["logprobs"] is None and choice["text"]
        plps = choice["prompt_logprobs"]
        assert len(plps) == len(ids) and plps[0] is None
        for e, t in zip(plps[1:], ids[1:], strict=True):
            assert list(e)[0] == str(t)  # the prompt's token first
            assert e[str(t)]["rank"] == 1 and e[str(t)]["decoded_token"] == chr(t)
            assert sorted(x["rank"] for x in e.values()) == [1, 2, 3]
            assert all(-9999 <= x["logprob"] <= 0 for x in e.values())
            assert e[str(t)]["logprob"] == max(x["logprob"] for x in e.values())
        # 0: the prompt's own token only, its rank unknown.
        zero = (await f.http.post("/v1/completions", json={**BASE, "prompt": ids, "max_tokens": 1,
                                                            "prompt_logprobs": 0})).json()
        z = zero["choices"][0]["prompt_logprobs"]
        assert [list(e) for e in z[1:]] == [[str(t)] for t in ids[1:]]
        assert all(e[str(t)]["rank"] is None for e, t in zip(z[1:], ids[1:], strict=True))
        assert [e[str(t)]["logprob"] for e, t in zip(z[1:], ids[1:], strict=True)] == \
            [e[str(t)]["logprob"] for e, t in zip(plps[1:], ids[1:], strict=True)]
        # Not asked: no field.
        plain = (await f.http.post("/v1/completions", json={**BASE, "prompt": ids, "max_tokens": 1})).json()
        assert "prompt_logprobs" not in plain["choices"][0]
        # Chat: at the response's top level, the rendered chat's tokens (the byte tokenizer's).
        c = await f.http.post("/v1/chat/completions", json={**BASE, "messages": USER, "max_tokens": 2,
                                                             "n": 2, "prompt_logprobs": 1})
        assert c.status_code == 200, c.text
        chat = c.json()
        rendered = "<user>hi\n<assistant>"
        assert chat["usage"]["prompt_tokens"] == len(rendered)
        cp = chat["prompt_logprobs"]
        assert cp[0] is None and [e[str(ord(ch))]["decoded_token"] for e, ch in zip(cp[1:], rendered[1:],
                                                                                      strict=True)] == list(rendered[1:])
        assert all("prompt_logprobs" not in x for x in chat["choices"])
        plain_chat = (await f.http.post("/v1/chat/completions", json={**BASE, "messages": USER,
                                                                      "max_tokens": 1})).json()
        assert "prompt_logprobs" not in plain_chat

    front(body)


def test_echo_with_logprobs_streams_the_prompt_in_the_first_chunk(front) -> None:
    async def body(f: Front) -> None:
        req = {**BASE, "prompt": "stream me", "max_tokens": 4, "echo": True, "logprobs": 1}
        whole = (await f.http.post("/v1/completions", json={**req, "n": 2})).json()
        r = await f.http.post("/v1/completions", json={**req, "n": 2, "stream": True,
                                                        "stream_options": {"include_usage": True}})
        assert r.status_code == 200, r.text
        events = sse(r.text)
        assert events[-1] == "[DONE]" and events[-2]["choices"] == []
        assert len(rows_that_asked(f)) == 2  # once per request (each prompt's first choice)
        for i in (0, 1):
            mine = [e["choices"][0] for e in events[:-2] if e["choices"][0]["index"] == i]
            first = mine[0]
            assert first["text"].startswith("stream me")  # with what was generated (maybe none)
            assert first["logprobs"]["tokens"][:9] == list("stream me")
            assert first["logprobs"]["token_logprobs"][0] is None
            text = "".join(c["text"] for c in mine)
            assert text == whole["choices"][i]["text"]
            lps = [c["logprobs"] for c in mine if c["logprobs"]]
            tokens = [t for lp in lps for t in lp["tokens"]]
            offsets = [o for lp in lps for o in lp["text_offset"]]
            assert tokens == whole["choices"][i]["logprobs"]["tokens"]
            assert [x for lp in lps for x in lp["token_logprobs"]] == \
                whole["choices"][i]["logprobs"]["token_logprobs"]
            # Later chunks count from the text sent (the fake's pieces of UTF-8 are longer as tokens).
            assert offsets[:9] == whole["choices"][i]["logprobs"]["text_offset"][:9] == list(range(9))
            assert offsets == sorted(offsets)
            assert len(tokens) == len("stream me") + 4
            assert mine[-1]["finish_reason"] == "length"
        # vLLM's prompt_logprobs field does not stream (as vLLM).
        bad = await f.http.post("/v1/completions", json={**req, "stream": True, "prompt_logprobs": 1})
        err = bad.json()["error"]
        assert (bad.status_code, err["param"], err["code"]) == (400, "prompt_logprobs", "unsupported_parameter")
        assert "stream" in err["message"]

    front(body)


def test_bounds_are_refused_by_name(front) -> None:
    for value in (21, -1, 1.5, True, "2"):
        for kind, extra in (("completion", {"prompt": "a"}), ("chat", {"messages": USER})):
            with pytest.raises(ApiError) as e:
                parse(kind, {**extra, "prompt_logprobs": value}, 64)  # type: ignore[arg-type]
            assert (e.value.status, e.value.param) == (400, "prompt_logprobs"), e.value.message
    for ok in (0, 20):
        p = parse("completion", {"prompt": "a", "prompt_logprobs": ok, "n": 3}, 64)
        assert p.ask_prompt == ok and "prompt_logprobs" in p.features
        assert [g.prompt_logprobs for g in p.messages("r")] == [ok, None, None]
    assert parse("completion", {"prompt": "a"}, 64).messages("r")[0].prompt_logprobs is None
    both = parse("completion", {"prompt": "a", "echo": True, "logprobs": 3, "prompt_logprobs": 1}, 64)
    assert both.echo_logprobs and both.ask_prompt == 3  # the larger of the two
    assert not parse("completion", {"prompt": "a", "echo": True}, 64).features

    async def body(f: Front) -> None:
        for path, extra in (("/v1/completions", {"prompt": "a"}), ("/v1/chat/completions", {"messages": USER})):
            r = await f.http.post(path, json={**BASE, **extra, "prompt_logprobs": 21})
            err = r.json()["error"]
            assert (r.status_code, err["param"]) == (400, "prompt_logprobs") and "0..20" in err["message"]
        # The Responses API has no such parameter: named, not ignored.
        r = await f.http.post("/v1/responses", json={"model": "fake", "input": "hi", "prompt_logprobs": 1})
        assert (r.status_code, r.json()["error"]["param"]) == (400, "prompt_logprobs")

    front(body)


def test_a_daemon_without_the_feature_refuses_by_name(front, monkeypatch) -> None:
    every = frozenset(P.GENERATE_FEATURES)
    monkeypatch.setattr(P, "GENERATE_FEATURES", tuple(x for x in every if x != "prompt_logprobs"))

    async def body(f: Front) -> None:
        cases: list[tuple[dict[str, Any], str]] = [({"prompt_logprobs": 1}, "prompt_logprobs"),
                                                   ({"echo": True, "logprobs": 1}, "echo")]
        for extra, param in cases:
            r = await f.http.post("/v1/completions", json={**BASE, "prompt": "x", "max_tokens": 1, **extra})
            err = r.json()["error"]
            assert (r.status_code, err["param"], err["code"]) == (400, param, "unsupported_parameter"), err
            assert "yet" in err["message"]
        assert "log-probabilities" in err["message"]
        c = await f.http.post("/v1/chat/completions", json={**BASE, "messages": USER, "prompt_logprobs": 0})
        assert (c.status_code, c.json()["error"]["param"]) == (400, "prompt_logprobs")
        # Echo without logprobs, and logprobs without echo, need nothing of it.
        for extra in ({"echo": True}, {"logprobs": 1}):
            ok = await f.http.post("/v1/completions", json={**BASE, "prompt": "x", "max_tokens": 1, **extra})
            assert ok.status_code == 200, ok.text
        assert rows_that_asked(f) == []

    front(body)


def test_workers_that_do_not_compute_them_are_named(front) -> None:
    async def body(f: Front) -> None:
        w = f.h.transport.connect("old", FakeEngine(decode_s=0.0), auth=f.h.server.fleet.secret or "",
                                  register=False)
        w.register(caps=P.EngineCaps())  # an engine that does not say it computes them
        await f.h.registered("old")
        for extra, param, stream in (({"prompt_logprobs": 1}, "prompt_logprobs", False),
                                     ({"echo": True, "logprobs": 0}, "echo", False),
                                     ({"echo": True, "logprobs": 0}, "echo", True)):
            r = await f.http.post("/v1/completions", json={**BASE, "prompt": "x y", "max_tokens": 1,
                                                            "stream": stream, **extra})
            err = r.json()["error"]
            assert (r.status_code, err["param"]) == (400, param), err
            assert "do not compute" in err["message"]
        ok = await f.http.post("/v1/completions", json={**BASE, "prompt": "x y", "max_tokens": 1, "logprobs": 0})
        assert ok.status_code == 200

    front(body)


def test_through_the_openai_client(front) -> None:
    async def body(f: Front) -> None:
        client = f.openai()
        ctx, cont = list(b"Paris is"), list(b" nice")
        c = await client.completions.create(model="fake", prompt=[ctx + cont, ctx], max_tokens=1,
                                            temperature=0, echo=True, logprobs=1)
        assert len(c.choices) == 2
        first = c.choices[0].logprobs
        assert first is not None and first.tokens is not None and first.token_logprobs is not None
        assert len(first.tokens) == len(ctx + cont) + 1
        assert first.token_logprobs[0] is None and first.top_logprobs is not None
        assert first.top_logprobs[0] is None
        cont_ll = sum(x for x in first.token_logprobs[len(ctx):-1] if x is not None)
        assert cont_ll < 0 and all(first.token_logprobs[len(ctx):-1])
        x = await client.completions.create(model="fake", prompt="Paris", max_tokens=1, temperature=0,
                                            extra_body={"prompt_logprobs": 1, "ignore_eos": True})
        assert x.choices[0].model_extra is not None
        plps = x.choices[0].model_extra["prompt_logprobs"]
        assert plps[0] is None and [list(e.values())[0]["decoded_token"] for e in plps[1:]] == list("aris")
        chat = await client.chat.completions.create(model="fake", messages=USER, max_tokens=1,
                                                    extra_body={"prompt_logprobs": 0})
        assert chat.model_extra is not None and chat.model_extra["prompt_logprobs"][0] is None
        stream = await client.completions.create(model="fake", prompt="Paris", max_tokens=2, temperature=0,
                                                 echo=True, logprobs=0, stream=True)
        chunks = [ch async for ch in stream]
        lp0 = chunks[0].choices[0].logprobs
        assert chunks[0].choices[0].text.startswith("Paris")
        assert lp0 is not None and lp0.tokens is not None and lp0.tokens[:5] == list("Paris")

    front(body)


# ------------------------------------------------------------------ rendering alone


def lp(i: int, x: float, t: str) -> P.Logprob:
    return P.Logprob(i, x, t)


def test_top_logprobs_keep_the_chosen_token_and_rank_what_they_know() -> None:
    # Position 1: the prompt's token "b" is not among the 2 likeliest; position 2: it is first.
    plps = [P.TokenLogprobs(lp(98, -3.0, "b"), [lp(120, -0.5, "x"), lp(121, -1.0, "y")]),
            P.TokenLogprobs(lp(99, -0.1, "c"), [lp(99, -0.1, "c"), lp(122, -2.5, "z")])]
    gen = [P.TokenLogprobs(lp(100, float("-inf"), "d"), [lp(123, -0.01, "w")])]
    out = render.completion_logprobs(gen, top=1, prompt=("a", plps))
    assert out["tokens"] == ["a", "b", "c", "d"]
    assert out["token_logprobs"] == [None, -3.0, -0.1, -9999.0]
    assert out["top_logprobs"] == [None, {"b": -3.0, "x": -0.5}, {"c": -0.1}, {"d": -9999.0, "w": -0.01}]
    assert out["text_offset"] == [0, 1, 2, 3]
    answer = {"choices": [{"index": 0, "logprobs": out}]}
    assert lm_eval_parse(answer, [1]) == [(-3.1, False)]  # "b" was not the likeliest
    assert lm_eval_parse(answer, [2]) == [(-0.1, True)]
    field = render.prompt_logprobs(plps, 1)
    assert field == [None,
                     {"98": {"logprob": -3.0, "rank": None, "decoded_token": "b"},
                      "120": {"logprob": -0.5, "rank": 1, "decoded_token": "x"}},
                     {"99": {"logprob": -0.1, "rank": 1, "decoded_token": "c"}}]
    assert list(field[1] or {}) == ["98", "120"]  # the prompt's token first
    # Two ids of one text: the first (the chosen, else the likelier) keeps the key.
    same = P.TokenLogprobs(lp(5, -0.2, "q"), [lp(5, -0.2, "q"), lp(6, -0.3, "q")])
    assert render.completion_logprobs([same])["top_logprobs"] == [{"q": -0.2}]


def test_a_missing_answer_of_the_daemon_is_an_error_not_a_guess() -> None:
    p = parse("completion", {"prompt": [1, 2, 3], "echo": True, "logprobs": 0}, 64)
    usage = P.Usage(prompt_tokens=3, completion_tokens=1)
    timings = P.Timings(queued_s=0, ttft_s=0, e2e_s=0, slices=1)
    from sclsd.http.generate import prompt_logprobs

    with pytest.raises(ApiError) as e:
        prompt_logprobs(p, [P.Done(id="r", finish_reason="length", usage=usage, timings=timings)])
    assert e.value.status == 500
    with pytest.raises(ApiError) as e:  # a failed choice says why
        prompt_logprobs(p, [P.Done(id="r", finish_reason="timeout", usage=usage, timings=timings)])
    assert e.value.status == 504
    one = P.Usage(prompt_tokens=1, completion_tokens=1)
    shown = prompt_logprobs(p, [P.Done(id="r", finish_reason="length", usage=one, timings=timings)])
    assert shown is not None and shown.entries == [[]]


def test_streamed_choices_wait_for_their_prompts_log_probabilities() -> None:
    from sclsd.http.stream import Chunks

    head = {"id": "cmpl-x", "created": 0, "model": "fake", "system_fingerprint": "fp"}
    ch = Chunks("completion", head, 2, 2, logprobs=True, echo=["ab"], prompt_heads=["a"])
    plps = [P.TokenLogprobs(lp(98, -1.0, "b"))]
    gen = [P.TokenLogprobs(lp(99, -2.0, "c"))]
    assert ch.event(0, P.Accepted(id="0", prompt_tokens=2)) == b""
    assert ch.event(1, P.Accepted(id="1", prompt_tokens=2)) == b""
    # Choice 1 (which did not ask) comes first: held until choice 0 brings the prompt's.
    assert ch.event(1, P.Delta(id="1", token_ids=[99], text="c", logprobs=gen)) == b""
    out = sse(ch.event(0, P.Delta(id="0", token_ids=[99], text="c", logprobs=gen, prompt_logprobs=plps))
              .decode())
    assert [e["choices"][0]["index"] for e in out] == [0, 1]
    for e in out:
        c = e["choices"][0]
        assert c["text"] == "abc"
        assert c["logprobs"] == {"tokens": ["a", "b", "c"], "token_logprobs": [None, -1.0, -2.0],
                                 "top_logprobs": [None, {"b": -1.0}, {"c": -2.0}], "text_offset": [0, 1, 2]}
    later = sse(ch.event(1, P.Delta(id="1", token_ids=[100], text="d", logprobs=[
        P.TokenLogprobs(lp(100, -0.5, "d"))])).decode())
    assert later[0]["choices"][0]["logprobs"]["text_offset"] == [3]

