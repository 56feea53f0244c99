"""``sclsd-bench score``: what scoring prompts costs, the way evaluation harnesses score them.

::

    sclsd-bench score [--model smollm2-135m-instruct] [--engine auto] [--workers 2] [--threads 1]
                      [--prompts 64] [--prompt-tokens 256] [--concurrency 8] [--rounds 2] [--out out/score]

lm-evaluation-harness's ``local-completions`` scores a loglikelihood task as a completion of
the context and the continuation as token ids, ``echo: true``, ``logprobs: 1``, ``max_tokens: 1``,
and sums the prompt's log-probabilities past the context. This starts sclsd with its defaults
for the model (``[workers] engine = "auto"``) and ``sclsd-http`` in front, then sends
``--prompts`` such requests of ``--prompt-tokens`` tokens each (the prompts of
``sclsd/data/prompts.txt``, tokenized by ``/tokenize`` and repeated to length), ``--concurrency``
at a time, in two ways, alternating for ``--rounds`` rounds:

* **scored**: ``echo`` with ``logprobs: 1`` (the prompt's log-probabilities computed in the
  prefill, every prompt token's logits);
* **plain**: the same prompts for one token, without ``echo`` (a prefill that keeps the last
  token's logits only): the floor a scored request cannot go below.

Each scored answer is checked: one log-probability per prompt token (``null`` for the first)
and the generated one, each at most 0. Reports requests/s and prompt tokens/s of each way
(the best round) and their ratio, with the load average beside them. Writes ``score.json`` and
``score.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..launch import launch


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--engine", default="auto", help="workers.engine (auto: llama for a GGUF on the CPU)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="threads per worker")
    p.add_argument("--prompts", type=int, default=64, help="requests of each way per round")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default="out/score", help="directory for score.json and score.md")


def _post(host: str, port: int, path: str, body: dict[str, Any]) -> dict[str, Any]:
    conn = http.client.HTTPConnection(host, port, timeout=600)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{path}: HTTP {resp.status}: {data[:300]!r}")
        return dict(json.loads(data))
    finally:
        conn.close()


def prompts(host: str, port: int, n: int, length: int, tag: str) -> list[list[int]]:
    """``n`` prompts of ``length`` token ids: the shipped prompts, tokenized, each repeated to
    length, starting from a different one, after a head of its own (``tag`` and its number):
    no two prompts of any way or round begin alike, so none starts from KV another left
    (the ``llama`` engine's shared prefixes)."""
    texts = (Path(__file__).resolve().parent.parent / "data" / "prompts.txt").read_text().splitlines()
    ids = [_post(host, port, "/tokenize", {"prompt": t + "\n"})["tokens"] for t in texts if t.strip()]
    out = []
    for i in range(n):
        p: list[int] = list(_post(host, port, "/tokenize", {"prompt": f"[{tag} {i}]\n"})["tokens"])
        j = i
        while len(p) < length:
            p += ids[j % len(ids)]
            j += 1 + i // len(ids)
        out.append(p[:length])
    return out


def check(answer: dict[str, Any], prompt: list[int]) -> None:
    """A scored answer covers the prompt (``null`` first) and the token generated."""
    lp = answer["choices"][0]["logprobs"]
    values = lp["token_logprobs"]
    if len(values) != len(prompt) + 1 or values[0] is not None or lp["top_logprobs"][0] is not None:
        raise RuntimeError(f"a scored answer has {len(values)} log-probabilities for {len(prompt)} prompt tokens")
    if not all(v <= 0.0 for v in values[1:]):
        raise RuntimeError("a scored answer has a log-probability above 0")


def one_way(host: str, port: int, model: str, ps: list[list[int]], scored: bool, concurrency: int) -> dict[str, Any]:
    extra = {"echo": True, "logprobs": 1} if scored else {}

    def send(p: list[int]) -> None:
        answer = _post(host, port, "/v1/completions", {"model": model, "prompt": p, "max_tokens": 1,
                                                         "temperature": 0, **extra})
        if scored:
            check(answer, p)

    t0 = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(send, ps))
    wall = time.monotonic() - t0
    tokens = sum(len(p) for p in ps)
    return {"way": "scored" if scored else "plain", "requests": len(ps), "wall_s": round(wall, 3),
            "req_per_s": round(len(ps) / wall, 2), "prompt_tok_per_s": round(tokens / wall, 1),
            "load": round(os.getloadavg()[0], 2)}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from ..demo import _start_http

    sections = {"daemon": {"drain_timeout_s": 60.0}, "model": {"name": args.model},
                "workers": {"spawn": args.workers, "threads": args.threads, "engine": args.engine}}
    result: dict[str, Any] = {"model": args.model, "workers": args.workers, "threads": args.threads,
                              "prompts": args.prompts, "prompt_tokens": args.prompt_tokens,
                              "concurrency": args.concurrency, "runs": []}
    with launch(sections, wait_workers=args.workers, timeout=300) as d:
        result["engine"] = d.status().workers[0].engine
        http_proc, url = _start_http(d.sock, d.status_sock, "127.0.0.1:0")
        try:
            host, _, port_s = url.removeprefix("http://").partition(":")
            port = int(port_s)
            warm = prompts(host, port, args.concurrency, args.prompt_tokens, "warm")
            one_way(host, port, args.model, warm, True, args.concurrency)
            for k in range(args.rounds):
                for scored in (True, False) if k % 2 == 0 else (False, True):
                    ps = prompts(host, port, args.prompts, args.prompt_tokens, f"{'s' if scored else 'p'}{k}")
                    r = one_way(host, port, args.model, ps, scored, args.concurrency)
                    r["round"] = k + 1
                    result["runs"].append(r)
                    print(f"  round {k + 1} {r['way']:6}: {r['req_per_s']:7.2f} req/s, "
                          f"{r['prompt_tok_per_s']:8.1f} prompt tok/s (load {r['load']})", file=sys.stderr, flush=True)
        finally:
            http_proc.terminate()
            http_proc.wait(timeout=30)
    return result


def markdown(r: dict[str, Any]) -> str:
    best = {w: max((x for x in r["runs"] if x["way"] == w), key=lambda x: x["prompt_tok_per_s"])
            for w in ("scored", "plain")}
    rows = [f"| {w} | {b['req_per_s']:.2f} | {b['prompt_tok_per_s']:.1f} | {b['load']:.2f} |"
            for w, b in best.items()]
    ratio = best["scored"]["prompt_tok_per_s"] / best["plain"]["prompt_tok_per_s"]
    return (f"`{r['model']}`, {r['workers']} {r['engine']} workers x {r['threads']} thread(s); "
            f"{r['prompts']} prompts of {r['prompt_tokens']} tokens, {r['concurrency']} at a time, "
            f"one token each; the best of {len(r['runs']) // 2} rounds.\n\n"
            "| way | requests/s | prompt tokens/s | load avg (1 min) |\n|---|---:|---:|---:|\n"
            + "\n".join(rows) + f"\n\nscored / plain: {ratio:.2f}x\n")


def run(args: argparse.Namespace) -> int:
    print(f"== sclsd: {args.workers} workers x {args.threads} thread(s), engine {args.engine}, {args.model}",
          file=sys.stderr, flush=True)
    r = measure(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "score.json").write_text(json.dumps(r, indent=2) + "\n")
    md = markdown(r)
    (out / "score.md").write_text(md)
    print(md)
    return 0
