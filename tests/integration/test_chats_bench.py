"""``sclsd-bench chats`` end to end on the tiny model: two ``hf-static-cb`` worker processes, the
daemon and sclsd-http, with shared prefixes off and on. On, every turn after a chat's first
takes at least the turn before from KV: its worker cached that turn, and the daemon sent the
next one back there (each worker caches its own)."""

from __future__ import annotations

import argparse
import json


def test_next_turns_start_from_the_turn_before_on_its_worker(tmp_path) -> None:
    from sclsd.bench import chats as C

    args = argparse.Namespace(model="tiny-random", engines="hf-static-cb", workers=2, threads=1, chats=2, turns=3,
                              concurrency=2, output_tokens=8, out=str(tmp_path), configs="off,routed")
    assert C.run(args) == 0
    off, on = json.loads((tmp_path / "chats.json").read_text())["runs"]
    assert off["config"] == "off" and off["cached_tokens"] == 0 and off["prefix_hints"] == 0
    assert on["config"] == "routed" and on["requests"] == 6 and on["prefix_hints"] >= 4
    turns = {(r["chat"], r["turn"]): r for r in on["records"]}
    for (chat, turn), r in turns.items():
        if turn:
            before = turns[(chat, turn - 1)]
            assert r["cached_tokens"] >= before["prompt_tokens"], (chat, turn, r, before)
    assert "| `hf-static-cb` | routed |" in (tmp_path / "chats.md").read_text()
