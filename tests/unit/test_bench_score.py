"""``sclsd-bench score``: scored answers checked, and the table (a run end to end:
tests/integration/test_score_bench.py)."""

from __future__ import annotations

import pytest

from sclsd.bench import score as S
from sclsd.bench.cli import SUBCOMMANDS


def _answer(values: list[float | None], top_first: object = None) -> dict:
    tops = [top_first] + [{"x": v} for v in values[1:]]
    return {"choices": [{"logprobs": {"token_logprobs": values, "top_logprobs": tops}}]}


def test_a_scored_answer_must_cover_the_prompt_and_the_token() -> None:
    S.check(_answer([None, -1.0, -0.5, -2.0]), [5, 6, 7])
    for bad in (_answer([None, -1.0, -0.5]),  # the generated token's missing
                _answer([-0.1, -1.0, -0.5, -2.0]),  # the first prompt token has none
                _answer([None, -1.0, -0.5, -2.0], {"x": -1.0}),
                _answer([None, -1.0, 0.5, -2.0])):  # above 0
        with pytest.raises(RuntimeError):
            S.check(bad, [5, 6, 7])


def test_the_table_takes_each_ways_best_round() -> None:
    runs = [{"way": "scored", "req_per_s": 1.5, "prompt_tok_per_s": 384.0, "load": 1.0},
            {"way": "plain", "req_per_s": 2.0, "prompt_tok_per_s": 512.0, "load": 1.1},
            {"way": "plain", "req_per_s": 2.5, "prompt_tok_per_s": 640.0, "load": 0.9},
            {"way": "scored", "req_per_s": 1.0, "prompt_tok_per_s": 256.0, "load": 2.0}]
    md = S.markdown({"model": "m", "workers": 2, "engine": "llama", "threads": 1, "prompts": 64,
                     "prompt_tokens": 256, "concurrency": 8, "runs": runs})
    assert "| scored | 1.50 | 384.0 | 1.00 |" in md and "| plain | 2.50 | 640.0 | 0.90 |" in md
    assert "scored / plain: 0.60x" in md and "the best of 2 rounds" in md
    assert "score" in SUBCOMMANDS

