"""A request that ends in the daemon while its batch is in flight has its row ended on the
worker (``cancel_rows``), whatever ended it: its client's cancel or disconnect, its deadline, a
stop string seen in its stream. And the one record of a request's progress: tokens count as
they stream, so a slice that ends without a result leaves the next grant's reservation right.
The serving core on a fake clock (:class:`~.driving.WorkerDriver`)."""

from __future__ import annotations

from pathlib import Path

from sclsd import protocol as P

from .driving import WorkerDriver

CB = {"policy": "scls-cb", "slice_len": 16}


def cancels(drv: WorkerDriver, wid: str) -> list[tuple[int, str]]:
    return [(c.batch_id, c.rid) for m in drv.to_worker.get(wid, []) if isinstance(m, P.CancelRows) for c in m.rows]


def in_flight(drv: WorkerDriver, rid: str) -> tuple[str, int]:
    r = drv.core.sched.get(rid)
    assert r is not None and r.batch_id is not None and r.worker is not None
    return r.worker, r.batch_id


def test_a_cancel_ends_the_row_on_its_worker_once(tmp_path: Path) -> None:
    drv = WorkerDriver(tmp_path, scheduler=CB)
    drv.join("w0", batching="continuous")
    drv.submit("c", "a", max_tokens=200, ignore_eos=True)
    drv.submit("c", "b", max_tokens=200, ignore_eos=True)
    drv.step()
    wid, bid = in_flight(drv, "a")
    drv.run(drv.core.cancel("a", drv.now, requester="c"))
    assert cancels(drv, wid) == [(bid, "a")]
    assert drv.core.dispatch.cancelled_rows == 1
    drv.run(drv.core.cancel("a", drv.now, requester="c"))  # not live any more: nothing more
    assert cancels(drv, wid) == [(bid, "a")]


def test_a_client_that_hangs_up_has_its_rows_ended_in_one_message_per_worker(tmp_path: Path) -> None:
    drv = WorkerDriver(tmp_path, scheduler=CB)
    drv.join("w0", batching="continuous")
    drv.join("w1", batching="continuous")
    rids = [f"r{i}" for i in range(6)]
    for rid in rids:
        drv.submit("c", rid, max_tokens=200, ignore_eos=True)
    drv.submit("other", "x", max_tokens=200, ignore_eos=True)
    drv.step()
    where = {rid: in_flight(drv, rid) for rid in rids}
    eff = drv.run(drv.core.client_gone("c", drv.now))
    msgs = [(w, m) for w, m in eff.worker_messages() if isinstance(m, P.CancelRows)]
    assert len(msgs) == len({w for w, _ in where.values()})  # one per worker
    got = {(w, c.batch_id, c.rid) for w, m in msgs for c in m.rows}
    assert got == {(w, b, rid) for rid, (w, b) in where.items()}
    assert "x" not in {c.rid for _, m in msgs for c in m.rows}


def test_a_request_past_its_deadline_has_its_row_ended(tmp_path: Path) -> None:
    drv = WorkerDriver(tmp_path, scheduler=CB)
    drv.join("w0", batching="continuous")
    drv.submit("c", "t", max_tokens=200, ignore_eos=True, timeout=5.0)
    drv.step()
    wid, bid = in_flight(drv, "t")
    drv.now += 6.0
    drv.step()
    (done,) = drv.terminal("c", "t")
    assert done.finish_reason == "timeout" and cancels(drv, wid) == [(bid, "t")]


def test_a_request_waiting_in_the_daemon_is_cancelled_there_alone(tmp_path: Path) -> None:
    drv = WorkerDriver(tmp_path, scheduler=CB)
    drv.submit("c", "p", max_tokens=20)  # no worker yet: it waits in the pool
    drv.run(drv.core.cancel("p", drv.now, requester="c"))
    assert drv.terminal("c", "p") and not any(cancels(drv, w) for w in drv.to_worker)


def test_the_grant_after_a_lost_worker_reserves_the_tokens_it_streamed(tmp_path: Path) -> None:
    """Tokens streamed before a worker was lost count in the request's context at once: the
    next grant reserves prompt + streamed + its tokens (it reserved the prompt alone before)."""
    drv = WorkerDriver(tmp_path, scheduler=CB)
    drv.join("w0", batching="continuous")
    drv.submit("c", "s", prompt="x" * 40, max_tokens=100, stream=True, ignore_eos=True)
    drv.step()
    prompt = drv.core.sched.get("s").prompt_len  # type: ignore[union-attr]
    drv.serve("w0", stream=True, result=False)  # the grant's 16 tokens streamed, no result
    streamed = len([t for d in drv.events("c", P.Delta) for t in d.token_ids])
    assert streamed == 16
    drv.run(drv.core.worker_lost("w0", "test", "exited", drv.now))
    drv.join("w1", batching="continuous")
    drv.step()
    (g,) = drv.core.sched.grants.grants_on("w1").values()
    assert g.context == prompt + streamed
    assert g.reserve >= prompt + streamed + g.tokens
    (b,) = drv.batches("w1")
    (row,) = b.requests
    assert len(row.token_ids) == g.context and row.max_new_tokens == 100 - streamed
