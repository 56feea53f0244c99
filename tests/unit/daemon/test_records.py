"""The daemon's side of row deltas (:mod:`sclsd.daemon.serving.records`) and the rows it
sends: whole once per worker, then deltas; whole again after a failed batch, a move, or a
new registration; records the daemon no longer needs forgotten on that worker."""

from __future__ import annotations

from pathlib import Path

import pytest

from sclsd import protocol as P
from sclsd.daemon.serving.records import Records

from .test_core import Driver


def test_records_follow_rows_results_moves_and_ends() -> None:
    r = Records()
    r.sent("w0", "a", 10)
    assert r.known("w0", "a") == 10 and r.known("w1", "a") is None
    r.grew("w0", "a", 18)
    assert r.known("w0", "a") == 18
    r.grew("w1", "a", 99)  # not held there: nothing changes
    assert r.sent("w1", "a", 18) == "w0"  # moved: w0 must forget it
    assert r.known("w0", "a") is None
    assert r.sent("w1", "a", 18) is None  # held there already: nobody to tell
    r.stale("w1", "a")
    assert r.known("w1", "a") is None  # held, but not vouched for: the next row is whole
    assert r.sent("w1", "b", 4) is None
    assert r.ended("b") == "w1"
    r.dropped("w1", "a")  # finished there: nothing to tell
    assert r.where == {}
    r.sent("w2", "c", 1)
    assert r.ended("x") is None  # never held anywhere
    r.worker_gone("w2")
    assert r.where == {} and r.ended("c") is None


def rows(msg: P.BatchMsg) -> tuple[list[str], list[str]]:
    return [x.rid for x in msg.requests], [c.rid for c in msg.cont]


def test_a_request_goes_whole_once_then_as_deltas_and_whole_again_after_a_failure(tmp_path: Path) -> None:
    drv = Driver(tmp_path, scheduler={"slice_len": 4})
    drv.join("w0")
    drv.submit("c", "a", max_tokens=16, ignore_eos=True)
    drv.step()
    drv.serve("w0")
    for _ in range(2):
        drv.now += 1.0
        drv.step()
        drv.serve("w0")
    sent = [m for m in drv.to_worker["w0"] if isinstance(m, P.BatchMsg)]
    assert [rows(m) for m in sent] == [(["a"], []), ([], ["a"]), ([], ["a"])]
    assert [(c.known, c.tail) for m in sent[1:] for c in m.cont] == [(9, []), (13, [])]
    # The next batch fails: the worker's record is not vouched for, the row after it is whole.
    drv.now += 1.0
    drv.step()
    (failing,) = drv.batches("w0")
    drv.served.add(failing.batch_id)
    drv.message("w0", P.Result(worker_id="w0", batch_id=failing.batch_id, error="device lost"))
    drv.now += 1.0
    drv.step()
    (again,) = drv.batches("w0")
    assert rows(again) == (["a"], []) and len(again.requests[0].token_ids) == 5 + 12


def test_a_row_the_worker_holds_no_record_of_is_sent_whole_next_and_not_charged(tmp_path: Path) -> None:
    drv = Driver(tmp_path, scheduler={"slice_len": 4, "max_failures": 0})
    drv.join("w0")
    drv.submit("c", "a", max_tokens=12, ignore_eos=True)
    drv.step()
    drv.serve("w0")
    drv.rows["w0"].drop()  # the worker lost its records (the daemon does not know)
    drv.now += 1.0
    drv.step()
    drv.serve("w0")  # answered with Result.unknown
    drv.until_done("c", "a")
    (done,) = drv.terminal("c", "a")
    assert isinstance(done, P.Done) and done.usage.completion_tokens == 12  # not failed
    sent = [rows(m) for m in drv.to_worker["w0"] if isinstance(m, P.BatchMsg)]
    assert sent[:3] == [(["a"], []), ([], ["a"]), (["a"], [])]


@pytest.mark.parametrize(("kv_reuse", "told"), [(True, P.Release), (False, P.Forget)])
def test_a_request_ended_by_the_daemon_is_forgotten_on_the_worker(tmp_path: Path, kv_reuse: bool,
                                                                   told: type) -> None:
    """Told once: with kept KV, the release drops the record too (no forget follows);
    without, a forget."""
    drv = Driver(tmp_path, scheduler={"slice_len": 4, "kv_reuse": kv_reuse})
    drv.join("w0")
    drv.submit("c", "a", max_tokens=40, ignore_eos=True)
    drv.step()
    drv.serve("w0")
    assert "a" in drv.rows["w0"]
    drv.run(drv.core.cancel("a", drv.now, requester="c"))
    drv.now += 1.0
    drv.step()
    sent = [m for m in drv.to_worker["w0"] if isinstance(m, (P.Forget, P.Release))]
    assert [(type(m), m.rids) for m in sent] == [(told, ["a"])] and "a" not in drv.rows["w0"]


def test_a_forget_behind_a_queued_delta_does_not_unmake_it(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A request cancelled while its next grant waits in the worker's queue: the ``forget``
    comes after the delta, which was made whole on arrival, so the batch is served."""
    drv = Driver(tmp_path, scheduler={"slice_len": 4})
    drv.join("w0")
    drv.submit("c", "k", max_tokens=40, ignore_eos=True, stream=True)
    drv.step()
    (first,) = drv.serve("w0", stream=True)  # the first grant, whole
    assert rows(first) == (["k"], [])
    drv.now += 1.0
    drv.step()
    (delta,) = drv.batches("w0")  # the second, a delta, waits in the worker's queue
    assert rows(delta) == ([], ["k"])
    drv.run(drv.core.cancel("k", drv.now, requester="c"))
    told = [m for m in drv.to_worker["w0"] if isinstance(m, (P.Forget, P.Release))]
    assert told and "k" not in drv.rows["w0"]  # the record is gone, after the delta came
    whole = drv.whole[delta.batch_id]
    assert isinstance(whole, P.BatchMsg) and [r.rid for r in whole.requests] == ["k"]
    drv.serve("w0", stream=True)  # served whole all the same: no unknown row
    (done,) = drv.terminal("c", "k")
    assert isinstance(done, P.Done) and done.finish_reason == "cancelled"
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
