"""Continuous-batching baselines (ils-conservative, ils-paged) and the oracle."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from sclsd.core.estimator import Estimator
from sclsd.core.profiles import Profile
from sclsd.core.request import Request
from sclsd.sim.common import SimConfig
from sclsd.sim.engine import StaticSimulation, simulate
from sclsd.sim.ils import ILSSimulation, ILSWorker
from sclsd.sim.oracle import OracleBatcher
from sclsd.sim.workers import SimPayload, serve_ragged
from sclsd.sim.workload import Workload

EST = Estimator(p1=2e-4, p2=1e-3, p3=1e-5, p4=0.02, d1=2e-6, d2=1e-4, d3=1e-6, d4=0.02)


def profile(mem_tokens: float) -> Profile:
    return Profile("toy", "hf", "toy", "sim", EST, kv_bytes_per_token=1, mem_available=mem_tokens)


def cfg(policy: str, mem_tokens: float = 50_000, **kw: object) -> SimConfig:
    base: dict[str, object] = dict(workers=2, slice_len=32, max_gen=256, gamma=1.0)
    base.update(kw)
    return SimConfig(policy=policy, profile=profile(mem_tokens), **base)  # type: ignore[arg-type]


def workload(n: int = 80, seed: int = 2, rate: float = 10.0) -> Workload:
    rng = np.random.default_rng(seed)
    arr = np.cumsum(rng.exponential(1 / rate, n))
    return Workload(
        arr - arr[0],
        rng.integers(20, 300, n).astype(np.int64),
        rng.integers(1, 256, n).astype(np.int64),
    )


class Checked(ILSSimulation):
    """Checks the memory invariants after every admission + allocation."""

    def __init__(self, *a: object, **kw: object) -> None:
        super().__init__(*a, **kw)  # type: ignore[arg-type]
        self.max_running = 0
        self.blocked_steps = 0  # steps that left requests waiting while others ran
        self.max_tokens_cached = 0

    def _step(self, w: ILSWorker, now: float) -> None:
        super()._step(w, now)
        if not w.running:
            return
        n = len(w.running)
        cached = w.ctx_base + n * w.it + n  # after this step's token
        self.max_running = max(self.max_running, n)
        self.max_tokens_cached = max(self.max_tokens_cached, cached)
        if w.waiting:
            self.blocked_steps += 1
        if self.paged:
            expect = sum(math.ceil((r.c0 + w.it - r.t0 + 1) / self.B) for r in w.running.values())
            assert w.used_blocks == expect <= self.total_blocks
        else:
            if n > 1:
                assert w.reserved <= self.budget
            assert w.reserved == sum(r.c0 + r.req.max_tokens - r.g0 for r in w.running.values())
            assert cached <= w.reserved


def test_ils_single_request_timing() -> None:
    wl = Workload.of([0.0], [100], [50])
    for pol in ("ils-conservative", "ils-paged"):
        (r,) = simulate(cfg(pol, workers=1), wl).requests
        assert r.finished == pytest.approx(EST.t_prefill(1, 100) + EST.t_decode(1, 100, 50))
        # The first token is streamed when the prefill that produced it ends.
        assert r.first_token == pytest.approx(EST.t_prefill(1, 100))
        assert r.output_len == 50 and r.pad_tokens == 0 and r.invalid_tokens == 0


def test_ils_dispatches_round_robin() -> None:
    sim = ILSSimulation(cfg("ils-paged", workers=3), workload(n=9))
    sim.run()
    assert [r.worker for r in sim.requests] == ["w0", "w1", "w2"] * 3


def test_ils_conservative_never_exceeds_memory() -> None:
    # Budget 0.9 * 3000 = 2700 tokens; each request reserves prompt + 256.
    sim = Checked(cfg("ils-conservative", mem_tokens=3000), workload())
    res = sim.run()
    assert all(r.completed for r in res.requests)
    assert res.oom_events == 0 and res.preemptions == 0
    assert sim.blocked_steps > 0  # memory really was the limit
    assert sim.max_tokens_cached <= 2700


def test_ils_paged_preempts_under_pressure_and_conserves_tokens() -> None:
    wl = workload()
    sim = Checked(cfg("ils-paged", mem_tokens=3000), wl)
    res = sim.run()
    assert res.preemptions > 0
    assert sum(r.preemptions for r in res.requests) == res.preemptions
    assert all(r.completed for r in res.requests) and res.oom_events == 0
    assert sum(r.output_len for r in res.requests) == int(np.minimum(wl.output_len, 256).sum())
    assert sim.max_tokens_cached <= 2700
    # With memory to spare nothing is preempted.
    assert simulate(cfg("ils-paged", mem_tokens=10**7), wl).preemptions == 0


def test_paged_packs_more_requests_than_conservative() -> None:
    wl = workload()
    cons = Checked(cfg("ils-conservative", mem_tokens=4000), wl)
    paged = Checked(cfg("ils-paged", mem_tokens=4000), wl)
    rc, rp = cons.run().summary(), paged.run().summary()
    assert paged.max_running > cons.max_running
    assert rp["avg_batch_size"] > rc["avg_batch_size"]


def test_oracle_pads_nothing_and_never_slices() -> None:
    res = simulate(cfg("oracle"), workload())
    s = res.summary()
    assert s["pad_tokens_per_req"] == 0 and s["invalid_tokens_per_req"] == 0
    assert s["slices_per_req"] == 1.0 and s["early_return_ratio"] == 0.0
    assert s["completed"] == 80 and s["oom_events"] == 0


def test_oracle_does_less_work_than_scls() -> None:
    wl = workload()
    orc = simulate(cfg("oracle"), wl)
    scls = simulate(cfg("scls"), wl)
    assert sum(orc.extra["busy_s"].values()) < sum(scls.extra["busy_s"].values())


def test_oracle_loads_return_to_zero() -> None:
    sim = StaticSimulation(cfg("oracle"), workload(n=30))
    sim.run()
    assert all(v == pytest.approx(0.0, abs=1e-9) for v in sim.sched.loads().values())


def _reqs(lens: list[int], outs: list[int]) -> list[Request]:
    out = []
    for k, (L, o) in enumerate(zip(lens, outs, strict=True)):
        r = Request(f"q{k}", prompt_len=L, max_tokens=1024, arrival=float(k))
        r.payload = SimPayload(true_len=o)
        out.append(r)
    return out


@pytest.mark.parametrize("seed", range(5))
def test_oracle_dp_is_optimal_over_contiguous_partitions(seed: int) -> None:
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, 500, 7).tolist()
    outs = rng.integers(1, 300, 7).tolist()
    budget = 2500.0
    reqs = _reqs(lens, outs)
    batcher = OracleBatcher(EST, budget)
    got = batcher(reqs, 1024, None)  # type: ignore[arg-type]
    assert sorted(r.rid for b in got for r in b) == sorted(r.rid for r in reqs)

    def cost(batch: list[Request]) -> float:
        from sclsd.core.scheduler import Batch

        return serve_ragged(Batch(0, batch, 1024, max(r.input_len for r in batch)), EST).time

    def fits(batch: list[Request]) -> bool:
        return len(batch) == 1 or sum(r.input_len + r.payload.true_len for r in batch) <= budget

    assert all(fits(b) for b in got)
    ordered = sorted(reqs, key=lambda r: (r.payload.true_len, r.input_len, r.arrival))
    best = math.inf
    n = len(ordered)
    for cuts in itertools.product([0, 1], repeat=n - 1):
        parts, cur = [], [ordered[0]]
        for k, c in enumerate(cuts, start=1):
            if c:
                parts.append(cur)
                cur = []
            cur.append(ordered[k])
        parts.append(cur)
        if all(fits(p) for p in parts):
            best = min(best, sum(cost(p) for p in parts))
    assert sum(cost(b) for b in got) == pytest.approx(best, rel=1e-9)
    # The DP's incremental costs are the engine's true times.
    assert batcher.total(reqs) == pytest.approx(best, rel=1e-9)


def test_rule_table_profiles_give_continuous_engines_the_tables_token_budget() -> None:
    from sclsd.core.profiles import load_profile
    from sclsd.sim.common import rules_token_budget

    table = ((1024, 12), (512, 22), (0, 28))
    assert rules_token_budget(table, 2048) == 12 * 2048
    assert rules_token_budget(table, 1000) == 22 * 1000
    ds = SimConfig("ils-paged", load_profile("a100-llama2-13b-ds"))
    assert ds.kv_token_budget == ds.kv_token_capacity == 12 * 2048
    hf = SimConfig("ils-paged", load_profile("a100-llama2-13b-hf"))
    assert hf.kv_token_budget == pytest.approx(0.9 * hf.kv_token_capacity)
