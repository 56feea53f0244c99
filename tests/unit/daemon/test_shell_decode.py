"""Detokenizing in the shell: a small job is decoded at once on the loop, a large one in the
pool, and the texts reach the core in the order the jobs were asked for, whichever way
each was decoded."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from sclsd.daemon.serving.effects import Effects, TextJob
from sclsd.daemon.shell import INLINE_DECODE_TOKENS, Shell
from sclsd.tokenizer import ByteTokenizer


@dataclass
class Job(TextJob):
    name: str
    seqs: list[list[int]]
    keep_special: list[bool]


class SlowBytes(ByteTokenizer):
    """Decodes in the pool only once let go."""

    def __init__(self) -> None:
        self.go = threading.Event()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if threading.current_thread() is not threading.main_thread():
            assert self.go.wait(10)
        return super().decode(ids, skip_special_tokens)


class Core:
    def __init__(self) -> None:
        self.tok = SlowBytes()
        self.table: list[Any] = []
        self.order: list[tuple[str, Any]] = []
        self.any = asyncio.Event()

    def decoded(self, job: Any, texts: Any, now: float) -> Effects:
        self.order.append((getattr(job, "name", job), texts))
        self.any.set()
        return Effects()


def test_small_jobs_at_once_large_ones_in_the_pool_and_the_order_kept() -> None:
    async def main() -> None:
        core = Core()
        pool = ThreadPoolExecutor(1)
        shell = Shell(None, core, None, None, None, None, pool, asyncio.Event(), lambda: 0.0)  # type: ignore[arg-type]
        shell._decode(Job("small", [[104, 105]], [False]))
        assert core.order == [("small", ["hi"])]  # at once, on the loop
        big = [[97] * INLINE_DECODE_TOKENS, [98]]
        shell._decode(Job("big", big, [False, False]))
        shell._decode(Job("after", [[99]], [False]))
        await asyncio.sleep(0)
        assert [n for n, _ in core.order] == ["small"]  # the small one waits behind the big
        core.tok.go.set()
        while len(core.order) < 3:
            core.any.clear()
            await asyncio.wait_for(core.any.wait(), 10)
        assert [n for n, _ in core.order] == ["small", "big", "after"]
        assert core.order[1][1] == ["a" * INLINE_DECODE_TOKENS, "b"] and core.order[2][1] == ["c"]
        pool.shutdown()

    asyncio.run(main())


def test_a_long_prompts_logprobs_are_named_in_the_pool_in_their_turn() -> None:
    """Naming a long prompt's log-probabilities (an entry per token, with its alternatives) is
    a job like detokenizing: in the pool when large, its named entries back in order."""
    from sclsd import protocol as P
    from sclsd.daemon.serving.events import PromptNamesJob

    async def main() -> None:
        core = Core()
        pool = ThreadPoolExecutor(1)
        shell = Shell(None, core, None, None, None, None, pool, asyncio.Event(), lambda: 0.0)  # type: ignore[arg-type]
        lps = [P.TokenLogprobs(P.Logprob(97, -1.0), [P.Logprob(98, -0.5)]) for _ in range(INLINE_DECODE_TOKENS)]
        job = PromptNamesJob(None, lps, {})  # type: ignore[arg-type]
        assert job.size() == 2 * INLINE_DECODE_TOKENS
        shell._decode(job)
        shell._decode(Job("after", [[99]], [False]))
        await asyncio.sleep(0)
        assert core.order == []  # in the pool, and the small one after it waits its turn
        core.tok.go.set()
        while len(core.order) < 2:
            core.any.clear()
            await asyncio.wait_for(core.any.wait(), 10)
        (first, got), (second, _) = core.order
        assert first is job and second == "after"
        assert {(e.chosen.token, e.top[0].token) for e in got} == {("a", "b")} and len(got) == len(lps)
        pool.shutdown()

    asyncio.run(main())
