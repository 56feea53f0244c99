"""sclsd-bench detok measures both ways on the same text (it checks they agree)."""

from __future__ import annotations

from sclsd.bench.detok import _corpus, measure
from sclsd.tokenizer import load


def test_both_ways_give_the_same_text_and_windows_cost_less_on_long_outputs() -> None:
    tok = load("tiny-random")
    ids = _corpus(tok, 1200)
    win_us, win_s = measure(tok, ids, 1, whole=False)
    whole_us, whole_s = measure(tok, ids, 1, whole=True)
    assert win_s < whole_s  # the whole output's decode grows with it; a window does not
