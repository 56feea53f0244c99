"""``sclsd-bench detok``: the daemon's detokenizing cost per streamed message, by output length.

One request's output is streamed ``--chunk`` tokens per message, as a worker's ``tokens``
messages bring it, and each message is detokenized the way the daemon does it
(:meth:`sclsd.tokenizer.Detokenizer.window` and ``apply_window``: a window of a few tokens),
and, for comparison, by decoding the whole output so far (``Detokenizer.apply`` on it: the
cost grows with the output, so a whole answer costs its square). Reported: microseconds per
message over the last 64 messages of outputs of each ``--lengths`` (so a flat column means a
cost independent of the output length), and the total for the whole output.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from importlib import resources
from pathlib import Path
from typing import Any

from ..tokenizer import Detokenizer, Tokenizer, load


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--lengths", default="64,256,1024,4096", help="output lengths in tokens")
    p.add_argument("--chunk", type=int, default=1, help="tokens per streamed message")
    p.add_argument("--out", default="out/detok", help="directory for detok.json and detok.md")


def _corpus(tok: Tokenizer, n: int) -> list[int]:
    text = resources.files("sclsd").joinpath("data/prompts.txt").read_text()
    ids = tok.encode(text)
    while len(ids) < n:
        ids += ids
    return ids[:n]


def measure(tok: Tokenizer, ids: list[int], chunk: int, whole: bool) -> tuple[float, float]:
    """(µs per message over the last 64 messages, seconds for the whole output)."""
    d = Detokenizer()
    times: list[float] = []
    for i in range(chunk, len(ids) + chunk, chunk):
        part = ids[: min(i, len(ids))]
        t0 = time.perf_counter()
        if whole:
            d.apply(tok.decode(part), final=len(part) == len(ids))
        else:
            win, pre, snap = d.window(part)
            d.apply_window(snap, tok.decode(win), tok.decode(pre), final=len(part) == len(ids))
        times.append(time.perf_counter() - t0)
    assert d.text == tok.decode(ids), "the texts differ"
    tail = times[-64:]
    return 1e6 * sum(tail) / len(tail), sum(times)


def run(args: argparse.Namespace) -> int:
    tok = load(args.model)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    rows: list[dict[str, Any]] = []
    for n in lengths:
        ids = _corpus(tok, n)
        win_us, win_s = measure(tok, ids, args.chunk, whole=False)
        whole_us, whole_s = measure(tok, ids, args.chunk, whole=True)
        rows.append({"tokens": n, "window_us_per_msg": win_us, "whole_us_per_msg": whole_us,
                     "window_total_ms": 1e3 * win_s, "whole_total_ms": 1e3 * whole_s})
        print(f"  {n} tokens: window {win_us:.1f} us/message, whole output {whole_us:.1f} us/message",
              file=sys.stderr, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "detok.json").write_text(json.dumps(rows, indent=1))
    lines = ["| output tokens | windows: µs per message | whole output: µs per message | windows: ms in all | "
             "whole output: ms in all |", "|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['tokens']} | {r['window_us_per_msg']:.1f} | {r['whole_us_per_msg']:.1f} | "
                     f"{r['window_total_ms']:.1f} | {r['whole_total_ms']:.1f} |")
    table = "\n".join(lines)
    (out / "detok.md").write_text(table + "\n")
    print(table)
    return 0
