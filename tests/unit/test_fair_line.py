"""The grant policy's line is fair between groups: a burst from one group takes turns with
a newcomer from another instead of all going first; one group alone is first come, first
served."""

from __future__ import annotations

from pathlib import Path

from sclsd.core.grant_queue import GrantQueue, Pending


def _p(rid: str) -> Pending:
    return Pending(rid, 10, 10, None)


def test_one_group_is_first_come_first_served() -> None:
    q = GrantQueue()
    for i in range(20):
        q.join(_p(f"a{i}"), "a")
    assert [q.take().rid for _ in range(20)] == [f"a{i}" for i in range(20)]


def test_a_newcomer_takes_its_turn_after_a_burst_of_another_group() -> None:
    q = GrantQueue()
    for i in range(64):
        q.join(_p(f"a{i}"), "a")  # n = 64 in one go
    assert [q.take().rid for _ in range(3)] == ["a0", "a1", "a2"]  # three granted meanwhile
    q.join(_p("b0"), "b")
    order = [q.take().rid for _ in range(len(q.waiting))]
    assert order.index("b0") == 1  # next but one, not 62nd
    assert [r for r in order if r != "b0"] == [f"a{i}" for i in range(3, 64)]


def test_two_bursts_interleave_and_the_front_stays_the_front() -> None:
    q = GrantQueue()
    for i in range(4):
        q.join(_p(f"a{i}"), "a")
    for i in range(4):
        q.join(_p(f"b{i}"), "b")
    q.waiting.appendleft(_p("lost"))  # a request whose worker was lost goes first
    assert [q.take().rid for _ in range(9)] == ["lost", "a0", "b0", "a1", "b1", "a2", "b2", "a3", "b3"]


def test_the_daemon_groups_by_connection_and_the_clients_group(tmp_path: Path) -> None:
    from .daemon.test_core import Driver

    drv = Driver(tmp_path)
    drv.submit("c1", "x", max_tokens=4)
    drv.submit("c1", "y", max_tokens=4, group="job-1")
    drv.submit("c2", "z", max_tokens=4, group="job-1")  # the same name on another connection
    live = drv.core.sched.live
    groups = {live[r].group for r in ("x", "y", "z")}
    assert len(groups) == 3
