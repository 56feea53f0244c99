"""The routes: OpenAI shapes (through the official SDK and raw), errors, auth, health,
and cancellation when a client goes away."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec
import openai
import pytest

from sclsd import protocol as P

from ..daemon.conftest import RecConn, until
from .conftest import Front


def sse(text: str) -> list[Any]:
    """The ``data:`` payloads of an event stream, JSON-decoded (``[DONE]`` kept as is)."""
    out: list[Any] = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    assert text.endswith("\n\n")
    return out


def test_completions_and_chat_through_the_sdk(front) -> None:
    async def body(f: Front) -> None:
        client = f.openai()
        c = await client.completions.create(model="fake", prompt="hello", max_tokens=5,
                                            temperature=0, extra_body={"ignore_eos": True})
        assert c.object == "text_completion" and c.model == "fake"
        assert c.choices[0].finish_reason == "length" and len(c.choices[0].text) >= 1
        assert (c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens) == (5, 5, 10)
        chat = await client.chat.completions.create(
            model="fake", messages=[{"role": "system", "content": "be brief"},
                                    {"role": "user", "content": "hi"}],
            max_completion_tokens=7, temperature=0, extra_body={"ignore_eos": True})
        assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
        assert chat.usage.completion_tokens == 7
        # The byte tokenizer's chat format: "<role>content\n" per turn, then "<assistant>".
        assert chat.usage.prompt_tokens == len("<system>be brief\n<user>hi\n<assistant>")
        models = await client.models.list()
        assert [m.id for m in models.data] == ["fake"]

    front(body)


def test_stream_chunks_end_with_done_and_add_up_to_the_answer(front) -> None:
    async def body(f: Front) -> None:
        req = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20,
               "temperature": 0, "ignore_eos": True}
        whole = (await f.http.post("/v1/chat/completions", json=req)).json()
        r = await f.http.post("/v1/chat/completions",
                              json={**req, "stream": True, "stream_options": {"include_usage": True}})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse(r.text)
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        assert text == whole["choices"][0]["message"]["content"]
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
        assert all(c["usage"] is None for c in chunks[:-1])
        # Without include_usage: no usage key, no usage chunk.
        r = await f.http.post("/v1/completions", json={"model": "fake", "prompt": "hi", "max_tokens": 4,
                                                        "stream": True})
        events = sse(r.text)
        assert events[-1] == "[DONE]" and all("usage" not in c for c in events[:-1])
        assert "".join(c["choices"][0]["text"] for c in events[:-1]) != ""

    front(body)


def test_n_fans_out_and_usage_counts_the_prompt_once(front) -> None:
    async def body(f: Front) -> None:
        client = f.openai()
        c = await client.completions.create(model="fake", prompt=["ab", "abcd"], n=3, max_tokens=6,
                                            temperature=1.0, seed=11, extra_body={"ignore_eos": True})
        assert [x.index for x in c.choices] == list(range(6))
        assert len({x.text for x in c.choices[:3]}) == 3  # seeds 11, 12, 13: different samples
        assert (c.usage.prompt_tokens, c.usage.completion_tokens) == (2 + 4, 6 * 6)
        again = await client.completions.create(model="fake", prompt=["ab", "abcd"], n=3, max_tokens=6,
                                                temperature=1.0, seed=11, extra_body={"ignore_eos": True})
        assert [x.text for x in again.choices] == [x.text for x in c.choices]  # reproducible
        stream = await client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "x"}], n=2, max_tokens=5, stream=True,
            extra_body={"ignore_eos": True})
        texts = ["", ""]
        reasons: dict[int, str] = {}
        async for chunk in stream:
            for ch in chunk.choices:
                texts[ch.index] += ch.delta.content or ""
                if ch.finish_reason:
                    reasons[ch.index] = ch.finish_reason
        assert reasons == {0: "length", 1: "length"} and all(texts)

    front(body)


def test_logprobs_in_both_formats(front) -> None:
    async def body(f: Front) -> None:
        client = f.openai()
        chat = await client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "x"}], max_tokens=6, logprobs=True,
            top_logprobs=3, extra_body={"ignore_eos": True})
        content = chat.choices[0].logprobs.content
        assert len(content) == chat.usage.completion_tokens == 6
        for e in content:
            assert len(e.top_logprobs) == 3 and e.logprob <= 0 and e.bytes == list(e.token.encode())
        c = await client.completions.create(model="fake", prompt="x", max_tokens=4, logprobs=2,
                                            extra_body={"ignore_eos": True})
        lp = c.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
        assert lp.text_offset[0] == 0 and all(len(t) <= 2 for t in lp.top_logprobs)
        plain = await client.completions.create(model="fake", prompt="x", max_tokens=2)
        assert plain.choices[0].logprobs is None

    front(body)


def test_errors_have_openai_shape_and_status(front) -> None:
    async def body(f: Front) -> None:
        client = f.openai()
        with pytest.raises(openai.NotFoundError) as nf:
            await client.completions.create(model="gpt-4", prompt="x")
        assert nf.value.body["param"] == "model" and nf.value.body["code"] == "model_not_found"
        cases = [
            ({"prompt": "x", "best_of": 2, "stream": True}, "best_of"),
            ({"prompt": "x", "temperature": "hot"}, "temperature"),
            ({"prompt": "x", "top_p": 0}, "top_p"),
            ({"prompt": "x", "max_tokens": 5000}, "max_tokens"),  # model.max_gen is 1024
            ({"prompt": "x", "n": 1000}, "n"),
            ({"prompt": [], "n": 1}, "prompt"),
            ({"prompt": "x", "stop": ["ok", 3]}, "stop"),
            ({"prompt": "x", "logprobs": 21}, "logprobs"),
            ({"prompt": "x" * 5000}, "prompt"),  # longer than model.max_input: the daemon refuses
            ({"prompt": [[1, 2], [300]]}, "prompt"),  # id outside the byte vocabulary
        ]
        for extra, param in cases:
            r = await f.http.post("/v1/completions", json={"model": "fake", **extra})
            err = r.json()["error"]
            assert (r.status_code, err["param"]) == (400, param), (extra, err)
            assert err["type"] == "invalid_request_error" and err["message"]
        r = await f.http.post("/v1/chat/completions", json={"messages": [{"role": "tool", "content": "x"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        r = await f.http.post("/v1/chat/completions", content=b"{not json")
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        r = await f.http.get("/v1/nothing")
        assert r.status_code == 404 and "error" in r.json()

    front(body)


def test_api_key_guards_v1_but_not_health(front) -> None:
    async def body(f: Front) -> None:
        with pytest.raises(openai.AuthenticationError):
            await f.openai(api_key="wrong").models.list()
        assert len((await f.openai(api_key="sekrit").models.list()).data) == 1
        assert (await f.http.post("/v1/completions", json={"prompt": "x"})).status_code == 401
        for path in ("/health", "/ready", "/metrics"):
            assert (await f.http.get(path)).status_code == 200, path

    front(body, settings={"api_key": "sekrit"})


def test_health_ready_metrics_and_model_name_override(front) -> None:
    async def body(f: Front) -> None:
        assert (await f.http.get("/health")).status_code == 200
        ready = (await f.http.get("/ready")).json()
        assert ready["ready"] is True and ready["workers"] == 1
        # As if the config started two workers: 1/2 is not ready.
        cfg = f.h.server.cfg
        spawn = cfg.workers.spawn
        object.__setattr__(cfg.workers, "spawn", 2)
        try:
            not_yet = await f.http.get("/ready")
            assert not_yet.status_code == 503 and not_yet.json()["why"] == "1/2 workers active"
            assert (await f.http.get("/ready?min_workers=1")).status_code == 200
        finally:
            object.__setattr__(cfg.workers, "spawn", spawn)
        metrics = (await f.http.get("/metrics")).text
        assert "sclsd:request_success_total" in metrics or "# HELP sclsd:" in metrics
        assert (await f.http.get("/v1/models")).json()["data"][0]["id"] == "my-model"
        ok = await f.http.post("/v1/completions", json={"model": "my-model", "prompt": "x", "max_tokens": 1})
        assert ok.status_code == 200 and ok.json()["model"] == "my-model"
        assert (await f.http.post("/v1/completions", json={"model": "fake", "prompt": "x"})).status_code == 404
        f.h.server.drain.draining = True
        r = await f.http.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining"

    front(body, settings={"model_name": "my-model"})


def test_health_is_503_without_a_daemon(front) -> None:
    async def body(f: Front) -> None:
        await f.h.server.stop()
        await f.app.state.api.link.close()
        assert (await f.http.get("/health")).status_code == 503
        assert (await f.http.get("/ready")).status_code == 503
        r = await f.http.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "daemon_unavailable"

    front(body)


def test_overload_is_429(front) -> None:
    async def body(f: Front) -> None:
        w = f.h.worker("slow", hold=True)
        await f.h.registered("slow")
        f.h.drain("w0")  # only the holding worker serves
        await f.h.submit(RecConn(), id="hog", max_tokens=4)
        with pytest.raises(openai.RateLimitError) as rl:
            await f.openai().completions.create(model="fake", prompt="x", max_tokens=2)
        assert rl.value.body["code"] == "overloaded"
        w.release()

    front(body, daemon={"max_queued_requests": 1})


async def _asgi(app: Any, path: str, payload: dict[str, Any], gone: asyncio.Event,
                sent: list[dict[str, Any]], progress: asyncio.Event) -> None:
    """Call the app as a server would, the client disconnecting once ``gone`` is set;
    ``progress`` is set at each message the app sends."""
    body = msgspec.json.encode(payload)
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)
        progress.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("sclsd", 80)}
    await app(scope, receive, send)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_goes_away_cancels_its_requests_at_once(front, stream: bool) -> None:
    async def body(f: Front) -> None:
        w = f.h.worker("slow", hold=True)  # holds every batch: nothing would ever finish
        await f.h.registered("slow")
        f.h.drain("w0")
        gone, sent, progress = asyncio.Event(), [], asyncio.Event()
        call = asyncio.ensure_future(_asgi(f.app, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "x"}], "n": 2, "max_tokens": 50, "stream": stream,
        }, gone, sent, progress))
        await until(w.got, lambda: len(f.h.live) >= 2 and bool(w.held))
        if stream:  # the response started: the role chunks
            await until(progress, lambda: any(m.get("body") for m in sent))
        gone.set()
        await asyncio.wait_for(call, 5)
        await asyncio.wait_for(f.h.server.idle.wait(), 2)
        assert f.live == 0
        assert f.h.counters().get("cancelled", 0) >= 2 or not f.h.server.sched.live

    front(body)


def test_a_stream_that_fails_after_it_started_sends_one_error_event(front) -> None:
    async def body(f: Front) -> None:
        w = f.h.worker("slow", hold=True)
        await f.h.registered("slow")
        f.h.drain("w0")
        call = asyncio.ensure_future(f.http.post("/v1/completions", json={
            "prompt": "x", "max_tokens": 5, "stream": True}))
        await until(w.got, lambda: bool(w.held))  # live, and its first slice on the worker
        (rid,) = f.h.live.ids()
        f.h.deliver(f.h.core.fail(rid, "internal", "worker exploded", f.h.server.clock()))
        r = await asyncio.wait_for(call, 5)
        events = sse(r.text)
        assert r.status_code == 200 and events[-1] == "[DONE]"
        errors = [e for e in events[:-1] if "error" in e]
        assert len(errors) == 1 and "worker exploded" in errors[0]["error"]["message"]
        assert all("error" not in e for e in events[:-2])

    front(body)


def test_protocol_fields_reach_the_daemon(front) -> None:
    async def body(f: Front) -> None:
        w = f.h.worker("slow", hold=True)
        await f.h.registered("slow")
        f.h.drain("w0")
        call = asyncio.ensure_future(f.http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 9, "max_tokens": 3,
            "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.05, "seed": 4, "stop": "zz",
            "stop_token_ids": [7], "presence_penalty": 0.1, "frequency_penalty": 0.2,
            "repetition_penalty": 1.1, "ignore_eos": True, "user": "u1", "logprobs": True,
            "top_logprobs": 2}))
        await until(w.got, lambda: bool(w.held))
        (c,) = list(f.h.live)
        g = c.gen
        assert (g.max_tokens, g.cap_max_tokens, g.temperature, g.top_p, g.top_k, g.min_p, g.seed) == (
            9, False, 0.5, 0.9, 5, 0.05, 4)
        assert (g.stop, g.stop_token_ids, g.presence_penalty, g.frequency_penalty) == (["zz"], [7], 0.1, 0.2)
        assert (g.repetition_penalty, g.ignore_eos, g.user, g.logprobs, g.top_logprobs) == (
            1.1, True, "u1", True, 2)
        w.hold = False
        w.release()
        r = await asyncio.wait_for(call, 5)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 9

    front(body)


def test_every_daemon_error_code_maps_to_a_status() -> None:
    from sclsd.http.render import STATUS_OF, from_daemon

    codes = P.ErrorCode.__args__  # type: ignore[attr-defined]
    for code in codes:
        e = from_daemon(P.Error(code=code, message="m"))
        assert e.status == STATUS_OF.get(code, 500)
    assert from_daemon(P.Error(code="overloaded", message="m")).status == 429
    assert from_daemon(P.Error(code="draining", message="m")).status == 503
    assert from_daemon(P.Error(code="bad_request", message="max_tokens: too many")).param == "max_tokens"
