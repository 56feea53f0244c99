"""Admission, scheduling and results.

Scheduling and results on the serving core driven synchronously with a fake clock
(:class:`~.driving.WorkerDriver`, :class:`~.driving.TimedDriver` where the metrics count):
workers are ``fake`` engines served by hand. Admission (refusals and their codes, the
per-uid share, the drain) lives in the asyncio shell, in front of the core: those tests
run the whole server over the in-process transport.
"""

from __future__ import annotations

import math
from pathlib import Path

from sclsd import protocol as P

from .conftest import Harness, RecConn, held
from .driving import TimedDriver, WorkerDriver


def test_requests_served_each_with_one_terminal_event(tmp_path: Path) -> None:
    drv = WorkerDriver(tmp_path)
    drv.join("w0")
    drv.join("w1")
    rids = [f"r{i}" for i in range(20)]
    for i, rid in enumerate(rids):
        drv.submit("c", rid, prompt=f"prompt number {i}", max_tokens=24)
    drv.until_done("c", *rids, wid=("w0", "w1"))
    for rid in rids:
        assert len([e for e in drv.events("c", P.Accepted) if e.id == rid]) == 1
        (done,) = drv.terminal("c", rid)
        assert isinstance(done, P.Done) and done.finish_reason in ("stop", "length")
        assert done.usage.completion_tokens == len(done.token_ids or [])
    assert len(drv.core.table) == 0 and not drv.core.sched.live
    served = {d.worker for d in drv.events("c", P.Done)}
    assert served <= {"w0", "w1"}


def test_streaming_deltas_add_up_to_the_output(tmp_path: Path) -> None:
    drv = WorkerDriver(tmp_path)
    drv.join("w0")
    drv.submit("c", "s", max_tokens=40, stream=True, ignore_eos=True)
    drv.until_done("c", "s", stream=True)
    deltas = [d for d in drv.events("c", P.Delta) if d.id == "s"]
    (done,) = drv.terminal("c", "s")
    assert done.finish_reason == "length" and done.usage.completion_tokens == 40
    assert sum(len(d.token_ids) for d in deltas) == 40
    assert len(deltas) == 40  # S = 8, but each token streamed as the engine emits it


def test_duplicate_id_and_cancel(tmp_path: Path) -> None:
    """The core refuses a second live request of one id (admission refuses it first on a
    connection: tests/unit/daemon/test_request_ids.py), and only the owner cancels."""
    drv = WorkerDriver(tmp_path)
    drv.join("w0")
    drv.submit("c", "x", max_tokens=100)
    drv.submit("c", "x")
    assert [e.code for e in drv.events("c", P.Error) if e.id == "x"] == ["duplicate_id"]
    drv.step()
    assert drv.batches("w0")  # on the worker, not served
    drv.run(drv.core.cancel("x", drv.now, requester="other"))
    assert [(e.code, e.id) for e in drv.events("other")] == [("unknown_id", "x")]  # not its request
    drv.run(drv.core.cancel("x", drv.now, requester="c"))
    (done,) = drv.events("c", P.Done)  # the duplicate's refusal named "x" too
    assert done.id == "x" and done.finish_reason == "cancelled"
    drv.serve("w0")  # the late result of a cancelled request changes nothing
    drv.submit("c", "y", max_tokens=4)
    drv.until_done("c", "y")
    assert len([d for d in drv.events("c", P.Done) if d.id == "x"]) == 1
    assert isinstance(drv.terminal("c", "y")[0], P.Done)


def test_disconnect_cancels_without_events(tmp_path: Path) -> None:
    drv = TimedDriver(tmp_path)
    drv.join("w0")
    drv.submit("c", "gone", max_tokens=100)
    drv.step()
    assert drv.batches("w0")  # on the worker, not served
    before = len(drv.to_client["c"])
    eff = drv.run(drv.core.client_gone("c", drv.now))
    assert not eff.to_clients and len(drv.to_client["c"]) == before
    assert "gone" not in drv.core.table and not drv.core.sched.live
    m = drv.metrics
    assert m.cancelled.values == {("cancelled",): 1.0, ("timeout",): 0.0}
    assert not any(m.success.values.values())


def test_timeout_ends_request(tmp_path: Path) -> None:
    drv = WorkerDriver(tmp_path)  # no worker: the request can only wait
    drv.submit("c", "t", timeout=0.05)
    deadline = drv.now + 0.05
    _, wait = drv.core.step(drv.now)
    assert drv.now + wait == deadline  # the next step is due exactly then
    drv.now = math.nextafter(deadline, 0.0)
    drv.step()
    assert not drv.terminal("c", "t")  # not a moment before its deadline
    drv.now = deadline
    drv.step()
    assert drv.terminal("c", "t")[0].finish_reason == "timeout"


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


def test_a_burst_keeps_both_workers_busy(tmp_path: Path) -> None:
    """24 requests at once on 2 workers: the first round gives each worker work (the
    batcher's one-batch answer is split over the idle workers), not one worker all."""
    # The CPU model's profile, where one batch of 24 is the cheapest in summed time (the
    # DP's answer): without work-conserving rounds one worker would get it all.
    drv = WorkerDriver(tmp_path, scheduler={"profile": "cpu-smollm2-135m"})
    drv.join("w0")
    drv.join("w1")
    rids = [f"b{i}" for i in range(24)]
    for i, rid in enumerate(rids):  # all in the pool before the first round
        drv.submit("c", rid, prompt_ids=[3 + i, 4, 5, 6, 7, 8], max_tokens=8)
    drv.step()
    assert drv.batches("w0") and drv.batches("w1")
    drv.until_done("c", *rids, wid=("w0", "w1"))
    workers = {d.worker for d in drv.events("c", P.Done)}
    assert workers == {"w0", "w1"}
