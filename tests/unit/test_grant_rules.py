"""The rules of scls-cb on top of the plain grant mechanics (GrantRules), one at a time."""

from __future__ import annotations

import pytest

from sclsd.core.grants import GrantPolicy, GrantRules

from .toy import EST

NONE = GrantRules.basic()


def _moves(rules: GrantRules, ballast: int, rows: int) -> tuple[bool, float, float]:
    """r returns to its holder a (which also runs a ballast grant) while b runs ``rows``
    small grants: does r move to b? Also the load gap and r's re-prefill cost."""
    pol = GrantPolicy(EST, 16, token_budget=100_000, workers=["a", "b"], rules=rules)
    pol.arrive("r", 200, 1000)
    (g,) = pol.schedule()
    assert g.worker == "a"
    pol.set_active("a", False)
    for k in range(rows):
        pol.arrive(f"s{k}", 1, 1000)
    assert {g.worker for g in pol.schedule()} <= {"b"}
    pol.set_active("a", True)
    pol.set_active("b", False)
    pol.arrive("ballast", ballast, 16)
    assert [g.worker for g in pol.schedule()] == ["a"]
    pol.set_active("b", True)
    pol.end("r", 216, 984)
    gap = pol.load("a") - pol.load("b")
    (g2,) = pol.schedule()
    return g2.worker == "b", gap, pol.prefill_cost(216)


def test_a_move_pays_the_stall_of_every_request_on_its_target() -> None:
    stall = GrantRules(stall=1.0, headroom=0.0, short=0.0, least=0.0)
    rows = 3
    only_plain_moves = 0
    for ballast in range(1, 2000, 37):
        moved, gap, pre = _moves(stall, ballast, rows)
        plain, gap0, _ = _moves(NONE, ballast, rows)
        assert gap == pytest.approx(gap0)
        if abs(gap - pre * (1 + rows)) > 1e-9:
            assert moved == (gap > pre * (1 + rows))  # its own re-prefill plus 3 stalled rows
        if abs(gap - pre) > 1e-9:
            assert plain == (gap > pre)
        only_plain_moves += plain and not moved
    assert only_plain_moves > 0  # the stall keeps requests home that the plain rule moves


def test_new_requests_leave_headroom_for_the_next_grants_of_returning_ones() -> None:
    # window 1: rho is the last grant end's outcome (1: it came back, 0: it finished).
    rules = GrantRules(stall=0.0, headroom=5.0, headroom_cap=0.5, short=0.0, least=0.0, window=1)
    pol = GrantPolicy(EST, 16, token_budget=1000, workers=["a"], rules=rules)
    pol.arrive("big", 400, 100)
    pol.arrive("n1", 30, 100)
    pol.arrive("n2", 30, 100)
    # rho starts at 1 (no end seen): the headroom is the cap, 500 tokens.
    assert [g.rid for g in pol.schedule()] == ["big", "n1"]  # 416 + 46 + 46 + 500 > 1000
    pol.end("big", 416, 84)  # it came back: rho = 1
    # A returning request needs no headroom: it resumes; the newcomer still waits.
    assert [(g.rid, g.prefill) for g in pol.schedule()] == [("big", 0)]
    assert pol.queued == 1
    pol.end("n1", 46, 0)  # finished: rho = 0, no headroom
    assert [g.rid for g in pol.schedule()] == ["n2"]

    plain = GrantPolicy(EST, 16, token_budget=1000, workers=["a"], rules=NONE)
    for rid, ctx in (("big", 400), ("n1", 30), ("n2", 30)):
        plain.arrive(rid, ctx, 100)
    assert len(plain.schedule()) == 3


@pytest.mark.parametrize(("ctx", "admitted"), [(930, True), (931, False)])
def test_the_headroom_follows_how_many_grants_come_back(ctx: int, admitted: bool) -> None:
    rules = GrantRules(stall=0.0, headroom=1.0, headroom_cap=1.0, short=0.0, least=0.0, window=4)
    pol = GrantPolicy(EST, 10, token_budget=1000, workers=["a"], rules=rules)
    pol.arrive("x", 10, 10_000)
    assert [g.rid for g in pol.schedule()] == ["x"]  # an idle worker asks no headroom
    pol.end("x", 20, 9_990)  # came back: rho stays 1
    assert pol.rho == 1.0 and [g.rid for g in pol.schedule()] == ["x"]  # returns need none
    pol.rho = 0.75  # three of four ends came back: three returns per finish, 10 tokens each
    pol.arrive("n", ctx, 10)  # needs ctx + 10 beside x's 30, and a headroom of 30
    assert [g.rid for g in pol.schedule()] == (["n"] if admitted else [])
    pol.end("x", 30, 9_980)
    assert pol.rho == pytest.approx(0.75 + 0.25 / 4)
    pol.end("n", ctx + 10, 0) if admitted else None
    assert pol.rho == pytest.approx((0.8125 * 3 / 4) if admitted else 0.8125)


def test_grants_are_short_while_others_wait_for_room() -> None:
    rules = GrantRules(stall=0.0, headroom=0.0, short=0.25, least=0.0, floor=1)
    pol = GrantPolicy(EST, 64, token_budget=300, workers=["a"], rules=rules)
    for rid in ("a1", "a2", "a3"):
        pol.arrive(rid, 100, 500)
    # a1 and a2 have others behind them: 16 tokens each; a3, last in line, asks a full 64.
    assert [(g.rid, g.tokens) for g in pol.schedule()] == [("a1", 16), ("a2", 16)]
    assert pol.queued == 1  # 232 + 164 > 300
    pol.end("a1", 110, 0)
    assert [(g.rid, g.tokens) for g in pol.schedule()] == [("a3", 64)]


def test_grants_keep_their_length_where_the_line_waits_for_a_row() -> None:
    rules = GrantRules(stall=0.0, headroom=0.0, short=0.25, least=0.0, floor=1)
    pol = GrantPolicy(EST, 64, token_budget=100_000, rules=rules)
    pol.add_worker("a", rows=2)
    for rid in ("a1", "a2", "a3", "a4"):
        pol.arrive(rid, 100, 500)
    # KV for all four, rows for two: the line waits for a row, so grants keep S.
    assert [(g.rid, g.tokens) for g in pol.schedule()] == [("a1", 64), ("a2", 64)]
    assert pol.queued == 2
    pol.end("a1", 164, 436)
    assert [(g.rid, g.tokens) for g in pol.schedule()] == [("a1", 64)]  # back first, full
    # Rows for all but KV for two: the line waits for KV, so grants are short.
    pol = GrantPolicy(EST, 64, token_budget=300, rules=rules)
    pol.add_worker("a", rows=8)
    for rid in ("a1", "a2", "a3"):
        pol.arrive(rid, 100, 500)
    assert [(g.rid, g.tokens) for g in pol.schedule()] == [("a1", 16), ("a2", 16)]


@pytest.mark.parametrize(("least", "granted"), [(0.25, 8), (0.5, 8), (0.5625, None), (0.75, None)])
def test_a_holder_short_of_room_grants_what_fits_rather_than_park(least: float, granted: int | None) -> None:
    rules = GrantRules(stall=0.0, headroom=0.0, short=0.0, least=least, floor=1)
    pol = GrantPolicy(EST, 16, token_budget=240, workers=["a"], rules=rules)
    pol.arrive("x", 100, 100)
    pol.arrive("y", 100, 100)
    assert len(pol.schedule()) == 2  # 116 + 116 <= 240
    pol.end("x", 116, 84)  # needs 132 beside y's 116: only 8 tokens of room
    grants = pol.schedule()
    if granted is None:  # fewer than least · S = 12 tokens: it parks
        assert grants == [] and pol.queued == 1 and pol.reserved("a") == 232
    else:
        (g,) = grants
        assert (g.rid, g.tokens, g.prefill, g.reserve) == ("x", granted, 0, 124)
        assert pol.reserved("a") == 240


def test_no_rule_shortens_a_grant_below_the_floor() -> None:
    rules = GrantRules()
    assert (rules.tokens(rules.short, 128), rules.tokens(rules.least, 128)) == (32, 16)
    assert (rules.tokens(rules.short, 32), rules.tokens(rules.least, 32)) == (16, 16)
    assert rules.tokens(rules.short, 4) == 4  # never above S
    pol = GrantPolicy(EST, 4, token_budget=1000, workers=["a"], rules=rules)
    for rid in ("a1", "a2", "a3"):
        pol.arrive(rid, 10, 100)
    assert [g.tokens for g in pol.schedule()] == [4, 4, 4]  # S = 4: shorter would cost round trips


def test_rules_are_checked() -> None:
    with pytest.raises(ValueError):
        GrantRules(short=-0.1)
    with pytest.raises(ValueError):
        GrantRules(window=0)
    with pytest.raises(ValueError):
        GrantRules(floor=0)


def test_a_prefix_hint_weighs_only_the_prefill_it_saves() -> None:
    """A new request hinted to worker b (a cached prefix of its prompt there) goes to b while b
    finishes it no later than the best other worker, its prefill there counted past the prefix
    only; to another when b's load exceeds the other's by more than the prefix's prefill; never
    to a worker without room; and the load b is charged is the tail's."""
    def placed(ballast: int, prefix: int = 900, budget: int = 100_000) -> tuple[str, float, float]:
        pol = GrantPolicy(EST, 16, token_budget=budget, workers=["a", "b"], rules=NONE)
        if ballast:
            pol.set_active("a", False)
            pol.arrive("ballast", ballast, 16)
            assert [g.worker for g in pol.schedule()] == ["b"]
            pol.set_active("a", True)
        # b's lead in the placement's terms (a busy worker's d4 per step counts for either)
        before = pol.load("b") - (EST.d4 * 16 if ballast else 0.0)
        pol.arrive("r", 1000, 100, prefix=("b", prefix))
        (g,) = pol.schedule()
        return g.worker, before, pol.load(g.worker)

    saved = EST.t_prefill(1, 1000) - EST.t_prefill(1, 100)
    assert saved > 0
    worker, _, _ = placed(0)
    assert worker == "b"  # idle both: the hint wins (without it the rotation picks a)
    pol = GrantPolicy(EST, 16, token_budget=100_000, workers=["a", "b"], rules=NONE)
    pol.arrive("r", 1000, 100)
    assert [g.worker for g in pol.schedule()] == ["a"]
    followed = 0
    for ballast in range(1, 6000, 211):
        worker, gap, _ = placed(ballast)
        if abs(gap - saved) > 1e-9:
            assert worker == ("b" if gap < saved else "a"), (ballast, gap, saved)
            followed += worker == "b"
    assert 0 < followed
    assert placed(0, budget=1100)[0] == "b"
    assert placed(100, budget=1100)[0] == "a"  # b holds the ballast (116 tokens): no room beside it
    assert placed(100)[0] == "b"  # with room, b: the ballast costs it less than the prefix saves
    # Charged the prefill of the 100 tokens past the prefix, not the whole prompt's.
    _, _, load = placed(0)
    plain = GrantPolicy(EST, 16, token_budget=100_000, workers=["a", "b"], rules=NONE)
    plain.arrive("r", 1000, 100)
    plain.schedule()
    assert load == pytest.approx(plain.load("a") - saved)
