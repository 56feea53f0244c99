"""``sclsd-bench engine``: what one decode step costs in each engine, cold and warm.

::

    sclsd-bench engine [--engines hf,hf-eager,hf-static-cb,hf-cb,deepspeed,generate] [--device auto]
                       [--model auto] [--shapes 1x128,16x128,32x256] [--gen 64] [--out DIR]

For every engine variant and shape ``N x P`` (N rows of P-token prompts, ``--gen`` new
tokens, greedy, EOS ignored) one batch is served twice: the first call of the shape
(cold) and the second (warm). Reported per call, from the engine's streamed tokens:
the prefill, until every row has its first token, and the decode step, the rest of the
call divided by the ``gen - 1`` steps after it (in ms). Each variant's decode graphs kept after
its warm-up check are printed and written; a variant that asked for graphs and kept none is
an error (exit status 1): its timings would be the eager step's. Timing the stream rather than
the engine's own stats treats every engine alike: continuous batching (``hf-cb``)
interleaves prefill and decode and reports one wall time. Each variant runs in a process of its own
(so a GPU's memory is given back between them), after the engine's warm-up, as a worker
would serve. Variants:

- ``hf``: the engine as a worker runs it (on CUDA: static cache, captured decode graphs);
- ``hf-eager``: ``hf`` with ``static_cache = false`` (transformers' DynamicCache, eager);
- ``hf-static``: the static cache without graphs (what the CPU can check of the graph path);
- ``hf-cb``, ``hf-static-cb``, ``deepspeed``: those engines with their defaults;
- ``generate``: transformers' own ``generate`` with ``cache_implementation="static"``
  (on CUDA it compiles the forward and captures graphs itself): the in-library reference;
- ``llama``: the llama engine (llama.cpp on the CPU, a GGUF model);
- ``llama-loop``: llama.cpp's own greedy loop through the same binding, without sclsd: the
  N rows' prompts, then one ``llama_decode`` of every row's next token per step, each the
  argmax of its logits (the reference the ``llama`` engine is measured against).

The bandwidth floor of a decode step (the weights read once per step) is computed
from the card's memory bandwidth and the model's size where both are known.
Writes ``engine.json`` and ``engine.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..defaults import offline_env

#: Variant -> (engine, constructor options).
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "hf": ("hf", {}),
    "hf-eager": ("hf", {"static_cache": False}),
    "hf-static": ("hf", {"static_cache": True, "cuda_graphs": False}),
    "hf-cb": ("hf-cb", {}),
    "hf-static-cb": ("hf-static-cb", {}),
    "deepspeed": ("deepspeed", {}),
    "generate": ("hf", {"static_cache": False, "kv_reuse": False}),
    "llama": ("llama", {}),
    "llama-loop": ("llama", {}),
}
#: Memory bandwidth in bytes/s of cards whose torch properties do not say.
KNOWN_BANDWIDTH = {"H100 80GB HBM3": 3.35e12, "H100": 3.35e12, "H200": 4.8e12, "A100-SXM4-80GB": 2.04e12,
                   "A100": 1.55e12, "L40S": 0.864e12}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engines", default="", help="variants (default: hf,hf-eager,hf-static-cb,hf-cb,deepspeed,"
                   "generate on CUDA; hf,hf-static,hf-static-cb,hf-cb,generate,llama,llama-loop on the CPU)")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda or cpu")
    p.add_argument("--model", default="auto", help="model spec; auto: the largest random Llama that fits "
                   "the card (gpu-check's choice), tiny-random on the CPU")
    p.add_argument("--dtype", default="auto", help="auto: float16 on CUDA, float32 on the CPU")
    p.add_argument("--shapes", default="", help="N x P list (default 1x128,16x128,32x256,64x256 on CUDA; "
                   "1x16,8x32,32x64 on the CPU)")
    p.add_argument("--gen", type=int, default=0, help="new tokens per row (0: 64 on CUDA, 16 on the CPU)")
    p.add_argument("--threads", type=int, default=1, help="threads on the CPU (torch's, llama.cpp's)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every variant this many times in turn and keep each cell's fastest (a machine "
                        "whose cores other jobs share)")
    p.add_argument("--out", default="out/engine", help="directory for engine.json and engine.md")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)


#: A shape's prompts: every row ``P`` tokens, or ``"A-B"``: rows from ``A`` to ``B`` tokens,
#: evenly spread (:func:`prompt_lens`), as rows of many lengths share a step at saturation.
Prompts = int | str


def parse_shapes(text: str) -> list[tuple[int, Prompts]]:
    """``"1x128,16x128,32x128-1024"`` -> ``[(1, 128), (16, 128), (32, "128-1024")]``."""
    out: list[tuple[int, Prompts]] = []
    for part in (p for p in text.replace(" ", "").split(",") if p):
        n, _, p = part.lower().partition("x")
        lo, dash, hi = p.partition("-")
        try:
            rows, lens = int(n), (int(lo), int(hi) if dash else int(lo))
        except ValueError:
            raise SystemExit(f"sclsd-bench engine: --shapes: {part!r} is not NxP or NxA-B") from None
        if min(rows, *lens) < 1 or lens[0] > lens[1]:
            raise SystemExit(f"sclsd-bench engine: --shapes: {part!r} must be positive, A <= B")
        out.append((rows, f"{lens[0]}-{lens[1]}" if dash else lens[0]))
    return out


def prompt_lens(n: int, p: Prompts) -> list[int]:
    """Each row's prompt length in a shape of ``n`` rows (``"A-B"``: A to B, evenly spread)."""
    if isinstance(p, int):
        return [p] * n
    lo, hi = (int(x) for x in p.split("-"))
    return [lo + (hi - lo) * i // max(1, n - 1) for i in range(n)]


def widest(p: Prompts) -> int:
    """The longest prompt of a shape."""
    return p if isinstance(p, int) else int(p.split("-")[1])


# --------------------------------------------------------------------------- the child


def _batch(bid: int, n: int, p: Prompts, gen: int, vocab: int) -> Any:
    import random

    from ..protocol import BatchMsg, BatchRequest

    rng = random.Random(bid)
    reqs = [BatchRequest(rid=f"{bid}-{i}", token_ids=[rng.randrange(3, vocab) for _ in range(length)],
                         max_new_tokens=gen, temperature=0.0, ignore_eos=True)
            for i, length in enumerate(prompt_lens(n, p))]
    return BatchMsg(batch_id=bid, slice_len=gen, requests=reqs, kv_reuse=False)


def _generate_call(engine: Any, n: int, p: Prompts, gen: int, bid: int) -> tuple[float, float]:
    """transformers' generate with a static cache: (prefill s, decode ms/step), the prefill
    taken as a 1-token generate of the same shape (prompts of one length: ``NxP``)."""
    import random

    import torch

    if not isinstance(p, int):
        raise ValueError(f"generate takes prompts of one length (NxP), not {p}")

    rng = random.Random(bid)
    vocab = min(int(engine.config.vocab_size), 32000)
    ids = torch.tensor([[rng.randrange(3, vocab) for _ in range(p)] for _ in range(n)], device=engine.device)
    mask = torch.ones_like(ids)

    def timed(new: int) -> float:
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
        t = time.perf_counter()
        with torch.inference_mode():
            engine.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                  do_sample=False, cache_implementation="static", pad_token_id=engine.pad_id)
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
        return time.perf_counter() - t

    prefill = timed(1)
    whole = timed(gen)
    return prefill, 1000 * max(0.0, whole - prefill) / max(1, gen - 1)


def _loop_call(engine: Any, batch: Any, cpu: list[float] | None = None) -> tuple[float, float]:
    """llama.cpp's own greedy loop over ``batch``'s rows in the llama engine's (idle) context:
    (prefill s, decode ms/step), the prefill until every row has its first token; ``cpu``
    (given) gets the process's CPU ms per decode step, as :func:`_serve_call`'s."""
    from worker.engines.llama_lib import Batch, prefill_seq

    ctx, reqs, gen = engine.ctx, batch.requests, batch.slice_len
    b = Batch(ctx.api, engine.batch_tokens)
    t0 = time.perf_counter()
    last: list[int] = []
    for seq, r in enumerate(reqs):
        prefill_seq(ctx, b, list(r.token_ids), seq)
        last.append(int(ctx.logits(1)[0].argmax()))
    t1, c1 = time.perf_counter(), time.process_time()
    for step in range(gen - 1):
        b.clear()
        for seq, r in enumerate(reqs):
            b.add([last[seq]], seq, len(r.token_ids) + step, True)
        if ctx.decode(b) != 0:
            raise RuntimeError("the context is full")
        last = [int(t) for t in ctx.logits(len(reqs)).argmax(axis=1)]
    end = time.perf_counter()
    if cpu is not None:
        cpu.append(1000 * (time.process_time() - c1) / max(1, gen - 1))
    for seq in range(len(reqs)):
        ctx.seq_rm(seq)
    return t1 - t0, 1000 * (end - t1) / max(1, gen - 1)


def _serve_call(engine: Any, batch: Any, cpu: list[float] | None = None) -> tuple[float, float]:
    """(prefill s, decode ms/step) of one served batch, from when its tokens stream out;
    ``cpu`` (given) gets the process's CPU ms per decode step too (every thread of it: on a
    machine whose cores other jobs share, the work of a step rather than its wait)."""
    rows = len(batch.requests)
    gen = batch.slice_len
    seen: set[str] = set()
    first: list[tuple[float, float]] = []

    def emit(outputs: list[Any]) -> None:
        for o in outputs:
            if o.token_ids:
                seen.add(o.rid)
        if not first and len(seen) == rows:
            first.append((time.perf_counter(), time.process_time()))

    t0 = time.perf_counter()
    outs, _ = engine.serve(batch, emit)
    end, cpu_end = time.perf_counter(), time.process_time()
    if any(len(o.token_ids) != gen for o in outs):
        raise RuntimeError(f"rows generated {[len(o.token_ids) for o in outs]} tokens, not {gen}")
    t1, c1 = first[0] if first else (end, cpu_end)
    if cpu is not None:
        cpu.append(1000 * (cpu_end - c1) / max(1, gen - 1))
    return t1 - t0, 1000 * (end - t1) / max(1, gen - 1)


def graph_facts(engine: Any) -> dict[str, Any]:
    """Which decode graphs the engine's static path asked for and kept after its warm-up
    check: ``graphs_requested`` and ``graphs_kept`` (``[batch, cache]`` buckets); nothing for
    an engine without one."""
    static = getattr(engine, "static", None)
    if static is None:
        return {}
    return {"graphs_requested": bool(static.graphs_requested), "graphs_kept": [list(b) for b in static.captured()]}


def graph_problem(row: dict[str, Any]) -> str | None:
    """What is wrong with a variant's graphs, from its first line: graphs asked for and none
    kept (every decode step then runs eagerly, and its timings are not the graphed ones)."""
    if row.get("graphs_requested") and not row.get("graphs_kept"):
        return (f"{row['variant']}: CUDA graphs were requested but none was kept after the warm-up check "
                "(decode ran eagerly; see the worker's warnings)")
    return None


def child(args: argparse.Namespace) -> int:
    """Run one variant over every shape; one JSON line per call on stdout."""
    from worker.engines import create_engine

    name = args.child
    engine_name, opts = VARIANTS[name]
    opts = dict(opts)
    if args.device == "cpu":
        opts["threads"] = args.threads
    if engine_name not in ("fake", "llama"):  # llama runs the GGUF's weights as they are
        opts["dtype"] = args.dtype
    t0 = time.perf_counter()
    engine: Any = create_engine(engine_name, args.model, device=args.device, **opts)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.warm_up(lambda step: print(step, file=sys.stderr, flush=True))
    print(json.dumps({"variant": name, "load_s": round(load_s, 2), "warm_up_s": round(time.perf_counter() - t0, 2),
                      **graph_facts(engine)}), flush=True)
    vocab = min(int(engine.info().vocab_size), 32000)
    bid = 0
    try:
        for n, p in parse_shapes(args.shapes):
            for call in ("cold", "warm"):
                bid += 1
                row: dict[str, Any] = {"variant": name, "n": n, "p": p, "gen": args.gen, "call": call}
                try:
                    if name == "generate":
                        row["prefill_s"], row["ms_per_step"] = _generate_call(engine, n, p, args.gen, bid)
                    else:
                        cpu: list[float] = []
                        call_fn = _loop_call if name == "llama-loop" else _serve_call
                        row["prefill_s"], row["ms_per_step"] = call_fn(engine, _batch(bid, n, p, args.gen, vocab),
                                                                       cpu if args.device == "cpu" else None)
                        if cpu:
                            row["cpu_ms_per_step"] = cpu[0]
                except Exception as exc:  # noqa: BLE001 - a failing shape is a result, not a crash
                    row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                print(json.dumps(row), flush=True)
    finally:
        engine.close()
    return 0


# --------------------------------------------------------------------------- the parent


def bandwidth_floor_ms(facts: dict[str, Any], model: str, dtype: str) -> float | None:
    """Milliseconds to read the model's weights once at the card's memory bandwidth."""
    from .. import models
    from .gpu_check import param_count

    bw = facts.get("bandwidth") or KNOWN_BANDWIDTH.get(str(facts.get("gpu", "")).replace("NVIDIA ", ""))
    if not bw:
        return None
    try:
        weights = param_count(models.load_config(model)) * models.dtype_bytes(dtype)
    except Exception:  # noqa: BLE001 - an unknown architecture has no floor to show
        return None
    return 1000 * weights / bw


def markdown(rows: list[dict[str, Any]], floor_ms: float | None, key: str = "ms_per_step") -> str:
    """The table of ``key`` (ms per decode step, or the CPU ms of it) per variant and shape,
    cold / warm, each the fastest of its rounds."""
    shapes = sorted({(r["n"], r["p"]) for r in rows if "n" in r})
    unit = "CPU ms" if key == "cpu_ms_per_step" else "ms"
    head = "| variant | " + " | ".join(f"N={n}, P={p} cold / warm {unit}" for n, p in shapes) + " |"
    lines = [head, "|---|" + "---:|" * len(shapes)]
    for v in dict.fromkeys(r["variant"] for r in rows if "n" in r):
        cells = []
        for n, p in shapes:
            parts = []
            for c in ("cold", "warm"):
                got = [r for r in rows if r["variant"] == v and r.get("n") == n and r.get("p") == p
                       and r.get("call") == c]
                ok = [r[key] for r in got if key in r]
                parts.append(f"{min(ok):.1f}" if ok else "err" if got else "-")  # the fastest round
            cells.append(" / ".join(parts))
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    if floor_ms is not None:
        lines.append("| bandwidth floor | " + " | ".join(f"{floor_ms:.1f}" for _ in shapes) + " |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.child:
        return child(args)
    from .gpu_check import choose_model, device_facts

    facts = device_facts(args.device)
    gpu = facts["device"] == "cuda"
    device = args.device if args.device.startswith("cuda") else facts["device"]
    model = args.model if args.model != "auto" else (choose_model(facts["mem_total"]) if gpu else "tiny-random")
    dtype = args.dtype if args.dtype != "auto" else ("float16" if gpu else "float32")
    variants = [v for v in (args.engines or ("hf,hf-eager,hf-static-cb,hf-cb,deepspeed,generate" if gpu else
                                            "hf,hf-static,hf-static-cb,hf-cb,generate,llama,llama-loop")).split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        print(f"sclsd-bench engine: unknown variant {bad}; choose from {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    shapes = args.shapes or ("1x128,16x128,32x256,64x256" if gpu else "1x16,8x32,32x64")
    parse_shapes(shapes)
    gen = args.gen or (64 if gpu else 16)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    rc = 0
    rounds = max(1, getattr(args, "rounds", 1))
    for rnd, v in ((r, v) for r in range(rounds) for v in variants):
        print(f"== {v}: {model} ({dtype}) on {device}" + (f", round {rnd + 1}/{rounds}" if rounds > 1 else ""),
              file=sys.stderr, flush=True)
        cmd = [sys.executable, "-m", "sclsd.bench.cli", "engine", "--child", v, "--model", model, "--device",
               device, "--dtype", dtype, "--shapes", shapes, "--gen", str(gen), "--threads", str(args.threads)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=offline_env())
        assert proc.stdout is not None
        for line in proc.stdout:
            row = {**json.loads(line), "round": rnd}
            rows.append(row)
            if "graphs_kept" in row:
                kept = row["graphs_kept"]
                print(f"   graphs kept: {len(kept)}" + (f" (batch, cache: {kept})" if kept else ""),
                      file=sys.stderr, flush=True)
                if problem := graph_problem(row):
                    rc = 1
                    print(f"   ERROR {problem}", file=sys.stderr, flush=True)
            if "n" in row:
                what = row.get("error") or f"prefill {row['prefill_s']:.3f} s, {row['ms_per_step']:.1f} ms/step"
                print(f"   N={row['n']} P={row['p']} {row['call']}: {what}", file=sys.stderr, flush=True)
        if proc.wait() != 0:
            rc = 1
            rows.append({"variant": v, "error": f"exit status {proc.returncode}"})
            print(f"   {v} failed (exit status {proc.returncode})", file=sys.stderr, flush=True)
    floor = bandwidth_floor_ms(facts, model, dtype) if gpu else None
    table = markdown(rows, floor)
    if any("cpu_ms_per_step" in r for r in rows):
        table += ("\n\nThe process's CPU time per decode step (all its threads; the work of a step, whatever "
                  "else the cores ran):\n\n" + markdown(rows, None, "cpu_ms_per_step"))
    weights = f"in {dtype}" if not all(v.startswith("llama") for v in variants) else "as its GGUF ships it"
    if any(v.startswith("llama") for v in variants) and weights.startswith("in "):
        weights += " (llama variants: as its GGUF ships it)"
    header = (f"`{model}` {weights} on {facts.get('gpu') or 'the CPU'}; prefill until every row streamed "
              f"its first token, then ms per step over the other {gen - 1} of {gen} new tokens; cold "
              f"(first call of the shape) / warm (second)"
              + (f", each the fastest of {rounds} rounds." if rounds > 1 else "."))
    graphs = list(dict.fromkeys(f"{r['variant']}: {len(r['graphs_kept'])} decode graphs kept"
                                for r in rows if "graphs_kept" in r))
    problems = [p for p in (graph_problem(r) for r in rows) if p]
    if graphs:
        header += " " + "; ".join(graphs) + "."
    if problems:
        header += "\n\n**" + " ".join(f"ERROR {p}." for p in problems) + "**"
    (out / "engine.md").write_text(header + "\n\n" + table + "\n")
    (out / "engine.json").write_text(json.dumps({"model": model, "dtype": dtype, "device": device, "facts": facts,
                                                 "gen": gen, "floor_ms": floor, "rows": rows}, indent=2) + "\n")
    print(header + "\n\n" + table)
    return rc
