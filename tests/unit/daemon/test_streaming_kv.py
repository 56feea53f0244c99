"""Tokens streamed during a slice, and the daemon's bookkeeping of KV that workers keep.

Workers are in-process ``fake`` engines: they stream each iteration's tokens as a
``tokens`` message; with ``hold_results`` the batch's ``result`` waits until the
test sends it, as if the slice were still running.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sclsd import protocol as P
from sclsd.daemon.admission import daemon_id
from worker.engines.fake import FakeEngine

from .conftest import Harness, RecConn, held, until

PROMPT = "hello"


def reference(max_tokens: int, prompt: str = PROMPT) -> list[int]:
    """The fake engine's output for ``prompt`` in one pass (slicing does not change it)."""
    req = P.BatchRequest(rid="ref", token_ids=list(prompt.encode()), max_new_tokens=max_tokens,
                         temperature=0.0, ignore_eos=True)
    outs, _ = FakeEngine(kv_reuse=False).serve(P.BatchMsg(batch_id=1, slice_len=max_tokens, requests=[req]))
    return outs[0].token_ids


def streamed_ids(conn: RecConn, rid: str) -> list[int]:
    return [t for d in conn.events(rid, P.Delta) for t in d.token_ids]


def ctx(h: Harness, rid: str) -> Any:
    return h.entry(rid)


def test_first_delta_arrives_before_its_slice_ends(daemon) -> None:
    async def body(h: Harness) -> None:
        w = h.worker("w0", hold_results=True)
        await h.registered("w0")
        conn = RecConn()
        await h.submit(conn, id="s", max_tokens=20, stream=True, ignore_eos=True)
        await conn.wait_for(lambda: bool(conn.events("s", P.Delta)))
        # The slice's result has not been sent: the client already has tokens.
        assert len(w.held_results) == 1 and not conn.terminal("s")
        first = conn.events("s", P.Delta)[0]
        assert first.token_ids == reference(20)[:1]
        assert ctx(h, "s").req.first_token is not None
        assert h.counters()["slices"] == 0  # the scheduler has not acted yet
        while not conn.terminal("s"):
            await until(w.got, lambda: bool(w.held_results) or bool(conn.terminal("s")))
            w.finish()
            await conn.wait_for(lambda: bool(w.held_results) or bool(conn.terminal("s")))
        (done,) = conn.terminal("s")
        assert done.finish_reason == "length" and done.timings.slices == 3  # S = 8
        # Every token once, in order, none twice (the results added nothing streamed again).
        assert streamed_ids(conn, "s") == reference(20)
        assert done.timings.ttft_s is not None and done.timings.ttft_s <= done.timings.e2e_s

    daemon(body)


class PartlyStreaming(FakeEngine):
    """Streams only the first token of each row per slice: the result brings the rest."""

    def serve(self, batch: P.BatchMsg, emit: Any = None) -> Any:
        def first_only(outputs: list[P.RequestOutput]) -> None:
            if emit is not None and not sent:
                sent.append(True)
                emit(outputs)

        sent: list[bool] = []
        return super().serve(batch, first_only)


def test_result_sends_only_what_was_not_streamed(daemon) -> None:
    async def body(h: Harness) -> None:
        h.transport.connect("w0", PartlyStreaming(), auth=h.server.fleet.secret or "")
        await h.registered("w0")
        conn = RecConn()
        await h.submit(conn, id="s", max_tokens=20, stream=True, ignore_eos=True)
        await h.finished(conn, "s")
        deltas = conn.events("s", P.Delta)
        # Per slice (8, 8, 4 tokens): one streamed token, then the result's remainder.
        assert [len(d.token_ids) for d in deltas] == [1, 7, 1, 7, 1, 3]
        assert streamed_ids(conn, "s") == reference(20)
        assert conn.terminal("s")[0].usage.completion_tokens == 20

    daemon(body)


def test_non_streaming_request_gets_ttft_from_the_first_tokens(daemon) -> None:
    async def body(h: Harness) -> None:
        w = h.worker("w0", hold_results=True)
        await h.registered("w0")
        conn = RecConn()
        await h.submit(conn, id="n", max_tokens=4, stream=False, ignore_eos=True)
        await until(w.got, lambda: bool(w.held_results))
        await until(w.got, lambda: ctx(h, "n").req.first_token is not None, timeout=2.0)
        assert not conn.events("n", P.Delta)
        w.finish()
        await h.finished(conn, "n")
        (done,) = conn.terminal("n")
        assert done.token_ids == reference(4) and done.timings.ttft_s is not None

    daemon(body)


def test_streamed_tokens_stand_when_the_worker_is_lost(daemon) -> None:
    async def body(h: Harness) -> None:
        w0 = h.worker("w0", hold_results=True)
        await h.registered("w0")
        conn = RecConn()
        await h.submit(conn, id="s", max_tokens=20, stream=True, ignore_eos=True)
        await until(w0.got, lambda: bool(w0.held_results))
        await conn.wait_for(lambda: len(streamed_ids(conn, "s")) == 8)  # the whole first slice
        h.lose("w0")  # its result never comes
        c = ctx(h, "s")
        assert c.req.num_generated == 8 and c.out.ids == reference(20)[:8]
        h.worker("w1")
        await h.finished(conn, "s")
        (done,) = conn.terminal("s")
        assert done.worker == "w1" and done.usage.completion_tokens == 20
        assert streamed_ids(conn, "s") == reference(20)  # continued after them, none repeated

    daemon(body)


def test_streamed_end_of_a_row_finishes_it_when_the_worker_is_lost(daemon) -> None:
    async def body(h: Harness) -> None:
        w0 = h.worker("w0", hold_results=True)
        await h.registered("w0")
        conn = RecConn()
        await h.submit(conn, id="s", max_tokens=5, stream=True, ignore_eos=True)
        await until(w0.got, lambda: bool(w0.held_results))
        await conn.wait_for(lambda: len(streamed_ids(conn, "s")) == 5)
        h.lose("w0")
        await h.finished(conn, "s")
        (done,) = conn.terminal("s")
        assert done.finish_reason == "length" and done.usage.completion_tokens == 5
        assert streamed_ids(conn, "s") == reference(5)

    daemon(body)


def test_tokens_are_checked_like_results(daemon) -> None:
    async def body(h: Harness) -> None:
        w0 = h.worker("w0", hold=True)
        w1 = h.worker("w1", hold=True)
        await h.registered("w0", "w1")
        conn = RecConn()
        await h.submit(conn, id="s", max_tokens=3, stream=True, ignore_eos=True)
        await until(h.wake, lambda: bool(w0.held or w1.held))
        owner, other = (w0, w1) if w0.held else (w1, w0)
        bid = owner.held[0].batch_id

        def tokens(w: Any, batch_id: int, rid: str, ids: list[int]) -> None:
            # Workers know a request by the daemon's id for it.
            w.send(P.Tokens(worker_id=w.wid, batches=[P.BatchTokens(
                batch_id=batch_id, outputs=[P.RequestOutput(rid=daemon_id(conn, rid), token_ids=ids)])]))

        tokens(other, bid, "s", [7])  # not its batch
        tokens(owner, bid + 100, "s", [7])  # no such batch
        tokens(owner, bid, "nobody", [7])  # not a row of the batch
        tokens(owner, bid, "s", [50, 51, 52, 53, 54])  # past the budget of 3: capped
        await conn.wait_for(lambda: bool(conn.events("s", P.Delta)))
        assert streamed_ids(conn, "s") == [50, 51, 52]
        # The result is authoritative for the scheduler; nothing more goes out.
        owner.release()
        await h.finished(conn, "s")
        assert streamed_ids(conn, "s") == [50, 51, 52]
        assert conn.terminal("s")[0].usage.completion_tokens == 3

    daemon(body)


# --------------------------------------------------------------------------- retained KV


def kv_reuse(h: Harness) -> None:
    """Switch the daemon's policy to KV reuse (``scheduler.kv_reuse``): batches ask workers
    to use and keep KV across slices."""
    h.server.sched.policy = dataclasses.replace(h.server.sched.policy, kv_reuse=True)


def test_kv_worker_follows_results_and_ended_requests_are_released(daemon) -> None:
    async def body(h: Harness) -> None:
        kv_reuse(h)
        w = h.worker("w0", hold=True)
        await h.registered("w0")
        conn = RecConn()
        await h.submit(conn, id="k", max_tokens=40, ignore_eos=True)
        await held(w)
        w.release(1)  # first slice: 8 tokens
        await held(w)  # the second slice is on its way: the first's result was applied
        r = ctx(h, "k").req
        assert r.kv_worker == "w0" and r.kv_tokens == len(PROMPT) + 8 - 1
        k = daemon_id(conn, "k")  # what the daemon and its workers call it
        assert w.engine.kv.store.held() == {k: len(PROMPT) + 7}
        w.release(1)
        await held(w)
        assert h.counters()["reused_tokens"] == len(PROMPT) + 7
        assert h.counters()["prefill_tokens"] == len(PROMPT) + 1
        h.server.on_client(conn, P.Cancel(id="k"))
        await until(w.got, lambda: any(isinstance(m, P.Release) for m in w.received))
        assert [m.rids for m in w.received if isinstance(m, P.Release)] == [[k]]
        assert w.engine.kv.store.held() == {}

    daemon(body)


def test_a_request_moving_to_another_worker_is_released_on_the_old_one(daemon) -> None:
    async def body(h: Harness) -> None:
        kv_reuse(h)
        w0 = h.worker("w0", hold=True)
        await h.registered("w0")
        conn = RecConn()
        await h.submit(conn, id="m", max_tokens=20, ignore_eos=True)
        await held(w0)
        h.drain("w0")  # its next slice must go elsewhere
        w0.release(1)
        await until(h.wake, lambda: ctx(h, "m").req.num_generated == 8)
        assert ctx(h, "m").req.kv_worker == "w0"  # kept there while it waits
        w1 = h.worker("w1", hold=True)
        await held(w1)
        await until(w0.got, lambda: any(isinstance(m, P.Release) for m in w0.received))
        assert w0.engine.kv.store.held() == {}
        assert ctx(h, "m").req.kv_worker is None
        w1.hold = False
        w1.release()
        await h.finished(conn, "m")
        (done,) = conn.terminal("m")
        assert done.worker == "w1" and done.token_ids == reference(20)

    daemon(body)


def test_evicted_kv_is_forgotten(daemon) -> None:
    async def body(h: Harness) -> None:
        kv_reuse(h)
        # Room for one retained context (5 + 7 tokens of 46,080 bytes), not two.
        conn = RecConn()
        await h.submit(conn, id="a", max_tokens=20, ignore_eos=True)
        await h.submit(conn, id="b", max_tokens=20, ignore_eos=True)
        w = h.worker("w0", hold=True, kv_retain_bytes=20 * 46_080, decode_s=0.001)  # both wait: one batch
        await held(w)
        assert [len(b.requests) for b in w.held] == [2]
        w.release(1)
        await held(w)
        kept = {rid: ctx(h, rid).req.kv_worker for rid in ("a", "b")}
        assert sorted(kept.values(), key=str) == [None, "w0"]  # the first kept was evicted
        assert h.counters()["kv_evicted"] == 1
        w.hold = False
        w.release()
        await h.finished(conn, "a", "b")
        assert [conn.terminal(r)[0].token_ids for r in ("a", "b")] == [reference(20)] * 2

    daemon(body)


def test_dead_worker_forgets_its_kv(daemon) -> None:
    async def body(h: Harness) -> None:
        kv_reuse(h)
        w0 = h.worker("w0", hold=True)
        await h.registered("w0")
        conn = RecConn()
        await h.submit(conn, id="d", max_tokens=20, ignore_eos=True)
        await held(w0)
        w0.release(1)
        await held(w0)
        assert ctx(h, "d").req.kv_worker == "w0"
        h.lose("w0")
        assert ctx(h, "d").req.kv_worker is None and ctx(h, "d").req.kv_tokens == 0

    daemon(body)


def test_without_kv_reuse_workers_keep_nothing(daemon) -> None:
    async def body(h: Harness) -> None:
        h.server.sched.policy = dataclasses.replace(h.server.sched.policy, kv_reuse=False)
        w = h.worker("w0")
        await h.registered("w0")
        conn = RecConn()
        await h.submit(conn, id="p", max_tokens=20, ignore_eos=True)
        await h.finished(conn, "p")
        assert all(not b.kv_reuse for b in w.batches())
        assert h.counters()["reused_tokens"] == 0
        assert conn.terminal("p")[0].token_ids == reference(20)

    daemon(body)


def test_a_stop_string_seen_in_streamed_text_ends_the_request_at_its_slice_end(daemon) -> None:
    from sclsd.tokenizer import ByteTokenizer

    full = ByteTokenizer().decode(reference(20))
    stop = "s"  # completed by the fifth token, in the first slice
    assert full.index(stop) > 0 and ByteTokenizer().decode(reference(20)[:5]).endswith(stop)

    async def body(h: Harness) -> None:
        w = h.worker("w0", hold_results=True)
        await h.registered("w0")
        conn = RecConn()
        await h.submit(conn, id="s", max_tokens=20, stream=True, ignore_eos=True, stop=[stop])
        await until(w.got, lambda: bool(w.held_results))
        await conn.wait_for(lambda: bool(conn.events("s", P.Delta)))
        assert not conn.terminal("s")  # the scheduler acts at the slice's end
        w.finish()
        await h.finished(conn, "s")
        (done,) = conn.terminal("s")
        assert done.finish_reason == "stop" and done.timings.slices == 1
        text = "".join(d.text for d in conn.events("s", P.Delta))
        assert stop not in text and full.startswith(text)
        assert streamed_ids(conn, "s") == reference(20)[:5]  # up to the one completing it
        assert done.usage.completion_tokens == 5

    daemon(body)


def test_done_counts_the_prompt_tokens_a_slice_took_from_kept_kv(daemon) -> None:
    async def body(h: Harness) -> None:
        kv_reuse(h)
        h.worker("w0")
        await h.registered("w0")
        conn = RecConn()
        await h.submit(conn, id="one", max_tokens=4, ignore_eos=True)  # a single slice
        await h.submit(conn, id="many", max_tokens=30, ignore_eos=True)  # slices 2.. reuse the prompt
        await conn.wait_for(lambda: conn.terminal("one") and conn.terminal("many"))
        (one,), (many,) = conn.terminal("one"), conn.terminal("many")
        assert one.usage.cached_tokens == 0
        assert many.usage.cached_tokens == many.usage.prompt_tokens == len(PROMPT)

    daemon(body)
