"""``sclsd-bench sampling`` runs end to end on a small engine and counts what its nucleus cuts
needed (its figures: docs/benchmarks.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sclsd.bench.cli import main

pytest.importorskip("torch")


def test_the_sampling_bench_times_greedy_and_sampled_steps_and_counts_the_cuts(tmp_path: Path) -> None:
    rc = main(["sampling", "--engine", "hf", "--model", "tiny-random", "--rows", "2", "--gen", "4",
               "--temperatures", "0,1", "--rounds", "1", "--out", str(tmp_path)])
    assert rc == 0
    doc = json.loads((tmp_path / "sampling.json").read_text())
    greedy, hot = doc["results"]
    assert greedy["temperature"] == 0 and greedy["rows_cut_from_candidates"] == greedy["rows_sorted_in_full"] == 0
    assert hot["top_p"] == 0.95 and hot["cpu_ms_per_step"] > 0
    # Every sampled pick tried the candidates (2 rows, 4 tokens; a random model is unsure of
    # everything, so some tried a wider set of them too).
    assert hot["rows_cut_from_candidates"] > 2 * 4


def test_bad_settings_are_refused_by_name() -> None:
    assert main(["sampling", "--temperatures", "hot"]) == 2
    assert main(["sampling", "--top-p", "0"]) == 2
