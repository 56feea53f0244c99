"""A request that its workers die serving ends instead of moving on (poison stops), and only
deaths count: a worker that reconnects or restarts cleanly charges nobody."""

from __future__ import annotations

from pathlib import Path

from sclsd import protocol as P

from .test_core import Driver


def _on(drv: Driver, wid: str) -> None:
    drv.now += 1.0
    drv.step()
    assert drv.batches(wid), f"no batch went to {wid}"


def test_a_request_on_two_workers_that_died_ends_with_an_error(tmp_path: Path) -> None:
    drv = Driver(tmp_path)
    drv.join("w0")
    drv.submit("c", "p", max_tokens=32)
    _on(drv, "w0")
    drv.run(drv.core.worker_lost("w0", "process exited rc=-11", "exited", drv.now))
    assert not drv.terminal("c", "p")  # once: it moves on
    drv.join("w1")
    _on(drv, "w1")
    eff = drv.run(drv.core.worker_lost("w1", "batch=2 made no progress for 301s", "stalled", drv.now))
    (err,) = drv.terminal("c", "p")
    assert isinstance(err, P.Error) and err.code == "engine_error"
    assert "2 workers that died" in err.message and "w1" in err.message
    assert [e.reason for e in eff.ended] == ["error"]
    assert not drv.core.sched.live and len(drv.core.table) == 0
    # A third worker gets nothing of it.
    drv.join("w2")
    drv.now += 1.0
    drv.step()
    assert not drv.batches("w2")


def test_connection_events_charge_nobody(tmp_path: Path) -> None:
    drv = Driver(tmp_path)
    for i, reason in enumerate(("reconnected", "restarted", "lost_batch", "replaced", "unreachable")):
        drv.join(f"w{i}")
        if i == 0:
            drv.submit("c", "r", max_tokens=32)
        _on(drv, f"w{i}")
        drv.run(drv.core.worker_lost(f"w{i}", "test", reason, drv.now))  # type: ignore[arg-type]
    assert not drv.terminal("c", "r")
    drv.join("w9")
    drv.until_done("c", "r", wid="w9")
    (done,) = drv.terminal("c", "r")
    assert isinstance(done, P.Done) and done.finish_reason == "length"


def test_the_limit_can_be_turned_off(tmp_path: Path) -> None:
    drv = Driver(tmp_path, scheduler={"max_worker_losses": 0})
    drv.submit("c", "r", max_tokens=32)
    for i in range(4):
        drv.join(f"w{i}")
        _on(drv, f"w{i}")
        drv.run(drv.core.worker_lost(f"w{i}", "killed", "exited", drv.now))
    assert not drv.terminal("c", "r")
    drv.join("w9")
    drv.until_done("c", "r", wid="w9")
    assert isinstance(drv.terminal("c", "r")[0], P.Done)
