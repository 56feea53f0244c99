"""``sclsd-bench cpu``: the library's loop child and the table against the targets."""

from __future__ import annotations

import argparse
import json

import pytest

from sclsd.bench import cpu as C
from sclsd.bench.cli import SUBCOMMANDS


def test_the_loop_child_decodes_one_row_and_reports_each_run(capsys) -> None:
    pytest.importorskip("ik_llama_cpp")
    args = argparse.Namespace(model="tiny-random", output_tokens=6, runs=2)
    assert C.child(args) == 0
    runs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(runs) == 3  # a warm-up run, then --runs
    assert all(r["tokens"] == 6 and r["prefill_s"] > 0 and r["decode_s"] > 0 for r in runs)
    assert runs[0]["prompt_tokens"] == len(C.chat_ids("tiny-random")) > 30


def test_the_table_puts_each_figure_beside_the_loop_and_its_target() -> None:
    r = {"model": "m", "workers": 2, "threads": 1, "output_tokens": 64, "engine": "llama", "start_s": 6.0,
         "loop_rate": 80.0, "loop_prefill_s": 0.3, "prompt_tokens": 84, "loop_load": 0.5,
         "one_stream": [{"decode_rate": 60.0, "e2e_rate": 40.0, "ttft_s": 0.4, "load": 0.6},
                        {"decode_rate": 50.0, "e2e_rate": 35.0, "ttft_s": 0.5, "load": 0.7}],
         "streams": {"n": 8, "tokens": 512, "wall_s": 4.0, "rate": 128.0, "p50_stream_decode_rate": 17.0,
                     "load": 1.5},
         "ttft": [{"ttft_s": 0.2, "prompt_tokens": 32, "load": 0.4}, {"ttft_s": 0.3, "prompt_tokens": 32,
                                                                      "load": 0.4}]}
    md = C.markdown(r)
    assert "| sclsd-http, one stream | 60.0 tok/s decode" in md and "| 0.75x | >= 0.7x | 0.60 |" in md
    assert "| 1.60x | >= 1.5x | 1.50 |" in md and "0.250 s (median of 2" in md
    assert "cpu" in SUBCOMMANDS


def test_make_bench_runs_it() -> None:
    from sclsd.bench import all as bench_all

    assert bench_all.STEPS["cpu"][:2] == ["sclsd.bench.cli", "cpu"]
