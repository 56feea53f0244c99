"""The shared metrics definition on hand-made records."""

from __future__ import annotations

import numpy as np
import pytest

from sclsd.eval.metrics import (
    SLO,
    SUMMARY_KEYS,
    BatchStats,
    RequestRecord,
    ct_std,
    percentile,
    summarize,
    tpot_of,
)


def records() -> list[RequestRecord]:
    return [
        # arrival, first token, finished: e2e 4, ttft 1, 9 tokens -> tpot 3/8
        RequestRecord("a", 0.0, 10, 9, 1.0, 4.0, "stop", slices=1, pad_tokens=4, invalid_tokens=2),
        # e2e 8, ttft 2, 1 token -> no tpot
        RequestRecord("b", 2.0, 20, 1, 4.0, 10.0, "length", slices=3, pad_tokens=0),
        # e2e 2, ttft 1
        RequestRecord("c", 4.0, 5, 5, 5.0, 6.0, "stop", slices=2, invalid_tokens=4),
        # never completed: counts as a request, not in the averages
        RequestRecord("d", 5.0, 5, 0, None, None, None),
        # cancelled: not completed either
        RequestRecord("e", 6.0, 5, 3, 7.0, 8.0, "cancelled"),
    ]


def test_summary_on_hand_made_records() -> None:
    b = BatchStats()
    for size, early in [(4, False), (2, True), (6, False), (4, True)]:
        b.add(size, early)
    s = summarize(records(), b, worker_completion={"w0": 10.0, "w1": 6.0}, oom_events=1)
    assert set(SUMMARY_KEYS) <= set(s)
    assert s["requests"] == 5 and s["completed"] == 3
    assert s["duration_s"] == 10.0  # first arrival 0, last completion 10
    assert s["throughput_rps"] == pytest.approx(0.3)
    assert s["output_tps"] == pytest.approx((9 + 1 + 5) / 10)
    assert s["avg_latency_s"] == pytest.approx((4 + 8 + 2) / 3)
    assert s["p95_latency_s"] == pytest.approx(float(np.percentile([4, 8, 2], 95)))
    assert s["avg_ttft_s"] == pytest.approx((1 + 2 + 1) / 3)
    assert s["avg_tpot_s"] == pytest.approx(((4 - 1) / 8 + (6 - 5) / 4) / 2)
    assert s["avg_batch_size"] == 4.0 and s["batches"] == 4
    assert s["early_return_ratio"] == 0.5
    assert s["pad_tokens_per_req"] == pytest.approx(4 / 3)
    assert s["invalid_tokens_per_req"] == pytest.approx(2.0)
    assert s["slices_per_req"] == pytest.approx(2.0)
    assert s["ct_std_s"] == pytest.approx(2.0)  # std of 10 and 6
    assert s["oom_events"] == 1
    assert "goodput_rps" not in s


def test_goodput_counts_requests_meeting_every_slo() -> None:
    s = summarize(records(), slo=SLO(ttft_s=1.5, e2e_s=5.0))
    assert s["goodput_rps"] == pytest.approx(2 / 10)  # a and c
    s2 = summarize(records(), slo=SLO(tpot_s=0.3))
    assert s2["goodput_rps"] == pytest.approx(2 / 10)  # a's tpot 0.375 fails; b has none


def test_empty_and_degenerate_inputs_give_zeros() -> None:
    s = summarize([])
    assert s["completed"] == 0 and s["throughput_rps"] == 0.0 and s["avg_latency_s"] == 0.0
    assert s["avg_batch_size"] == 0.0 and s["early_return_ratio"] == 0.0
    assert percentile([], 95) == 0.0 and ct_std({}) == 0.0


def test_ct_std_counts_idle_workers_at_start() -> None:
    assert ct_std({"a": 4.0, "b": None}) == pytest.approx(2.0)
    assert ct_std({"a": 3.0, "b": 3.0}) == 0.0


def test_tpot() -> None:
    recs = records()
    assert tpot_of(recs[0]) == pytest.approx(3 / 8)
    assert tpot_of(recs[1]) is None and tpot_of(recs[3]) is None


def test_reprefill_tokens_are_averaged_over_completed_requests() -> None:
    recs = [
        RequestRecord("a", 0.0, 10, 5, 1.0, 2.0, "stop", reprefill_tokens=30),
        RequestRecord("b", 0.0, 10, 5, 1.0, 3.0, "length", reprefill_tokens=10),
        RequestRecord("c", 0.0, 10, reprefill_tokens=99),  # never completed: not counted
    ]
    s = summarize(recs)
    assert "reprefill_tokens_per_req" in SUMMARY_KEYS
    assert s["reprefill_tokens_per_req"] == 20.0


def test_max_gap_is_the_longest_wait_between_tokens_and_counts_against_goodput() -> None:
    from sclsd.eval.metrics import max_gap

    assert max_gap([1.0]) is None
    assert max_gap([0.0, 0.1, 0.1, 2.6, 2.7]) == pytest.approx(2.5)
    recs = records()
    for r in recs:
        r.max_gap_s = 0.2
    recs[0].max_gap_s = 3.0  # a froze mid-stream
    s = summarize(recs, slo=SLO(ttft_s=1.5, e2e_s=5.0, gap_s=1.0))
    assert s["goodput_rps"] == pytest.approx(1 / 10)  # only c now
    assert s["max_gap_s"] == pytest.approx(3.0) and s["p50_gap_s"] == pytest.approx(0.2)
