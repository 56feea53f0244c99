"""``tokens`` are the one channel for generated tokens: a row's part counts only where its
previous one ended (``RequestOutput.start``), a result brings only what no part did, and a
result that does not follow the stream fails its batch, the tokens already streamed
standing."""

from __future__ import annotations

from pathlib import Path

from sclsd import protocol as P

from .test_core import Driver


def _tokens(drv: Driver, bid: int, rid: str, ids: list[int], start: int) -> None:
    drv.message("w0", P.Tokens(worker_id="w0", batches=[P.BatchTokens(batch_id=bid, outputs=[
        P.RequestOutput(rid=rid, token_ids=ids, start=start)])]))


def _streamed(drv: Driver, rid: str) -> list[int]:
    return [t for d in drv.events("c", P.Delta) if d.id == rid for t in d.token_ids]


def test_a_part_that_does_not_follow_the_last_is_not_taken(tmp_path: Path) -> None:
    drv = Driver(tmp_path)
    drv.join("w0")
    drv.submit("c", "s", max_tokens=8, stream=True, ignore_eos=True)
    drv.step()
    (b,) = drv.batches("w0")
    _tokens(drv, b.batch_id, "s", [104, 105], 0)
    _tokens(drv, b.batch_id, "s", [106], 0)  # again from the start: a repeat
    _tokens(drv, b.batch_id, "s", [107], 3)  # past a part we never had
    _tokens(drv, b.batch_id, "s", [108, 109], 2)  # where the first ended
    assert _streamed(drv, "s") == [104, 105, 108, 109]
    # The result brings the other four, after the four streamed.
    drv.message("w0", P.Result(worker_id="w0", batch_id=b.batch_id, outputs=[
        P.RequestOutput(rid="s", token_ids=[110, 111, 112, 113], start=4, finish_reason="length")],
        stats=P.BatchStats(iterations=8, batch_size=1)))
    (done,) = drv.terminal("c", "s")
    assert isinstance(done, P.Done) and done.usage.completion_tokens == 8
    assert _streamed(drv, "s") == [104, 105, 108, 109, 110, 111, 112, 113]


def test_a_result_that_does_not_follow_the_stream_fails_its_batch_and_the_streamed_tokens_stand(
        tmp_path: Path) -> None:
    drv = Driver(tmp_path)
    drv.join("w0")
    drv.submit("c", "s", max_tokens=20, stream=True, ignore_eos=True)
    drv.step()
    (b,) = drv.batches("w0")
    drv.served.add(b.batch_id)
    drv.whole.pop(b.batch_id)
    _tokens(drv, b.batch_id, "s", [104, 105, 106], 0)
    # The worker says it streamed 5: two never reached us.
    drv.message("w0", P.Result(worker_id="w0", batch_id=b.batch_id, outputs=[
        P.RequestOutput(rid="s", token_ids=[1, 2, 3], start=5)], stats=P.BatchStats(iterations=8, batch_size=1)))
    e = drv.core.table.get("s")
    assert e is not None and e.req.num_generated == 3 and e.req.failures == 1
    assert b.batch_id not in drv.core.sched.batches and not drv.terminal("c", "s")
    drv.until_done("c", "s")  # it goes on after the three its client saw
    (done,) = drv.terminal("c", "s")
    assert isinstance(done, P.Done) and done.usage.completion_tokens == 20
    assert _streamed(drv, "s")[:3] == [104, 105, 106] and len(_streamed(drv, "s")) == 20


def test_a_request_that_does_not_stream_gets_its_streamed_tokens_in_done(tmp_path: Path) -> None:
    drv = Driver(tmp_path)
    drv.join("w0")
    drv.submit("c", "n", max_tokens=20, ignore_eos=True)
    for _ in range(3):
        drv.now += 1.0
        drv.step()
        drv.serve("w0", stream=True)  # most tokens come in tokens messages, the rest in results
    (done,) = drv.terminal("c", "n")
    assert isinstance(done, P.Done) and not drv.events("c", P.Delta)
    want = drv.engines["w0"].serve(P.BatchMsg(batch_id=1, slice_len=20, requests=[P.BatchRequest(
        rid="x", token_ids=list(b"hello"), max_new_tokens=20, ignore_eos=True, temperature=0.0)]))[0][0].token_ids
    assert done.token_ids == want and done.text == drv.tok.decode(want)
