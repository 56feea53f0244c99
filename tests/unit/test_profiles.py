"""Built-in profiles: the paper's calibration points, the derivation, (de)serialisation."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sclsd.core.estimator import Estimator
from sclsd.core.memory import KVMemory, RuleTable
from sclsd.core.profiles import (
    DEFAULT_PROFILE,
    Profile,
    ProfileCost,
    builtin_profiles,
    load_profile,
    save_profile,
)


def test_builtins_present():
    assert {"a100-llama2-13b-hf", "a100-llama2-13b-ds", "cpu-smollm2-135m", "cpu-smollm2-135m-llama"} <= set(
        builtin_profiles())
    assert DEFAULT_PROFILE == "cpu-smollm2-135m"


def test_hf_profile_reproduces_the_papers_calibration_points():
    """Section 4.4, S = 128: 15×10 + 1×1024 together 13.5 s; as two batches 7.6 s in total."""
    cost = load_profile("a100-llama2-13b-hf").cost()
    together = cost.t_serve(16, 1024, 128)
    separate = cost.t_serve(15, 10, 128) + cost.t_serve(1, 1024, 128)
    assert together == pytest.approx(13.5, rel=0.15)
    assert separate == pytest.approx(7.6, rel=0.15)
    assert not cost.oom(16, 1024, 128)


def test_a100_coefficients_follow_from_the_stated_facts():
    """docs/estimator.md derivation: recompute every coefficient from the recorded facts."""
    for name in ("a100-llama2-13b-hf", "a100-llama2-13b-ds"):
        p = load_profile(name)
        f = p.extra["facts"]
        e = p.estimator
        assert p.kv_bytes_per_token == 2 * 40 * 5120 * 2
        d4 = f["weight_bytes"] / f["hbm_bytes_per_s"] + f["per_forward_overhead_s"]
        want = Estimator(
            p1=2 * f["params"] / (f["prefill_mfu"] * f["fp16_flops"]),
            p4=d4,
            d1=f["kv_traffic_factor"] * p.kv_bytes_per_token / f["hbm_bytes_per_s"],
            d2=2 * f["params"] / f["fp16_flops"],
            d4=d4,
        )
        for k, v in want.to_dict().items():
            assert getattr(e, k) == pytest.approx(v, rel=1e-5, abs=1e-12), (name, k)


def test_ds_profile_uses_algorithm_2():
    p = load_profile("a100-llama2-13b-ds")
    assert p.rules == RuleTable.deepspeed()
    cost = p.cost(zeta=0.1, mem_available=1.0)  # ignored: the rule table decides
    assert isinstance(cost.memory, RuleTable)
    assert not cost.oom(12, 1000, 128) and cost.oom(13, 1000, 128)
    assert not cost.oom(28, 300, 128) and cost.oom(29, 300, 128)


def test_hf_profile_kv_memory_and_overrides():
    p = load_profile("a100-llama2-13b-hf")
    cost = p.cost()
    assert isinstance(cost.memory, KVMemory) and cost.memory.zeta == 0.9
    nmax = int(0.9 * p.mem_available // (819_200 * (1024 + 128)))
    assert not cost.oom(nmax, 1024, 128) and cost.oom(nmax + 1, 1024, 128)
    small = p.cost(mem_available=819_200 * 1152 * 4 / 0.9 + 1)
    assert not small.oom(4, 1024, 128) and small.oom(5, 1024, 128)


def test_vectorised_max_batch_agrees_with_oom():
    for name in builtin_profiles():
        cost = load_profile(name).cost()
        L = np.array([1, 10, 100, 383, 384, 385, 896, 897, 1024, 4000])
        for Lk, k in zip(L, cost.max_batch(L, 128), strict=True):
            assert not cost.oom(int(k), int(Lk), 128) and cost.oom(int(k) + 1, int(Lk), 128)
        a, b = cost.linear_terms(L, 128)
        for Lk, ak, bk in zip(L, a, b, strict=True):
            assert cost.t_serve(7, int(Lk), 128) == pytest.approx(7 * ak + bk)


def test_cpu_profile_facts():
    p = load_profile("cpu-smollm2-135m")
    assert p.kv_bytes_per_token == 46_080
    assert p.source in ("design-table", "measured")
    assert p.rmse["prefill_s"] >= 0 and p.rmse["decode_s"] >= 0
    assert p.samples["prefill"] and p.samples["decode"]
    e = p.estimator
    assert all(v >= 0 for v in e.to_dict().values())
    # One decode step of one row is tens of milliseconds on one core, not seconds or microseconds.
    assert 0.005 < e.tau_decode(256, 1) < 0.5


def test_save_load_round_trip(tmp_path):
    p = load_profile("a100-llama2-13b-ds")
    path = tmp_path / "x.json"
    save_profile(p, path)
    assert load_profile(str(path)) == p
    json.loads(path.read_text())
    q = Profile(
        "t", "fake", "m", "cpu", Estimator(p4=1.0), 10, 1e6, samples={"prefill": [], "decode": [[1, 2, 3]]}
    )
    save_profile(q, path)
    assert load_profile(path) == q


def test_bad_profiles(tmp_path):
    with pytest.raises(ValueError, match="no profile"):
        load_profile("no-such-profile")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="JSON"):
        load_profile(bad)
    bad.write_text(json.dumps({"engine": "hf", "model": "m"}))
    with pytest.raises(ValueError, match="coefficients"):
        load_profile(bad)


def test_profile_cost_is_a_cost_model():
    cost = load_profile("a100-llama2-13b-hf").cost()
    assert isinstance(cost, ProfileCost)
    assert cost.t_serve(3, 100, 16) == pytest.approx(cost.estimator.t_serve(3, 100, 16))


def test_host_link_of_the_a100_profiles_and_none_on_the_cpu():
    for name in ("a100-llama2-13b-hf", "a100-llama2-13b-ds"):
        p = load_profile(name)
        assert p.host_link_bytes_per_s == 25e9 and p.host_kv_bytes == 128e9
        c = p.cost()
        # 1 GB of retained KV comes back over the link in 40 ms.
        assert c.copy_s(1e9) == pytest.approx(0.04)
        assert c.retain_bytes == pytest.approx(c.device_kv_bytes + 128e9)
    ds = load_profile("a100-llama2-13b-ds").cost(max_total=2048)
    assert ds.device_kv_bytes == 12 * 2048 * 819_200  # the rule table's token budget
    cpu = load_profile("cpu-smollm2-135m")
    assert cpu.host_link_bytes_per_s is None and cpu.cost().copy_s(1e9) == 0.0
    assert cpu.cost().retain_bytes == pytest.approx(0.9 * cpu.mem_available)


def test_host_fields_round_trip_and_are_checked(tmp_path):
    p = load_profile("a100-llama2-13b-hf")
    path = tmp_path / "h.json"
    save_profile(p, path)
    assert load_profile(path).host_link_bytes_per_s == 25e9
    d = json.loads(path.read_text())
    d["host_link_bytes_per_s"] = -1
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="host_link_bytes_per_s"):
        load_profile(path)
    del d["host_link_bytes_per_s"], d["host_kv_bytes"]
    path.write_text(json.dumps(d))
    assert load_profile(path).host_link_bytes_per_s is None
