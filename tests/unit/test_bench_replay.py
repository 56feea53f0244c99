"""The replay's account of whether the server kept up with the arrivals."""

from __future__ import annotations

import pytest

from sclsd.bench.replay import LATE_START_S, kept_up
from sclsd.eval.metrics import RequestRecord


def rec(i: int, arrival: float, ttft: float | None) -> RequestRecord:
    return RequestRecord(rid=f"r{i}", arrival=arrival, prompt_len=8,
                         first_token=None if ttft is None else arrival + ttft)


def test_none_late_where_every_request_started_as_it_came() -> None:
    got = kept_up([rec(0, 10.0, 0.1), rec(1, 10.5, 0.4), rec(2, 29.6, LATE_START_S * 0.9)])
    assert got["late_starts"] == 0 and got["arrivals_s"] == pytest.approx(19.6) and got["late_start_s"] == LATE_START_S


def test_a_request_that_waited_or_never_started_is_late() -> None:
    got = kept_up([rec(0, 0.0, 0.1), rec(1, 0.2, LATE_START_S), rec(2, 0.3, 7.5), rec(3, 0.4, None)])
    assert got["late_starts"] == 3 and got["arrivals_s"] == pytest.approx(0.4)


def test_no_requests() -> None:
    assert kept_up([]) == {"arrivals_s": 0.0, "late_starts": 0, "late_start_s": LATE_START_S}
