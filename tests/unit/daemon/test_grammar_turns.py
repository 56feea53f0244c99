"""Grammar checks in fair turns, once per content, stopped when nobody waits, quick ones
first (:mod:`sclsd.daemon.grammar`, :mod:`sclsd.daemon.grammar_turns`,
:mod:`sclsd.daemon.grammar_cache`), on a fake checker: no processes, and time passes only
where a check says so."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from sclsd.daemon.grammar import GrammarChecks
from sclsd.daemon.grammar_cache import Checked, GrammarCache, key_of
from sclsd.daemon.grammar_turns import Turns
from sclsd.grammar_config import GrammarConfig

from .fake_checks import FakeChecker, grammar

# --------------------------------------------------------------------------- the line, pure


def test_a_burst_of_one_group_takes_turns_with_another_groups_single_item() -> None:
    line: Turns[str] = Turns()
    for i in range(4):
        line.join(f"a{i}", ("A",))
    line.join("b0", ("B",))  # came last
    assert [line.take() for _ in range(5)] == ["a0", "b0", "a1", "a2", "a3"]
    assert line.take() is None and len(line) == 0


def test_turns_are_nested_users_then_processes_then_groups() -> None:
    line: Turns[str] = Turns()
    for item, path in [("x1", ("u1", "p1", "c1")), ("x2", ("u1", "p1", "c1")), ("y1", ("u1", "p1", "c2")),
                       ("y2", ("u1", "p1", "c2")), ("z1", ("u1", "p2", "c3")), ("w1", ("u2", "p9", "c9"))]:
        line.join(item, path)
    # The other user's single item comes second, whatever the first user's numbers of
    # processes and connections; then the first user's processes, and connections, take turns.
    assert [line.take() for _ in range(6)] == ["x1", "w1", "z1", "y1", "x2", "y2"]


def test_one_group_is_first_come_first_served_and_removed_items_lose_their_turn() -> None:
    line: Turns[str] = Turns()
    for x in "abcd":
        line.join(x, ("A",))
    assert line.remove("b") and not line.remove("b")
    assert "b" not in line and "c" in line
    assert [line.take(), line.take(), line.take(), line.take()] == ["a", "c", "d", None]


def test_an_item_another_group_shares_is_taken_at_the_first_of_their_turns() -> None:
    line: Turns[str] = Turns()
    for i in range(4):
        line.join(f"a{i}", ("A",))
    line.share("a3", ("B",))  # B asks for what A queued last: B's first turn takes it
    line.share("a0", ("C",))
    assert [line.take() for _ in range(4)] == ["a0", "a3", "a1", "a2"]
    assert line.take() is None and len(line) == 0


def test_the_cache_keeps_the_most_recently_used_within_its_entries_and_bytes() -> None:
    cache = GrammarCache(max_entries=2, max_bytes=10_000)
    k = [key_of(grammar(f"g{i}")) for i in range(4)]
    assert cache.put(k[0], Checked("x" * 100)) and cache.put(k[1], Checked("y"))
    assert cache.get(k[0]) is not None  # used: k[1] is now the oldest
    cache.put(k[2], Checked("z"))
    assert cache.get(k[1]) is None and cache.get(k[0]) is not None and len(cache) == 2
    assert not cache.put(k[3], Checked("w" * 20_000))  # larger than the whole budget
    assert not cache.put(k[3], Checked(None, "timeout", "timeout", lasting=False))
    cache.put(k[3], Checked("v" * 9_700))  # the others no longer fit beside it
    assert len(cache) == 1 and cache.bytes <= 10_000
    assert key_of(grammar("a")) != key_of(grammar("b"))
    assert key_of(grammar("a")) != key_of(grammar("a").__class__(kind="lark", value="a"))


# --------------------------------------------------------------------------- GrammarChecks


def run(body: Callable[[GrammarChecks, FakeChecker], Awaitable[None]], **cfg: object) -> None:
    async def main() -> None:
        fake = FakeChecker()
        checks = GrammarChecks(GrammarConfig(**cfg), checker=fake)  # type: ignore[arg-type]
        try:
            await body(checks, fake)
        finally:
            checks.close()

    asyncio.run(main())


async def settle() -> None:
    """Let every task that can run, run (no time passes for the fake checks)."""
    for _ in range(20):
        await asyncio.sleep(0)


def test_checks_take_fair_turns_between_groups() -> None:
    async def body(checks: GrammarChecks, fake: FakeChecker) -> None:
        burst = [asyncio.create_task(checks.compile(grammar(f"hold:a{i}"), ("u", "p", "conn1"))) for i in range(4)]
        await settle()
        single = asyncio.create_task(checks.compile(grammar("hold:b"), ("u", "p", "conn2")))
        await settle()
        assert fake.started == ["hold:a0"]  # one child, busy
        for i in range(4):
            fake.release(f"hold:a{i}")
            fake.release("hold:b")
            await settle()
        await asyncio.gather(*burst, single)
        # The other group's single grammar is checked next, not after the whole burst.
        assert fake.started == ["hold:a0", "hold:b", "hold:a1", "hold:a2", "hold:a3"]

    run(body, processes=1)


def test_a_check_nobody_waits_for_is_stopped_or_leaves_the_line() -> None:
    async def body(checks: GrammarChecks, fake: FakeChecker) -> None:
        running = asyncio.create_task(checks.compile(grammar("hold:running"), ("g",)))
        queued = asyncio.create_task(checks.compile(grammar("hold:queued"), ("g",)))
        shared = [asyncio.create_task(checks.compile(grammar("hold:shared"), (g,))) for g in ("g", "h")]
        await settle()
        assert fake.started == ["hold:running"]
        queued.cancel()
        running.cancel()  # its request was cancelled, or its client left
        shared[0].cancel()  # another request still waits for this one
        await settle()
        assert fake.stopped == ["hold:running"]  # its child killed mid-check
        fake.release("hold:shared")
        assert await shared[1] == ("compiled hold:shared", None)
        assert fake.started == ["hold:running", "hold:shared"]  # the cancelled one never started
        assert checks.counts["stopped"] == 2 and not checks.jobs and not checks.running

    run(body, processes=1)


def test_the_same_grammar_is_checked_once_refusals_too() -> None:
    async def body(checks: GrammarChecks, fake: FakeChecker) -> None:
        n = await asyncio.gather(*(checks.compile(grammar("hold:schema"), ("g",)) for _ in range(3)),
                                 _release_soon(fake, "hold:schema"))
        assert n[:3] == [("compiled hold:schema", None)] * 3  # an HTTP request's n choices
        assert await checks.compile(grammar("hold:schema"), ("other",)) == ("compiled hold:schema", None)
        bad = [await checks.compile(grammar("bad:x"), ("g",)) for _ in range(2)]
        assert bad[0] == bad[1] == (None, "regex: bad:x is not a grammar")
        assert fake.started == ["hold:schema", "bad:x"]
        assert checks.counts == {"checked": 2, "cached": 2, "shared": 2, "retried": 0, "stopped": 0}
        assert checks.refused["invalid"] == 2  # each request refused is counted

    run(body, processes=2)


async def _release_soon(fake: FakeChecker, value: str) -> tuple[None, None]:
    await settle()
    fake.release(value)
    return None, None


@pytest.mark.parametrize("lasting", [True, False])
def test_a_timeout_is_kept_only_when_the_grammar_itself_took_the_time(lasting: bool) -> None:
    async def body(checks: GrammarChecks, fake: FakeChecker) -> None:
        fake.lasting = lasting  # False: the child got little CPU (a busy machine)
        fake.release("slow:x")
        for _ in range(2):
            text, why = await checks.compile(grammar("slow:x"), ("g",))
            assert text is None and "grammar.timeout_s" in (why or "")
        assert fake.started == ["slow:x"] * (1 if lasting else 2)
        assert checks.refused["timeout"] == 2

    run(body, processes=1)


def test_a_slow_first_try_does_not_hold_the_last_slot_quick_checks_go_first() -> None:
    async def body(checks: GrammarChecks, fake: FakeChecker) -> None:
        slow = [asyncio.create_task(checks.compile(grammar(f"slow:{i}"), (f"c{i}/",))) for i in range(3)]
        await settle()
        quick = asyncio.create_task(checks.compile(grammar("ok:valid"), ("bystander/",)))
        assert await asyncio.wait_for(quick, 5.0) == ("compiled ok:valid", None)
        # Answered while every slow one still runs or waits: first tries past quick_s were
        # stopped for a second try while other first tries waited, and at most one check
        # past quick_s runs at a time, so a slot was free for the quick one.
        assert not fake.timed_out and not any(t.done() for t in slow)
        assert checks.counts["retried"] >= 2 and checks.slow == 1
        for i in range(3):
            fake.release(f"slow:{i}")
        results = await asyncio.gather(*slow)
        assert all(text is None and "timeout_s" in (why or "") for text, why in results)
        assert sorted(fake.timed_out) == ["slow:0", "slow:1", "slow:2"]
        assert fake.started.count("slow:1") == fake.started.count("slow:2") == 2  # tried again, in full

    run(body, processes=2)
