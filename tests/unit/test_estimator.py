"""Estimator: closed forms against literal sums, fitting, RMSE helpers."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sclsd.core.estimator import Estimator, batch_rmse, decode_rmse, fit, prefill_rmse

EST = Estimator(p1=1e-4, p2=2e-3, p3=3e-5, p4=0.02, d1=2e-6, d2=1e-4, d3=3e-7, d4=0.015)

coef = st.floats(min_value=0, max_value=1e-2, allow_nan=False)


def test_prefill_and_tau_formulas():
    assert EST.t_prefill(4, 100) == pytest.approx(1e-4 * 400 + 2e-3 * 4 + 3e-5 * 100 + 0.02)
    assert EST.tau_decode(100, 4) == pytest.approx(2e-6 * 400 + 1e-4 * 4 + 3e-7 * 100 + 0.015)


@given(
    st.tuples(coef, coef, coef, coef, coef, coef, coef, coef),
    st.integers(1, 64),
    st.integers(1, 2048),
    st.integers(0, 300),
)
def test_t_decode_closed_form_equals_the_sum(cs, n, L, S):
    e = Estimator(*cs)
    literal = sum(e.tau_decode(l, n) for l in range(L + 1, L + S + 1))  # noqa: E741
    assert e.t_decode(n, L, S) == pytest.approx(literal, rel=1e-9, abs=1e-12)
    assert e.t_serve(n, L, S) == pytest.approx(e.t_prefill(n, L) + literal, rel=1e-9, abs=1e-12)


@given(st.integers(1, 64), st.integers(1, 2048), st.integers(0, 300))
def test_linear_terms_are_affine_in_n(n, L, S):
    a, b = EST.linear_terms(L, S)
    assert EST.t_serve(n, L, S) == pytest.approx(a * n + b, rel=1e-12)


def test_dict_round_trip_and_unknown_key():
    assert Estimator.from_dict(EST.to_dict()) == EST
    with pytest.raises(ValueError):
        Estimator.from_dict({"p1": 1.0, "q9": 2.0})


def _grid(e: Estimator):
    pre = [(n, L, e.t_prefill(n, L)) for n in (1, 4, 16) for L in (32, 256, 1024)]
    dec = [(n, l, e.tau_decode(l, n)) for n in (1, 4, 16) for l in (64, 512, 1500)]  # noqa: E741
    return pre, dec


def test_fit_recovers_exact_coefficients():
    pre, dec = _grid(EST)
    batch = [(n, L, 128, EST.t_serve(n, L, 128)) for n in (2, 8) for L in (100, 900)]
    got, rmse = fit(pre, dec, batch)
    for k, v in EST.to_dict().items():
        assert getattr(got, k) == pytest.approx(v, rel=1e-4, abs=1e-9), k
    assert set(rmse) == {"prefill_s", "decode_s", "batch_s"}
    assert all(r < 1e-6 for r in rmse.values())


def test_fit_nonneg_clamps_and_unconstrained_does_not():
    # Data from a model with a negative intercept: the constrained fit must stay >= 0.
    truth = Estimator(p1=1e-4, p4=-0.05, d1=1e-6, d4=-0.001)
    pre, dec = _grid(truth)
    got, _ = fit(pre, dec)
    assert all(v >= 0 for v in got.to_dict().values())
    free, rmse = fit(pre, dec, nonneg=False)
    assert free.p4 == pytest.approx(-0.05, rel=1e-3)
    assert rmse["prefill_s"] < 1e-6


def test_fit_needs_enough_samples():
    with pytest.raises(ValueError):
        fit([(1, 1, 1.0)] * 3, [(1, 1, 1.0)] * 5)


def test_rmse_helpers():
    assert prefill_rmse(EST, [(2, 10, EST.t_prefill(2, 10) + 0.3)]) == pytest.approx(0.3)
    errs = [0.1, -0.2]
    dec = [(4, 100 + k, EST.tau_decode(100 + k, 4) + e) for k, e in enumerate(errs)]
    assert decode_rmse(EST, dec) == pytest.approx(math.sqrt((0.01 + 0.04) / 2))
    assert batch_rmse(EST, [(3, 50, 128, EST.t_serve(3, 50, 128) - 2.0)]) == pytest.approx(2.0)
    assert math.isnan(batch_rmse(EST, []))
