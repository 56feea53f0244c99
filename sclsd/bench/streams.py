"""``sclsd-bench streams``: do streams stall? Closed-loop streaming load on a live daemon.

For each configuration a daemon with local CPU workers is started (:func:`sclsd.launch.launch`),
``--concurrency`` clients each keep one streaming completion in flight over the daemon's
Unix socket until ``--num`` requests have been served (a closed loop, as aiperf's
``--concurrency``), and the arrival time of every streamed delta is recorded. The load is
aiperf's synthetic one: prompts of exactly ``--prompt-tokens`` tokens of text, exactly
``--output-tokens`` tokens out (``ignore_eos``), the protocol's default sampling
(temperature 1, as OpenAI clients send it unless told otherwise).

Configurations:

- ``default``: the shipped defaults, nothing set but the model and the number of workers
  (policy ``scls-cb``, S = 128, on the engine ``auto`` picks: ``llama`` for a GGUF such as
  the default model, ``hf-cb`` for a transformers model);
- ``scls``: the paper's static policy as the README used to start it (``--policy scls
  --slice-len 32``, work-conserving rounds and KV reuse on; engine ``llama`` for a GGUF,
  ``hf`` for a transformers model);
- ``ils``: iteration-level scheduling, the paper's ILS baseline (``hf-cb`` workers, each
  request dispatched on arrival, round-robin; as ``sclsd-bench live``).

Reported per configuration (:func:`report`): requests per second and output tokens per
second over the measured run (first request sent to last one done), TTFT p50/p95, the
per-request **maximum inter-token gap** (:func:`sclsd.eval.metrics.max_gap`) at p50, p95,
p99 and its maximum, the streams with a gap over ``--gap-bound`` seconds (a stream the
user sees freeze) with the median of those gaps, and goodput under
:data:`sclsd.eval.metrics.DEFAULT_SLO` (TTFT <= 2 s, no gap over 1 s). ``--warmup``
requests per configuration run first and are not counted.

``--saturate N`` runs N processes that spin on the CPU for the whole run (a machine busy
with other work), and ``--duration S`` keeps the closed loop going for S seconds (prompts
reused) instead of stopping at ``--num``. Each configuration also reports the workers the
daemon dropped (``worker_losses``, with their reasons): a slow machine is no fault, so
the run fails (exit status 1) when a worker was dropped, as when a request was not served.
The daemon runs with its default liveness timings.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from ..client import AsyncClient, Delta, Done, RequestError
from ..eval.metrics import DEFAULT_SLO, SLO, RequestRecord, max_gap, percentile, summarize
from ..launch import launch

CONFIGS = ("default", "scls", "ils")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from worker.main import parse_opt

    p.add_argument("--configs", default=",".join(CONFIGS), help=f"subset of {','.join(CONFIGS)}")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--engine", default="auto",
                   help="workers.engine of the default and scls configurations (auto: the defaults')")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--opt", action="append", type=parse_opt, default=[], metavar="KEY=VALUE",
                   help="[workers.options] KEY = VALUE of the default and scls configurations, as "
                        "sclsd-worker --opt takes it (repeatable)")
    p.add_argument("--num", type=int, default=48, help="measured requests per configuration")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (closed loop)")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0, help="1: the OpenAI clients' default")
    p.add_argument("--slice-len", type=int, default=32, help="S of the static scls configuration")
    p.add_argument("--warmup", type=int, default=2, help="requests served first and not counted")
    p.add_argument("--gap-bound", type=float, default=DEFAULT_SLO.gap_s, help="a stream with a longer gap counts as stalled")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--saturate", type=int, default=0,
                   help="processes spinning on the CPU during the run (other work on the machine)")
    p.add_argument("--duration", type=float, default=0.0,
                   help="seconds to keep the loop going, prompts reused (0: --num requests)")
    p.add_argument("--out", default="out/streams", help="directory for streams.json and streams.md")


def sections(name: str, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The daemon config of configuration ``name`` (the daemon's own liveness timings: a
    busy machine must not make it drop a worker)."""
    out: dict[str, dict[str, Any]] = {
        "daemon": {"drain_timeout_s": 120.0},
        "model": {"name": args.model},
        "workers": {"spawn": args.workers, "threads": args.threads},
    }
    if getattr(args, "engine", "auto") != "auto":
        out["workers"]["engine"] = args.engine
    opts = getattr(args, "opt", None) or []
    if opts and name != "ils":
        out["workers"]["options"] = dict(opts)
    if name == "scls":
        out["scheduler"] = {"policy": "scls", "slice_len": args.slice_len}
    elif name == "ils":
        # Every request to a worker as soon as it arrives, run to its end in the engine's
        # continuous batch (sls with batches of one: no slices, round-robin).
        out["scheduler"] = {"policy": "sls", "batch_size": 1, "gamma_s": 0.05,
                            "work_conserving": False, "kv_reuse": False}
        out["workers"]["engine"] = "hf-cb"
    elif name != "default":
        raise ValueError(f"unknown configuration {name!r}")
    return out


@dataclass
class Stream:
    """One request as its client saw it (times from ``time.monotonic()``)."""

    rid: str
    sent: float
    prompt_tokens: int = 0
    token_times: list[float] = field(default_factory=list)
    """Arrival time of every token (the tokens of one delta share its time)."""
    done: float | None = None
    finish_reason: str | None = None
    completion_tokens: int = 0
    slices: int = 0
    """Slices (grants, under scls-cb) the daemon served it in."""
    worker: str | None = None
    error: str | None = None


def record(s: Stream) -> RequestRecord:
    """The metrics' view of a stream: served when a ``done`` came with stop or length."""
    return RequestRecord(
        rid=s.rid, arrival=s.sent, prompt_len=s.prompt_tokens, output_len=s.completion_tokens,
        first_token=s.token_times[0] if s.token_times else None, finished=s.done,
        finish_reason=s.finish_reason if s.error is None else "error",  # type: ignore[arg-type]
        max_gap_s=max_gap(s.token_times),
    )


def report(streams: list[Stream], gap_bound: float = 1.0, slo: SLO = DEFAULT_SLO) -> dict[str, Any]:
    """The numbers of one run of ``streams`` (see the module docstring)."""
    recs = [record(s) for s in streams]
    summary = summarize(recs, slo=slo)
    done = [r for r in recs if r.completed]
    ttft = [r.first_token - r.arrival for r in done if r.first_token is not None]
    stalls = sorted(r.max_gap_s for r in done if r.max_gap_s is not None and r.max_gap_s > gap_bound)
    return {
        "requests": len(recs),
        "completed": len(done),
        "errors": sum(1 for s in streams if s.error is not None),
        "duration_s": summary["duration_s"],
        "throughput_rps": summary["throughput_rps"],
        "output_tps": summary["output_tps"],
        "p50_ttft_s": percentile(ttft, 50),
        "p95_ttft_s": percentile(ttft, 95),
        "p50_gap_s": summary.get("p50_gap_s", 0.0),
        "p95_gap_s": summary.get("p95_gap_s", 0.0),
        "p99_gap_s": summary.get("p99_gap_s", 0.0),
        "max_gap_s": summary.get("max_gap_s", 0.0),
        "gap_bound_s": gap_bound,
        "stalled_streams": len(stalls),
        "p50_stall_s": percentile(stalls, 50),
        "goodput_rps": summary["goodput_rps"],
    }


def prompts(model: str, n: int, length: int) -> list[list[int]]:
    """``n`` different prompts of exactly ``length`` tokens: windows into the demo prompts'
    text, tokenized as the daemon does (aiperf's synthetic prompts are corpus text too)."""
    from ..defaults import force_offline
    from ..tokenizer import load

    force_offline()
    text = resources.files("sclsd").joinpath("data/prompts.txt").read_text()
    corpus = load(model).encode(" ".join(text.split()))
    while len(corpus) < 2 * length:
        corpus += corpus
    # A step that is no divisor of the corpus length, so that no two windows are the same.
    step = 37
    return [[corpus[(i * step + j) % len(corpus)] for j in range(length)] for i in range(n)]


async def drive(sock: str, name: str, work: list[list[int]], args: argparse.Namespace,
                progress: bool = True, warmup: bool = False) -> list[Stream]:
    """Serve every prompt of ``work``, ``args.concurrency`` at a time, streaming (with
    ``--duration``, again and again until it is up; a ``warmup`` serves them once, showing
    its progress too); the streams in the order sent."""
    streams: list[Stream] = []
    t0 = time.monotonic()
    duration = 0.0 if warmup else getattr(args, "duration", 0.0)
    todo: Iterator[tuple[int, list[int]]] = iter(enumerate(work))
    if duration > 0:  # prompts reused until the time is up
        todo = ((i, work[i % len(work)]) for i in range(10**9))
    state = {"done": 0, "stalled": 0, "shown": t0}

    def show(final: bool = False) -> None:
        now = time.monotonic()
        if progress and (final or now - state["shown"] >= 15.0):
            state["shown"] = now
            total = f"{now - t0:.0f}/{duration:.0f}s" if duration > 0 else f"{len(work)}"
            print(f"  [{name}] {state['done']}/{total} done, {state['stalled']} with a gap "
                  f"> {args.gap_bound:g}s ({now - t0:.0f}s)", file=sys.stderr, flush=True)

    async with AsyncClient(sock) as client:

        async def one(i: int, ids: list[int]) -> None:
            s = Stream(rid=f"{name}-{i}", sent=time.monotonic(), prompt_tokens=len(ids))
            streams.append(s)

            async def consume() -> None:
                async for ev in client.stream(prompt_ids=ids, id=s.rid, max_tokens=args.output_tokens,
                                              ignore_eos=True, temperature=args.temperature):
                    now = time.monotonic()
                    if isinstance(ev, Delta):
                        s.token_times += [now] * len(ev.token_ids)
                    elif isinstance(ev, Done):
                        s.done, s.finish_reason = now, ev.finish_reason
                        s.completion_tokens = ev.usage.completion_tokens
                        s.slices, s.worker = ev.timings.slices, ev.worker

            try:
                await asyncio.wait_for(consume(), args.timeout)
            except (RequestError, asyncio.TimeoutError) as exc:
                s.error = str(exc) or type(exc).__name__
            state["done"] += 1
            gap = max_gap(s.token_times)
            state["stalled"] += gap is not None and gap > args.gap_bound
            show()

        async def client_loop() -> None:
            for i, ids in todo:  # one shared iterator: each client takes the next request
                if duration > 0 and time.monotonic() - t0 >= duration:
                    return
                await one(i, ids)

        await asyncio.gather(*(client_loop() for _ in range(args.concurrency)))
    show(final=True)
    return sorted(streams, key=lambda s: s.sent)


@contextlib.contextmanager
def saturated(n: int) -> Iterator[None]:
    """``n`` processes spinning on the CPU meanwhile (each ends by itself after a day, should
    this process die without stopping them)."""
    spin = "import time\nend = time.monotonic() + 86400\nwhile time.monotonic() < end: pass\n"
    procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def run_config(name: str, args: argparse.Namespace, work: list[list[int]]) -> dict[str, Any]:
    """Start the daemon of ``name``, warm it up, measure, stop it; the report with the config."""
    cfg = sections(name, args)
    busy = getattr(args, "saturate", 0)
    print(f"== {name}: starting sclsd with {args.workers} workers ({cfg.get('scheduler') or 'defaults'})"
          + (f", {busy} processes spinning on {os.cpu_count()} cores" if busy else ""),
          file=sys.stderr, flush=True)
    with saturated(busy), launch(cfg) as d:
        d.wait_workers(args.workers, timeout=600, progress=True)
        st = d.status()
        engines = sorted({w.engine for w in st.workers})
        if args.warmup:
            asyncio.run(drive(d.sock, f"{name}-warmup", work[: args.warmup], args, warmup=True))
        streams = asyncio.run(drive(d.sock, name, work[args.warmup:], args))
        end = d.status()
        counters = dict(end.counters)
    losses: dict[str, dict[str, Any]] = {
        wl.id: {"count": wl.count, "by_reason": dict(wl.by_reason), "last": wl.last_why}
        for wl in end.worker_losses}
    if losses:
        print(f"  [{name}] workers dropped: {losses}", file=sys.stderr, flush=True)
    out = report(streams, gap_bound=args.gap_bound)
    out.update(config=name, policy=st.policy, slice_len=st.slice_len, engine=",".join(engines),
               saturate=busy, workers_dropped=sum(wl.count for wl in end.worker_losses), worker_losses=losses,
               counters=counters, streams=[asdict(s) for s in streams])
    return out


def markdown(rows: list[dict[str, Any]]) -> str:
    """The table of docs/benchmarks.md."""
    cols = [("config", "config"), ("policy", "policy"), ("engine", "engine"), ("completed", "done"),
            ("throughput_rps", "req/s"), ("output_tps", "out tok/s"), ("p50_ttft_s", "TTFT p50 s"),
            ("p95_ttft_s", "TTFT p95 s"), ("p50_gap_s", "max gap p50 s"), ("p95_gap_s", "p95 s"),
            ("p99_gap_s", "p99 s"), ("max_gap_s", "max s"), ("stalled_streams", "streams gap > 1 s"),
            ("p50_stall_s", "their median gap s"), ("goodput_rps", "goodput req/s"),
            ("workers_dropped", "workers dropped")]
    lines = ["| " + " | ".join(h for _, h in cols) + " |",
             "|" + "|".join("---" if k in ("config", "policy", "engine") else "---:" for k, _ in cols) + "|"]
    for r in rows:
        cells = []
        for k, _ in cols:
            v = r.get(k)
            if k == "policy" and r.get("slice_len"):
                v = f"{v} (S={r['slice_len']})"
            if k == "stalled_streams":
                v = f"{v} of {r['completed']}"
            cells.append("-" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    configs = [c for c in args.configs.split(",") if c]
    bad = [c for c in configs if c not in CONFIGS]
    if bad or args.num < 1 or args.concurrency < 1 or args.warmup < 0:
        print(f"sclsd-bench streams: configs must be of {','.join(CONFIGS)} (got {bad or configs}); "
              "--num and --concurrency >= 1, --warmup >= 0", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"streams: {args.num} requests of {args.prompt_tokens} -> {args.output_tokens} tokens, "
          f"concurrency {args.concurrency}, temperature {args.temperature:g}, on {args.workers} workers; "
          f"configs {', '.join(configs)}", file=sys.stderr, flush=True)
    work = prompts(args.model, args.warmup + args.num, args.prompt_tokens)
    rows = [run_config(name, args, work) for name in configs]
    (out / "streams.json").write_text(json.dumps(rows, indent=1))
    table = markdown(rows)
    (out / "streams.md").write_text(table + "\n")
    print(table)
    return 0 if all(r["completed"] == r["requests"] and not r["workers_dropped"] for r in rows) else 1
