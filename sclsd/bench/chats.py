"""``sclsd-bench chats``: multi-turn chats that share a system prompt, with the engines' shared
prefixes off and on.

::

    sclsd-bench chats [--model smollm2-135m-instruct] [--engines hf-static-cb,llama] [--workers 2]
                      [--threads 1] [--chats 16] [--turns 3] [--concurrency 4] [--output-tokens 32]
                      [--out out/chats]

The workload a chat server sees most: ``--chats`` conversations, ``--concurrency`` of them at
a time, each of ``--turns`` turns sent one after another (each turn's messages are the ones
before, the model's answers included, and a new question), every one behind the same system
prompt of about 250 tokens. Each request is a streamed chat completion through ``sclsd-http``,
greedy, exactly ``--output-tokens`` tokens. For each engine, sclsd starts three times with its
defaults for the model but ``workers.engine``: ``share_prefixes`` off (``off``), on with
``scheduler.prefix_routing`` off (``shared``: a request starts from the KV another left on its
worker, the system prompt or a chat's turns before, wherever the loads placed it), and both on
(``routed``: the daemon sends a request to the worker likely to hold its prefix).

Reports per run: requests/s over the wall time, time to first token (median and p90, all
turns, and the first turns apart), and the share of prompt tokens the workers took from KV
(``usage.prompt_tokens_details.cached_tokens``), with the load average beside them; for the
runs with shared prefixes, how many turns got the same greedy answer as with them off. Each
worker caches its own prefixes, and the daemon sends a chat's next turn back to the worker that
served the turn before where its load allows (docs/design.md §8). Writes ``chats.json`` and
``chats.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ..launch import launch
from .cpu import HTTPStream, load

#: The system prompt every chat shares (about 250 tokens with SmolLM2's tokenizer).
SYSTEM = (
    "You are the help desk assistant of a small public library. Answer questions from visitors "
    "politely, briefly and accurately. The library opens from nine in the morning to seven in the "
    "evening on weekdays, and from ten to four on Saturdays; it is closed on Sundays and public "
    "holidays. Members may borrow up to twelve items at once: books for three weeks, films and "
    "music for one week, magazines for one week. Items may be renewed twice online or at the desk "
    "unless another member has reserved them. Late returns cost twenty cents a day per item, at "
    "most five euros per item; children's items are never fined. Membership is free for residents "
    "of the town and costs fifteen euros a year for others; a card needs a photo identity document "
    "and proof of address. The reading room on the first floor is silent; group study rooms on the "
    "second floor may be booked for two hours at a time, up to a week ahead. Printing costs ten "
    "cents a page in black and white and fifty cents in colour. Wireless internet is free; the "
    "network name and password are on the card at the desk. If you do not know an answer, say so "
    "and suggest asking a librarian at the front desk."
)
#: Questions of the chats' turns (chat ``c``'s turn ``t`` asks ``QUESTIONS[(c + t) % len]``).
QUESTIONS = [
    "How many books can I borrow at once?", "What does it cost to print ten colour pages?",
    "Can I renew a film that someone else has reserved?", "When are you open on Saturday?",
    "I live in the next town. Can I become a member, and what do I need?",
    "Where can my study group meet, and for how long?", "My book is five days late. What do I owe?",
    "Is there internet, and how do I connect?", "Are children's books fined when they are late?",
    "Can I book a study room for next month?", "Which floor is the quiet reading room on?",
    "Do you open on public holidays?",
]


#: config -> (share_prefixes, scheduler.prefix_routing).
CONFIGS = {"off": (False, False), "shared": (True, False), "routed": (True, True)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--engines", default="hf-static-cb,llama", help="workers.engine values, comma-separated")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="threads per worker")
    p.add_argument("--chats", type=int, default=16)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=4, help="chats in flight")
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"of {', '.join(CONFIGS)}, comma-separated")
    p.add_argument("--out", default="out/chats", help="directory for chats.json and chats.md")


class ChatStream(HTTPStream):
    """A streamed chat completion that keeps its text and the cached prompt tokens."""

    def __init__(self, host: str, port: int, body: dict[str, Any]) -> None:
        super().__init__(host, port, body)
        self.text = ""
        self.cached = 0

    def chunk(self, chunk: dict[str, Any]) -> None:
        super().chunk(chunk)
        for c in chunk.get("choices", []):
            self.text += c.get("delta", {}).get("content") or ""
        if chunk.get("usage"):
            self.cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def _chat(host: str, port: int, args: argparse.Namespace, c: int, out: list[dict[str, Any]]) -> None:
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    for t in range(args.turns):
        messages.append({"role": "user", "content": QUESTIONS[(c + t) % len(QUESTIONS)]})
        s = ChatStream(host, port, {
            "model": args.model, "messages": list(messages), "max_tokens": args.output_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
        s.run()
        if s.error or not s.times:
            raise RuntimeError(f"chat {c} turn {t}: {s.error or 'no tokens'}")
        out.append({"chat": c, "turn": t, "ttft_s": s.ttft, "prompt_tokens": s.prompt_tokens,
                    "cached_tokens": s.cached, "tokens": s.tokens, "text": s.text})
        messages.append({"role": "assistant", "content": s.text})


def workload(host: str, port: int, args: argparse.Namespace) -> tuple[list[dict[str, Any]], float]:
    """Every chat, ``--concurrency`` at a time: each turn's record, and the wall time."""
    records: list[dict[str, Any]] = []
    todo = list(range(args.chats))
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker() -> None:
        while True:
            with lock:
                if not todo or errors:
                    return
                c = todo.pop(0)
            try:
                _chat(host, port, args, c, records)
            except BaseException as exc:  # noqa: BLE001 - the run fails with it below
                errors.append(exc)
            print(f"    chat {c} done ({len(records)} of {args.chats * args.turns} turns)", file=sys.stderr,
                  flush=True)

    threads = [threading.Thread(target=worker) for _ in range(args.concurrency)]
    t0 = time.monotonic()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return records, time.monotonic() - t0


def one(args: argparse.Namespace, engine: str, config: str) -> dict[str, Any]:
    from ..demo import _start_http

    share, routing = CONFIGS[config]
    workers: dict[str, Any] = {"spawn": args.workers, "threads": args.threads, "engine": engine,
                               "options": {"share_prefixes": share}}
    sections: dict[str, Any] = {"daemon": {"drain_timeout_s": 60.0}, "model": {"name": args.model},
                                "workers": workers, "scheduler": {"prefix_routing": routing}}
    with launch(sections, wait_workers=args.workers, timeout=300) as d:
        http_proc, url = _start_http(d.sock, d.status_sock, "127.0.0.1:0")
        try:
            host, _, port = url.removeprefix("http://").partition(":")
            records, wall = workload(host, int(port), args)
            hints = d.status().counters.get("prefix_hints", 0)
        finally:
            http_proc.terminate()
            http_proc.wait(timeout=30)
    ttft = sorted(r["ttft_s"] for r in records)
    firsts = [r["ttft_s"] for r in records if r["turn"] == 0]
    prompt = sum(r["prompt_tokens"] for r in records)
    return {"engine": engine, "config": config, "share_prefixes": share, "prefix_routing": routing,
            "prefix_hints": hints, "requests": len(records), "wall_s": wall,
            "req_per_s": len(records) / wall, "ttft_p50_s": statistics.median(ttft),
            "ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))], "first_turn_ttft_p50_s": statistics.median(firsts),
            "prompt_tokens": prompt, "cached_tokens": sum(r["cached_tokens"] for r in records),
            "cached_share": sum(r["cached_tokens"] for r in records) / max(1, prompt),
            "later_share": _share([r for r in records if r["turn"] > 0]), "load": load(),
            "records": records}


def _share(records: list[dict[str, Any]]) -> float:
    """The share of these turns' prompt tokens taken from KV."""
    return sum(r["cached_tokens"] for r in records) / max(1, sum(r["prompt_tokens"] for r in records))


def same_answers(off: dict[str, Any], on: dict[str, Any]) -> int:
    """How many turns got the same greedy answer with shared prefixes as without."""
    texts = {(r["chat"], r["turn"]): r["text"] for r in off["records"]}
    return sum(texts.get((r["chat"], r["turn"])) == r["text"] for r in on["records"])


def markdown(args: argparse.Namespace, runs: list[dict[str, Any]]) -> str:
    head = (f"`{args.model}`, {args.workers} workers x {args.threads} thread(s); {args.chats} chats of "
            f"{args.turns} turns, {args.concurrency} in flight, {args.output_tokens} tokens per answer, greedy.\n\n"
            "| engine | prefixes | req/s | TTFT p50 | TTFT p90 | first turns' TTFT p50 | prompt tokens "
            "from KV (later turns) | requests routed | answers as with it off | load avg (1 min) |\n"
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    rows = [f"| `{r['engine']}` | {r['config']} | {r['req_per_s']:.2f} | {r['ttft_p50_s']:.3f} s "
            f"| {r['ttft_p90_s']:.3f} s | {r['first_turn_ttft_p50_s']:.3f} s | {100 * r['cached_share']:.0f} % "
            f"({100 * r['later_share']:.0f} %) | {r['prefix_hints']} | {r.get('same', '')} | {r['load']:.2f} |"
            for r in runs]
    return head + "\n".join(rows) + "\n"


def run(args: argparse.Namespace) -> int:
    runs: list[dict[str, Any]] = []
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"sclsd-bench chats: --configs: unknown {unknown[0]!r} (of {', '.join(CONFIGS)})")
    for engine in [e.strip() for e in args.engines.split(",") if e.strip()]:
        off: dict[str, Any] | None = None
        for config in configs:
            print(f"== {engine}, {config}", file=sys.stderr, flush=True)
            r = one(args, engine, config)
            print(f"   {r['req_per_s']:.2f} req/s, TTFT p50 {r['ttft_p50_s']:.3f} s, "
                  f"{100 * r['cached_share']:.0f} % of prompt tokens from KV", file=sys.stderr, flush=True)
            if config == "off":
                off = r
            elif off is not None:
                r["same"] = f"{same_answers(off, r)} of {len(r['records'])}"
            runs.append(r)
    out = Path(args.out)
    os.makedirs(out, exist_ok=True)
    (out / "chats.json").write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))
    md = markdown(args, runs)
    (out / "chats.md").write_text(md)
    print(md)
    return 0
