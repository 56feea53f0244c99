"""``sclsd-bench engine`` reports the decode graphs each variant kept after its warm-up check,
and fails loudly when a variant asked for graphs and kept none (its timings would be the
eager step's)."""

from __future__ import annotations

import argparse
import io
import json
from types import SimpleNamespace
from typing import Any

import pytest

from sclsd.bench import engine as E


def static(requested: bool, kept: list[tuple[int, int]]) -> Any:
    return SimpleNamespace(static=SimpleNamespace(graphs_requested=requested, captured=lambda: kept))


def test_graph_facts_come_from_the_static_path():
    assert E.graph_facts(static(True, [(1, 256), (8, 512)])) == {
        "graphs_requested": True, "graphs_kept": [[1, 256], [8, 512]]}
    assert E.graph_facts(SimpleNamespace(static=None)) == {}
    assert E.graph_facts(SimpleNamespace()) == {}


def test_the_cpu_static_path_asks_for_no_graphs():
    pytest.importorskip("torch")
    from worker.engines import create_engine

    eng = create_engine("hf", "tiny-random", threads=1, mem_budget=2**24, static_cache=True)
    facts = E.graph_facts(eng)
    assert facts == {"graphs_requested": False, "graphs_kept": []} and E.graph_problem({"variant": "hf", **facts}) is None


class FakeChild:
    """A variant's child process: its first line (load, warm-up, graphs) and one call."""

    def __init__(self, cmd: list[str], first: dict[str, Any]) -> None:
        variant = cmd[cmd.index("--child") + 1]
        lines = [{"variant": variant, "load_s": 0.1, "warm_up_s": 0.1, **first},
                 {"variant": variant, "n": 1, "p": 8, "gen": 4, "call": "cold", "prefill_s": 0.1, "ms_per_step": 2.0}]
        self.stdout = io.StringIO("".join(json.dumps(x) + "\n" for x in lines))
        self.returncode = 0

    def wait(self) -> int:
        return 0


@pytest.mark.parametrize(("first", "rc"), [
    ({"graphs_requested": True, "graphs_kept": [[1, 256]]}, 0),
    ({"graphs_requested": True, "graphs_kept": []}, 1),
    ({"graphs_requested": False, "graphs_kept": []}, 0),
])
def test_a_run_fails_when_graphs_were_requested_and_none_kept(tmp_path, monkeypatch, capsys, first, rc):
    import sclsd.bench.gpu_check as gpu_check

    monkeypatch.setattr(gpu_check, "device_facts", lambda device: {"device": "cpu"})
    monkeypatch.setattr(E.subprocess, "Popen", lambda cmd, **kw: FakeChild(cmd, first))
    args = argparse.Namespace(child=None, engines="hf", device="cpu", model="tiny-random", dtype="auto",
                              shapes="1x8", gen=4, threads=1, out=str(tmp_path))
    assert E.run(args) == rc
    err = capsys.readouterr().err
    md = (tmp_path / "engine.md").read_text()
    assert f"graphs kept: {len(first['graphs_kept'])}" in err
    assert f"hf: {len(first['graphs_kept'])} decode graphs kept" in md
    assert ("ERROR" in err and "ERROR" in md and "requested but none was kept" in md) == (rc == 1)
    data = json.loads((tmp_path / "engine.json").read_text())
    assert data["rows"][0]["graphs_kept"] == first["graphs_kept"]
