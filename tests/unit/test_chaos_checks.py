"""The checks of ``sclsd-bench chaos`` catch what they are there for: a duplicate terminal
event, a duplicated delta, wrong tokens, a request never ended (the run itself:
``tests/integration/test_chaos.py``)."""

from __future__ import annotations

import asyncio
import random

from sclsd import protocol as P
from sclsd.bench.chaos import ChaosClient, Tally, _Req, reference_tokens


class _Sink:
    def __init__(self) -> None:
        self.frames: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.frames.append(data)


def _done(rid: str, n: int, token_ids: list[int] | None = None) -> P.Done:
    return P.Done(id=rid, finish_reason="length", usage=P.Usage(prompt_tokens=3, completion_tokens=n),
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
    assert (tally.done, tally.duplicated, tally.wrong, tally.unexpected) == (4, 2, 1, 1), tally
    assert list(c.inflight) == ["lost"]
