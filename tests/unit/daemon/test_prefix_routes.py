"""The daemon's hint of which worker holds a cached prefix of a prompt (:mod:`sclsd.daemon.serving.prefixes`)."""

from __future__ import annotations

from sclsd.daemon.serving.prefixes import BLOCK, PrefixRoutes


def ids(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 50_000 for i in range(n)]


def test_the_longest_prefix_noted_names_its_worker_in_whole_blocks() -> None:
    r = PrefixRoutes()
    r.join("a", True)
    r.join("b", True)
    system = ids(1, 3 * BLOCK)
    r.note("a", system + ids(2, 40))
    r.note("b", system + ids(3, 40))
    assert r.hint(system + ids(2, 40) + [9]) == ("a", 3 * BLOCK + 32)  # its own turn: all 5 whole blocks
    assert r.hint(system + ids(4, 40)) == ("b", 3 * BLOCK)  # the system prompt, as last served
    assert r.hint(system[:BLOCK]) is None  # the prompt's last token is always computed: no whole block
    assert r.hint(system[:BLOCK] + [1]) == ("b", BLOCK)
    assert r.hint(ids(5, 100)) is None and r.hints == 3


def test_only_workers_that_share_prefixes_are_noted_and_hinted() -> None:
    r = PrefixRoutes()
    r.join("a", False)
    r.join("b", True)
    p = ids(1, 50)
    r.note("a", p)
    assert r.hint(p + [1]) is None and len(r) == 0
    r.note("b", p)
    assert r.hint(p + [1]) == ("b", 48)
    r.forget("b")  # gone: what it held went with it
    assert r.hint(p + [1]) is None and len(r) == 0
    r.join("b", True)
    r.note("b", p)
    r.join("b", False)  # registered again, not sharing: forgotten
    assert r.hint(p + [1]) is None
    r.join("b", True)
    r.note("b", p)
    r.join("b", True)  # registered again (a restarted engine holds nothing): its old blocks are stale
    assert r.hint(p + [1]) is None and len(r) == 0


def test_the_least_recently_noted_blocks_go_first() -> None:
    r = PrefixRoutes(max_blocks=4)
    r.join("a", True)
    r.note("a", ids(1, 2 * BLOCK))
    r.note("a", ids(2, 2 * BLOCK))
    r.note("a", ids(3, 2 * BLOCK))
    assert len(r) == 4
    assert r.hint(ids(1, 2 * BLOCK) + [0]) is None
    assert r.hint(ids(3, 2 * BLOCK) + [0]) == ("a", 2 * BLOCK)
