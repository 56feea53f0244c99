"""``sclsd-bench gpu-check``'s targets and summary: each verdict from result rows alone."""

from __future__ import annotations

from typing import Any

import pytest

from sclsd.bench import gpu_report as R


def end(stage: str, status: str = "ok", note: str = "") -> dict[str, Any]:
    return {"stage": stage, "phase": "end", "status": status, "rc": 0 if status == "ok" else 1, "note": note}


def hf_row(ms: float, kept: bool = True, n: int = 32, p: int = 256, call: str = "warm") -> dict[str, Any]:
    return {"stage": "hf", "phase": "shape", "n": n, "p": p, "call": call, "ms_per_step": ms, "graphs_kept": kept}


def replay(policy: str, rps: float, ttft: float = 0.5, rate: float = 4.0, done: int = 40,
           errors: int = 0) -> dict[str, Any]:  # fmt: skip
    return {"stage": f"live-{policy}", "phase": "replay", "policy": policy, "rate": rate, "requests": 40,
            "completed": done, "errors": errors, "throughput_rps": rps, "avg_ttft_s": ttft}  # fmt: skip


@pytest.mark.parametrize(("ms", "kept", "verdict"), [
    (11.9, True, R.MET), (12.0, True, R.MET), (12.1, True, R.MISSED), (8.0, False, R.MISSED),
])  # fmt: skip
def test_hf_decode_needs_the_time_and_the_graphs(ms: float, kept: bool, verdict: str) -> None:
    """12 ms/step at N = 32, P = 256 is met only with the graphs kept: a fast step that fell
    back to eager is a different configuration than the one served."""
    v = R.hf_decode(R.Rows([hf_row(ms, kept), end("hf")]))
    assert v.verdict == verdict
    assert (f"{ms:.2f} ms/step" in v.measured) and (("NOT kept" in v.measured) != kept)


def test_hf_decode_reads_the_warm_call_at_the_target_shape_and_names_the_reference() -> None:
    rows = R.Rows([hf_row(30.0, call="cold"), hf_row(5.0, n=64), hf_row(11.0),
                   {"stage": "generate", "phase": "shape", "n": 32, "p": 256, "call": "warm", "ms_per_step": 7.5}])
    v = R.hf_decode(rows)
    assert v.verdict == R.MET and v.measured.startswith("11.00 ms/step") and "compiled generate 7.50 ms" in v.measured


@pytest.mark.parametrize(("rows", "why"), [
    ([], "hf: not run"),
    ([end("hf", "skipped", "skipped: 30 s left before the deadline, needs 40 s")], "needs 40 s"),
    ([end("hf", "timed out", "killed after its 140 s cap")], "timed out (killed after its 140 s cap)"),
    ([{"stage": "hf", "phase": "load", "error": "OutOfMemoryError: CUDA"}, end("hf", "failed")], "OutOfMemoryError"),
    ([hf_row(9.0, n=2, p=16), end("hf")], "no N=32 P=256 shape"),
])  # fmt: skip
def test_a_target_without_its_figure_is_not_measured_and_says_why(rows: list[dict[str, Any]], why: str) -> None:
    v = R.hf_decode(R.Rows(rows))
    assert v.verdict == R.NOT_MEASURED and why in v.measured


def test_hf_cb_starts_or_says_its_error() -> None:
    ok = R.cb_starts(R.Rows([{"stage": "cb", "phase": "ready", "cache_tokens": 81920}, end("cb")]))
    assert ok.verdict == R.MET and "81920" in ok.measured
    bad = R.cb_starts(R.Rows([{"stage": "cb", "phase": "load", "error": "ValueError: num_blocks"}, end("cb", "failed")]))
    assert bad.verdict == R.MISSED and "num_blocks" in bad.measured
    assert R.cb_starts(R.Rows([])).verdict == R.NOT_MEASURED


@pytest.mark.parametrize(("row", "verdict"), [
    (replay("scls", 3.2, ttft=1.9), R.MET),
    (replay("scls", 2.9, ttft=0.5), R.MISSED),              # too slow
    (replay("scls", 3.5, ttft=2.3), R.MISSED),              # first tokens too late
    (replay("scls", 3.5, done=39, errors=1), R.MISSED),     # a request lost
    (replay("scls", 5.0, rate=2.0), R.NOT_MEASURED),        # not at the targets' rate
])  # fmt: skip
def test_live_scls_target(row: dict[str, Any], verdict: str) -> None:
    assert R.live(R.Rows([row]), "scls", R.SCLS_RPS, R.SCLS_TTFT_S).verdict == verdict


def test_live_cb_policies_have_no_ttft_bound() -> None:
    rows = R.Rows([replay("ils", 1.5, ttft=9.0), replay("scls-cb", 1.4)])
    assert R.live(rows, "ils", R.CB_RPS).verdict == R.MET
    assert R.live(rows, "scls-cb", R.CB_RPS).verdict == R.MISSED


def check(prefill: float, decode: float, batch: float | None) -> dict[str, Any]:
    kinds = {k: {"n": 8, "rmse_s": rel * 0.01, "mean_s": 0.01, "relative": rel}
             for k, rel in (("prefill", prefill), ("decode", decode), ("batch", batch)) if rel is not None}
    return {"stage": "profile", "phase": "check", "kinds": kinds}


def test_rmse_is_judged_at_10_percent_for_prefill_and_decode_and_15_for_batches() -> None:
    got = {v.target: v.verdict for v in R.rmse_verdicts(check(0.099, 0.101, 0.149), "")}
    assert got == {"profile RMSE/mean ≤ 10% (prefill)": R.MET, "profile RMSE/mean ≤ 10% (decode)": R.MISSED,
                   "profile RMSE/mean ≤ 15% (batch)": R.MET}
    got = [v.verdict for v in R.rmse_verdicts(check(0.05, 0.05, 0.151), "")]
    assert got == [R.MET, R.MET, R.MISSED]
    # No validation batches: that kind is not measured, the others still judged.
    assert [v.verdict for v in R.rmse_verdicts(check(0.05, 0.2, None), "")] == [R.MET, R.MISSED, R.NOT_MEASURED]


def test_a_failed_profile_leaves_every_rmse_target_not_measured_with_its_error() -> None:
    rows = R.Rows([{"stage": "profile", "phase": "check", "error": "only 3 grid points fit"}, end("profile", "failed")])
    vs = [v for v in R.verdicts(rows) if v.target.startswith("profile")]
    assert len(vs) == 3 and all(v.verdict == R.NOT_MEASURED and "only 3 grid points" in v.measured for v in vs)


def test_ready_takes_the_worst_of_every_start() -> None:
    rows = [{"stage": "hf", "phase": "ready", "ready_since_launch_s": 41.0},
            {"stage": "live-scls", "phase": "ready", "ready_s": 35.0},
            {"stage": "live-ils", "phase": "stopped", "worker_ready_in_s": [12.0]}]
    assert R.ready(R.Rows(rows)).verdict == R.MET
    rows.append({"stage": "cb", "phase": "ready", "ready_since_launch_s": 61.0})
    v = R.ready(R.Rows(rows))
    assert v.verdict == R.MISSED and "cb 61.0 s" in v.measured and "live-ils worker 12.0 s" in v.measured
    assert R.ready(R.Rows([])).verdict == R.NOT_MEASURED


def test_summary_lists_every_target_and_the_stages() -> None:
    rows = [
        {"stage": "plan", "model": "random:llama2-7b", "dtype": "float16", "device": "cuda:0", "smoke": False,
         "trace_kind": "synthetic, seed 0", "trace": "/tmp/t.csv", "deadline_s": 510, "stages": ["hf", "live"]},
        {"stage": "facts", "phase": "facts", "cuda_available": True, "gpu": "NVIDIA H100 80GB HBM3",
         "mem_total_gib": 79.2, "cuda": "12.8"},
        hf_row(10.5), end("hf"), replay("scls", 3.3, ttft=0.9), end("live-scls"),
        end("live-ils", "timed out", "killed after its 130 s cap"),
        end("generate", "skipped", "skipped: 20 s left before the deadline, needs 70 s"),
    ]  # fmt: skip
    text = R.render(rows)
    table = [line for line in text.splitlines() if line.startswith("| ") and line.endswith(" |")]
    verdicts = {line.split(" | ")[0][2:]: line.rsplit(" | ", 1)[1][:-2] for line in table}
    assert verdicts["hf decode ≤ 12 ms/step at N = 32, P = 256, graphs kept"] == "met"
    assert verdicts["live at 4 req/s: `scls` ≥ 3 req/s, avg TTFT ≤ 2 s"] == "met"
    assert verdicts["live at 4 req/s: `ils` ≥ 1.5 req/s"] == "not measured"
    assert verdicts["hf-cb starts with its defaults"] == "not measured"
    assert sum(1 for k in verdicts if k.startswith("profile RMSE")) == 3
    assert "NVIDIA H100 80GB HBM3" in text and "`random:llama2-7b` in float16" in text
    assert "| live-ils | timed out |" in text and "| generate | skipped |" in text and "needs 70 s" in text
    assert "Smoke run" not in text and "targets are set for the 7B" not in text
    assert "targets are set for the 7B" in R.render([{"stage": "plan", "model": "random:llama2-13b"}])
    assert "Smoke run" in R.render([{"stage": "plan", "smoke": True}])


def arena_row(ms: float, n: int = 32, kept: bool = True) -> dict[str, Any]:
    return {**hf_row(ms, kept, n=n), "stage": "arena"}


@pytest.mark.parametrize(("arena_ms", "kept", "verdict"), [
    (11.8, True, R.MET), (12.5, True, R.MET), (12.6, True, R.MISSED), (9.0, False, R.MISSED),
])  # fmt: skip
def test_the_arena_step_is_judged_against_hf_with_graphs_at_each_shape(arena_ms: float, kept: bool,
                                                                        verdict: str) -> None:
    rows = R.Rows([hf_row(10.0), arena_row(arena_ms, kept=kept), hf_row(12.0, n=64), arena_row(13.0, n=64),
                   {"stage": "cb", "phase": "shape", "n": 32, "p": 256, "call": "warm", "ms_per_step": 23.6}])
    v = R.arena_step(rows, 32, 256)
    assert v.verdict == verdict and f"{arena_ms:.2f} vs 10.00 ms/step" in v.measured and "hf-cb 23.60 ms" in v.measured
    assert R.arena_step(rows, 64, 256).verdict == R.MET  # 13.0 / 12.0 = 1.08
    alone = R.arena_step(R.Rows([arena_row(9.0), end("arena"), end("hf", "timed out", "killed")]), 32, 256)
    assert alone.verdict == R.NOT_MEASURED and "9.00 ms/step" in alone.measured and "hf: timed out" in alone.measured
    assert R.arena_step(R.Rows([]), 32, 256).verdict == R.NOT_MEASURED


def sat(policy: str, engine: str, tps: float, rate: float = 8.0, n: int = 80, preempt: int = 0,
        done: int | None = None) -> dict[str, Any]:
    return {"stage": f"sat-{policy}-{engine}", "phase": "replay", "policy": policy, "engine": engine, "rate": rate,
            "requests": n, "completed": n if done is None else done, "errors": 0, "output_tps": tps,
            "preemptions": preempt}


@pytest.mark.parametrize(("rows", "verdict", "why"), [
    ([sat("scls-cb", "hf-static-cb", 3000), sat("ils", "hf-static-cb", 2900), sat("scls-cb", "hf-cb", 1400)],
     R.MET, "1.03×, 2.14×"),
    ([sat("scls-cb", "hf-static-cb", 2800), sat("ils", "hf-static-cb", 2900), sat("scls-cb", "hf-cb", 1400)],
     R.MISSED, "0.97×"),                                                  # behind ils on its own engine
    ([sat("scls-cb", "hf-static-cb", 2000), sat("ils", "hf-static-cb", 1900), sat("scls-cb", "hf-cb", 1400)],
     R.MISSED, "1.43×"),                                                  # not twice hf-cb
    ([sat("scls-cb", "hf-static-cb", 3000, preempt=2), sat("ils", "hf-static-cb", 2900), sat("scls-cb", "hf-cb", 10)],
     R.MISSED, "preemptions 2"),
    ([sat("scls-cb", "hf-static-cb", 3000, done=79), sat("ils", "hf-static-cb", 2900), sat("scls-cb", "hf-cb", 10)],
     R.MISSED, "requests lost"),
    ([sat("scls-cb", "hf-static-cb", 3000, rate=4.0), sat("ils", "hf-static-cb", 2900), sat("scls-cb", "hf-cb", 10)],
     R.NOT_MEASURED, "replayed at 4.0 req/s"),
    ([sat("scls-cb", "hf-static-cb", 3000), sat("ils", "hf-static-cb", 2900), end("sat-scls-cb-hf-cb", "skipped",
                                                                                 "skipped: 12 s left")],
     R.NOT_MEASURED, "12 s left"),
    ([sat("scls-cb", "hf-static-cb", 3000), sat("ils", "hf-static-cb", 2900), end("sat-scls-cb-hf-cb-cap", "timed out",
                                                                                 "killed at its 150 s cap")],
     R.NOT_MEASURED, "sat-scls-cb-hf-cb-cap: timed out"),
])  # fmt: skip
def test_saturation_needs_ils_on_the_same_engine_and_twice_hf_cb(rows: list[dict[str, Any]], verdict: str,
                                                                  why: str) -> None:
    v = R.saturation(R.Rows(rows))
    assert v.verdict == verdict and why in v.measured


def test_saturation_is_not_judged_where_the_card_kept_up_with_the_arrivals() -> None:
    """Every request on the arena engine started within a second of its send (as on the H200
    at 8 req/s): the tokens/s are the trace's pace, so the ratio to ils is not measured; one
    request that waited on either arena replay makes it a saturation replay again."""
    def paced(policy: str, engine: str, tps: float, late: int) -> dict[str, Any]:
        return {**sat(policy, engine, tps, n=160), "late_starts": late, "late_start_s": 1.0, "arrivals_s": 19.6}

    kept = [paced("scls-cb", "hf-static-cb", 1443, 0), paced("ils", "hf-static-cb", 1434, 0),
            paced("scls-cb", "hf-cb", 541, 120)]
    v = R.saturation(R.Rows(kept))
    assert v.verdict == R.NOT_MEASURED and "kept up with the arrivals" in v.measured and "1.01×" in v.measured
    waited = [paced("scls-cb", "hf-static-cb", 3000, 0), paced("ils", "hf-static-cb", 2900, 40),
              paced("scls-cb", "hf-cb", 1400, 120)]
    assert R.saturation(R.Rows(waited)).verdict == R.MET
    text = R.render(kept)
    assert "| 0 (≥ 1 s; sends over 19.6 s) |" in text and "| 120 (≥ 1 s; sends over 19.6 s) |" in text


def test_saturation_judges_the_capped_pair_where_it_ran() -> None:
    """With the pair of exact lengths and the pair with ``max_tokens`` a cap both replayed, the
    capped one (as clients send requests) is judged and the other shown beside it; hf-cb's
    replay counts whichever kind it was."""
    def rep(policy: str, engine: str, tps: float, cap: int = 0) -> dict[str, Any]:
        r = {**sat(policy, engine, tps, rate=32.0, n=160), "late_starts": 30, "late_start_s": 1.0,
             "arrivals_s": 5.0, "max_tokens_cap": cap}
        return {**r, "stage": r["stage"] + ("-cap" if cap else "")}

    exact = [rep("scls-cb", "hf-static-cb", 1870), rep("ils", "hf-static-cb", 1890), rep("scls-cb", "hf-cb", 650)]
    assert R.saturation(R.Rows(exact)).verdict == R.MISSED  # 0.99× ils where ils knows each length
    both = exact + [rep("scls-cb", "hf-static-cb", 1850, 1024), rep("ils", "hf-static-cb", 1510, 1024)]
    v = R.saturation(R.Rows(both))
    assert v.verdict == R.MET and "(1.23×, 2.85×)" in v.measured and "max_tokens a cap" in v.measured
    assert "with max_tokens the trace lengths: 1870 vs ils 1890 (0.99×)" in v.measured
    text = R.render(both)
    assert "| ils | hf-static-cb, max_tokens 1024 cap | 32 | 160/160 |" in text and "| ils | hf-static-cb | 32 |" in text


def test_first_tokens_are_judged_on_the_arena_engine_only() -> None:
    ok = {**replay("scls-cb", 3.9, ttft=0.31), "engine": "hf-static-cb"}
    assert R.first_tokens(R.Rows([ok])).verdict == R.MET
    assert R.first_tokens(R.Rows([{**ok, "avg_ttft_s": 0.7}])).verdict == R.MISSED
    other = R.first_tokens(R.Rows([{**ok, "engine": "hf-cb"}]))
    assert other.verdict == R.NOT_MEASURED and "on hf-cb" in other.measured


def test_hf_cb_warm_up_is_re_measured() -> None:
    ready = {"stage": "cb", "phase": "ready", "warm_up_s": 31.2, "cb": {"use_cuda_graph": True}, "warmed_shapes": 48}
    v = R.cb_warm_up(R.Rows([ready]))
    assert v.verdict == R.MET and "48 step shapes" in v.measured and "31.20 s" in v.measured
    bad = {**ready, "warnings": ["worker.engines.cb_setup: hf-cb warm-up: 5 of 48 step shapes failed to capture"]}
    assert R.cb_warm_up(R.Rows([bad])).verdict == R.MISSED
    off = {**ready, "cb": {"use_cuda_graph": [False, False]}, "warmed_shapes": None}
    v = R.cb_warm_up(R.Rows([off]))
    assert v.verdict == R.NOT_MEASURED and "graphs off" in v.measured
    assert R.cb_warm_up(R.Rows([{**ready, "cb": {"use_cuda_graph": [True, False]}}])).verdict == R.MET


def test_the_summary_has_the_arena_targets_and_the_saturation_table() -> None:
    rows = [hf_row(10.0), arena_row(11.0), end("arena"), sat("scls-cb", "hf-static-cb", 3000),
            sat("ils", "hf-static-cb", 2900), sat("scls-cb", "hf-cb", 1400),
            {"stage": "arena", "phase": "ready", "ready_since_launch_s": 52.0,
             "graphs": {"captured": 98, "buckets": 98, "capture_s": 28.0, "arena_tokens": 65290}}]
    text = R.render(rows)
    assert "| hf-static-cb decode ≤ 1.25× `hf`'s with graphs at N = 32, P = 256 | 11.00 vs 10.00 ms/step" in text
    assert "## hf-static-cb (continuous batching on the static arena" in text and "98 graphs captured" in text
    assert "| scls-cb | hf-static-cb | 8 | 80/80 |" in text and "| ils | hf-static-cb | 8 |" in text
    assert "arena 52.0 s" in R.ready(R.Rows(rows)).measured


def test_a_replay_on_an_engine_with_an_option_set_is_named_for_it() -> None:
    """``--sat scls-cb@hf-static-cb-flex`` runs hf-static-cb with decode_attention=flex: its
    row in the table says hf-static-cb-flex, beside the plain arena's; its engine stage has
    a section of its own."""
    flex = {**sat("scls-cb", "hf-static-cb", 3300), "stage": "sat-scls-cb-hf-static-cb-flex"}
    shape = {"stage": "flex", "phase": "shape", "n": 32, "p": "128-1024", "call": "warm", "ms_per_step": 9.5,
             "prefill_s": 0.3}
    text = R.render([sat("scls-cb", "hf-static-cb", 3000), flex, shape])
    assert "| scls-cb | hf-static-cb | 8 | 80/80 |" in text and "| scls-cb | hf-static-cb-flex | 8 | 80/80 |" in text
    assert "decode_attention = flex" in text and "- N=32 P=128-1024 warm: 9.50 ms/step" in text


def test_a_replay_shows_its_tpot_gaps_slices_and_the_arena_rows_account(tmp_path: Any) -> None:
    """The daemon log's account of hf-static-cb's rows (resumed in place, copied in, spilled)
    reaches the replay's results and its summary line, beside TPOT and the gaps."""
    from sclsd.bench.gpu_stages import log_facts

    log = tmp_path / "sat.log"
    log.write_text("... sclsd-worker[w0] INFO worker: engine hf-static-cb ready in 33.1s: registering\n"
                   "... hf-static-cb: rows resumed in place 170, copied in from the store 3, paused rows spilled 4, "
                   "rows moved between slots 212, rows that waited for room 0; 2105 decode steps of 37.4 rows on "
                   "average, 81 prefill turns; 41216 KV columns read per step, 47 % of them the rows' own; "
                   "12 relayouts, 3.4 s of prefill, 41.2 s in turns: 17.9 ms a step besides prefill; 77 steps "
                   "outside the buckets, 240 regroups\n")
    assert "flex_failed" not in log_facts(log)
    with log.open("a") as f:
        f.write('... ERROR worker: decode_attention = "flex" failed (BackendCompilerFailed: no triton); decode '
                "attends with SDPA from now on\n")
    facts = log_facts(log)
    assert facts["flex_failed"] == "BackendCompilerFailed: no triton"
    assert facts["arena_rows"] == {"resumed": 170, "loaded": 3, "spilled": 4, "moved": 212, "waited": 0,
                                   "steps": 2105, "rows_per_step": 37.4, "prefills": 81, "cols_per_step": 41216,
                                   "own_pct": 47, "relayouts": 12, "prefill_s": 3.4, "turns_s": 41.2,
                                   "ms_per_step": 17.9, "loose_steps": 77, "regroups": 240}
    assert facts["worker_ready_in_s"] == [33.1] and "arena_rows" not in log_facts(tmp_path / "sat.log.none")
    row = {**sat("scls-cb", "hf-static-cb", 800), "avg_tpot_s": 0.042, "p50_gap_s": 0.31, "max_gap_s": 0.9,
           "slices_per_req": 2.96}
    text = R.render([row, {"stage": "sat-scls-cb-hf-static-cb", "phase": "stopped", "total_s": 60, **facts}])
    assert "| 0.042 |" in text and "| 0.31 / 0.90 | 2.96 |" in text
    assert "arena rows resumed in place 170, copied in 3, spilled 4, moved 212, waited 0; 2105 steps of 37.4 rows, " \
        "81 prefill turns; 41216 KV columns read per step, 47 % the rows' own; 12 relayouts, 3.4 s of prefill, " \
        "41.2 s in turns: 17.9 ms a step besides prefill; 77 steps outside the buckets (eager with graphs), 240 regroups" in text
    assert "FlexAttention FAILED, decode fell back to SDPA: BackendCompilerFailed: no triton" in text
    assert "for want of device memory" not in text
    # Spills whose copies found no device memory come last, only when there were any.
    log.write_text(log.read_text().replace("240 regroups\n", "240 regroups, 2 spills dropped for want of device memory\n"))
    oom = log_facts(log)
    assert oom["arena_rows"]["spill_oom"] == 2 and oom["arena_rows"]["regroups"] == 240
    assert "shared" not in oom["arena_rows"]
    # Prefixes shared (hf-static-cb's default): their counts come in, and the rest still parses.
    log.write_text(log.read_text().replace("waited for room 0; ", "waited for room 0; rows started from a cached "
                                           "prefix 9, finished rows cached as prefixes 150; "))
    shared = log_facts(log)["arena_rows"]
    assert (shared["shared"], shared["cached"], shared["steps"], shared["ms_per_step"]) == (9, 150, 2105, 17.9)
    text = R.render([row, {"stage": "sat-scls-cb-hf-static-cb", "phase": "stopped", "total_s": 60,
                           "arena_rows": shared}])
    assert "waited 0; from a cached prefix 9, cached as prefixes 150; 2105 steps of 37.4 rows" in text
    text = R.render([row, {"stage": "sat-scls-cb-hf-static-cb", "phase": "stopped", "total_s": 60, **oom}])
    assert "240 regroups, 2 spills dropped for want of device memory" in text
    # Turns that ran out of device memory come after them, and the report shouts them.
    log.write_text(log.read_text().replace("want of device memory\n", "want of device memory, 3 turns out of "
                                           "device memory\n"))
    turns = log_facts(log)["arena_rows"]
    assert (turns["oom_turns"], turns["spill_oom"], turns["cached"]) == (3, 2, 150)
    text = R.render([row, {"stage": "sat-ils-hf-static-cb", "phase": "stopped", "total_s": 60, "arena_rows": turns}])
    assert "2 spills dropped for want of device memory, 3 turns OUT OF DEVICE MEMORY" in text
    # And the room the cached prefixes were held to after them.
    log.write_text(log.read_text().replace("3 turns out of device memory\n", "3 turns out of device memory, cached "
                                           "prefixes held to 1.55 GiB since\n"))
    held = log_facts(log)["arena_rows"]
    assert (held["oom_turns"], held["prefix_limit_gib"]) == (3, 1.55)
    text = R.render([row, {"stage": "sat-ils-hf-static-cb", "phase": "stopped", "total_s": 60, "arena_rows": held}])
    assert "3 turns OUT OF DEVICE MEMORY (cached prefixes held to 1.55 GiB since)" in text
    assert "padding" not in held
    # The padding a step read, by why, ends the account.
    log.write_text(log.read_text().replace("GiB since\n", "GiB since; padding read per step: dummy rows 9000, "
                                           "ended rows 1200, above the widest row 20000, the widest row over the "
                                           "others 15000, slices not yet written 8000; steps by shape: 64×2048 312, "
                                           "48×3072 120\n"))
    pad = log_facts(log)["arena_rows"]
    assert pad["prefix_limit_gib"] == 1.55 and pad["padding"] == {
        "dummy rows": 9000, "ended rows": 1200, "above the widest row": 20000, "the widest row over the others": 15000,
        "slices not yet written": 8000}
    assert pad["shapes"] == [[64, 2048, 312], [48, 3072, 120]]
    text = R.render([row, {"stage": "sat-ils-hf-static-cb", "phase": "stopped", "total_s": 60, "arena_rows": pad}])
    assert "captures_cut" not in log_facts(log) and "CUT" not in text
    # A warm-up whose captures ran out of their budget says so.
    with log.open("a") as f:
        f.write("... WARNING worker: warming: the decode graphs' captures took 30.2 s of their 30 s (graph_capture_s): "
                "54 smaller bucket shapes of 230 left out, batches of fewer rows run in the next captured bucket\n")
    cut = log_facts(log)
    assert cut["captures_cut"] == {"s": 30.2, "left_out": 54, "shapes": 230}
    cut_text = R.render([row, {"stage": "sat-scls-cb-hf-static-cb-fine-cap", "phase": "stopped", "total_s": 60, **cut}])
    assert "graph captures CUT at 30.2 s (graph_capture_s): 54 of 230 bucket shapes left out" in cut_text
    assert "(cached prefixes held to 1.55 GiB since); padding read per step: dummy rows 9000, ended rows 1200, " \
        "above the widest row 20000, the widest row over the others 15000, slices not yet written 8000; steps by " \
        "shape: 64×2048 312, 48×3072 120" in text
