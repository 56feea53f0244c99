"""sclsd-bench streams: the report's arithmetic on streams with known timings, and its configs."""

from __future__ import annotations

import argparse

import pytest

from sclsd import config as C
from sclsd.bench import streams as S
from sclsd.bench.cli import SUBCOMMANDS


def stream(rid: str, sent: float, times: list[float], done: float | None = None,
           finish: str | None = "length", error: str | None = None) -> S.Stream:
    return S.Stream(rid=rid, sent=sent, prompt_tokens=128, token_times=times,
                    done=times[-1] if done is None and times else done, finish_reason=finish,
                    completion_tokens=len(times), error=error)


def test_report_of_known_streams() -> None:
    streams = [
        # Steady: first token 0.5 s after sending, then one every 0.1 s.
        stream("a", 0.0, [0.5, 0.6, 0.7, 0.8]),
        # Frozen once for 2.5 s after its second token.
        stream("b", 1.0, [1.5, 1.6, 4.1, 4.2]),
        # First token late (TTFT 3 s), steady after: no stall, but misses the TTFT SLO.
        stream("c", 2.0, [5.0, 5.2, 5.4, 5.6]),
        # Two tokens in one delta (gap 0), then gaps of 1.2 s and 1.4 s: its max gap is 1.4 s.
        stream("d", 3.0, [3.4, 3.4, 4.6, 6.0]),
        # Failed: counted as a request, not in the gaps, TTFT or throughput.
        stream("e", 3.5, [3.9], done=None, finish=None, error="worker_failed"),
    ]
    r = S.report(streams, gap_bound=1.0)
    assert (r["requests"], r["completed"], r["errors"]) == (5, 4, 1)
    # First request sent at 0.0, last one done at 6.0 (d's last token).
    assert r["duration_s"] == pytest.approx(6.0)
    assert r["throughput_rps"] == pytest.approx(4 / 6.0)
    assert r["output_tps"] == pytest.approx(16 / 6.0)
    ttfts = [0.5, 0.5, 3.0, 0.4]
    assert r["p50_ttft_s"] == pytest.approx(0.5)
    assert r["p95_ttft_s"] == pytest.approx(sorted(ttfts)[2] + 0.85 * (3.0 - 0.5))
    gaps = sorted([0.1, 2.5, 0.2, 1.4])  # per stream: max of its consecutive differences
    assert r["max_gap_s"] == pytest.approx(2.5)
    assert r["p50_gap_s"] == pytest.approx((gaps[1] + gaps[2]) / 2)
    assert r["p99_gap_s"] == pytest.approx(gaps[2] + 0.97 * (gaps[3] - gaps[2]))
    assert r["stalled_streams"] == 2 and r["p50_stall_s"] == pytest.approx((2.5 + 1.4) / 2)
    # Goodput (TTFT <= 2 s, no gap over 1 s): only a meets both.
    assert r["goodput_rps"] == pytest.approx(1 / 6.0)


def test_a_run_without_stalls_and_a_wider_bound() -> None:
    streams = [stream(str(i), float(i), [i + 0.2 + 0.3 * k for k in range(5)]) for i in range(3)]
    r = S.report(streams, gap_bound=1.0)
    assert r["stalled_streams"] == 0 and r["p50_stall_s"] == 0.0
    assert r["max_gap_s"] == pytest.approx(0.3) and r["goodput_rps"] == pytest.approx(r["throughput_rps"])
    stalled = [stream("x", 0.0, [0.1, 0.2, 1.7])]
    assert S.report(stalled, gap_bound=1.0)["stalled_streams"] == 1
    assert S.report(stalled, gap_bound=2.0)["stalled_streams"] == 0


def test_the_configs_are_the_default_static_scls_and_ils() -> None:
    args = argparse.Namespace(model="smollm2-135m-instruct", workers=2, threads=1, slice_len=32)
    cfgs = {name: C.from_dict({k: v for k, v in S.sections(name, args).items() if k != "daemon"})
            for name in S.CONFIGS}
    # The default model is a GGUF: on the CPU both policies run the llama engine.
    assert (cfgs["default"].scheduler.policy, cfgs["default"].engine) == ("scls-cb", "llama")
    assert cfgs["default"].scheduler == C.SchedulerConfig()  # nothing but the defaults
    assert (cfgs["scls"].scheduler.policy, cfgs["scls"].scheduler.slice_len, cfgs["scls"].engine) == (
        "scls", 32, "llama")
    assert (cfgs["ils"].scheduler.policy, cfgs["ils"].scheduler.batch_size, cfgs["ils"].engine) == (
        "sls", 1, "hf-cb")
    assert "streams" in SUBCOMMANDS
    # --opt: the engine's options in the default and scls configurations, typed and checked.
    from worker.main import parse_opt

    tuned = argparse.Namespace(**vars(args), engine="hf-static-cb",
                               opt=[parse_opt("prefill_chunk_tokens=64"), parse_opt("kv-reuse=true")])
    cfg = C.from_dict({k: v for k, v in S.sections("default", tuned).items() if k != "daemon"})
    assert cfg.engine == "hf-static-cb" and cfg.workers.options == {"prefill_chunk_tokens": 64, "kv_reuse": True}
    assert "options" not in S.sections("ils", tuned)["workers"]  # ils keeps hf-cb as it is
