"""Admission, scheduling and results through the in-process transport."""

from __future__ import annotations

from sclsd import protocol as P

from .conftest import Harness, RecConn, held


def test_requests_served_each_with_one_terminal_event(daemon) -> None:
    async def body(h: Harness) -> None:
        h.worker("w0")
        h.worker("w1")
        await h.registered("w0", "w1")
        conn = RecConn()
        rids = [f"r{i}" for i in range(20)]
        for i, rid in enumerate(rids):
            await h.submit(conn, id=rid, prompt=f"prompt number {i}", max_tokens=24)
        await h.finished(conn, *rids)
        for rid in rids:
            assert len(conn.events(rid, P.Accepted)) == 1
            (done,) = conn.terminal(rid)
            assert isinstance(done, P.Done) and done.finish_reason in ("stop", "length")
            assert done.usage.completion_tokens == len(done.token_ids or [])
        assert len(h.live) == 0 and not h.server.sched.live
        served = {m.worker for m in conn.sent if isinstance(m, P.Done)}
        assert served <= {"w0", "w1"}

    daemon(body)


def test_streaming_deltas_add_up_to_the_output(daemon) -> None:
    async def body(h: Harness) -> None:
        h.worker("w0")
        await h.registered("w0")
        conn = RecConn()
        await h.submit(conn, id="s", max_tokens=40, stream=True, ignore_eos=True)
        await h.finished(conn, "s")
        deltas = conn.events("s", P.Delta)
        (done,) = conn.terminal("s")
        assert done.finish_reason == "length" and done.usage.completion_tokens == 40
        assert sum(len(d.token_ids) for d in deltas) == 40
        assert len(deltas) == 40  # S = 8, but each token streamed as the engine emits it

    daemon(body)


def test_refusals_have_codes(daemon) -> None:
    async def body(h: Harness) -> None:
        conn = RecConn()
        await h.submit(conn, id="a", prompt="x", prompt_ids=[1])
        await h.submit(conn, id="b", prompt="")
        await h.submit(conn, id="c", prompt_ids=[300])  # byte tokenizer: vocab 256
        await h.submit(conn, id="d", prompt="y" * 5000)  # max_input 1024
        codes = {m.id: m.code for m in conn.sent if isinstance(m, P.Error)}
        assert codes == {"a": "bad_request", "b": "bad_request", "c": "bad_request", "d": "prompt_too_long"}
        assert h.server.metrics.refused_total == 4

    daemon(body)


def test_long_prompt_refused_before_tokenizing(daemon) -> None:
    async def body(h: Harness) -> None:
        calls = []
        encode = h.server.tok.encode
        h.server.admission.tok.encode = lambda text: calls.append(len(text)) or encode(text)  # type: ignore[method-assign]
        conn = RecConn()
        await h.submit(conn, id="big", prompt="z" * 4_000_000)
        await h.submit(conn, id="ok", prompt="small")
        assert conn.sent[0].code == "prompt_too_long"
        assert calls == [5]  # only the small prompt reached the tokenizer

    daemon(body)


def test_duplicate_id_and_cancel(daemon) -> None:
    async def body(h: Harness) -> None:
        w = h.worker("w0", hold=True)
        await h.registered("w0")
        conn = RecConn()
        await h.submit(conn, id="x", max_tokens=100)
        await h.submit(conn, id="x")
        assert conn.events("x", P.Error)[0].code == "duplicate_id"
        await held(w)
        other = RecConn(cid=2)
        h.server.on_client(other, P.Cancel(id="x"))
        assert other.sent[-1].code == "unknown_id"  # not its request
        h.server.on_client(conn, P.Cancel(id="x"))
        (done,) = conn.events("x", P.Done)  # the duplicate's refusal named "x" too
        assert done.finish_reason == "cancelled"
        w.release()  # the late result of a cancelled request changes nothing
        await h.submit(conn, id="y", max_tokens=4)
        await held(w)
        w.release()
        await h.finished(conn, "y")
        assert len(conn.events("x", P.Done)) == 1

    daemon(body)


def test_disconnect_cancels_without_events(daemon) -> None:
    async def body(h: Harness) -> None:
        h.worker("w0", hold=True)
        await h.registered("w0")
        conn = RecConn()
        await h.submit(conn, id="gone", max_tokens=100)
        conn.closed = True
        h.server.on_client_close(conn)
        assert "gone" not in h.live and not h.server.sched.live
        m = h.server.metrics
        assert m.cancelled.values == {("cancelled",): 1.0, ("timeout",): 0.0}
        assert not any(m.success.values.values())

    daemon(body)


def test_timeout_ends_request(daemon) -> None:
    async def body(h: Harness) -> None:
        conn = RecConn()  # no worker: the request can only wait
        await h.submit(conn, id="t", timeout=0.05)
        await h.finished(conn, "t")
        assert conn.terminal("t")[0].finish_reason == "timeout"

    daemon(body)


def test_per_uid_share_of_the_bounds(daemon) -> None:
    async def body(h: Harness) -> None:
        greedy, polite = RecConn(cid=1, uid=1001), RecConn(cid=2, uid=1002)
        for i in range(6):
            await h.submit(greedy, id=f"g{i}")
        await h.submit(polite, id="p0")
        codes = [m.code for m in greedy.sent if isinstance(m, P.Error)]
        assert codes == ["overloaded"]  # the 6th: one uid holds at most 5 of 10
        assert len(polite.events("p0", P.Accepted)) == 1

    daemon(body, daemon={"max_queued_requests": 10, "uid_share": 0.5})


def test_draining_refuses_new_requests(daemon) -> None:
    async def body(h: Harness) -> None:
        w = h.worker("w0", hold=True)
        await h.registered("w0")
        conn = RecConn()
        await h.submit(conn, id="live", max_tokens=4)
        h.server.drain.begin()
        await h.submit(conn, id="late")
        assert conn.events("late", P.Error)[0].code == "draining"
        await held(w)
        w.release()
        await h.finished(conn, "live")
        await h.server.drain.stopped.wait()  # the drain ends once nothing is live
        assert conn.terminal("live")[0].finish_reason in ("stop", "length")

    daemon(body)


def test_a_burst_keeps_both_workers_busy(daemon) -> None:
    """24 requests at once on 2 workers: the first round gives each worker work (the
    batcher's one-batch answer is split over the idle workers), not one worker all."""

    async def body(h: Harness) -> None:
        w0 = h.worker("w0", hold=True)
        w1 = h.worker("w1", hold=True)
        await h.registered("w0", "w1")
        conn = RecConn()
        rids = [f"b{i}" for i in range(24)]
        for i, rid in enumerate(rids):  # token ids: admitted without a loop turn, one pool
            await h.submit(conn, id=rid, prompt_ids=[3 + i, 4, 5, 6, 7, 8], max_tokens=8)
        await held(w0)
        await held(w1)
        assert w0.held and w1.held
        for w in (w0, w1):
            w.hold = False
            w.release()
        await h.finished(conn, *rids)
        workers = {m.worker for m in conn.sent if isinstance(m, P.Done)}
        assert workers == {"w0", "w1"}

    # The CPU model's profile, where one batch of 24 is the cheapest in summed time (the
    # DP's answer): without work-conserving rounds one worker would get it all.
    daemon(body, scheduler={"profile": "cpu-smollm2-135m"})
