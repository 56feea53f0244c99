"""A completion's ``max_tokens: 0`` with ``echo`` (OpenAI's legacy completions, vLLM's): the
prompt alone, with its log-probabilities where ``logprobs`` asks, nothing generated in the
answer or its usage; without ``echo`` it is refused by name."""

from __future__ import annotations

from .conftest import Front
from .test_app import sse
from .test_prompt_logprobs import BASE, check_echo_shape

PROMPT = "Hello there"


def test_the_prompt_alone_with_its_logprobs_whole_and_streamed(front) -> None:
    async def body(f: Front) -> None:
        req = {**BASE, "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1}
        r = await f.http.post("/v1/completions", json=req)
        assert r.status_code == 200, r.text
        out = r.json()
        (choice,) = out["choices"]
        assert choice["text"] == PROMPT
        check_echo_shape(choice, PROMPT, 0)  # the prompt's tokens only
        assert out["usage"]["completion_tokens"] == 0 and out["usage"]["prompt_tokens"] == len(PROMPT)
        # The same answer streamed: the prompt in the first chunk, then the end.
        events = sse((await f.http.post("/v1/completions", json={**req, "stream": True})).text)
        assert events[-1] == "[DONE]"
        chunks = [c["choices"][0] for c in events[:-1]]
        assert "".join(c["text"] for c in chunks) == PROMPT and chunks[-1]["finish_reason"] is not None
        streamed = [x for c in chunks if c["logprobs"] for x in c["logprobs"]["token_logprobs"]]
        assert streamed == choice["logprobs"]["token_logprobs"]
        # Without logprobs: the text alone; two prompts, two choices each.
        r = await f.http.post("/v1/completions", json={**BASE, "prompt": [PROMPT, "ab"], "max_tokens": 0,
                                                       "echo": True, "n": 2})
        assert [c["text"] for c in r.json()["choices"]] == [PROMPT, PROMPT, "ab", "ab"]
        assert all(c["logprobs"] is None for c in r.json()["choices"])

    front(body)


def test_zero_needs_echo_and_a_completion(front) -> None:
    async def body(f: Front) -> None:
        r = await f.http.post("/v1/completions", json={**BASE, "prompt": PROMPT, "max_tokens": 0})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        assert "needs echo" in r.json()["error"]["message"]
        r = await f.http.post("/v1/chat/completions", json={**BASE, "max_tokens": 0, "echo": True,
                                                            "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        assert f.live == 0

    front(body)
