"""``sclsd-bench engine``: shapes, the table, the bandwidth floor, and a run on the CPU."""

from __future__ import annotations

import argparse
import json

import pytest

from sclsd.bench import engine as E


def test_shapes_are_parsed_and_checked() -> None:
    assert E.parse_shapes("1x128, 16X128,32x256") == [(1, 128), (16, 128), (32, 256)]
    for bad in ("3", "ax2", "0x5", "4x9-3", "4x0-3", "4x2-"):
        with pytest.raises(SystemExit):
            E.parse_shapes(bad)


def test_a_shape_of_many_prompt_lengths_spreads_them_evenly() -> None:
    """``NxA-B``: rows of A to B tokens (rows of many lengths share a step at saturation)."""
    (n, p), = E.parse_shapes("5x100-500")
    assert (n, p) == (5, "100-500") and E.prompt_lens(n, p) == [100, 200, 300, 400, 500]
    assert E.widest(p) == 500 and E.prompt_lens(3, 7) == [7, 7, 7] and E.prompt_lens(1, "4-9") == [4]
    batch = E._batch(1, n, p, 4, 1000)
    assert [len(r.token_ids) for r in batch.requests] == [100, 200, 300, 400, 500]


def test_table_has_cold_and_warm_per_shape_and_the_floor() -> None:
    rows = [{"variant": "hf", "n": 1, "p": 8, "call": "cold", "ms_per_step": 30.0},
            {"variant": "hf", "n": 1, "p": 8, "call": "warm", "ms_per_step": 10.04},
            {"variant": "hf-cb", "n": 1, "p": 8, "call": "cold", "error": "MemoryError: no"},
            {"variant": "hf-cb", "load_s": 1.0}]
    md = E.markdown(rows, 4.02)
    assert "| hf | 30.0 / 10.0 |" in md and "| hf-cb | err / - |" in md
    assert "| bandwidth floor | 4.0 |" in md


def test_with_rounds_each_cell_is_its_fastest_round() -> None:
    rows = [{"variant": "hf", "n": 1, "p": 8, "call": c, "ms_per_step": ms, "round": r}
            for r, (cold, warm) in enumerate(((30.0, 12.0), (25.0, 14.0))) for c, ms in (("cold", cold), ("warm", warm))]
    rows.append({"variant": "hf", "n": 1, "p": 8, "call": "warm", "error": "killed", "round": 2})
    assert "| hf | 25.0 / 12.0 |" in E.markdown(rows, None)


def test_bandwidth_floor_of_llama2_7b_on_an_h100() -> None:
    """13.5 GB of fp16 weights at 3.35 TB/s: about 4 ms (the figure docs/design.md quotes)."""
    floor = E.bandwidth_floor_ms({"gpu": "NVIDIA H100 80GB HBM3"}, "random:llama2-7b", "float16")
    assert floor is not None and 3.8 < floor < 4.2
    assert E.bandwidth_floor_ms({"gpu": "unknown card"}, "random:llama2-7b", "float16") is None


def test_a_run_on_the_cpu_measures_every_shape_twice(tmp_path) -> None:
    args = argparse.Namespace(child=None, engines="hf-static", device="cpu", model="tiny-random", dtype="auto",
                              shapes="2x8", gen=4, threads=1, out=str(tmp_path))
    assert E.run(args) == 0
    data = json.loads((tmp_path / "engine.json").read_text())
    calls = [r for r in data["rows"] if "n" in r]
    assert [(r["variant"], r["call"]) for r in calls] == [("hf-static", "cold"), ("hf-static", "warm")]
    assert all(r["ms_per_step"] > 0 and r["prefill_s"] > 0 and r["cpu_ms_per_step"] > 0 for r in calls)
    md = (tmp_path / "engine.md").read_text()
    assert "| hf-static |" in md and "cold / warm CPU ms |" in md


def test_the_llama_engine_beside_the_librarys_own_loop(tmp_path) -> None:
    pytest.importorskip("ik_llama_cpp")
    args = argparse.Namespace(child=None, engines="llama,llama-loop", device="cpu", model="tiny-random",
                              dtype="auto", shapes="2x40", gen=6, threads=1, rounds=1, out=str(tmp_path))
    assert E.run(args) == 0
    calls = [r for r in json.loads((tmp_path / "engine.json").read_text())["rows"] if "n" in r]
    assert [(r["variant"], r["call"]) for r in calls] == [("llama", "cold"), ("llama", "warm"),
                                                          ("llama-loop", "cold"), ("llama-loop", "warm")]
    assert all("error" not in r and r["ms_per_step"] > 0 and r["prefill_s"] > 0 and r["cpu_ms_per_step"] > 0
               for r in calls)
    md = (tmp_path / "engine.md").read_text()
    assert "| llama |" in md and "| llama-loop |" in md and "err" not in md
