"""``sclsd-bench gpu-check``'s planning: the model for the card, the trace, the stages and
their caps, the live configs, the profile's RMSE check."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sclsd.bench import gpu_check as G
from sclsd.bench import gpu_stages as S
from sclsd.bench.gpu_stages import live_sections, why_not_ready
from sclsd.eval.traces import load_trace

GIB = 2**30


def args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    G.add_arguments(p)
    return p.parse_args(list(argv))


def cuda_facts(mem_gib: float) -> dict[str, Any]:
    return {"phase": "facts", "cuda_available": True, "mem_total": int(mem_gib * GIB), "gpu": "H100"}


@pytest.mark.parametrize(("mem_gib", "model"), [
    (79.2, "random:llama2-7b"),     # an H100 80GB: the targets' model, not the 13B that fits it
    (40, "random:llama2-7b"),
    (24, "random:llama2-7b"),
    (139.8, "random:llama2-13b"),   # an H200
    (16, "tiny-random"),            # the 7B's 13.7 GB of weights would leave no room
])  # fmt: skip
def test_the_model_follows_the_card(mem_gib: float, model: str) -> None:
    assert G.choose_model(int(mem_gib * GIB)) == model


def test_builtin_parameter_counts_need_no_transformers() -> None:
    # LLaMA2-7B's 6,738,415,616 with its 32,000-token vocabulary; here the SmolLM2 vocabulary.
    assert G.builtin_params("llama2-7b") - 2 * (49152 - 32000) * 4096 == 6_738_415_616


def test_a_bundle_copy_of_the_architecture_is_preferred(tmp_path: Path) -> None:
    assert G.bundled("random:llama2-7b", tmp_path) == "random:llama2-7b"  # the bundle lacks it
    (tmp_path / "llama2-7b").mkdir()
    (tmp_path / "llama2-7b" / "config.json").write_text("{}")
    assert G.bundled("random:llama2-7b", tmp_path) == f"random:{(tmp_path / 'llama2-7b').resolve()}"
    assert G.bundled("tiny-random", tmp_path) == "tiny-random"


def test_plan_on_an_h100_and_in_smoke() -> None:
    p = G.make_plan(args(), cuda_facts(79.2), None, "/t.csv", "file")
    assert (p.device, p.model, p.dtype, p.smoke, p.skip) == ("cuda:0", "random:llama2-7b", "float16", False, None)
    assert (p.sizes.num, p.sizes.rate, p.sizes.hf_shapes, p.sizes.slice_len) == (40, 4.0, "32x256,64x256", 128)
    assert p.stages == ("hf", "cb", "profile", "live", "generate") and p.policies == ("scls", "ils", "scls-cb")
    s = G.make_plan(args("--smoke", "--stages", "live,tests,hf", "--live", "scls"), {}, None, "/t.csv", "file")
    assert (s.device, s.model, s.dtype) == ("cpu", "tiny-random", "float32")
    assert s.stages == ("hf", "live", "tests") and s.policies == ("scls",)
    assert G.make_plan(args(), {"cuda_available": False}, None, "/t", "file").skip.startswith("no CUDA device")


def test_stages_with_their_caps_and_commands(tmp_path: Path) -> None:
    plan = G.make_plan(args("--stages", "hf,profile,live,tests", "--profile-budget", "80"), cuda_facts(80), None,
                       "/t.csv", "file")  # fmt: skip
    stages = G.measuring_stages(plan, tmp_path / "out", tmp_path, {}, G.parse_caps(["live-ils=70", "tests=99"]))
    by = {s.name: s for s in stages}
    assert list(by) == ["hf", "profile", "live-scls", "live-ils", "live-scls-cb", "tests"]
    assert (by["hf"].cap_s, by["hf"].min_s) == G.CAPS["hf"]
    assert by["profile"].cap_s == 80 + G.PROFILE_MARGIN_S and "80" in by["profile"].argv
    assert (by["live-scls"].cap_s, by["live-ils"].cap_s, by["tests"].cap_s) == (130, 70, 99)
    assert by["live-ils"].min_s == 45  # a cap under the minimum would lower it; this one does not
    ils = by["live-ils"].argv
    assert ils[ils.index("--rate") + 1] == "4" and ils[ils.index("--num") + 1] == "40"
    assert ils[ils.index("--profile") + 1] == str(tmp_path / "out" / "profile-hf.json")
    assert by["live-ils"].attach == [tmp_path / "live-ils.log"] and by["live-ils"].log == "live.log"
    assert "--ab" in by["hf"].argv and by["hf"].argv[by["hf"].argv.index("--shapes") + 1] == "32x256,64x256"
    # A cap below a stage's minimum lowers the minimum: the stage runs, under the cap asked for.
    assert G.cap_of("hf", plan, {"hf": 5}) == (5, 5)


def test_no_cuda_skips_every_measuring_stage(tmp_path: Path) -> None:
    plan = G.make_plan(args(), {"cuda_available": False}, None, "/t.csv", "file")
    assert all(s.skip and "--smoke" in s.skip for s in G.measuring_stages(plan, tmp_path, tmp_path, {}, {}))


def test_bad_caps_are_refused() -> None:
    with pytest.raises(SystemExit, match="STAGE=SECONDS"):
        G.parse_caps(["hf"])
    with pytest.raises(SystemExit, match="STAGE=SECONDS"):
        G.parse_caps(["hf=soon"])


def test_synthetic_trace_resembles_sharegpt_and_follows_its_seed(tmp_path: Path) -> None:
    a = load_trace(G.synthetic_trace(tmp_path / "a.csv", 4000, seed=1))
    b = load_trace(G.synthetic_trace(tmp_path / "b.csv", 4000, seed=1))
    c = load_trace(G.synthetic_trace(tmp_path / "c.csv", 4000, seed=2))
    assert np.array_equal(a.input_tokens, b.input_tokens) and not np.array_equal(a.input_tokens, c.input_tokens)
    assert not a.has_arrivals  # the replay draws Poisson arrivals at --rate
    # ShareGPT: input median 1730, p90 5696; output median 415, p90 834, at most 1024.
    for got, median, p90, top in ((a.input_tokens, 1730, 5696, 8141), (a.output_tokens, 415, 834, 1024)):
        assert abs(np.median(got) - median) < 0.08 * median
        assert abs(np.percentile(got, 90) - p90) < 0.08 * p90
        assert got.min() >= 1 and got.max() <= top


def test_live_configs() -> None:
    kw: dict[str, Any] = dict(model="random:llama2-7b", device="cuda:0", dtype="float16", slice_len=128,
                              max_input=1024, max_gen=1024)  # fmt: skip
    scls = live_sections("scls", **kw, profile=Path("/p/profile-hf.json"), options={"static_cache": True})
    assert scls["workers"] == {"spawn": 1, "engine": "hf", "device": "cuda", "threads": 1,
                               "options": {"static_cache": True}}  # fmt: skip
    assert scls["scheduler"] == {"policy": "scls", "slice_len": 128, "profile": "/p/profile-hf.json"}
    assert scls["model"]["dtype"] == "float16"
    ils = live_sections("ils", **kw)
    assert ils["workers"]["engine"] == "hf-cb" and "options" not in ils["workers"]
    assert ils["scheduler"]["policy"] == "sls" and ils["scheduler"]["batch_size"] == 1
    cb = live_sections("scls-cb", **kw)
    assert (cb["workers"]["engine"], cb["scheduler"]["policy"]) == ("hf-cb", "scls-cb")


def test_a_worker_that_cannot_start_is_said_in_one_line() -> None:
    text = ("1 workers not registered within 70s:\n... INFO sclsd: listening\nTraceback (most recent call last):\n"
            "  File x\nModuleNotFoundError: No module named 'flash_attn'\n... INFO sclsd: stopped")
    assert why_not_ready(text) == ("1 workers not registered within 70s: | "
                                   "ModuleNotFoundError: No module named 'flash_attn'")


def write_profile(path: Path, prefill_rel: float, decode_rel: float, batch_rel: float) -> Path:
    """A profile whose estimator predicts 10 ms for a prefill and for a decode step, with
    samples off by ± the given share (so RMSE / mean is exactly that share)."""
    def around(t: float, rel: float, k: int) -> list[float]:
        return [t * (1 + rel * (-1) ** i) for i in range(k)]

    samples = {"prefill": [[1, 64, t] for t in around(0.01, prefill_rel, 8)],
               "decode": [[1, 64, t] for t in around(0.01, decode_rel, 8)],
               "batch": [[1, 64, 4, t] for t in around(0.05, batch_rel, 4)]}  # 10 ms + 4 x 10 ms
    path.write_text(json.dumps({"name": "t", "engine": "hf", "model": "m", "device": "cuda",
                                "coefficients": {"p4": 0.01, "d4": 0.01}, "kv_bytes_per_token": 512,
                                "mem_available": 2**30, "samples": samples}))  # fmt: skip
    return path


def test_check_profile_judges_each_kind_at_its_own_limit(tmp_path: Path) -> None:
    c = S.check_profile(write_profile(tmp_path / "a.json", 0.09, 0.09, 0.14))
    rel = {r["samples"]: round(r["relative"], 6) for r in c["rows"]}
    assert rel == {"prefill": 0.09, "decode": 0.09, "batch": 0.14}
    assert c["ok"] and {r["samples"]: r["limit"] for r in c["rows"]} == {"prefill": 0.1, "decode": 0.1, "batch": 0.15}
    assert not S.check_profile(write_profile(tmp_path / "b.json", 0.09, 0.11, 0.14))["ok"]
    assert not S.check_profile(write_profile(tmp_path / "c.json", 0.09, 0.09, 0.16))["ok"]
    # The worst decode sample is one 9% under the estimate: off by 0.09 / 0.91 of itself.
    assert c["worst_decode"][0]["rel_err"] == round(0.09 / 0.91, 3)


def test_the_arena_preset_measures_hf_static_cb_against_hf_and_hf_cb(tmp_path: Path) -> None:
    """``--preset arena``: the step of hf-static-cb beside hf's graphs and hf-cb, three
    saturation replays at 32 req/s (80 requests), scls-cb on hf-static-cb at 4 req/s."""
    plan = G.make_plan(args("--preset", "arena"), cuda_facts(139.8), None, "/t.csv", "file")
    assert plan.model == "random:llama2-7b"  # the targets' model, on an H200 too
    assert G.make_plan(args("--preset", "arena", "--model", "random:llama2-13b"), cuda_facts(139.8), None, "/t",
                       "file").model == "random:llama2-13b"
    assert plan.stages == ("hf", "arena", "cb", "sat", "live", "tests") and plan.policies == ("scls-cb",)
    assert plan.cb_engine == "hf-static-cb" and plan.tests_k == "arena"
    assert plan.sat == (G.SatReplay("scls-cb", "hf-static-cb", True), G.SatReplay("ils", "hf-static-cb", True),
                        G.SatReplay("scls-cb", "hf-cb", True))  # max_tokens a cap, as clients send it
    stages = G.measuring_stages(plan, tmp_path / "out", tmp_path, {}, {}, "", "kv_padding_tokens=1024",
                                "static_share=0.6")
    by = {s.name: s for s in stages}
    assert list(by) == ["hf", "arena", "cb", "sat-scls-cb-hf-static-cb-cap", "sat-ils-hf-static-cb-cap", "sat-scls-cb-hf-cb-cap",
                        "live-scls-cb", "tests"]
    assert by["tests"].argv[-3:] == ["tests", "-k", "arena"]  # its CUDA test only, last, if time is left
    arena = by["arena"].argv
    assert arena[arena.index("--variant") + 1] == "hf-static-cb" and "--ab" in arena
    assert arena[arena.index("--shapes") + 1] == "32x256,64x256,32x128-1024"
    assert arena[arena.index("--opts") + 1] == "static_share=0.6"
    for name, engine, opts in (("sat-ils-hf-static-cb-cap", "hf-static-cb", "static_share=0.6"),
                               ("sat-scls-cb-hf-cb-cap", "hf-cb", "kv_padding_tokens=1024")):
        argv = by[name].argv
        assert argv[argv.index("--engine") + 1] == engine and argv[argv.index("--opts") + 1] == opts
        assert (argv[argv.index("--rate") + 1], argv[argv.index("--num") + 1]) == ("32", "80")
        assert (by[name].cap_s, by[name].min_s) == G.CAPS["sat"] and by[name].attach == [tmp_path / f"{name}.log"]
    live = by["live-scls-cb"].argv
    assert live[live.index("--engine") + 1] == "hf-static-cb" and live[live.index("--rate") + 1] == "4"
    # Options given explicitly win over the preset's.
    p = G.make_plan(args("--preset", "arena", "--stages", "arena", "--cb-engine", "hf-cb"), cuda_facts(80), None,
                    "/t.csv", "file")
    assert (p.stages, p.cb_engine) == (("arena",), "hf-cb")
    s = G.make_plan(args("--preset", "arena", "--smoke", "--sat", "ils@hf-cb"), {}, None, "/t.csv", "file")
    assert (s.sizes.sat_rate, s.sizes.sat_num, s.sizes.arena_shapes, s.sat) == (4.0, 6, "2x16,2x8-40",
                                                                                 (G.SatReplay("ils", "hf-cb"),))


def test_the_flex_preset_measures_flex_decode_against_sdpa_on_the_arena(tmp_path: Path) -> None:
    """``--preset flex``: the arena's step with SDPA and with FlexAttention (rows of many
    lengths among the shapes), then scls-cb at saturation on each; the flex engine is
    hf-static-cb with ``decode_attention=flex`` beside the arena's own options."""
    plan = G.make_plan(args("--preset", "flex"), cuda_facts(80), None, "/t.csv", "file")
    assert plan.stages == ("arena", "flex", "sat") and plan.model == "random:llama2-7b"
    assert plan.sat == (G.SatReplay("scls-cb", "hf-static-cb", True), G.SatReplay("scls-cb", "hf-static-cb-flex", True))
    by = {s.name: s for s in G.measuring_stages(plan, tmp_path / "out", tmp_path, {}, {}, "", "", "static_share=0.6")}
    assert list(by) == ["arena", "flex", "sat-scls-cb-hf-static-cb-cap", "sat-scls-cb-hf-static-cb-flex-cap"]
    flex = by["flex"].argv
    assert flex[flex.index("--variant") + 1] == "hf-static-cb" and "32x128-1024" in flex[flex.index("--shapes") + 1]
    assert flex[flex.index("--opts") + 1] == "static_share=0.6;decode_attention=flex"
    sat = by["sat-scls-cb-hf-static-cb-flex-cap"].argv
    assert sat[sat.index("--engine") + 1] == "hf-static-cb"
    assert sat[sat.index("--opts") + 1] == "static_share=0.6;decode_attention=flex"
    plain = by["sat-scls-cb-hf-static-cb-cap"].argv
    assert plain[plain.index("--opts") + 1] == "static_share=0.6"
    assert G.parse_sat("ils@hf-static-cb-flex") == (G.SatReplay("ils", "hf-static-cb-flex"),)


def test_the_half_variant_runs_the_arena_at_half_the_kv_memory(tmp_path: Path) -> None:
    """``hf-static-cb-half``: the arena engine with ``static_share=0.5`` (the split before the
    arena took 0.9), which wins over a share in ``--arena-opts``; its replay's log and stage
    are its own, so the report sets it beside the default's."""
    plan = G.make_plan(args("--preset", "arena", "--stages", "sat", "--sat",
                            "scls-cb@hf-static-cb,scls-cb@hf-static-cb-half"), cuda_facts(80), None, "/t.csv", "file")
    by = {s.name: s for s in G.measuring_stages(plan, tmp_path / "out", tmp_path, {}, {}, "", "",
                                                "static_share=0.6;static_buckets=true")}
    assert list(by) == ["sat-scls-cb-hf-static-cb", "sat-scls-cb-hf-static-cb-half"]
    half = by["sat-scls-cb-hf-static-cb-half"].argv
    assert half[half.index("--engine") + 1] == "hf-static-cb"
    opts = half[half.index("--opts") + 1]
    assert opts == "static_share=0.6;static_buckets=true;static_share=0.5"
    assert S.parse_opts(opts) == {"static_share": 0.5, "static_buckets": True}  # the later share wins
    assert str(tmp_path / "sat-scls-cb-hf-static-cb-half.log") in half


def test_the_fine_variant_runs_the_arena_with_the_finer_bucket_grid(tmp_path: Path) -> None:
    """``hf-static-cb-fine``: the arena engine with more batch and cache buckets, which win
    over grids in ``--arena-opts``; the worker's options take both lists as they parse them."""
    plan = G.make_plan(args("--preset", "arena", "--stages", "sat", "--sat",
                            "scls-cb@hf-static-cb:cap,scls-cb@hf-static-cb-fine:cap"), cuda_facts(139.8), None, "/t.csv",
                       "file")
    by = {s.name: s for s in G.measuring_stages(plan, tmp_path / "out", tmp_path, {}, {}, "", "",
                                                "static_share=0.9;graph_batch_sizes=1,2")}
    assert list(by) == ["sat-scls-cb-hf-static-cb-cap", "sat-scls-cb-hf-static-cb-fine-cap"]
    fine = by["sat-scls-cb-hf-static-cb-fine-cap"].argv
    assert fine[fine.index("--engine") + 1] == "hf-static-cb"
    opts = S.parse_opts(fine[fine.index("--opts") + 1])
    assert opts["static_share"] == 0.9 and opts["graph_batch_sizes"] == "1,2,4,8,12,16,24,32,40,48,56,64,80,96,112,128,160,192,256"
    from worker.engines.static_cache import StaticOptions
    grid = StaticOptions.parse("cuda", True, True, True, 0.9, opts["graph_batch_sizes"], opts["graph_cache_tokens"], None)
    assert {40, 56, 80, 112, 160} <= set(grid.batch_sizes) and {640, 1280, 1792, 2560, 3584} <= set(grid.cache_tokens)
    plain = by["sat-scls-cb-hf-static-cb-cap"].argv
    assert S.parse_opts(plain[plain.index("--opts") + 1])["graph_batch_sizes"] == "1,2"


def test_a_capped_replay_beside_one_of_exact_lengths_in_one_call(tmp_path: Path) -> None:
    """``:cap`` sends one replay's requests with ``max_tokens`` the cap (``--max-gen``), ended
    by the client at their trace lengths; the items without it keep the trace lengths, and
    ``--sat-cap`` caps every one. A capped replay's stage and log are its own."""
    plan = G.make_plan(args("--preset", "arena", "--stages", "sat", "--sat",
                            "scls-cb@hf-static-cb,ils@hf-static-cb:cap,scls-cb@hf-static-cb:cap,scls-cb@hf-cb"),
                       cuda_facts(139.8), None, "/t.csv", "file")  # fmt: skip
    by = {s.name: s for s in G.measuring_stages(plan, tmp_path / "out", tmp_path, {}, {})}
    assert list(by) == ["sat-scls-cb-hf-static-cb", "sat-ils-hf-static-cb-cap", "sat-scls-cb-hf-static-cb-cap",
                        "sat-scls-cb-hf-cb"]
    caps = {name: st.argv[st.argv.index("--max-tokens-cap") + 1] for name, st in by.items()}
    assert caps == {"sat-scls-cb-hf-static-cb": "0", "sat-ils-hf-static-cb-cap": "1024",
                    "sat-scls-cb-hf-static-cb-cap": "1024", "sat-scls-cb-hf-cb": "0"}
    assert str(tmp_path / "sat-ils-hf-static-cb-cap.log") in by["sat-ils-hf-static-cb-cap"].argv
    every = G.make_plan(args("--preset", "arena", "--sat-cap"), cuda_facts(80), None, "/t.csv", "file")
    assert [r.stage for r in every.sat] == ["sat-scls-cb-hf-static-cb-cap", "sat-ils-hf-static-cb-cap",
                                            "sat-scls-cb-hf-cb-cap"]


@pytest.mark.parametrize("bad", ["scls@hf-cb", "ils@hf", "scls-cb", "scls-cb@hf-cb,ils@deepspeed", "ils@hf-cb:capped",
                                 "ils@hf-cb:"])
def test_bad_saturation_replays_are_refused(bad: str) -> None:
    with pytest.raises(SystemExit, match=r"POLICY@ENGINE\[:cap\]"):
        G.parse_sat(bad)


def test_live_configs_on_the_arena_engine() -> None:
    kw: dict[str, Any] = dict(model="random:llama2-7b", device="cuda:0", dtype="float16", slice_len=128,
                              max_input=1024, max_gen=1024)  # fmt: skip
    ils = live_sections("ils", **kw, engine="hf-static-cb", options={"static_share": 0.6})
    assert ils["workers"]["engine"] == "hf-static-cb" and ils["workers"]["options"] == {"static_share": 0.6}
    assert ils["scheduler"]["policy"] == "sls" and ils["scheduler"]["batch_size"] == 1
    cb = live_sections("scls-cb", **kw, engine="hf-static-cb")
    assert (cb["workers"]["engine"], cb["scheduler"]["policy"]) == ("hf-static-cb", "scls-cb")
