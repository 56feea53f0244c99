"""The grant policy's line is fair between groups, at every level of a group's path (users,
their processes, their connections or named groups): a burst from one group takes turns with
a newcomer from another instead of all going first, however many connections it spreads
over; one group alone is first come, first served. With workers that bound their rows, the
line stays in the policy (a worker holds its rows and a lookahead) and each free row goes to
the next group in turn, returning requests included."""

from __future__ import annotations

from pathlib import Path

from sclsd.config import SchedulerConfig
from sclsd.core.estimator import Estimator
from sclsd.core.grant_queue import GrantQueue, Pending
from sclsd.core.grants import GrantPolicy, GrantRules

EST = Estimator(p1=0.0, p2=0.0, p3=0.0, p4=0.0, d1=0.0, d2=0.0, d3=0.0, d4=0.01)


def _p(rid: str) -> Pending:
    return Pending(rid, 10, 10, None)


def drain(q: GrantQueue) -> list[str]:
    """Take requests in turn until none is left: the order the line serves them."""
    order: list[str] = []
    while True:
        group = q.next_group(set())
        if group is None:
            return order
        p = group.back[0] if group.back else group.waiting[0]
        q.take(p)
        order.append(p.rid)


def test_one_group_is_first_come_first_served() -> None:
    q = GrantQueue()
    for i in range(20):
        q.join(_p(f"a{i}"), ("a",))
    assert drain(q) == [f"a{i}" for i in range(20)]


def test_a_newcomer_takes_its_turn_after_a_burst_of_another_group() -> None:
    q = GrantQueue()
    for i in range(64):
        q.join(_p(f"a{i}"), ("a",))  # n = 64 in one go
    for _ in range(3):  # three granted meanwhile
        group = q.next_group(set())
        assert group is not None
        q.take(group.waiting[0])
    q.join(_p("b0"), ("b",))
    order = drain(q)
    assert order.index("b0") <= 1  # next, or next but one: not 62nd
    assert [r for r in order if r != "b0"] == [f"a{i}" for i in range(3, 64)]


def test_turns_nest_so_a_burst_over_many_connections_is_one_process() -> None:
    """64 connections of one process (each its own group) against one request of another
    process of the same user: the other process is next in turn, not 65th."""
    q = GrantQueue()
    for i in range(256):
        q.join(_p(f"burst{i}"), ("uid 1", "pid 10", f"conn {i % 64}"))
    q.join(_p("bystander"), ("uid 1", "pid 20", "conn 0"))
    order = drain(q)
    assert order.index("bystander") <= 1
    # Within the burst's process its connections take turns among themselves.
    burst = [r for r in order if r != "bystander"]
    assert burst[:64] == [f"burst{i}" for i in range(64)]


def test_users_share_equally_whatever_their_processes() -> None:
    q = GrantQueue()
    for pid in range(8):  # one user, eight processes with eight requests each
        for i in range(8):
            q.join(_p(f"a{pid}.{i}"), ("uid 1", f"pid {pid}", "c"))
    for i in range(8):  # another user, one process
        q.join(_p(f"b{i}"), ("uid 2", "pid 99", "c"))
    first16 = drain(q)[:16]
    assert sum(r.startswith("b") for r in first16) == 8  # every other grant


def test_the_front_goes_first_and_keeps_its_order() -> None:
    q = GrantQueue()
    for i in range(4):
        q.join(_p(f"a{i}"), ("a",))
    for rid in ("lost2", "lost1"):  # pushed last to first
        q.push_front(_p(rid))
    assert list(p.rid for p in q.front) == ["lost1", "lost2"] and q.n_waiting == 6


def test_a_group_that_leaves_and_comes_back_takes_no_extra_turns() -> None:
    q = GrantQueue()
    for i in range(4):
        q.join(_p(f"a{i}"), ("a",))
    q.join(_p("b0"), ("b",))
    assert drain(q)[:2] in (["a0", "b0"], ["b0", "a0"])
    q.join(_p("b1"), ("b",))  # b was served in turn: it comes back behind a's next
    for i in range(4, 6):
        q.join(_p(f"a{i}"), ("a",))
    order = drain(q)
    assert order.index("b1") <= 2


def policy(rows: int, workers: int = 1) -> GrantPolicy:
    pol = GrantPolicy(EST, 8, 10_000, rules=GrantRules.basic())
    for w in range(workers):
        pol.add_worker(f"w{w}", rows=rows)
    return pol


def test_a_worker_holds_only_its_rows_and_the_rest_waits_in_the_line() -> None:
    pol = policy(rows=6, workers=2)
    for i in range(100):
        pol.arrive(f"r{i}", 10, 64, group=("u", "p", "burst"))
    grants = pol.schedule()
    assert len(grants) == 12 and {len(pol.grants_on(w)) for w in pol.workers} == {6}
    assert pol.queued == 88


def test_a_worker_whose_room_changes_holds_its_new_rows() -> None:
    pol = policy(rows=6)
    for i in range(20):
        pol.arrive(f"r{i}", 10, 8, group=("u", "p", "c"))
    assert len(pol.schedule()) == 6
    pol.set_rows("w0", 3)  # a long row widened every slot: room for three now
    for i in range(3):
        pol.end(f"r{i}", 18, 0)
    assert pol.schedule() == []  # three of six ended: the three left fill the room
    pol.end("r3", 18, 0)
    assert [g.rid for g in pol.schedule()] == ["r6"]
    pol.set_rows("w0", 5)  # narrower again
    assert [g.rid for g in pol.schedule()] == ["r7", "r8"] and len(pol.grants_on("w0")) == 5
    pol.set_rows("w0", 0)  # unbounded: as many as the KV budget takes
    assert len(pol.schedule()) == 20 - 9 and pol.queued == 0


def test_the_next_free_row_goes_to_the_next_group_in_turn_not_to_a_returning_request() -> None:
    pol = policy(rows=2)
    for i in range(4):
        pol.arrive(f"long{i}", 10, 1000, group=("u", "p1", "c"))
    assert [g.rid for g in pol.schedule()] == ["long0", "long1"]
    pol.arrive("bystander", 10, 8, group=("u", "p2", "c"))
    pol.end("long0", 18, 992)  # back with its KV kept: it would take its row again at once
    (g,) = pol.schedule()
    assert g.rid == "bystander"


def test_without_bounded_rows_returning_requests_go_first() -> None:
    pol = policy(rows=0)
    pol.budget = 72  # three grants of 10 + 8, then room for one more: long0 again, or new
    for i in range(3):
        pol.arrive(f"long{i}", 10, 1000, group=("u", "p1", "c"))
    assert len(pol.schedule()) == 3
    pol.arrive("new", 10, 8, group=("u", "p2", "c"))
    pol.end("long0", 18, 992)
    (g,) = pol.schedule()
    assert g.rid == "long0"  # its KV is reserved already: it goes on


def test_grant_rows_are_the_engines_rows_and_a_lookahead() -> None:
    cfg = SchedulerConfig()
    assert cfg.grant_rows(0) == 0  # rows only the KV bounds
    assert cfg.grant_rows(4) == 5 and cfg.grant_rows(64) == 72
    assert SchedulerConfig(grant_lookahead=0.0).grant_rows(4) == 4


def test_the_daemon_groups_by_user_process_and_connection_or_named_group(tmp_path: Path) -> None:
    from .daemon.test_core import Driver

    drv = Driver(tmp_path)
    drv.submit("c1", "x", max_tokens=4)
    drv.submit("c1", "y", max_tokens=4, group="job-1")
    drv.submit("c2", "z", max_tokens=4, group="job-1")  # the same name on another connection
    drv.submit("c2", "w", max_tokens=4)
    live = drv.core.sched.live
    groups = {r: live[r].group for r in ("x", "y", "z", "w")}
    assert groups["y"] == groups["z"]  # a named group is the process's, whatever connection
    assert len({groups["x"], groups["y"], groups["w"]}) == 3
    assert all(g[:2] == groups["x"][:2] for g in groups.values())  # one user and process here
