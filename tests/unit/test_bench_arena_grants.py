"""``sclsd-bench arena-grants`` on the tiny random Llama: the same tokens in grants and whole,
every grant after a request's first resumed in place, and its figures written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

from sclsd.bench import arena_grants, cli  # noqa: E402


def test_grants_resume_in_place_and_give_the_whole_runs_tokens(tmp_path: Path) -> None:
    assert cli.SUBCOMMANDS["arena-grants"][0] == "sclsd.bench.arena_grants"
    args = cli.argparse.ArgumentParser()
    arena_grants.add_arguments(args)
    ns = args.parse_args(["--requests", "6", "--slice", "5", "--graph-like", "--out", str(tmp_path)])
    assert arena_grants.run(ns) == 0
    report = json.loads((tmp_path / "arena-grants.json").read_text())
    assert report["same_tokens"] is True
    g, w = report["grants"], report["whole"]
    assert g["tokens"] == w["tokens"] and g["rows"]["loaded"] == 0 and g["rows"]["spilled"] == 0
    assert g["rows"]["resumed"] >= 6 and w["rows"]["resumed"] == 0  # every output is longer than a grant
    assert g["prefill_turns"] <= 6 and g["steps"] > 0 and g["rows_per_step"] > 1
