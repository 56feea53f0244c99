"""The discrete-event simulator driving core's Scheduler: completion, tokens, timing, memory."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sclsd.core.policy import POLICIES, Policy, RoundRobin, make_policy
from sclsd.core.profiles import Profile
from sclsd.core.request import Request
from sclsd.core.scheduler import Batch
from sclsd.sim.common import ALL_POLICIES, SimConfig
from sclsd.sim.engine import StaticSimulation, simulate
from sclsd.sim.workers import Noise, SimPayload, ragged_decode_time, serve_ragged, serve_static
from sclsd.sim.workload import Workload

from .toy import EST, toy_profile


def profile(mem_tokens: float = 50_000, gamma: float = 1.0) -> Profile:
    return toy_profile(mem_tokens, gamma)


def workload(n: int = 60, seed: int = 1, rate: float = 4.0, max_out: int = 300) -> Workload:
    rng = np.random.default_rng(seed)
    arr = np.cumsum(rng.exponential(1 / rate, n))
    return Workload(
        arr - arr[0],
        rng.integers(1, 400, n).astype(np.int64),
        rng.integers(1, max_out, n).astype(np.int64),
    )


def cfg(policy: str, **kw: object) -> SimConfig:
    base: dict[str, object] = dict(workers=3, slice_len=32, max_gen=256, batch_size=8)
    base.update(kw)
    base.setdefault("profile", profile())
    return SimConfig(policy=policy, **base)  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_every_request_completes_once_and_tokens_are_conserved(policy: str) -> None:
    # Some true lengths exceed max_gen = 256: those stop at the budget ("length").
    wl = workload(max_out=400)
    res = simulate(cfg(policy), wl)
    recs = res.requests
    assert sorted(r.rid for r in recs) == sorted(f"r{i}" for i in range(len(wl)))
    assert all(r.completed for r in recs)
    expected = np.minimum(wl.output_len, 256)
    assert sum(r.output_len for r in recs) == int(expected.sum())
    for r, true in zip(recs, wl.output_len.tolist(), strict=True):
        assert r.output_len == min(true, 256)
        assert r.finish_reason == ("stop" if true <= 256 else "length")
        assert r.first_token is not None and r.arrival <= r.first_token <= r.finished
    assert res.oom_events == 0
    assert res.summary()["completed"] == len(wl)


def test_scheduler_reports_each_request_finished_exactly_once() -> None:
    sim = StaticSimulation(cfg("scls"), workload())
    seen: list[str] = []
    orig = sim.sched.on_result

    def spy(outcome, now):  # type: ignore[no-untyped-def]
        done = orig(outcome, now)
        seen.extend(r.rid for r in done.ended)
        return done

    sim.sched.on_result = spy  # type: ignore[method-assign]
    sim.run()
    assert len(seen) == len(set(seen)) == 60
    assert sim.sched.stats().finished == 60 and not sim.sched.live and not sim.sched.pool


def test_one_batch_takes_exactly_t_serve() -> None:
    # slice_len >= max_gen, one worker, one request whose true length is the whole budget.
    wl = Workload.of([0.0], [300], [128])
    res = simulate(cfg("so", workers=1, slice_len=128, max_gen=128), wl)
    (r,) = res.requests
    assert r.finished - r.arrival == pytest.approx(EST.t_serve(1, 300, 128), rel=1e-12)
    assert res.batches.batches == 1 and res.batches.early_returns == 0


def test_queued_batches_run_back_to_back_on_a_worker() -> None:
    # Γ = 1: the first request is scheduled alone at t=0, the other two together at t=1;
    # the second batch waits in the worker's FIFO queue until the first finishes.
    wl = Workload.of([0.0, 0.5, 0.5], [100, 50, 80], [64, 64, 64])
    res = simulate(cfg("so", workers=1, slice_len=64, max_gen=64), wl)
    t1 = EST.t_serve(1, 100, 64)
    assert t1 > 1.0
    t2 = t1 + EST.t_serve(2, 80, 64)
    fin = {r.rid: r.finished for r in res.requests}
    assert fin["r0"] == pytest.approx(t1) and fin["r1"] == fin["r2"] == pytest.approx(t2)
    assert res.requests[1].pad_tokens == 30 and res.requests[2].pad_tokens == 0


def _batch(lens: list[int], gens: list[int], trues: list[int], S: int, max_tokens: int = 1024):
    reqs = []
    for k, (L, g, t) in enumerate(zip(lens, gens, trues, strict=True)):
        r = Request(f"q{k}", prompt_len=L, max_tokens=max_tokens, arrival=0.0)
        r.num_generated = g
        r.payload = SimPayload(true_len=t)
        reqs.append(r)
    return Batch(1, reqs, S, max(r.input_len for r in reqs))


def test_static_batch_early_return_invalid_and_pad_tokens() -> None:
    # Remaining true lengths 5 and 20 < S = 64: the batch stops after 20 iterations.
    b = _batch([10, 30], [0, 0], [5, 20], S=64)
    s = serve_static(b, EST)
    assert s.iterations == 20 and s.early_return
    assert s.time == pytest.approx(EST.t_serve(2, 30, 20))
    assert [row.new_tokens for row in s.rows] == [5, 20]
    assert [row.finish_reason for row in s.rows] == ["stop", "stop"]
    assert s.invalid == [15, 0] and s.pad == [20, 0]
    # A row still going at S is cut there and not finished.
    s2 = serve_static(_batch([10, 30], [0, 0], [5, 200], S=64), EST)
    assert s2.iterations == 64 and not s2.early_return
    assert s2.rows[1].finish_reason is None and s2.rows[1].new_tokens == 64
    # max_tokens ends a row like EOS does, with reason "length".
    s3 = serve_static(_batch([10], [90], [500], S=64, max_tokens=100), EST)
    assert s3.iterations == 10 and s3.rows[0].finish_reason == "length"


def test_early_return_ratio_counts_batches_ending_before_the_slice() -> None:
    short = Workload.of([0.0, 3.0, 6.0], [50, 50, 50], [10, 10, 10])
    r1 = simulate(cfg("scls", slice_len=128, max_gen=512), short).summary()
    assert r1["early_return_ratio"] == 1.0 and r1["batches"] == 3
    # 256 tokens = exactly two full slices of 128: no early return.
    exact = Workload.of([0.0], [50], [256])
    r2 = simulate(cfg("scls", slice_len=128, max_gen=512), exact).summary()
    assert r2["early_return_ratio"] == 0.0 and r2["slices_per_req"] == 2.0


def test_oom_events_detect_a_batcher_that_ignores_memory() -> None:
    def everything(reqs, slice_len, cost):  # type: ignore[no-untyped-def]
        return [list(reqs)]

    pol = Policy("greedy", 64, everything, RoundRobin(), make_policy("so").interval)
    wl = Workload.of([0.0] * 2 + [0.1] * 8, [500] * 10, [64] * 10)
    c = cfg("so", profile=profile(mem_tokens=2000), workers=1, slice_len=64)
    res = StaticSimulation(c, wl, policy=pol).run()
    assert res.oom_events >= 1  # 8 rows × (500 + 64) tokens > 2000
    # The real policies respect the same memory and never trigger it.
    assert simulate(c, wl).oom_events == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_static_policies_respect_memory_under_pressure(policy: str) -> None:
    c = cfg(policy, profile=profile(mem_tokens=6000), batch_size=16)
    res = simulate(c, workload(n=80, rate=20.0))
    assert res.oom_events == 0 and all(r.completed for r in res.requests)


def test_slicing_returns_short_requests_sooner_than_sls() -> None:
    # Under load, sls holds short requests hostage to long batch-mates; slices release them.
    wl = workload(n=120, rate=6.0, max_out=256)
    sls = simulate(cfg("sls"), wl).summary()
    so = simulate(cfg("so"), wl).summary()
    assert so["invalid_tokens_per_req"] < sls["invalid_tokens_per_req"]
    assert sls["slices_per_req"] == 1.0 and so["slices_per_req"] > 1.0


def test_same_seed_same_result_and_noise_changes_times_not_tokens() -> None:
    wl = workload()
    a = simulate(cfg("scls", noise=0.2, seed=3), wl).summary()
    b = simulate(cfg("scls", noise=0.2, seed=3), wl).summary()
    c = simulate(cfg("scls", noise=0.0), wl).summary()
    for k in ("duration_s", "avg_latency_s", "batches", "ct_std_s"):
        assert a[k] == b[k]
    assert a["duration_s"] != c["duration_s"]
    assert a["output_tps"] * a["duration_s"] == pytest.approx(c["output_tps"] * c["duration_s"])


def test_noise_is_mean_one_lognormal() -> None:
    n = Noise(0.3, seed=0)
    xs = np.array([n() for _ in range(20000)])
    assert xs.min() > 0 and abs(xs.mean() - 1.0) < 0.01
    assert Noise(0.0, seed=0)() == 1.0


def test_ragged_decode_time_matches_iteration_by_iteration_sum() -> None:
    lens, outs = [10, 200, 37, 5], [3, 17, 17, 40]
    brute = 0.0
    for t in range(1, max(outs) + 1):
        alive = [L for L, o in zip(lens, outs, strict=True) if o >= t]
        brute += EST.tau_decode(sum(alive) / len(alive) + t, len(alive))
    assert ragged_decode_time(EST, lens, outs) == pytest.approx(brute, rel=1e-12)
    b = _batch(lens, [0] * 4, outs, S=1024)
    s = serve_ragged(b, EST)
    assert s.time == pytest.approx(EST.t_prefill(4, sum(lens) / 4) + brute)
    assert s.pad == [0] * 4 and s.invalid == [0] * 4 and s.kv_tokens == sum(lens) + sum(outs)


def test_ct_std_is_zero_for_one_worker_and_reported() -> None:
    res = simulate(cfg("scls", workers=1), workload(n=20))
    assert res.summary()["ct_std_s"] == 0.0
    res8 = simulate(cfg("sls", workers=4), workload(n=40))
    cts = [t for t in res8.worker_completion.values() if t is not None]
    assert res8.summary()["ct_std_s"] == pytest.approx(float(np.std(cts)))
    assert math.isfinite(res8.summary()["ct_std_s"])
