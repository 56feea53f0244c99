"""``sclsd-bench chats``: what a streamed chunk leaves, the answers compared, the table (a run
end to end: tests/integration/test_chats_bench.py)."""

from __future__ import annotations

import argparse

from sclsd.bench import chats as C
from sclsd.bench.cli import SUBCOMMANDS


def test_a_stream_keeps_its_text_and_the_cached_prompt_tokens() -> None:
    s = C.ChatStream("127.0.0.1", 1, {})
    s.chunk({"choices": [{"delta": {"role": "assistant"}}]})
    s.chunk({"choices": [{"delta": {"content": "Twelve"}}]})
    s.chunk({"choices": [{"delta": {"content": " items."}}]})
    s.chunk({"choices": [], "usage": {"prompt_tokens": 300, "completion_tokens": 2,
                                      "prompt_tokens_details": {"cached_tokens": 280}}})
    assert (s.text, s.cached, s.prompt_tokens, s.tokens, len(s.times)) == ("Twelve items.", 280, 300, 2, 2)
    s.chunk({"choices": [], "usage": {"prompt_tokens": 300, "completion_tokens": 2}})  # none counted
    assert s.cached == 0


def test_answers_are_compared_turn_by_turn_and_tabled() -> None:
    off = {"records": [{"chat": 0, "turn": 0, "text": "a"}, {"chat": 0, "turn": 1, "text": "b"}]}
    on = {"records": [{"chat": 0, "turn": 1, "text": "b"}, {"chat": 0, "turn": 0, "text": "x"}]}
    assert C.same_answers(off, on) == 1
    args = argparse.Namespace(model="m", workers=2, threads=1, chats=16, turns=3, concurrency=4, output_tokens=32)
    run = {"engine": "hf-static-cb", "config": "routed", "req_per_s": 1.25, "ttft_p50_s": 0.2,
           "ttft_p90_s": 0.5, "first_turn_ttft_p50_s": 0.3, "cached_share": 0.625, "later_share": 0.9,
           "prefix_hints": 7, "same": "1 of 2", "load": 1.5}
    md = C.markdown(args, [run])
    assert "| `hf-static-cb` | routed | 1.25 | 0.200 s | 0.500 s | 0.300 s | 62 % (90 %) | 7 | 1 of 2 | 1.50 |" in md
    assert C._share([{"cached_tokens": 3, "prompt_tokens": 4}, {"cached_tokens": 0, "prompt_tokens": 4}]) == 3 / 8
    assert C.CONFIGS == {"off": (False, False), "shared": (True, False), "routed": (True, True)}
    assert "chats" in SUBCOMMANDS


def test_make_bench_runs_it() -> None:
    from sclsd.bench import all as bench_all

    assert bench_all.STEPS["chats"][:2] == ["sclsd.bench.cli", "chats"]
