"""The simulator with work-conserving rounds and KV reuse, and the static oracle."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sclsd.core.estimator import Estimator
from sclsd.core.memory import KVMemory
from sclsd.core.profiles import Profile, ProfileCost
from sclsd.core.request import Request
from sclsd.sim.common import SimConfig
from sclsd.sim.engine import StaticSimulation, simulate
from sclsd.sim.oracle import StaticOracleBatcher
from sclsd.sim.retained_kv import RetainedKV
from sclsd.sim.workers import SimPayload
from sclsd.sim.workload import Workload

EST = Estimator(p1=2e-4, p2=1e-3, p3=1e-5, p4=0.02, d1=2e-6, d2=1e-4, d3=1e-6, d4=0.02)
SWITCHES = list(itertools.product((False, True), repeat=2))


def profile(mem_tokens: float = 50_000, host_link: float | None = None, host: float | None = None) -> Profile:
    """A toy profile: Δ = 1 byte, so memory is counted in tokens."""
    return Profile("toy", "hf", "toy", "sim", EST, kv_bytes_per_token=1, mem_available=mem_tokens,
                   gamma_s=1.0, host_link_bytes_per_s=host_link, host_kv_bytes=host)


def cfg(policy: str = "scls", wc: bool = False, kv: bool = False, **kw: object) -> SimConfig:
    base: dict[str, object] = dict(workers=3, slice_len=32, max_gen=256, batch_size=8)
    base.update(kw)
    base.setdefault("profile", profile())
    return SimConfig(policy=policy, work_conserving=wc, kv_reuse=kv, **base)  # type: ignore[arg-type]


def workload(n: int = 60, seed: int = 1, rate: float = 4.0, max_out: int = 300) -> Workload:
    rng = np.random.default_rng(seed)
    arr = np.cumsum(rng.exponential(1 / rate, n))
    return Workload(arr - arr[0], rng.integers(1, 400, n).astype(np.int64),
                    rng.integers(1, max_out, n).astype(np.int64))


def _check_complete(res, wl: Workload, max_gen: int = 256) -> None:  # type: ignore[no-untyped-def]
    recs = res.requests
    assert sorted(r.rid for r in recs) == sorted(f"r{i}" for i in range(len(wl)))
    for r, true in zip(recs, wl.output_len.tolist(), strict=True):
        assert r.completed and r.output_len == min(true, max_gen)
        assert r.first_token is not None and r.arrival <= r.first_token <= r.finished
    assert res.oom_events == 0


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    rate=st.floats(0.5, 40.0),
    n=st.integers(1, 40),
    policy=st.sampled_from(["scls", "lb", "pm", "sls"]),
    switches=st.sampled_from(SWITCHES),
    mem=st.sampled_from([3_000.0, 50_000.0]),
    host=st.sampled_from([None, 2_000.0]),
)
def test_every_request_completes_exactly_once_under_every_switch(
    seed: int, rate: float, n: int, policy: str, switches: tuple[bool, bool], mem: float, host: float | None
) -> None:
    wc, kv = switches
    prof = profile(mem, host_link=None if host is None else 1e4, host=host)
    wl = workload(n=n, seed=seed, rate=rate)
    sim = StaticSimulation(cfg(policy, wc, kv, profile=prof), wl)
    finished: list[str] = []
    orig = sim.sched.on_result

    def spy(outcome, now):  # type: ignore[no-untyped-def]
        done = orig(outcome, now)
        finished.extend(r.rid for r in done.ended)
        return done

    sim.sched.on_result = spy  # type: ignore[method-assign]
    res = sim.run()
    assert sorted(finished) == sorted(f"r{i}" for i in range(n))  # once each
    _check_complete(res, wl)


@pytest.mark.parametrize(("wc", "kv"), SWITCHES)
def test_switches_complete_a_loaded_run(wc: bool, kv: bool) -> None:
    wl = workload(n=120, rate=30.0)
    _check_complete(simulate(cfg("scls", wc, kv, profile=profile(8_000)), wl), wl)


def test_first_token_at_the_end_of_the_first_prefill() -> None:
    wl = Workload.of([0.0], [300], [100])
    for pol in ("scls", "sls", "oracle", "oracle-static"):
        (r,) = simulate(cfg(pol, workers=1), wl).requests
        assert r.first_token == pytest.approx(EST.t_prefill(1, 300)), pol


def test_kv_reuse_prefills_only_new_tokens() -> None:
    # One request, three slices of 32 on one worker: later slices hold all but the last token.
    # (lb: a fixed interval, here 1 µs, so no slice waits for a round.)
    wl = Workload.of([0.0], [300], [96])
    plain = simulate(cfg("lb", workers=1, gamma=1e-6), wl)
    kv = simulate(cfg("lb", kv=True, workers=1, gamma=1e-6), wl)
    (p,), (k,) = plain.requests, kv.requests
    assert p.reprefill_tokens == (332 - 1) + (364 - 1) and k.reprefill_tokens == 0
    assert p.slices == k.slices == 3
    t = EST.t_serve(1, 300, 32)
    t_kv = t + EST.t_serve_cached(1, 331, 1, 32) + EST.t_serve_cached(1, 363, 1, 32)
    assert k.finished == pytest.approx(t_kv, abs=1e-5)
    assert p.finished == pytest.approx(t + EST.t_serve(1, 332, 32) + EST.t_serve(1, 364, 32), abs=1e-5)
    assert kv.summary()["reprefill_tokens_per_req"] == 0.0


def test_retained_kv_beyond_the_budget_is_evicted_and_re_prefilled() -> None:
    # Device room for almost nothing beside a batch and no host tier: KV is evicted.
    wl = workload(n=30, rate=50.0)
    res = simulate(cfg("scls", kv=True, workers=1, profile=profile(2_500)), wl)
    _check_complete(res, wl)
    assert res.extra["kv_evictions"] > 0 and res.summary()["reprefill_tokens_per_req"] > 0


def test_host_tier_keeps_kv_at_a_copy_cost() -> None:
    wl = workload(n=30, rate=50.0)
    host = simulate(cfg("scls", kv=True, workers=1, profile=profile(2_500, host_link=1e4, host=1e6)), wl)
    none = simulate(cfg("scls", kv=True, workers=1, profile=profile(2_500)), wl)
    assert host.extra["kv_evictions"] == 0 and host.extra["host_copy_share"] > 0
    assert host.summary()["reprefill_tokens_per_req"] < none.summary()["reprefill_tokens_per_req"]


def test_kv_store_tiers_and_lru() -> None:
    s = RetainedKV(delta=1, device_bytes=100, host_bytes=50)
    assert s.put([("a", 40), ("b", 40), ("c", 40)]) == []  # 120 > 100: "a" (LRU) to host
    co = s.checkout(["a"], running_bytes=0)
    assert co.held == [40] and co.host_bytes == 40
    # A batch of 90 leaves 10 on the device: b and c go to host (50): c fits, b is evicted.
    co = s.checkout(["zz"], running_bytes=90)
    assert co.held == [0] and co.evicted == ["b"] and "c" in s and s.evictions == 1
    s.drop("c")
    assert len(s) == 0


def test_oracle_static_beats_scls_on_a_small_workload() -> None:
    wl = workload(n=150, rate=40.0)
    scls = simulate(cfg("scls"), wl).summary()
    orc = simulate(cfg("oracle-static"), wl).summary()
    assert orc["throughput_rps"] >= scls["throughput_rps"]
    assert orc["slices_per_req"] == 1.0 and orc["reprefill_tokens_per_req"] == 0.0
    assert orc["oom_events"] == 0


@settings(max_examples=30, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(1, 300), st.integers(1, 200)), min_size=1, max_size=7))
def test_static_oracle_dp_is_optimal_over_output_sorted_splits(lens: list[tuple[int, int]]) -> None:
    """Brute force over every contiguous split of the output-sorted pool, same memory."""
    c = ProfileCost(EST, KVMemory(1, 2_000, 1.0))
    reqs = []
    for k, (L, out) in enumerate(lens):
        r = Request(f"q{k}", prompt_len=L, max_tokens=1024, arrival=0.0)
        r.payload = SimPayload(true_len=out)
        reqs.append(r)
    b = StaticOracleBatcher(EST)
    ordered = sorted(reqs, key=lambda r: (r.payload.true_len, r.input_len, r.arrival, r.rid))
    n = len(ordered)
    best = float("inf")
    for mask in range(1 << (n - 1)):
        cuts = [0] + [i + 1 for i in range(n - 1) if mask >> i & 1] + [n]
        total = 0.0
        for a, z in itertools.pairwise(cuts):
            g = ordered[a:z]
            L = max(r.input_len for r in g)
            O = max(r.payload.true_len for r in g)  # noqa: E741 - output length
            if len(g) > 1 and c.oom(len(g), L, O):
                total = float("inf")
                break
            total += EST.t_prefill(len(g), L) + EST.t_decode(len(g), L, O)
        best = min(best, total)
    assert b.total(reqs, c) == pytest.approx(best, rel=1e-9)
    got = b(reqs, 1024, c)
    assert sorted(r.rid for g in got for r in g) == sorted(r.rid for r in reqs)


def test_grid_variants_name_their_switches() -> None:
    from sclsd.sim.grid import parse_variant

    assert parse_variant("scls") == ("scls", {})
    assert parse_variant("scls+wc+kv") == ("scls", {"work_conserving": True, "kv_reuse": True})
    with pytest.raises(ValueError, match="unknown switch"):
        parse_variant("scls+turbo")


def test_variants_report_checks_the_targets() -> None:
    from sclsd.sim import variants

    def row(v: str, rate: float, **kw: float) -> dict[str, object]:
        base = dict(throughput_rps=1.0, avg_latency_s=10.0, avg_ttft_s=1.0, reprefill_tokens_per_req=100.0)
        base.update(kw)
        return dict(base, policy=v, rate=rate, trace="sharegpt", profile="p")

    rows = [
        row("scls", 20, throughput_rps=2.0, reprefill_tokens_per_req=1000),
        row("scls+kv", 20, throughput_rps=2.5, reprefill_tokens_per_req=100),
        row("oracle-static", 20, throughput_rps=3.0),
        row("scls+wc+kv", 2, avg_latency_s=30, avg_ttft_s=1.5),
        row("ils-paged", 2, avg_latency_s=20),
        row("sls", 2, avg_latency_s=100),
    ]
    text = variants.targets(rows)
    assert "2.50 / 2.00 = 1.25× | yes" in text
    assert "100 / 1000 = 0.10× | yes" in text
    assert "2.00 / 3.00 = 0.67× | no" in text
    assert "30.0 / 20.0 s = 1.50× | yes" in text and "1.50 s | yes" in text
    assert "| 20 | scls+kv | 2.50 |" in variants.markdown(rows)
