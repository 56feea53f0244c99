"""``sclsd-bench score`` end to end: a short run on the fake model (daemon, worker and
sclsd-http as processes), every scored answer checked by the benchmark itself."""

from __future__ import annotations

import argparse
import json

from sclsd.bench import score as S


def test_a_short_run_on_the_fake_model(tmp_path) -> None:
    args = argparse.Namespace(model="fake", engine="fake", workers=1, threads=1, prompts=4, prompt_tokens=40,
                              concurrency=2, rounds=1, out=str(tmp_path))
    assert S.run(args) == 0
    r = json.loads((tmp_path / "score.json").read_text())
    assert [x["way"] for x in r["runs"]] == ["scored", "plain"]
    assert all(x["requests"] == 4 and x["prompt_tok_per_s"] > 0 for x in r["runs"])
    assert "scored / plain" in (tmp_path / "score.md").read_text()
