"""DP batcher (Algorithm 1): optimality against brute force, memory, partition, speed path."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sclsd.core.batcher import DPBatcher, FCFSBatcher
from sclsd.core.estimator import Estimator
from sclsd.core.memory import KVMemory, RuleTable
from sclsd.core.profiles import ProfileCost, load_profile
from sclsd.core.request import Request


def reqs_of(lens, gen=None):
    gen = gen or [0] * len(lens)
    out = []
    for k, (L, g) in enumerate(zip(lens, gen, strict=True)):
        r = Request(f"r{k}", prompt_len=L, max_tokens=4096, arrival=float(k))
        r.num_generated = g
        out.append(r)
    return out


@dataclass(frozen=True)
class SlowCost:
    """The same cost without the fast path: forces Algorithm 1's literal loop."""

    inner: ProfileCost

    def t_serve(self, n, L, S):
        return self.inner.t_serve(n, L, S)

    def oom(self, n, L, S):
        return self.inner.oom(n, L, S)


def brute_force(lens, S, cost, cap=None):
    """Best partition of the sorted list into contiguous batches (exhaustive)."""
    xs = sorted(lens)
    n = len(xs)

    @functools.cache
    def best(i):  # first i requests
        if i == 0:
            return 0.0
        out = math.inf
        for j in range(i):  # batch xs[j:i]
            size = i - j
            if size > 1 and (cost.oom(size, xs[i - 1], S) or (cap and size > cap)):
                continue
            out = min(out, best(j) + cost.t_serve(size, xs[i - 1], S))
        return out

    return best(n)


def check_batches(batches, reqs, S, cost):
    ids = [r.rid for b in batches for r in b]
    assert sorted(ids) == sorted(r.rid for r in reqs)  # each request exactly once
    for b in batches:
        assert b
        L = max(r.input_len for r in b)
        if len(b) > 1:
            assert not cost.oom(len(b), L, S)


def total(batches, S, cost):
    return sum(cost.t_serve(len(b), max(r.input_len for r in b), S) for b in batches)


coef = st.floats(min_value=0, max_value=1e-2, allow_nan=False)
estimators = st.builds(Estimator, coef, coef, coef, coef, coef, coef, coef, coef)
memories = st.one_of(
    st.builds(KVMemory, st.integers(1, 50), st.floats(100, 100_000), st.floats(0.5, 1.0)),
    st.builds(
        RuleTable,
        st.lists(st.tuples(st.integers(0, 600), st.integers(1, 9)), min_size=1, max_size=3),
    ),
)


@settings(max_examples=300, deadline=None)
@given(
    lens=st.lists(st.integers(1, 400), min_size=1, max_size=9),
    gen=st.lists(st.integers(0, 100), min_size=9, max_size=9),
    est=estimators,
    mem=memories,
    S=st.integers(1, 200),
    cap=st.one_of(st.none(), st.integers(1, 5)),
)
def test_dp_equals_brute_force(lens, gen, est, mem, S, cap):
    reqs = reqs_of(lens, gen[: len(lens)])
    cost = ProfileCost(est, mem)
    want = brute_force([r.input_len for r in reqs], S, cost, cap)
    for c in (cost, SlowCost(cost)):
        batches = DPBatcher(cap)(reqs, S, c)
        check_batches(batches, reqs, S, cost)
        if cap:
            assert all(len(b) <= cap for b in batches)
        assert total(batches, S, cost) == pytest.approx(want, rel=1e-9, abs=1e-12)


@settings(max_examples=100, deadline=None)
@given(lens=st.lists(st.integers(1, 1024), min_size=1, max_size=300), S=st.integers(1, 256))
def test_fast_path_matches_literal_loop(lens, S):
    cost = load_profile("a100-llama2-13b-hf").cost(mem_available=2e9)  # N_max small: windows bind
    reqs = reqs_of(lens)
    fast = DPBatcher()(reqs, S, cost)
    slow = DPBatcher()(reqs, S, SlowCost(cost))
    assert total(fast, S, cost) == pytest.approx(total(slow, S, cost), rel=1e-9)
    check_batches(fast, reqs, S, cost)


def test_paper_example_splits_in_two():
    """Section 4.4: 15 requests of 10 tokens and one of 1024, S = 128, LLaMA2-13B on HF."""
    cost = load_profile("a100-llama2-13b-hf").cost()
    reqs = reqs_of([10] * 15 + [1024])
    batches = DPBatcher()(reqs, 128, cost)
    sizes = sorted(len(b) for b in batches)
    assert sizes == [1, 15]
    long = next(b for b in batches if len(b) == 1)
    assert long[0].input_len == 1024
    assert total(batches, 128, cost) < cost.t_serve(16, 1024, 128)


def test_sorted_by_input_len_including_generated():
    cost = load_profile("a100-llama2-13b-hf").cost()
    # r0 has a short prompt but a long context after earlier slices: it belongs with the long one.
    reqs = reqs_of([10] * 15 + [1000], gen=[990] + [0] * 15)
    batches = DPBatcher()(reqs, 128, cost)
    together = next(b for b in batches if any(r.rid == "r15" for r in b))
    assert {r.rid for r in together} == {"r0", "r15"}


def test_single_oversized_request_still_batched_alone():
    cost = ProfileCost(Estimator(p4=1.0), KVMemory(delta=1000, m_avail=10))
    reqs = reqs_of([50, 60])
    assert sorted(len(b) for b in DPBatcher()(reqs, 8, cost)) == [1, 1]


def test_cap_limits_batch_size():
    cost = load_profile("a100-llama2-13b-hf").cost()
    reqs = reqs_of([20] * 40)
    assert max(len(b) for b in DPBatcher()(reqs, 128, cost)) > 16
    assert max(len(b) for b in DPBatcher(16)(reqs, 128, cost)) <= 16


def test_empty_and_validation():
    cost = load_profile("a100-llama2-13b-hf").cost()
    assert DPBatcher()([], 128, cost) == []
    with pytest.raises(ValueError):
        DPBatcher(0)


def test_large_pool_respects_memory():
    cost = load_profile("a100-llama2-13b-ds").cost()
    rng = np.random.default_rng(1)
    reqs = reqs_of(rng.integers(1, 1025, size=2000).tolist())
    batches = DPBatcher()(reqs, 128, cost)
    check_batches(batches, reqs, 128, cost)
    assert DPBatcher().total(reqs, 128, cost) == pytest.approx(total(batches, 128, cost))


def test_fcfs_fixed_size_and_memory():
    cost = ProfileCost(Estimator(p4=1.0), RuleTable([(0, 3)]))
    reqs = reqs_of([5, 1, 4, 2, 3, 9, 7])
    batches = FCFSBatcher(2)(reqs, 10, cost)
    assert [[r.rid for r in b] for b in batches] == [["r0", "r1"], ["r2", "r3"], ["r4", "r5"], ["r6"]]
    batches = FCFSBatcher(5)(reqs, 10, cost)
    assert [len(b) for b in batches] == [3, 3, 1]
