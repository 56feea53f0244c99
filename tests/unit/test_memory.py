"""OOM predicates: the KV model (eq. 5-9) and the DeepSpeed rule table (Algorithm 2)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sclsd.core.memory import KVMemory, RuleTable, kv_bytes_per_token


def test_kv_bytes_per_token_llama2_13b_and_smollm2():
    assert kv_bytes_per_token(40, 40, 128, 2) == 819_200  # 2 · 40 · 5120 · 2
    assert kv_bytes_per_token(30, 3, 64, 4) == 46_080


def test_kv_oom_boundary():
    m = KVMemory(delta=100, m_avail=1000, zeta=0.9)  # 900 bytes usable = 9 tokens
    assert not m.oom(1, 4, 5)  # 9 tokens fit exactly
    assert m.oom(1, 5, 5)
    assert not m.oom(3, 1, 2)
    assert m.oom(4, 1, 2)
    assert m.max_batch(1, 2) == 3
    assert m.max_batch(9, 1) == 0  # 10 tokens: not even one row


@given(
    st.integers(1, 10**6),
    st.floats(1e3, 1e11),
    st.floats(0.05, 1.0),
    st.integers(0, 4096),
    st.integers(1, 1024),
)
def test_kv_max_batch_is_the_oom_threshold(delta, m_avail, zeta, L, S):
    m = KVMemory(delta, m_avail, zeta)
    nmax = m.max_batch(L, S)
    if nmax >= 1:
        assert not m.oom(nmax, L, S)
    assert m.oom(nmax + 1, L, S)


def test_kv_validation():
    with pytest.raises(ValueError):
        KVMemory(0, 1e9)
    with pytest.raises(ValueError):
        KVMemory(10, 1e9, zeta=1.5)


@pytest.mark.parametrize(
    "L, S, ok_n",
    [
        (1024 - 128 + 1, 128, 12),  # L + S = 1025 > 1024
        (1024 - 128, 128, 22),  # L + S = 1024, not > 1024
        (513 - 128, 128, 22),
        (512 - 128, 128, 28),  # L + S = 512
        (1, 1, 28),
    ],
)
def test_deepspeed_rules_algorithm_2(L, S, ok_n):
    rt = RuleTable.deepspeed()
    assert rt.max_batch(L, S) == ok_n
    assert not rt.oom(ok_n, L, S)
    assert rt.oom(ok_n + 1, L, S)


def test_rule_table_configurable_and_order_free():
    rt = RuleTable([(100, 5), (2000, 1), (500, 3)])
    assert rt.max_batch(2001, 0) == 1
    assert rt.max_batch(1000, 0) == 3
    assert rt.max_batch(101, 0) == 5
    assert rt.max_batch(50, 0) > 10**6  # below every threshold: no rule applies
    assert rt.to_list() == [[2000, 1], [500, 3], [100, 5]]
    with pytest.raises(ValueError):
        RuleTable([])


def test_rule_table_token_budget():
    t = RuleTable.deepspeed()
    assert t.token_budget(2048) == 12 * 2048
    assert t.token_budget(1000) == 22 * 1000
    assert RuleTable([(0, 4)]).token_budget(100) == 400
