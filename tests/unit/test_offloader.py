"""Max-min and round-robin offloading, fixed and adaptive intervals (eq. 11, 12)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sclsd.core.offloader import AdaptiveInterval, FixedInterval, MaxMin, RoundRobin


@dataclass
class B:
    est_time: float
    est_on: dict[str, float] = field(default_factory=dict)

    def est_for(self, w: str) -> float:
        return self.est_on.get(w, self.est_time)


def test_maxmin_longest_batch_to_least_loaded_worker():
    batches = [B(1.0), B(5.0), B(3.0)]
    loads = {"w0": 2.0, "w1": 0.0}
    # 5 -> w1 (0) => w1=5; 3 -> w0 (2) => w0=5; 1 -> tie 5/5 -> w1, the one after w0.
    assert MaxMin().assign(batches, loads) == ["w1", "w1", "w0"]
    assert loads == {"w0": 2.0, "w1": 0.0}  # the scheduler applies the update, not us


def test_maxmin_rotates_ties_across_calls():
    """At light load every worker is idle each round: lone batches must not all go to w0."""
    mm = MaxMin()
    idle = {"w0": 0.0, "w1": 0.0, "w2": 0.0}
    got = [mm.assign([B(3.0)], idle)[0] for _ in range(6)]
    assert got == ["w0", "w1", "w2", "w0", "w1", "w2"]
    # A strictly less loaded worker still wins over the rotation.
    assert mm.assign([B(1.0)], {"w0": 0.0, "w1": 5.0, "w2": 5.0}) == ["w0"]
    # Workers joining or leaving: the rotation continues in name order.
    assert mm.assign([B(1.0)], {"w0": 0.0, "w3": 0.0}) == ["w3"]


def test_maxmin_accounts_for_batches_placed_in_the_same_call():
    batches = [B(4.0)] * 4
    assert sorted(MaxMin().assign(batches, {"a": 0.0, "b": 0.0})) == ["a", "a", "b", "b"]


@given(
    st.lists(st.floats(0.0, 100.0), min_size=1, max_size=30),
    st.lists(st.floats(0.0, 100.0), min_size=1, max_size=6),
)
def test_maxmin_greedy_invariant(ests, initial):
    loads = {f"w{k}": v for k, v in enumerate(initial)}
    batches = [B(e) for e in ests]
    got = MaxMin().assign(batches, loads)
    assert len(got) == len(batches) and set(got) <= set(loads)
    # Replay in decreasing est: each chosen worker had the minimal load at that moment.
    local = dict(loads)
    for k in sorted(range(len(batches)), key=lambda k: -ests[k]):
        assert local[got[k]] == min(local.values())
        local[got[k]] += ests[k]
    # LPT bound: final makespan <= max(initial) + average + the largest batch.
    assert max(local.values()) <= max(initial) + sum(ests) / len(loads) + max(ests) + 1e-9


def test_maxmin_needs_a_worker():
    with pytest.raises(ValueError):
        MaxMin().assign([B(1.0)], {})


def test_round_robin_cycles_across_calls_ignoring_load():
    rr = RoundRobin()
    loads = {"b": 100.0, "a": 0.0}
    assert rr.assign([B(1)] * 3, loads) == ["a", "b", "a"]
    assert rr.assign([B(1)] * 2, loads) == ["b", "a"]


def test_fixed_interval():
    f = FixedInterval(2.5)
    assert f.initial == 2.5 and f.next({"w": 100.0}) == 2.5


def test_adaptive_interval_eq_12():
    iv = AdaptiveInterval(lam=0.5, gamma=3.0)
    assert iv.initial == 3.0
    assert iv.next({"a": 20.0, "b": 10.0}) == 5.0  # 0.5 · min load
    assert iv.next({"a": 20.0, "b": 4.0}) == 3.0  # floor at Γ
    assert iv.next({}) == 3.0
    with pytest.raises(ValueError):
        AdaptiveInterval(lam=1.5, gamma=1.0)
    with pytest.raises(ValueError):
        AdaptiveInterval(lam=0.5, gamma=-1.0)
