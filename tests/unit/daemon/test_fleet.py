"""Worker membership and nothing lost: deaths, unacknowledged and overdue batches on the
serving core driven synchronously with a fake clock (:class:`.test_core.Driver`); refused
sends, registration on a connection, drain and the status snapshot through the shell,
in-process."""

from __future__ import annotations

import asyncio
from pathlib import Path

from sclsd import protocol as P

from .conftest import Harness, RecConn, held, until
from .test_core import Driver


async def _turn() -> None:
    """One turn of the event loop: what an in-process worker sent is delivered."""
    await asyncio.sleep(0)


async def _one_batch_on(h: Harness, wid: str, conn: RecConn, rid: str = "r") -> None:
    await h.submit(conn, id=rid, max_tokens=32)
    await held(h.transport.workers[h.members()[wid]])


def test_dead_worker_gives_its_requests_back(tmp_path: Path) -> None:
    drv = Driver(tmp_path)
    drv.join("w0")
    drv.submit("c", "r", max_tokens=32)
    drv.step()
    assert drv.batches("w0")  # sent, never answered: w0 died with it
    drv.now += 60.0  # heartbeats long overdue
    drv.run(drv.core.tick(drv.now))
    assert "w0" not in drv.core.members and drv.lost == ["w0"] and drv.core.sched.pool  # back in the pool
    drv.join("w1")
    drv.until_done("c", "r", wid="w1")
    (done,) = drv.terminal("c", "r")
    assert isinstance(done, P.Done) and done.worker == "w1" and done.usage.completion_tokens == 32


def _sent_unacked(drv: Driver) -> int:
    drv.join("w0")
    drv.submit("c", "r", max_tokens=32)
    drv.step()
    (bid,) = list(drv.core.dispatch.unacked)
    return bid


def test_a_batch_the_worker_never_got_drops_it_without_a_kill(tmp_path: Path) -> None:
    drv = Driver(tmp_path, daemon={"heartbeat_timeout_s": 60.0})
    bid = _sent_unacked(drv)
    ack = drv.core.cfg.daemon.batch_ack_timeout_s
    drv.now += ack + 1
    drv.run(drv.core.tick(drv.now))  # no ack: the tick alone judges nothing
    assert "w0" in drv.core.members
    drv.message("w0", P.Heartbeat(worker_id="w0", batches=[]))  # past its ack time, and not named
    assert "w0" not in drv.core.members and drv.lost == ["w0"]
    losses = drv.core.members.losses["w0"]
    assert losses.last_reason == "lost_batch" and f"batch={bid}" in losses.last_why
    drv.join("w1")
    drv.until_done("c", "r", wid="w1")
    assert drv.terminal("c", "r")[0].worker == "w1"


def test_a_heartbeat_before_the_ack_time_judges_nothing(tmp_path: Path) -> None:
    drv = Driver(tmp_path, daemon={"heartbeat_timeout_s": 60.0})
    bid = _sent_unacked(drv)
    drv.now += drv.core.cfg.daemon.batch_ack_timeout_s / 2  # the batch may still be on its way
    drv.message("w0", P.Heartbeat(worker_id="w0", batches=[]))
    assert "w0" in drv.core.members and bid in drv.core.dispatch.unacked


def test_a_heartbeat_that_names_the_batch_stands_for_its_ack(tmp_path: Path) -> None:
    drv = Driver(tmp_path, daemon={"heartbeat_timeout_s": 60.0})
    bid = _sent_unacked(drv)
    drv.message("w0", P.Heartbeat(worker_id="w0", batches=[bid]))
    assert not drv.core.dispatch.unacked
    drv.now += 3 * drv.core.cfg.daemon.batch_ack_timeout_s
    drv.message("w0", P.Heartbeat(worker_id="w0", batches=[bid]))
    drv.run(drv.core.tick(drv.now))
    assert "w0" in drv.core.members and bid in drv.core.sched.batches


def test_a_slow_batch_that_moves_is_never_dropped_and_one_that_stalls_is(tmp_path: Path) -> None:
    # The tick also loses workers silent past the heartbeat timeout: let only progress count.
    drv = Driver(tmp_path, daemon={"batch_stall_timeout_s": 20.0, "heartbeat_timeout_s": 1000.0})
    bid = _sent_unacked(drv)
    drv.message("w0", P.BatchAck(worker_id="w0", batch_id=bid))
    stall = drv.core.cfg.daemon.batch_stall_timeout_s
    t0 = drv.now
    # Far past any estimate of the batch, but the worker keeps saying it moves.
    for k in range(1, 6):
        drv.now = t0 + k * (stall - 1)
        drv.message("w0", P.Heartbeat(worker_id="w0", batches=[bid], stalled_s=0.5))
        drv.run(drv.core.tick(drv.now + 0.5))
        assert "w0" in drv.core.members
    # Then it holds the batch and says its engine has not moved since.
    last = t0 + 5 * (stall - 1)
    drv.now = last + stall / 2
    drv.message("w0", P.Heartbeat(worker_id="w0", batches=[bid], stalled_s=stall / 2))
    drv.run(drv.core.tick(last + stall - 1))
    assert "w0" in drv.core.members
    drv.run(drv.core.tick(last + stall + 1))
    assert "w0" not in drv.core.members
    losses = drv.core.members.losses["w0"]
    assert losses.last_reason == "stalled" and losses.count == 1 and f"batch={bid}" in losses.last_why


def test_refused_send_requeues_instead_of_losing(daemon) -> None:
    async def body(h: Harness) -> None:
        w0 = h.worker("w0")
        await h.registered("w0")
        h.transport.refuse_sends.add(w0.peer)  # as a full or vanished ZeroMQ pipe would
        conn = RecConn()
        await h.submit(conn, id="r", max_tokens=8)
        await conn.wait_for(lambda: "w0" not in h.members())
        assert not w0.batches()
        h.worker("w1")
        await h.finished(conn, "r")
        assert isinstance(conn.terminal("r")[0], P.Done)

    daemon(body)


def test_a_member_registering_again_on_its_connection_is_welcomed_not_dropped(daemon) -> None:
    async def body(h: Harness) -> None:
        w0 = h.worker("w0", hold=True)
        await h.registered("w0")
        conn = RecConn()
        await _one_batch_on(h, "w0", conn)
        welcomes = sum(isinstance(m, P.Welcome) for m in w0.received)
        w0.register()  # its Welcome was slow to come: it sends Register again
        await until(w0.got, lambda: sum(isinstance(m, P.Welcome) for m in w0.received) > welcomes)
        assert "w0" in h.members() and not h.core.members.losses
        assert len(h.server.sched.batches) == 1  # its batch stays with it
        w0.hold = False
        w0.release()
        await h.finished(conn, "r")
        assert conn.terminal("r")[0].worker == "w0"

    daemon(body)


def test_a_new_process_under_a_members_id_replaces_it_without_a_kill(daemon) -> None:
    async def body(h: Harness) -> None:
        h.worker("w0", hold=True)
        await h.registered("w0")
        conn = RecConn()
        await _one_batch_on(h, "w0", conn)
        killed: list[str] = []
        h.server.supervisor.kill = lambda wid, sig=0: killed.append(wid)  # type: ignore[method-assign]
        again = h.worker("w0")  # same pid (this process), new connection: it reconnected
        await until(again.got, lambda: h.members().get("w0") == again.peer)
        assert h.core.members.losses["w0"].last_reason == "reconnected" and not killed
        await h.finished(conn, "r")
        assert conn.terminal("r")[0].worker == "w0"

    daemon(body)


def test_registration_needs_the_secret_and_cannot_take_over(daemon) -> None:
    async def body(h: Harness) -> None:
        real = h.worker("w0", hold=True)
        await h.registered("w0")
        forged = h.worker("w0", auth="guess")
        await forged.got.wait()
        assert isinstance(forged.received[-1], P.Shutdown)
        assert h.members()["w0"] == real.peer  # the real one stays
        assert h.server.fleet.refused == 1
        conn = RecConn()
        await _one_batch_on(h, "w0", conn)
        assert not forged.batches()

    daemon(body)


def test_registration_refuses_a_model_that_does_not_fit_the_tokenizer(daemon) -> None:
    async def body(h: Harness) -> None:
        small = h.worker("w0", vocab=100)  # the byte tokenizer needs 256 ids
        await small.got.wait()
        assert isinstance(small.received[-1], P.Shutdown) and "w0" not in h.members()

    daemon(body)


def test_a_worker_registering_while_the_daemon_stops_is_told_to_exit(daemon) -> None:
    async def body(h: Harness) -> None:
        h.server.fleet.shutdown_all()  # the daemon stops: its members were told
        late = h.worker("w1")  # a worker that was loading registers now
        await late.got.wait()
        assert isinstance(late.received[-1], P.Shutdown) and "w1" not in h.members()
        assert h.server.fleet.refused == 0  # turned away, not refused: nothing was wrong with it

    daemon(body)


def test_reregistration_with_the_secret_replaces_the_old_connection(daemon) -> None:
    async def body(h: Harness) -> None:
        old = h.worker("w0", hold=True)
        await h.registered("w0")
        conn = RecConn()
        await _one_batch_on(h, "w0", conn)
        new = h.worker("w0")  # restarted: a new connection, the same secret
        await conn.wait_for(lambda: h.members()["w0"] == new.peer)
        await h.finished(conn, "r")  # the held batch was re-queued and served by the new one
        assert len(conn.terminal("r")) == 1
        old.release()  # the old connection's late result is ignored
        assert len(conn.terminal("r")) == 1

    daemon(body)


def test_drain_then_resume(daemon) -> None:
    async def body(h: Harness) -> None:
        w0 = h.worker("w0", hold=True)
        h.worker("w1")
        await h.registered("w0", "w1")
        admin = RecConn(uid=0)
        h.server.on_client(admin, P.DrainWorker(worker="w0"))
        assert admin.sent[-1] == P.WorkerStateReply(worker="w0", state="drained", batches_inflight=0)
        await until(w0.got, lambda: isinstance(w0.received[-1], P.Drain))
        conn = RecConn(uid=1000)
        for i in range(5):
            await h.submit(conn, id=f"r{i}")
        await h.finished(conn, *[f"r{i}" for i in range(5)])
        assert not w0.batches() and {m.worker for m in conn.sent if isinstance(m, P.Done)} == {"w1"}
        h.server.on_client(conn, P.DrainWorker(worker="w0", resume=True))
        assert conn.sent[-1].code == "forbidden"  # uid 1000 is no admin
        h.server.on_client(admin, P.DrainWorker(worker="w0", resume=True))
        assert admin.sent[-1].state == "active"

    daemon(body)


def test_status_snapshot_and_gauges_agree(daemon) -> None:
    async def body(h: Harness) -> None:
        w0 = h.worker("w0", hold=True)
        await h.registered("w0")
        conn = RecConn()
        await _one_batch_on(h, "w0", conn)
        st = h.server.snapshot()
        assert isinstance(st, P.StatusSnapshot)
        assert st.live_requests == 1 and st.running_requests == 1 and st.pool_size == 0
        (ws,) = st.workers
        assert ws.id == "w0" and ws.state == "active" and ws.batches_inflight == 1
        assert st.serving and st.why is None
        text = h.server.metrics.exposition()
        assert 'sclsd:num_requests_running{model_name="fake"} 1.0' in text
        assert 'sclsd:worker_batches_inflight{model_name="fake",worker="w0"} 1.0' in text
        w0.hold = False  # serve this batch and the request's next slices at once
        w0.release()
        await h.finished(conn, "r")
        st = h.server.snapshot()
        assert st.live_requests == 0 and st.counters["finished"] == 1
        assert st.estimator_error.batches >= 1
        # The snapshot survives the wire as the typed struct.
        assert P.status_reply_decoder.decode(P.encode(P.StatusReply(status=st))).status == st

    daemon(body)


def test_no_workers_left_ends_queued_requests_and_refuses_new_ones(daemon) -> None:
    async def body(h: Harness) -> None:
        conn = RecConn()
        await h.submit(conn, id="queued")
        sup = h.server.supervisor
        sup.gave_up["w0"] = "local worker w0 exited 5 times in a row"
        object.__setattr__(h.server.cfg.workers, "spawn", 1)  # as if one local worker was configured
        h.server._gave_up(sup.gave_up["w0"])
        (err,) = conn.terminal("queued")
        assert err.code == "no_workers"
        await h.submit(conn, id="new")
        assert conn.terminal("new")[0].code == "no_workers"
        st = h.server.snapshot()
        assert not st.serving and "w0" in (st.why or "")

    daemon(body)
