"""``sclsd-bench cpu``: sclsd on a CPU beside llama.cpp's own greedy loop, in one run.

::

    sclsd-bench cpu [--model smollm2-135m-instruct] [--workers 2] [--threads 1] [--engine auto]
                    [--streams 8] [--output-tokens 64] [--runs 3] [--out out/cpu]

1. **The library's loop** (a child process, before sclsd starts and again after it
   stopped): llama.cpp's greedy decoding of one row on one thread through the same binding
   the engine uses (:func:`worker.engines.llama_lib.greedy_loop`; its prompt in decodes as
   large as the engine's warm-up check allows on this CPU), the chat prompt below tokenized
   as the daemon does, ``--output-tokens`` tokens, the best of ``--runs`` runs each time:
   its decode rate (tokens after the first per second) is the reference.
2. **sclsd** with its defaults for the model (``[workers] engine = "auto"``: ``llama`` for the
   GGUF on the CPU; ``--workers`` of ``--threads`` threads) and ``sclsd-http`` in front, after
   one request to warm it:

   * **one stream**: a streamed chat completion of the same prompt, greedy, exactly
     ``--output-tokens`` tokens (``ignore_eos``), the best of ``--runs``; its decode rate as
     the client sees it (tokens after the first over the time from the first token to the
     last) and its end-to-end rate;
   * **N streams**: ``--streams`` such requests at once; their tokens per second over the
     wall time from the first sent to the last done;
   * **time to first token** of one short request (``Hi!``, 8 tokens), the median of
     ``--runs``, the machine otherwise idle.

The load average (1 minute) is recorded beside each figure: other work on the cores shows
there. Ratios are to the library's one-row decode rate; the targets (docs/benchmarks.md,
"sclsd on llama.cpp"): one stream >= 0.7x, N streams >= 1.5x, time to first token <= 0.5 s.
Writes ``cpu.json`` and ``cpu.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ..defaults import offline_env
from ..launch import launch

#: The chat message of the streamed requests (about 90 prompt tokens with SmolLM2's template).
PROMPT = ("You are helping a student prepare for an exam in physics. Explain, in plain words and in a "
          "few short paragraphs, why the sky looks blue during the day but red and orange at sunset, "
          "what Rayleigh scattering is, and why clouds look white instead of blue.")
TARGETS = {"one_stream": 0.7, "streams": 1.5, "ttft_s": 0.5}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from worker.main import parse_opt

    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--engine", default="auto", help="workers.engine (auto: llama for a GGUF on the CPU)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="threads per worker")
    p.add_argument("--streams", type=int, default=8, help="concurrent streams of the second figure")
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=3, help="runs of the loop, the one stream and the TTFT")
    p.add_argument("--out", default="out/cpu", help="directory for cpu.json and cpu.md")
    p.add_argument("--opt", action="append", type=parse_opt, default=[], metavar="KEY=VALUE",
                   help="[workers.options] KEY = VALUE, as sclsd-worker --opt takes it (repeatable; "
                        "share_prefixes=false: every request prefills its whole prompt)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)


def load() -> float:
    return os.getloadavg()[0]


def chat_ids(model: str) -> list[int]:
    """The prompt's token ids as the daemon makes them (chat template, generation prompt)."""
    from ..defaults import force_offline
    from ..tokenizer import load as load_tokenizer

    force_offline()
    return list(load_tokenizer(model).encode_chat([{"role": "user", "content": PROMPT}]))


def child(args: argparse.Namespace) -> int:
    """The library's greedy loop on one row, one thread: one JSON line per run."""
    from worker.engines.llama import BATCH_TOKENS, check_batches, gguf_file
    from worker.engines.llama_lib import Context, Model

    from .. import models

    ids = chat_ids(args.model)
    model = Model(gguf_file(models.resolve(args.model)))
    ctx = Context(model, 1024, 1, check_batches(model, 1, BATCH_TOKENS), 1)
    for _ in range(args.runs + 1):  # the first run warms the kernels up
        out, prefill_s, decode_s = ctx_loop(ctx, ids, args.output_tokens)
        print(json.dumps({"prompt_tokens": len(ids), "tokens": len(out), "prefill_s": prefill_s,
                          "decode_s": decode_s, "load": load()}), flush=True)
    ctx.close()
    model.close()
    return 0


def ctx_loop(ctx: Any, ids: list[int], n: int) -> tuple[list[int], float, float]:
    from worker.engines.llama_lib import greedy_loop

    return greedy_loop(ctx, ids, n)


class HTTPStream:
    """One streamed chat completion through sclsd-http: when each chunk with text came."""

    def __init__(self, host: str, port: int, body: dict[str, Any]) -> None:
        self.host, self.port, self.body = host, port, body
        self.sent = 0.0
        self.times: list[float] = []
        self.tokens = 0
        self.prompt_tokens = 0
        self.error: str | None = None

    def run(self) -> None:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=600)
        try:
            self.sent = time.monotonic()
            conn.request("POST", "/v1/chat/completions", json.dumps(self.body),
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                self.error = f"HTTP {resp.status}: {resp.read()[:300]!r}"
                return
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                self.chunk(json.loads(line[6:]))
        except OSError as exc:
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            conn.close()

    def chunk(self, chunk: dict[str, Any]) -> None:
        """One streamed chunk: when text came, and the usage at the end."""
        if chunk.get("usage"):
            self.tokens = chunk["usage"]["completion_tokens"]
            self.prompt_tokens = chunk["usage"]["prompt_tokens"]
        if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
            self.times.append(time.monotonic())

    @property
    def ttft(self) -> float:
        return self.times[0] - self.sent

    @property
    def decode_rate(self) -> float:
        """Tokens after the first per second, from the first chunk to the last."""
        span = self.times[-1] - self.times[0]
        return (self.tokens - 1) / span if span > 0 else 0.0

    @property
    def e2e_rate(self) -> float:
        return self.tokens / (self.times[-1] - self.sent)


def body(model: str, content: str, n: int) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": n,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


def concurrently(host: str, port: int, bodies: list[dict[str, Any]]) -> tuple[list[HTTPStream], float]:
    streams = [HTTPStream(host, port, b) for b in bodies]
    threads = [threading.Thread(target=s.run) for s in streams]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bad = [s.error for s in streams if s.error or not s.times]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(streams)} streams failed: {bad[0]}")
    return streams, max(s.times[-1] for s in streams) - t0


def library_loop(args: argparse.Namespace) -> list[dict[str, Any]]:
    cmd = [sys.executable, "-m", "sclsd.bench.cli", "cpu", "--child", "--model", args.model,
           "--output-tokens", str(args.output_tokens), "--runs", str(args.runs)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=offline_env(), check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")][1:]


def serve(args: argparse.Namespace, result: dict[str, Any]) -> None:
    from ..demo import _start_http

    sections: dict[str, Any] = {"daemon": {"drain_timeout_s": 60.0}, "model": {"name": args.model},
                                "workers": {"spawn": args.workers, "threads": args.threads, "engine": args.engine}}
    if args.opt:
        sections["workers"]["options"] = dict(args.opt)
    t0 = time.monotonic()
    with launch(sections, wait_workers=args.workers, timeout=300) as d:
        result["start_s"] = round(time.monotonic() - t0, 2)
        result["engine"] = d.status().workers[0].engine
        http_proc, url = _start_http(d.sock, d.status_sock, "127.0.0.1:0")
        try:
            host, _, port = url.removeprefix("http://").partition(":")
            n = args.output_tokens
            concurrently(host, int(port), [body(args.model, PROMPT, 8)])  # warm
            print("  one stream ...", file=sys.stderr, flush=True)
            one = []
            for _ in range(args.runs):
                (s,), _wall = concurrently(host, int(port), [body(args.model, PROMPT, n)])
                one.append({"decode_rate": s.decode_rate, "e2e_rate": s.e2e_rate, "ttft_s": s.ttft,
                            "tokens": s.tokens, "prompt_tokens": s.prompt_tokens, "load": load()})
            result["one_stream"] = one
            print(f"  {args.streams} streams ...", file=sys.stderr, flush=True)
            many, wall = concurrently(host, int(port), [body(args.model, PROMPT, n)] * args.streams)
            result["streams"] = {"n": args.streams, "tokens": sum(s.tokens for s in many), "wall_s": wall,
                                 "rate": sum(s.tokens for s in many) / wall,
                                 "p50_stream_decode_rate": statistics.median(s.decode_rate for s in many),
                                 "max_ttft_s": max(s.ttft for s in many), "load": load()}
            print("  time to first token ...", file=sys.stderr, flush=True)
            ttft = []
            for _ in range(args.runs):
                time.sleep(0.5)  # idle between requests
                (s,), _wall = concurrently(host, int(port), [body(args.model, "Hi!", 8)])
                ttft.append({"ttft_s": s.ttft, "prompt_tokens": s.prompt_tokens, "load": load()})
            result["ttft"] = ttft
        finally:
            http_proc.terminate()
            http_proc.wait(timeout=30)


def markdown(r: dict[str, Any]) -> str:
    ref = r["loop_rate"]
    best = max(r["one_stream"], key=lambda x: x["decode_rate"])
    st = r["streams"]
    ttft = statistics.median(x["ttft_s"] for x in r["ttft"])
    rows = [
        ("llama.cpp's greedy loop, 1 row, 1 thread", f"{ref:.1f} tok/s decode ({r['loop_prefill_s']:.3f} s prefill "
         f"of {r['prompt_tokens']} tokens)", "1.00x", "", f"{r['loop_load']:.2f}"),
        ("sclsd-http, one stream", f"{best['decode_rate']:.1f} tok/s decode, {best['e2e_rate']:.1f} e2e, "
         f"TTFT {best['ttft_s']:.2f} s", f"{best['decode_rate'] / ref:.2f}x", ">= 0.7x", f"{best['load']:.2f}"),
        (f"sclsd-http, {st['n']} streams", f"{st['rate']:.1f} tok/s ({st['tokens']} tokens in {st['wall_s']:.1f} s; "
         f"median stream {st['p50_stream_decode_rate']:.1f})", f"{st['rate'] / ref:.2f}x", ">= 1.5x",
         f"{st['load']:.2f}"),
        ("time to first token, `Hi!`", f"{ttft:.3f} s (median of {len(r['ttft'])}, "
         f"{r['ttft'][0]['prompt_tokens']} prompt tokens)", "", "<= 0.5 s",
         f"{statistics.median(x['load'] for x in r['ttft']):.2f}"),
    ]
    head = (f"`{r['model']}`, {r['workers']} {r['engine']} workers x {r['threads']} thread(s); "
            f"{r['output_tokens']} tokens per stream, greedy; started in {r['start_s']:.1f} s.\n\n"
            "| what | measured | vs the loop | target | load avg (1 min) |\n|---|---|---:|---|---:|\n")
    return head + "\n".join("| " + " | ".join(row) + " |" for row in rows)


def run(args: argparse.Namespace) -> int:
    if args.child:
        return child(args)
    print(f"== llama.cpp's own greedy loop: {args.model}, 1 row, 1 thread", file=sys.stderr, flush=True)
    loops = library_loop(args)
    rate = max((x["tokens"] - 1) / x["decode_s"] for x in loops)
    print(f"   {rate:.1f} tok/s (load {loops[-1]['load']:.2f})", file=sys.stderr, flush=True)
    result: dict[str, Any] = {"model": args.model, "workers": args.workers, "threads": args.threads,
                              "output_tokens": args.output_tokens}
    print(f"== sclsd: {args.workers} workers x {args.threads} thread(s), engine {args.engine}", file=sys.stderr,
          flush=True)
    serve(args, result)
    print("== llama.cpp's own greedy loop again", file=sys.stderr, flush=True)
    loops += library_loop(args)
    # The reference: the loop's best decode rate, before or after (the larger, so no
    # figure of sclsd's gains from a loop slowed by other work).
    best = max(loops, key=lambda x: (x["tokens"] - 1) / x["decode_s"])
    result |= {"loop": loops, "loop_rate": (best["tokens"] - 1) / best["decode_s"], "loop_prefill_s": best["prefill_s"],
               "prompt_tokens": best["prompt_tokens"], "loop_load": best["load"]}
    table = markdown(result)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "cpu.md").write_text(table + "\n")
    print(table)
    return 0
