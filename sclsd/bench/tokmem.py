"""``sclsd-bench tokenize-memory``: what ``POST /tokenize`` of a large prompt costs
``sclsd-http`` in memory, for one request and for several at once.

A daemon with the model (``--model``, no workers: ``/tokenize`` needs only its status)
and one ``sclsd-http`` in front of it; a small ``/tokenize`` loads the tokenizer first.
Then one request with a prompt of ``--chars`` characters (text of ``sclsd/data/prompts.txt``
repeated), and ``--concurrent`` of them at once: for each, the HTTP statuses, the seconds,
``sclsd-http``'s RSS before, its peak while the requests ran (sampled every 5 ms) and
after (``--settle`` seconds later), in MB. With the default ``model.max_input`` such a
prompt is refused on its length; ``--max-input 1048576`` (the largest allowed) makes the
same prompt fit, so it is tokenized.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ..http.process import start_http, stop_http
from ..launch import launch


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--chars", type=int, default=4_000_000, help="characters in each large prompt")
    p.add_argument("--concurrent", type=int, default=4, help="large requests at once in the second round")
    p.add_argument("--max-input", type=int, default=None,
                   help="the daemon's model.max_input (default: the config default)")
    p.add_argument("--settle", type=float, default=1.0, help="seconds before reading the RSS after")
    p.add_argument("--json", dest="json_out", help="write the result here too")


def rss_mb(pid: int) -> float:
    """A process's resident set in MB (Linux)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _post(url: str, body: bytes) -> tuple[int, bytes]:
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=600)
    try:
        conn.request("POST", "/tokenize", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _round(url: str, pid: int, body: bytes, n: int, settle: float) -> dict[str, Any]:
    """``n`` requests of ``body`` at once: statuses, seconds, RSS before / peak / after."""
    before = rss_mb(pid)
    peak = before
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.wait(0.005):
            peak = max(peak, rss_mb(pid))

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        answers = list(pool.map(lambda _: _post(url, body), range(n)))
    seconds = time.perf_counter() - t0
    time.sleep(settle)
    stop.set()
    watcher.join()
    after = rss_mb(pid)
    codes = sorted({json.loads(a[1]).get("error", {}).get("code", "") for a in answers if a[0] != 200})
    counts = sorted({json.loads(a[1])["count"] for a in answers if a[0] == 200})
    return {"requests": n, "statuses": [a[0] for a in answers], "error_codes": codes, "token_counts": counts,
            "seconds": round(seconds, 2), "rss_before_mb": round(before), "rss_peak_mb": round(peak),
            "rss_after_mb": round(after), "peak_growth_mb": round(peak - before),
            "kept_mb": round(after - before)}


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    text = resources.files("sclsd").joinpath("data/prompts.txt").read_text()
    prompt = (text * (args.chars // len(text) + 1))[: args.chars]
    body = json.dumps({"prompt": prompt}).encode()
    model: dict[str, Any] = {"name": args.model}
    if args.max_input is not None:
        model["max_input"] = args.max_input
    d = launch({"model": model, "workers": {"spawn": 0}}, wait_workers=0)
    http_proc = None
    try:
        http_proc, url = start_http(d.sock, d.status_sock, "--no-access-log")
        say(f"sclsd-http at {url} (pid {http_proc.pid}); loading the tokenizer")
        status, out = _post(url, b'{"prompt": "warm up"}')
        if status != 200:
            raise RuntimeError(f"the warm-up /tokenize failed: {status} {out[:300]!r}")
        time.sleep(args.settle)
        rounds = []
        for n in (1, args.concurrent):
            say(f"{n} x /tokenize of {len(prompt):,} characters ({len(body):,} bytes)")
            rounds.append(_round(url, http_proc.pid, body, n, args.settle))
            say(f"  {rounds[-1]}")
    finally:
        if http_proc is not None:
            stop_http(http_proc)
        d.stop()
    result = {"model": args.model, "chars": len(prompt), "body_bytes": len(body),
              "max_input": args.max_input, "rounds": rounds}
    out_text = json.dumps(result, indent=2)
    print(out_text)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(out_text + "\n")
    return 0
