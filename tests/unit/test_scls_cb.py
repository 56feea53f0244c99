"""scls-cb: slice grants on continuous batching, in core (GrantPolicy) and in the simulator."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sclsd.core.grants import GrantPolicy, GrantRules
from sclsd.core.policy import POLICIES, make_policy
from sclsd.core.profiles import Profile
from sclsd.sim.cb import CBSimulation
from sclsd.sim.common import ALL_POLICIES, SimConfig
from sclsd.sim.engine import simulate
from sclsd.sim.workload import Workload

from .toy import EST, toy_profile

#: The plain rules (full grants where they fit, no headroom, moves priced by re-prefill alone):
#: the mechanics tests below hold the policy to them; the rules on top have their own tests.
BASIC = GrantRules.basic()


def profile(mem_tokens: float = 20_000) -> Profile:
    return toy_profile(mem_tokens)


def workload(n: int = 60, seed: int = 1, rate: float = 4.0, max_in: int = 400, max_out: int = 300) -> Workload:
    rng = np.random.default_rng(seed)
    arr = np.cumsum(rng.exponential(1 / rate, n))
    return Workload(
        arr - arr[0],
        rng.integers(1, max_in, n).astype(np.int64),
        rng.integers(1, max_out, n).astype(np.int64),
    )


def cfg(**kw: object) -> SimConfig:
    base: dict[str, object] = dict(workers=3, slice_len=32, max_gen=256, profile=profile())
    base.update(kw)
    return SimConfig(policy="scls-cb", **base)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- names


def test_policy_name_is_a_grant_policy_for_the_simulator_and_the_daemon() -> None:
    assert "scls-cb" in ALL_POLICIES
    assert "scls-cb" not in POLICIES  # not a rung of the paper's ladder
    pol = make_policy("scls-cb", slice_len=64)
    assert pol.slice_len == 64 and pol.kv_reuse and pol.work_conserving


# --------------------------------------------------------------------------- what the daemon adds


def test_forget_frees_a_grant_a_parked_kv_and_a_queue_place() -> None:
    pol = GrantPolicy(EST, 16, token_budget=100, workers=["a"], rules=BASIC)
    pol.arrive("g", 30, 100)
    pol.arrive("p", 30, 100)
    pol.arrive("q", 30, 100)
    assert {g.rid for g in pol.schedule()} == {"g", "p"}  # q waits: 3 x 46 > 100
    pol.end("p", 46, 84)  # p back, parked on a with its KV
    assert pol.forget("g") and pol.take_evictions() == [("a", "g")]
    assert pol.forget("p") and pol.take_evictions() == [("a", "p")]
    assert pol.reserved("a") == 0
    assert pol.forget("q") and pol.queued == 0
    assert not pol.forget("q")


def test_a_grant_ending_without_kept_kv_queues_first_with_no_holder() -> None:
    pol = GrantPolicy(EST, 16, token_budget=1000, workers=["a", "b"])
    pol.arrive("x", 10, 100)
    (g,) = pol.schedule()
    pol.arrive("late", 10, 100)
    pol.end("x", 26, 84, kept=False)
    assert pol.reserved(g.worker) == 0
    grants = pol.schedule()
    assert [h.rid for h in grants] == ["x", "late"]
    assert grants[0].prefill == 26  # nothing kept: it prefills its whole context again


def test_a_drained_worker_gets_no_grant_and_gives_up_parked_kv() -> None:
    pol = GrantPolicy(EST, 16, token_budget=1000, workers=["a", "b"])
    pol.arrive("x", 10, 100)
    (g,) = pol.schedule()
    pol.end("x", 26, 84)  # parked on its worker
    pol.set_active(g.worker, False)
    assert pol.take_evictions() == [(g.worker, "x")]
    (h,) = pol.schedule()
    assert h.worker != g.worker and h.prefill == 26
    pol.set_active(g.worker, True)
    pol.arrive("y", 10, 100)
    assert [k.worker for k in pol.schedule()] == [g.worker]  # idle again, so it finishes first


# --------------------------------------------------------------------------- core


def test_new_requests_are_granted_at_once_while_memory_allows() -> None:
    pol = GrantPolicy(EST, 16, token_budget=100, workers=["a", "b"], rules=BASIC)
    for k in range(5):
        pol.arrive(f"r{k}", 30, 100)  # each needs 30 + 16 = 46 tokens
    grants = pol.schedule()
    # Two fit on each worker (92 <= 100), the fifth waits.
    assert len(grants) == 4 and pol.queued == 1
    assert {g.worker for g in grants} == {"a", "b"}
    assert all(pol.reserved(w) <= 100 for w in pol.workers)
    assert all(g.tokens == 16 and g.prefill == 30 for g in grants)
    pol.end("r0", 46, 0)  # finished: its room goes to the waiting one
    (g,) = pol.schedule()
    assert g.rid == "r4" and g.worker == grants[0].worker


def test_the_last_grant_is_the_remaining_budget() -> None:
    pol = GrantPolicy(EST, 16, token_budget=1000, workers=["a"])
    pol.arrive("r", 10, 5)
    (g,) = pol.schedule()
    assert g.tokens == 5 and g.reserve == 15


def test_a_returning_request_stays_with_its_kv_when_loads_are_close() -> None:
    pol = GrantPolicy(EST, 16, token_budget=10_000, workers=["a", "b"])
    pol.record_placements = True
    pol.arrive("r", 500, 100)
    (g,) = pol.schedule()
    pol.end("r", 516, 84)
    (g2,) = pol.schedule()
    assert g2.worker == g.worker and g2.prefill == 0 and pol.migrations == 0
    assert pol.take_evictions() == []


def test_a_returning_request_moves_only_when_the_gap_exceeds_its_reprefill() -> None:
    outcomes = set()
    for ballast in range(1, 400, 7):
        pol = GrantPolicy(EST, 16, token_budget=100_000, workers=["a", "b"])
        pol.record_placements = True
        pol.arrive("r", 200, 1000)
        (g,) = pol.schedule()
        assert g.worker == "a"
        # Other work on the holder only: a load gap of the ballast's cost.
        pol.set_active("b", False)
        pol.arrive("ballast", ballast, 16)
        (b,) = pol.schedule()
        pol.set_active("b", True)
        pol.end("r", 216, 984)
        (g2,) = pol.schedule()
        (p,) = pol.placements
        assert p.reprefill_cost == pol.prefill_cost(216)
        moved = g2.worker != "a"
        assert moved == (p.worker != p.holder) == (b.cost > p.reprefill_cost)
        assert p.gap == (pytest.approx(b.cost) if moved else 0.0)
        assert g2.prefill == (216 if moved else 0)
        assert pol.take_evictions() == ([("a", "r")] if moved else [])
        assert pol.migrations == int(moved)
        outcomes.add(moved)
    assert outcomes == {True, False}


def test_an_idle_worker_drops_parked_kv_until_a_request_fits() -> None:
    pol = GrantPolicy(EST, 16, token_budget=200, workers=["a"], rules=BASIC)
    pol.arrive("x", 80, 100)
    pol.arrive("y", 80, 100)
    assert len(pol.schedule()) == 2  # 96 + 96 <= 200
    pol.end("x", 96, 84)
    pol.end("y", 96, 84)
    assert pol.reserved("a") == 192  # both keep their KV
    # Each needs 16 more: neither fits beside the other, and nothing runs to free room.
    (g,) = pol.schedule()
    assert g.prefill == 0 and g.reserve == 112
    (dropped,) = pol.take_evictions()
    assert dropped[0] == "a" and dropped[1] != g.rid and pol.queued == 1
    assert pol.reserved("a") == 112


def test_a_context_near_the_budget_gets_a_shorter_grant() -> None:
    pol = GrantPolicy(EST, 16, token_budget=100, workers=["a"], rules=BASIC)
    pol.arrive("x", 88, 50)
    (g,) = pol.schedule()
    assert g.tokens == 12 and g.reserve == 100


def test_a_returning_request_parks_where_its_kv_is_until_room_frees() -> None:
    pol = GrantPolicy(EST, 16, token_budget=190, workers=["a"], rules=BASIC)
    pol.arrive("x", 60, 100)
    pol.arrive("y", 60, 100)
    assert len(pol.schedule()) == 2  # 76 + 76 <= 190
    pol.end("x", 76, 84)  # needs 76 + 16 = 92 beside y's 76: fits
    (g,) = pol.schedule()
    assert g.prefill == 0
    pol.end("y", 76, 84)  # 92 + 92 = 184: fits
    (g,) = pol.schedule()
    pol.end("x", 92, 68)  # 108 + 92 > 190: parked, its 92 tokens still reserved
    pol.arrive("z", 5, 10)  # a worker with a parked request takes no newcomer
    assert pol.schedule() == [] and pol.reserved("a") == 92 + 92 and pol.queued == 2
    pol.end("y", 92, 0)  # y finishes: x resumes with its KV, then z
    grants = pol.schedule()
    assert [(g.rid, g.prefill) for g in grants] == [("x", 0), ("z", 5)]
    assert pol.take_evictions() == [] and pol.migrations == 0


def test_removing_a_worker_returns_its_requests() -> None:
    pol = GrantPolicy(EST, 16, token_budget=1000, workers=["a", "b"])
    pol.arrive("r", 10, 50)
    (g,) = pol.schedule()
    assert pol.remove_worker(g.worker) == ["r"]
    pol.arrive("r", 10, 50)
    (g2,) = pol.schedule()
    assert g2.worker != g.worker and g2.prefill == 10


# --------------------------------------------------------------------------- simulator


def _check(res, wl: Workload, max_gen: int) -> None:  # type: ignore[no-untyped-def]
    recs = res.requests
    assert sorted(r.rid for r in recs) == sorted(f"r{i}" for i in range(len(wl)))
    assert all(r.completed for r in recs)
    for r, true in zip(recs, wl.output_len.tolist(), strict=True):
        assert r.output_len == min(true, max_gen)
        assert r.finish_reason == ("stop" if true <= max_gen else "length")
        assert r.first_token is not None and r.arrival <= r.first_token <= r.finished
    assert res.oom_events == 0 and res.preemptions == 0
    assert 0 < res.extra["max_reserved_frac"] <= 1.0


def test_every_request_completes_once_within_its_reservations() -> None:
    wl = workload(max_out=400)
    res = simulate(cfg(), wl)
    _check(res, wl, 256)
    s = res.summary()
    assert s["completed"] == len(wl) and s["preemptions"] == 0 and s["oom_events"] == 0


def test_tight_memory_makes_requests_wait_and_move_but_never_overflow() -> None:
    wl = workload(n=80, rate=20.0, max_in=800, max_out=400)
    res = simulate(cfg(profile=profile(mem_tokens=3_000), workers=2), wl)
    _check(res, wl, 256)
    assert res.extra["max_reserved_frac"] > 0.5


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 25),
    workers=st.integers(1, 4),
    S=st.integers(1, 40),
    mem=st.integers(1_500, 6_000),
    rate=st.floats(0.5, 50.0),
    seed=st.integers(0, 10_000),
)
def test_property_complete_once_and_reserved_within_budget(
    n: int, workers: int, S: int, mem: int, rate: float, seed: int
) -> None:
    wl = workload(n=n, seed=seed, rate=rate, max_in=600, max_out=300)
    c = cfg(workers=workers, slice_len=S, profile=profile(mem_tokens=mem), max_gen=200)
    sim = CBSimulation(c, wl)
    budget = sim.budget
    orig = sim._step

    def checked(w, now):  # type: ignore[no-untyped-def]
        orig(w, now)
        for wid in sim.policy.workers:  # the policy's books and the worker's agree, within budget
            assert sim.policy.reserved(wid) <= budget
        assert w.reserved <= budget
        ctx = sum(r.c0 + (w.it - r.t0) + 1 for r in w.running.values())
        assert ctx <= budget

    sim._step = checked  # type: ignore[method-assign]
    res = sim.run()
    _check(res, wl, 200)
    assert res.extra["grants"] >= n


def test_json_counters(tmp_path: Path) -> None:
    from sclsd.bench.cli import main

    trace = tmp_path / "t.csv"
    rng = np.random.default_rng(0)
    rows = [f",{int(rng.integers(1, 2000))},{int(rng.integers(1, 1200))}" for _ in range(40)]
    trace.write_text("arrival_s,input_tokens,output_tokens\n" + "\n".join(rows) + "\n")
    out = tmp_path / "o.json"
    args = ["sim", "--trace", str(trace), "--profile", "a100-llama2-13b-hf", "--workers", "2"]
    args += ["--rate", "4", "--duration", "10", "--json", str(out), "--no-progress"]
    assert main(args + ["--policy", "scls-cb"]) == 0
    d = json.loads(out.read_text())
    for key in ("preemptions", "oom_events", "migrations", "reprefill_tokens_per_req", "throughput_rps", "ct_std_s"):
        assert key in d, key
    assert d["policy"] == "scls-cb" and d["preemptions"] == 0 and d["oom_events"] == 0
    assert d["completed"] == d["requests"] > 0
    assert main(args + ["--policy", "ils-paged"]) == 0
    assert "preemptions" in json.loads(out.read_text())


def test_reservations_round_up_to_the_engines_kv_pages() -> None:
    pol = GrantPolicy(EST, 16, token_budget=64, workers=["a"], rules=BASIC)
    pol.page = 16
    pol.arrive("x", 10, 100)
    pol.arrive("y", 10, 100)
    pol.arrive("z", 10, 100)
    grants = pol.schedule()
    # 10 + 16 = 26 tokens take two pages of 16: two grants fill the 64-token budget.
    assert [g.reserve for g in grants] == [32, 32] and pol.reserved("a") == 64
    pol.end("x", 26, 84)  # kept: 26 tokens of KV still hold two pages
    assert pol.reserved("a") == 64


def test_cost_terms_and_kv_shares_account_for_the_run() -> None:
    wl = workload(n=80, rate=20.0, max_in=800, max_out=400)
    sim = CBSimulation(cfg(profile=profile(mem_tokens=4_000), workers=2), wl)
    res = sim.run()
    costs = res.extra["cost_s"]
    # Noise-free: the terms of the cost model add up to the workers' busy time exactly.
    assert sum(costs.values()) == pytest.approx(sum(res.extra["busy_s"].values()))
    prefill = costs["prefill_tokens"] + costs["prefill_fixed"]
    assert prefill / sum(costs.values()) == pytest.approx(res.extra["prefill_share"])
    used, reserved = res.extra["kv_used_frac"], res.extra["kv_reserved_frac"]
    assert 0 < used <= reserved <= res.extra["max_reserved_frac"] <= 1.0
    assert 0 <= res.extra["kv_parked_frac"] <= reserved


def test_a_grants_estimate_is_its_iterations_at_its_workers_step_cost() -> None:
    """What the status compares with a grant's measured time (``estimator_error``): its
    iterations at the cost of its worker's steps, the grants beside it included (its own
    share of those steps, its ``est_time``, is what loads add up, not what a clock sees)."""
    from sclsd.core.batch import BatchOutcome, RowOutcome
    from sclsd.core.estimator import Estimator
    from sclsd.core.grant_scheduler import SliceGrantScheduler
    from sclsd.core.memory import KVMemory
    from sclsd.core.profiles import ProfileCost
    from sclsd.core.request import Request

    est = Estimator(p1=0.0, p2=0.0, p3=0.0, p4=0.0, d1=1e-4, d2=1e-3, d3=0.0, d4=0.02)
    s = SliceGrantScheduler(make_policy("scls-cb", slice_len=16), ProfileCost(est, KVMemory(1, 1e6, 1.0)))
    s.add_worker("w0")
    for i in range(3):
        s.add(Request(rid=f"r{i}", prompt_len=100, max_tokens=16, arrival=0.0), 0.0)
    rnd = s.schedule(0.0)
    assert len(rnd.batches) == 3
    b = rnd.batches[0]
    s.on_result(BatchOutcome(b.bid, [RowOutcome(b.requests[0].rid, 16, "length")], elapsed=1.25), 1.0)
    (got, measured), = s.recent
    step = 0.02 + 3 * (1e-4 * (100 + 8) + 1e-3)  # three grants of 16 from 100 tokens, halfway
    assert measured == 1.25 and abs(got - 16 * step) < 1e-9
    assert got > 3 * b.est_time  # the grant's own share would claim a third of the steps
