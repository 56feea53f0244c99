"""``sclsd-bench arena-grants``: ``hf-static-cb`` serving many requests through the worker's own
loop, in slice grants or whole, without a daemon: what grant boundaries cost the engine.

::

    sclsd-bench arena-grants [--model tiny-random] [--device cpu] [--requests 120] [--slice 16]
                             [--graph-like] [--seed 0] [--out DIR]

``--requests`` requests of random lengths (prompts and outputs of 8 to 95 tokens, from
``--seed``), greedy, EOS ignored, all queued at once, are served twice on one engine:

- ``grants``: each request in grants of ``--slice`` tokens, its next grant queued the moment
  one ends, its KV kept (``scls-cb`` on a worker with room for every grant);
- ``whole``: one grant per request (``ils``).

For each: decode steps, running rows per step on average, turns that prefilled newcomers,
CPU and wall seconds, and the engine's account of rows (resumed in place, copied in from its
store, spilled, moved between slots). The tokens of both are checked equal. ``--graph-like``
runs the engine in bucket shapes (batch buckets up to 128, cache buckets of 128 and 256) with
the CUDA pipeline (the next step queued before a step's tokens are read), as it runs on a card,
also on the CPU. Writes ``arena-grants.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import queue
import random
import sys
import time
from pathlib import Path
from typing import Any

#: Lengths of prompts and outputs: uniform in [LO, HI).
LO, HI = 8, 96


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-random", help="model (default tiny-random: the engine's own costs show)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--slice", type=int, default=16, help="tokens per grant in the grants run")
    p.add_argument("--graph-like", action="store_true", help="bucket shapes and the CUDA pipeline, as on a card")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="out/arena-grants")


def serve_all(engine: Any, reqs: dict[str, tuple[list[int], int]], slice_len: int | None) -> dict[str, Any]:
    """Serve ``reqs`` (rid -> (prompt, output tokens)) through :func:`worker.serve.drive`, in
    grants of ``slice_len`` tokens (None: whole); the figures and each request's tokens."""
    from sclsd.protocol import BatchMsg, BatchRequest
    from worker.engines.base import BatchDone, BatchFailed, Event
    from worker.serve import NOTHING, drive

    got: dict[str, list[int]] = {rid: [] for rid in reqs}
    q: queue.Queue[Any] = queue.Queue()
    bids = itertools.count(1)
    left = [len(reqs)]

    def put(rid: str) -> None:
        ctx, total = reqs[rid]
        done = got[rid]
        r = BatchRequest(rid=rid, token_ids=ctx + done, max_new_tokens=total - len(done), generated=len(done),
                         temperature=0.0, ignore_eos=True)
        q.put(BatchMsg(batch_id=next(bids), slice_len=slice_len or total, requests=[r], kv_reuse=slice_len is not None))

    def take(timeout: float | None) -> Any:
        try:
            return q.get(timeout=timeout) if timeout != 0.0 else q.get_nowait()
        except queue.Empty:
            return NOTHING

    def on_event(ev: Event) -> None:
        if isinstance(ev, BatchFailed):
            raise RuntimeError(ev.error)
        if isinstance(ev, BatchDone):
            (out,) = ev.outputs
            got[out.rid] += out.token_ids
            if len(got[out.rid]) < reqs[out.rid][1]:
                put(out.rid)
            else:
                left[0] -= 1
                if left[0] == 0:
                    q.put(None)

    for rid in reqs:
        put(rid)
    steps0, rows0, counts0 = engine.rows.tally.steps, engine.rows.tally.rows, dict(engine.rows.counts)
    c0, w0 = time.process_time(), time.perf_counter()
    drive(engine, take, on_event)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    steps = engine.rows.tally.steps - steps0
    counts = {k: v - counts0.get(k, 0) for k, v in engine.rows.counts.items()}
    return {"steps": steps, "rows_per_step": round((engine.rows.tally.rows - rows0) / max(1, steps), 2),
            "prefill_turns": counts.pop("prefills"), "rows": counts, "cpu_s": round(cpu, 3),
            "wall_s": round(wall, 3), "tokens": sum(map(len, got.values())), "outputs": got}


def run(args: argparse.Namespace) -> int:
    from worker.engines import create_engine

    opts: dict[str, Any] = {}
    if args.graph_like:
        opts = {"static_buckets": True, "graph_batch_sizes": "1,2,4,8,16,32,64,128", "graph_cache_tokens": "128,256"}
    engine: Any = create_engine("hf-static-cb", args.model, device=args.device, threads=1, **opts)
    engine.warm_up()
    if args.graph_like:
        engine.read_behind = True
    rng = random.Random(args.seed)
    reqs = {f"r{i}": ([rng.randrange(3, 30000) for _ in range(rng.randrange(LO, HI))], rng.randrange(LO, HI))
            for i in range(args.requests)}
    report: dict[str, Any] = {"model": args.model, "device": args.device, "requests": args.requests,
                              "slice": args.slice, "graph_like": args.graph_like}
    outputs = {}
    for name, s in (("grants", args.slice), ("whole", None)):
        print(f"arena-grants: serving {args.requests} requests {name} ...", file=sys.stderr, flush=True)
        r = serve_all(engine, reqs, s)
        outputs[name] = r.pop("outputs")
        report[name] = r
        print(f"  {name}: {r['tokens']} tokens in {r['steps']} steps of {r['rows_per_step']} rows, "
              f"{r['prefill_turns']} prefill turns, rows {r['rows']}, CPU {r['cpu_s']} s, wall {r['wall_s']} s")
    report["same_tokens"] = outputs["grants"] == outputs["whole"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "arena-grants.json").write_text(json.dumps(report, indent=1))
    print(f"  the same tokens in grants and whole: {report['same_tokens']}")
    engine.close()
    return 0 if report["same_tokens"] else 1
