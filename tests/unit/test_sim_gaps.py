"""The simulators' per-request maximum inter-token gap, as a streaming client would see it."""

from __future__ import annotations

import numpy as np
import pytest

from sclsd.eval.metrics import DEFAULT_SLO
from sclsd.sim.cbsim import StepClock
from sclsd.sim.common import ALL_POLICIES, SimConfig
from sclsd.sim.engine import simulate
from sclsd.sim.workers import SimPayload
from sclsd.sim.workload import Workload

from .toy import EST, toy_profile


def cfg(policy: str, **kw: object) -> SimConfig:
    base: dict[str, object] = dict(workers=1, slice_len=32, max_gen=256, profile=toy_profile())
    base.update(kw)
    return SimConfig(policy=policy, **base)  # type: ignore[arg-type]


def test_step_clock_answers_the_longest_interval_of_any_range_to_the_latest() -> None:
    rng = np.random.default_rng(3)
    clock = StepClock()
    t = 0.0
    for _ in range(300):
        t += float(rng.exponential(1.0))
        clock.ended(t)
        ends = clock.ends
        for a in range(1, len(ends)):
            brute = max(ends[i] - ends[i - 1] for i in range(a, len(ends)))
            assert clock.longest_since(a) == brute
        assert clock.longest_since(len(ends)) is None


def test_payload_counts_the_gap_into_each_run_and_inside_it() -> None:
    p = SimPayload(true_len=10)
    p.received(1.0, 2.0, 0.3)
    assert p.max_gap == 0.3
    p.received(5.0, 6.0, 0.2)  # waited 3 s between its runs
    assert p.max_gap == 3.0 and p.last_token_at == 6.0
    single = SimPayload(true_len=1)
    single.received(1.0, 1.0, None)
    assert single.max_gap is None


def test_static_gap_across_slices_is_the_next_slice_start_plus_its_prefill() -> None:
    # One request alone on one worker, two slices of 32: the stream stops between them for
    # the last iteration of slice 1 and the whole re-prefill of slice 2 (no KV kept).
    L = 200
    res = simulate(cfg("scls", work_conserving=True), Workload.of([0.0], [L], [50]))
    (r,) = res.requests
    assert r.slices == 2
    across = EST.tau_decode(L + 32, 1) + EST.t_prefill(1, L + 32)
    assert r.max_gap_s == pytest.approx(across)
    assert r.max_gap_s > 2 * EST.tau_decode(L + 50, 1)  # far beyond any decode step


def test_a_request_that_stays_on_its_worker_streams_across_grants_without_a_stall() -> None:
    # Under scls-cb the same lone request runs in grants of 32 on one worker, its KV kept:
    # it streams exactly as under continuous batching, where it runs in one go.
    wl = Workload.of([0.0], [200], [100])
    (cb,) = simulate(cfg("scls-cb"), wl).requests
    (ils,) = simulate(cfg("ils-paged"), wl).requests
    assert cb.slices == 4 and ils.slices == 1
    assert cb.max_gap_s == pytest.approx(ils.max_gap_s)
    # The largest gap of continuous batching: the admission iteration's decode step after the
    # first token (streamed when the prefill ends), then the next iteration.
    assert ils.max_gap_s == pytest.approx(EST.tau_decode(201, 1) + EST.tau_decode(202, 1))
    (static,) = simulate(cfg("scls", work_conserving=True), wl).requests
    assert static.max_gap_s is not None and static.max_gap_s > 2 * cb.max_gap_s


def test_a_preempted_request_counts_the_wait_for_its_readmission() -> None:
    # Tiny memory: ils-paged preempts; a preempted request's stream waits for its readmission.
    rng = np.random.default_rng(2)
    n = 40
    wl = Workload(np.sort(rng.uniform(0, 2, n)), rng.integers(20, 300, n).astype(np.int64),
                  rng.integers(50, 256, n).astype(np.int64))
    res = simulate(cfg("ils-paged", workers=2, profile=toy_profile(2_000)), wl)
    hit = [r for r in res.requests if r.preemptions]
    assert hit and res.preemptions > 0
    for r in hit:
        # At least the re-prefill of its prompt plus what it had generated stands between two
        # of its tokens.
        assert r.max_gap_s is not None and r.max_gap_s >= EST.t_prefill(1, r.prompt_len + 1)


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_every_policy_reports_gaps_and_goodput(policy: str) -> None:
    rng = np.random.default_rng(1)
    n = 30
    wl = Workload(np.cumsum(rng.exponential(0.25, n)), rng.integers(1, 400, n).astype(np.int64),
                  rng.integers(2, 300, n).astype(np.int64))
    s = simulate(cfg(policy, workers=3), wl).summary(DEFAULT_SLO)
    assert all(r.max_gap_s is not None for r in simulate(cfg(policy, workers=3), wl).requests)
    assert 0 < s["p50_gap_s"] <= s["p95_gap_s"] <= s["p99_gap_s"] <= s["max_gap_s"]
    assert 0 <= s["goodput_rps"] <= s["throughput_rps"]
