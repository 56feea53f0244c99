"""The request surface vLLM users send (issue 20): per-chunk usage, echo, best_of,
suffix, the engine features, the tokenizer routes, model cards, version, the OpenAPI
schema, ``created`` and ``system_fingerprint``."""

from __future__ import annotations

import asyncio

from sclsd import protocol as P
from sclsd.http.params import ALLOWED

from ..daemon.conftest import held
from .conftest import Front
from .test_app import sse

ONE = {"model": "fake", "max_tokens": 6, "temperature": 0, "ignore_eos": True}


def test_continuous_usage_stats_puts_usage_in_every_chunk(front) -> None:
    async def body(f: Front) -> None:
        for path, extra in (("/v1/completions", {"prompt": "hello"}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            req = {**ONE, **extra, "stream": True, "n": 2,
                   "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
            r = await f.http.post(path, json=req)
            assert r.status_code == 200, r.text
            events = sse(r.text)
            assert events[-1] == "[DONE]"
            chunks, final = events[:-2], events[-2]
            assert all(c["usage"] is not None for c in chunks)
            for i in (0, 1):
                counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"][0]["index"] == i]
                assert counts == sorted(counts) and counts[-1] == 6, counts
                prompt = {c["usage"]["prompt_tokens"] for c in chunks if c["choices"][0]["index"] == i}
                assert len(prompt) == 1 and prompt.pop() == final["usage"]["prompt_tokens"]
            assert final["choices"] == [] and final["usage"]["completion_tokens"] == 12

    front(body)


def test_created_is_the_arrival_and_every_answer_has_a_fingerprint(front, monkeypatch) -> None:
    import sclsd.http.app as app_module

    clock = [1_700_000_000.0]

    class FakeTime:
        @staticmethod
        def time() -> float:
            return clock[0]

    monkeypatch.setattr(app_module, "time", FakeTime)

    async def body(f: Front) -> None:
        w = f.h.worker("slow", hold=True)
        await f.h.registered("slow")
        f.h.drain("w0")
        call = asyncio.ensure_future(f.http.post("/v1/completions", json={**ONE, "prompt": "x"}))
        await held(w)
        clock[0] += 8.0  # the answer takes 8 s: ``created`` must not move
        w.hold = False
        w.release()
        r = (await asyncio.wait_for(call, 5)).json()
        assert r["created"] == 1_700_000_000
        assert r["system_fingerprint"].startswith("fp_")
        s = sse((await f.http.post("/v1/chat/completions", json={
            **ONE, "messages": [{"role": "user", "content": "x"}], "stream": True})).text)
        assert {c["system_fingerprint"] for c in s[:-1]} == {r["system_fingerprint"]}
        assert {c["created"] for c in s[:-1]} == {int(clock[0])}
        assert r["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}  # one slice: none reused

    front(body)


def test_echo_prepends_the_prompt(front) -> None:
    async def body(f: Front) -> None:
        plain = (await f.http.post("/v1/completions", json={**ONE, "prompt": "hello"})).json()
        r = (await f.http.post("/v1/completions", json={**ONE, "prompt": "hello", "echo": True})).json()
        assert r["choices"][0]["text"] == "hello" + plain["choices"][0]["text"]
        assert r["usage"] == plain["usage"]
        ids = list(b"hi!")  # the byte tokenizer: ids are bytes
        r = (await f.http.post("/v1/completions", json={**ONE, "prompt": ids, "echo": True})).json()
        assert r["choices"][0]["text"].startswith("hi!")
        events = sse((await f.http.post("/v1/completions", json={
            **ONE, "prompt": "hello", "echo": True, "stream": True})).text)
        assert events[0]["choices"][0]["text"] == "hello"
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "hello" + plain["choices"][0]["text"]
        turns = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi, "}]
        c = (await f.http.post("/v1/chat/completions", json={**ONE, "messages": turns, "echo": True})).json()
        assert c["choices"][0]["message"]["content"].startswith("Hi, ")

    front(body)


def test_best_of_answers_the_likeliest(front) -> None:
    async def body(f: Front) -> None:
        req = {**ONE, "prompt": "abc", "temperature": 1.0, "seed": 7}
        three = (await f.http.post("/v1/completions", json={**req, "n": 3, "logprobs": 0})).json()
        scores = [sum(ch["logprobs"]["token_logprobs"]) for ch in three["choices"]]
        assert len(set(scores)) == 3  # seeds 7, 8, 9 sample differently
        best = (await f.http.post("/v1/completions", json={**req, "best_of": 3})).json()
        (choice,) = best["choices"]
        assert choice["text"] == three["choices"][scores.index(max(scores))]["text"]
        assert choice["logprobs"] is None  # asked for internally, not shown
        assert best["usage"]["completion_tokens"] == 3 * 6  # every generated token counts
        two = (await f.http.post("/v1/completions", json={**req, "best_of": 3, "n": 2, "logprobs": 1})).json()
        assert [sum(c["logprobs"]["token_logprobs"]) for c in two["choices"]] == sorted(scores, reverse=True)[:2]

    front(body)


def test_suffix_needs_fill_in_the_middle_tokens(front) -> None:
    async def body(f: Front) -> None:
        r = await f.http.post("/v1/completions", json={**ONE, "prompt": "def f(", "suffix": "return x"})
        err = r.json()["error"]
        assert (r.status_code, err["param"], err["code"]) == (400, "suffix", "unsupported_parameter")
        assert "fill-in-the-middle" in err["message"]

    front(body)


def test_engine_features_are_refused_until_the_daemon_lists_them(front, monkeypatch) -> None:
    # An older daemon: it lists none of the optional features in its pong.
    every = frozenset(P.GENERATE_FEATURES)
    monkeypatch.setattr(P, "GENERATE_FEATURES", ())

    async def body(f: Front) -> None:
        for extra in ({"min_tokens": 3}, {"logit_bias": {"65": 100}}, {"skip_special_tokens": False},
                      {"response_format": {"type": "json_object"}}):
            r = await f.http.post("/v1/completions", json={**ONE, "prompt": "x", **extra})
            err = r.json()["error"]
            assert (r.status_code, err["param"], err["code"]) == (400, next(iter(extra)),
                                                                  "unsupported_parameter"), err
            assert "do not apply it yet" in err["message"]
        # Their defaults are accepted from any daemon.
        ok = await f.http.post("/v1/completions", json={**ONE, "prompt": "x", "min_tokens": 0,
                                                        "logit_bias": {}, "skip_special_tokens": True})
        assert ok.status_code == 200
        # A daemon that applies them gets them on the wire.
        f.app.state.api.link.features = every
        w = f.h.worker("slow", hold=True)
        await f.h.registered("slow")
        f.h.drain("w0")
        call = asyncio.ensure_future(f.http.post("/v1/chat/completions", json={
            **ONE, "messages": [{"role": "user", "content": "x"}], "min_tokens": 3,
            "logit_bias": {"65": -100, "66": 5}, "skip_special_tokens": False}))
        await held(w)
        (c,) = list(f.h.live)
        assert (c.gen.min_tokens, c.gen.logit_bias, c.gen.skip_special_tokens) == (
            3, {65: -100.0, 66: 5.0}, False)
        w.hold = False
        w.release()
        assert (await asyncio.wait_for(call, 5)).status_code == 200

    front(body)


def test_tokenize_and_detokenize_count_as_the_daemon_does(front) -> None:
    async def body(f: Front) -> None:
        text = "Hello, wörld"
        t = (await f.http.post("/tokenize", json={"model": "fake", "prompt": text,
                                                  "return_token_strs": True})).json()
        c = (await f.http.post("/v1/completions", json={**ONE, "prompt": text})).json()
        assert t["count"] == len(t["tokens"]) == c["usage"]["prompt_tokens"]
        assert len(t["token_strs"]) == t["count"]
        msgs = [{"role": "user", "content": "hi"}]
        tc = (await f.http.post("/tokenize", json={"messages": msgs})).json()
        chat = (await f.http.post("/v1/chat/completions", json={**ONE, "messages": msgs})).json()
        assert tc["count"] == chat["usage"]["prompt_tokens"] and tc["token_strs"] is None
        d = (await f.http.post("/detokenize", json={"tokens": t["tokens"]})).json()
        assert d == {"prompt": text}
        for path, req, param in (("/detokenize", {"tokens": [1, 999]}, "tokens"),
                                 ("/tokenize", {"prompt": "a", "messages": msgs}, "prompt"),
                                 ("/tokenize", {"prompt": "a", "bogus": 1}, "bogus")):
            r = await f.http.post(path, json=req)
            assert (r.status_code, r.json()["error"]["param"]) == (400, param)
        assert (await f.http.post("/tokenize", json={"model": "gpt-4", "prompt": "a"})).status_code == 404

    front(body)


def test_model_card_version_docs_and_openapi(front) -> None:
    async def body(f: Front) -> None:
        card = (await f.http.get("/v1/models/fake")).json()
        assert card["id"] == "fake" and card["object"] == "model"
        assert (await f.http.get("/v1/models")).json()["data"] == [card]
        r = await f.http.get("/v1/models/gpt-4")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        from sclsd import __version__

        assert (await f.http.get("/version")).json() == {"version": __version__}
        docs = await f.http.get("/docs")
        assert docs.status_code == 200 and "swagger" in docs.text.lower()
        schema = (await f.http.get("/openapi.json")).json()
        for path, kind in (("/v1/completions", "completion"), ("/v1/chat/completions", "chat")):
            props = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
            assert set(props["properties"]) == set(ALLOWED[kind])  # type: ignore[index]
        for path in ("/tokenize", "/detokenize", "/v1/models", "/health", "/version"):
            assert path in schema["paths"], path

    front(body, settings={"max_model_len": 2048})


def test_model_card_shows_max_model_len_when_known(front) -> None:
    async def body(f: Front) -> None:
        assert (await f.http.get("/v1/models/fake")).json()["max_model_len"] == 2048
        t = (await f.http.post("/tokenize", json={"prompt": "a"})).json()
        assert t["max_model_len"] == 2048

    front(body, settings={"max_model_len": 2048})

