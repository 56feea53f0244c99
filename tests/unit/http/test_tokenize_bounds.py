"""What one tokenizer request may make sclsd-http hold (issue 28): a prompt that cannot fit
the daemon's ``model.max_input`` is refused before it is tokenized, at most
``MAX_TOKENIZING`` tokenizer calls run at once (a hung-up caller's call keeping its place),
and a large call gives its memory back."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest

from sclsd.http import tokens as T
from sclsd.tokenizer import ByteTokenizer

from .conftest import Front

MAX_INPUT = 64  # the byte tokenizer: a character is at least one token, so 64 characters at most


class Watched(ByteTokenizer):
    """The byte tokenizer, counting its calls and those inside at once; with ``gate``, each
    call waits for it."""

    def __init__(self) -> None:
        self.calls = 0
        self.inside = 0
        self.most = 0
        self.gate: threading.Event | None = None
        self._lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        return self._watched(lambda: super(Watched, self).encode(text))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._watched(lambda: super(Watched, self).decode(ids, skip_special_tokens))

    def _watched(self, call: Callable[[], Any]) -> Any:
        with self._lock:
            self.calls += 1
            self.inside += 1
            self.most = max(self.most, self.inside)
        try:
            if self.gate is not None:
                assert self.gate.wait(10), "the test never opened the gate"
            return call()
        finally:
            with self._lock:
                self.inside -= 1


async def until(pred: Callable[[], bool], timeout: float = 5.0) -> None:
    async def loop() -> None:
        while not pred():
            await asyncio.sleep(0.005)

    await asyncio.wait_for(loop(), timeout)


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(front) -> None:
    tok = Watched()

    async def body(f: Front) -> None:
        too_long = "x" * (MAX_INPUT + 1)
        chat = [{"role": "system", "content": "x" * 40}, {"role": "user", "content": "y" * 25}]
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        for path, req, param in (
                ("/tokenize", {"prompt": too_long}, "prompt"),
                ("/tokenize", {"messages": chat}, "messages"),  # 65 characters over two turns
                ("/tokenize", {"messages": chat, "tools": tools}, "messages"),
                # A chat with tools is rendered here, not in the daemon: the same bound.
                ("/v1/chat/completions", {"model": "fake", "messages": chat, "tools": tools}, "messages")):
            r = await f.http.post(path, json=req)
            err = r.json()["error"]
            assert (r.status_code, err["code"], err["param"]) == (400, "prompt_too_long", param), r.text
            assert f"more than {MAX_INPUT} tokens" in err["message"]
        assert tok.calls == 0  # refused on their length alone
        # What fits is tokenized as before.
        r = await f.http.post("/tokenize", json={"prompt": "x" * MAX_INPUT})
        assert r.status_code == 200 and r.json()["count"] == MAX_INPUT and tok.calls == 1

    front(body, settings={"tokenizer": tok}, model={"max_input": MAX_INPUT})


def test_the_config_files_max_input_bounds_prompts_when_the_daemon_does_not_say(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An older daemon's status has no ``max_input``: the config file's bounds the prompt."""
    async def main() -> None:
        async def status_without_it() -> int | None:
            return None

        t = T.TokenizerAccess(status_without_it, given=ByteTokenizer(), max_input=status_without_it)
        assert await t.bound(await t.view()) is None
        known = T.TokenizerAccess(status_without_it, given=ByteTokenizer(), max_input=_const(8))
        bound = await known.bound(await known.view())
        assert bound == T.PromptBound(8, 8)
        with pytest.raises(T.ApiError) as refused:
            bound.check(9, "prompt")
        assert (refused.value.status, refused.value.param, refused.value.code) == (400, "prompt", "prompt_too_long")
        bound.check(8, "prompt")

    asyncio.run(main())


def _const(n: int) -> Callable[[], Any]:
    async def get() -> int:
        return n

    return get


def test_tokenize_and_detokenize_run_at_most_two_at_once(front) -> None:
    tok = Watched()
    tok.gate = threading.Event()

    async def body(f: Front) -> None:
        tokens = f.app.state.api.tokens
        calls = [asyncio.ensure_future(f.http.post("/tokenize", json={"prompt": f"prompt {i}"}))
                 for i in range(4)]
        calls.append(asyncio.ensure_future(f.http.post("/detokenize", json={"tokens": [104, 105]})))
        try:
            # Two inside the tokenizer, the other three waiting for a place.
            await until(lambda: tok.inside == 2 and tokens.waiting == 3)
            assert tokens.running == 2 and tok.most == 2
        finally:
            tok.gate.set()
        answers = await asyncio.wait_for(asyncio.gather(*calls), 10)
        assert [r.status_code for r in answers] == [200] * 5
        assert [r.json()["count"] for r in answers[:4]] == [8] * 4 and answers[4].json() == {"prompt": "hi"}
        assert tok.most == 2 and tokens.running == tokens.waiting == 0

    front(body, settings={"tokenizer": tok})


def test_a_caller_that_goes_away_leaves_its_call_holding_its_place() -> None:
    """A thread cannot be stopped: its place stays taken until it ends, so callers that hang
    up cannot stack tokenizer calls."""
    async def main() -> None:
        t = T.TokenizerAccess(_const(0), given=ByteTokenizer(), places=2)
        gate = threading.Event()
        first = asyncio.ensure_future(t.run(1, gate.wait, 10))
        second = asyncio.ensure_future(t.run(1, gate.wait, 10))
        await until(lambda: t.running == 2)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        third = asyncio.ensure_future(t.run(1, lambda: "third"))
        await until(lambda: t.waiting == 1)
        assert t.running == 2  # the cancelled call still runs, in its place
        gate.set()
        assert await asyncio.wait_for(third, 5) == "third" and await second is True
        await until(lambda: t.running == 0)

    asyncio.run(main())


def test_a_large_call_gives_its_memory_back(monkeypatch: pytest.MonkeyPatch) -> None:
    trims: list[int] = []
    monkeypatch.setattr(T, "give_back_memory", lambda: trims.append(1) or True)

    async def main() -> None:
        t = T.TokenizerAccess(_const(0), given=ByteTokenizer())
        view = await t.view()
        assert await t.run(T.TRIM_AT - 1, view.encode, "small") == list(b"small")
        assert trims == []
        big = "x" * T.TRIM_AT
        assert len(await t.run(len(big), view.encode, big)) == T.TRIM_AT
        assert trims == [1]
        with pytest.raises(ValueError):  # given back even when the call fails
            await t.run(T.TRIM_AT, int, "not a number")
        assert trims == [1, 1]

    asyncio.run(main())


def test_give_back_memory_works_where_glibc_is_and_is_harmless_elsewhere() -> None:
    import sys

    done = T.give_back_memory()
    assert isinstance(done, bool)
    if sys.platform.startswith("linux") and _glibc():
        assert done
    elif not sys.platform.startswith("linux"):
        assert not done


def _glibc() -> bool:
    import platform

    return platform.libc_ver()[0] == "glibc"
