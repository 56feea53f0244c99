"""``sclsd-bench sampling``: what picking sampled tokens costs a CPU decode step.

A CPU engine (``llama`` on the default model, by default) serves the same rows of real chat
prompts greedily and then sampled at each ``--temperatures`` with ``--top-p`` (seeded, as a
client's ``temperature``/``top_p``), and reports the process's CPU milliseconds per decode step
(the prefill left out: from when every row has its first token) and what the picks' nucleus
cut needed: rows cut from their most likely tokens, and rows sorted in full
(:func:`worker.engines.sampling.filter_logits`). The rows' prompts are real text because a
nucleus follows the model's certainty: random token ids make a small model unsure of
everything, and its nucleus at top-p 0.95 spans most of the vocabulary.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from .. import models
from .engine import _serve_call

#: The rows' requests: chat turns of the kinds a demo or a load generator sends.
PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how photosynthesis works in simple terms.",
    "What are the main causes of the French Revolution?",
    "Give me three tips for learning a new language.",
    "Describe the city of Paris in the spring.",
    "How does a compiler turn source code into machine code?",
    "Write a poem about the sea at night.",
    "List some healthy breakfast ideas and why they are good.",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", default="llama", help="a CPU engine (llama, hf, hf-static-cb, hf-cb)")
    p.add_argument("--model", default=models.DEFAULT_MODEL, help="model spec (default: the embedded model)")
    p.add_argument("--rows", type=int, default=8, help="rows served together (prompts cycled)")
    p.add_argument("--gen", type=int, default=64, help="new tokens per row")
    p.add_argument("--temperatures", default="0,0.7,1.0", help="comma list; 0 is greedy")
    p.add_argument("--top-p", type=float, default=0.95, help="the sampled rows' top_p")
    p.add_argument("--threads", type=int, default=1, help="the engine's threads")
    p.add_argument("--rounds", type=int, default=2, help="serve each setting this many times, keep the fastest")
    p.add_argument("--out", default="out/sampling", help="directory for sampling.json")


class CutCounter:
    """Counts what :func:`~worker.engines.sampling.filter_logits`' nucleus cuts needed, by
    wrapping the module's two cuts while it is installed."""

    def __init__(self) -> None:
        self.candidates = 0
        """Row cuts tried from a row's most likely tokens (a row may need a wider try)."""
        self.sorted_rows = 0
        """Rows sorted in full."""

    def __enter__(self) -> CutCounter:
        import worker.engines.sampling as s

        self._saved = (s._top_floor, s._cut_sorted)
        top, full = self._saved

        def counted_top(x: Any, *a: Any) -> Any:
            self.candidates += int(x.shape[0])
            return top(x, *a)

        def counted_sorted(x: Any, *a: Any) -> Any:
            self.sorted_rows += int(x.shape[0])
            return full(x, *a)

        s._top_floor, s._cut_sorted = counted_top, counted_sorted  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        import worker.engines.sampling as s

        s._top_floor, s._cut_sorted = self._saved


def _batch(bid: int, prompts: list[list[int]], rows: int, gen: int, temperature: float, top_p: float) -> Any:
    from ..protocol import BatchMsg, BatchRequest

    reqs = [BatchRequest(rid=f"{bid}-{i}", token_ids=list(prompts[i % len(prompts)]), max_new_tokens=gen,
                         ignore_eos=True, temperature=temperature, top_p=top_p if temperature > 0 else 1.0,
                         seed=i if temperature > 0 else None)
            for i in range(rows)]
    return BatchMsg(batch_id=bid, slice_len=gen, requests=reqs, kv_reuse=False)


def run(args: argparse.Namespace) -> int:
    from worker.engines import create_engine

    from ..tokenizer import load

    try:
        temps = [float(t) for t in args.temperatures.split(",") if t.strip()]
    except ValueError:
        print(f"sclsd-bench sampling: --temperatures {args.temperatures!r}: not numbers", file=sys.stderr)
        return 2
    if not temps or min(temps) < 0 or args.rows < 1 or args.gen < 2 or not 0 < args.top_p <= 1:
        print("sclsd-bench sampling: need temperatures >= 0, --rows >= 1, --gen >= 2, 0 < --top-p <= 1",
              file=sys.stderr)
        return 2
    tok = load(args.model)
    prompts = [tok.encode_chat([{"role": "user", "content": t}]) for t in PROMPTS]
    print(f"sampling: {args.engine} on {args.model}, {args.rows} rows x {args.gen} tokens, "
          f"{args.threads} thread(s) ...", file=sys.stderr, flush=True)
    engine: Any = create_engine(args.engine, args.model, threads=args.threads)
    engine.warm_up(lambda step: None)
    results: list[dict[str, Any]] = []
    bid = 0
    try:
        for temp in temps:
            best: dict[str, Any] | None = None
            for _ in range(max(1, args.rounds)):
                bid += 1
                cpu: list[float] = []
                with CutCounter() as cuts:
                    _, wall = _serve_call(engine, _batch(bid, prompts, args.rows, args.gen, temp, args.top_p), cpu)
                row = {"temperature": temp, "top_p": args.top_p if temp > 0 else 1.0,
                       "cpu_ms_per_step": round(cpu[0], 2), "ms_per_step": round(wall, 2),
                       "rows_cut_from_candidates": cuts.candidates, "rows_sorted_in_full": cuts.sorted_rows}
                if best is None or row["cpu_ms_per_step"] < best["cpu_ms_per_step"]:
                    best = row
            assert best is not None
            results.append(best)
            print(f"  temperature {temp:g}: {best['cpu_ms_per_step']:.1f} CPU ms a step; nucleus cuts from the "
                  f"candidates {best['rows_cut_from_candidates']}, rows sorted in full {best['rows_sorted_in_full']}",
                  file=sys.stderr, flush=True)
    finally:
        engine.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"engine": args.engine, "model": args.model, "rows": args.rows, "gen": args.gen, "threads": args.threads,
           "when": time.strftime("%Y-%m-%d %H:%M:%S"), "results": results}
    (out / "sampling.json").write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc))
    return 0
