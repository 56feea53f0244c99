"""``sclsd-bench fairness``: how long a bystander waits behind another client's burst.

A daemon with ``--workers`` fake workers under ``scls-cb`` (continuous batching of at most
``--max-rows`` rows, each decoding step ``--decode-s``, KV memory plenty: rows, not KV,
bound what a worker runs) gets a burst of ``--burst`` requests of ``--burst-tokens`` tokens
from another client (its own process), then, ``--after`` seconds later, one 8-token request
from this process: the bystander. The cases:

* ``one-connection``: the burst over one connection (one group);
* ``64-connections``: the burst over 64 connections;
* ``256-groups``: the burst over one connection, each request naming its own group;
* ``hang-up``: the burst (over 64 connections) hangs up ``--after`` seconds in; the
  bystander is sent one second later. Also reported: how long after the hang-up the
  workers first had nothing in flight (the cancels reached the engines);
* ``throughput``: the burst alone, over 8 connections, served to its end: output tokens/s,
  and the share of the workers' row-steps it used (``--max-rows`` rows per worker, each
  giving a token per ``--decode-s``: what work conservation keeps near 1).

Each case prints a line as it ends; the table follows.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..client import AsyncClient
from ..launch import DaemonProcess, launch

#: The burst client: its own process (another client to the daemon), ``conns`` connections,
#: requests spread over them round-robin; prints ``accepted`` once every request was
#: accepted, ``done`` once every one ended, and exits.
BURST_CLIENT = r"""
import asyncio, sys
from sclsd.client import AsyncClient

async def main(sock, n, tokens, conns, groups):
    clients = [AsyncClient(sock) for _ in range(conns)]
    for c in clients:
        await c.__aenter__()
    started = asyncio.Event()
    accepted = 0

    async def one(i):
        nonlocal accepted
        c = clients[i % conns]
        async for ev in c.stream(prompt_ids=[5, 6, 7, 8], max_tokens=tokens, ignore_eos=True,
                                 temperature=0.0, group=f"g{i}" if groups else None):
            if type(ev).__name__ == "Accepted":
                accepted += 1
                if accepted == n:
                    started.set()

    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    await started.wait()
    print("accepted", flush=True)
    await asyncio.gather(*tasks)
    print("done", flush=True)

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"))
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--max-rows", type=int, default=4, help="rows each fake worker runs at once")
    p.add_argument("--burst", type=int, default=256)
    p.add_argument("--burst-tokens", type=int, default=64)
    p.add_argument("--decode-s", type=float, default=0.02)
    p.add_argument("--after", type=float, default=1.0, help="seconds between the burst and the bystander")
    p.add_argument("--grant-lookahead", type=float, default=None,
                   help="scheduler.grant_lookahead (default: the daemon's own)")
    p.add_argument("--cases", default="one-connection,64-connections,256-groups,hang-up,throughput",
                   help="comma-separated cases to run (see the module docstring)")


class _Burst:
    """The burst client's process."""

    def __init__(self, sock: str, n: int, tokens: int, conns: int, groups: bool) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", BURST_CLIENT, sock, str(n), str(tokens), str(conns), "1" if groups else "0"],
            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def wait_for(self, word: str, timeout: float) -> float:
        """Block until the client prints ``word``; the time it did."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the burst client exited ({self.proc.wait()}) before {word!r}")
            if line.strip() == word:
                return time.monotonic()
        raise TimeoutError(f"the burst client did not say {word!r} within {timeout:g}s")

    def hang_up(self) -> None:
        """The client goes away (its connections close)."""
        self.proc.kill()
        self.proc.wait()


async def _one(sock: str) -> float:
    async with AsyncClient(sock) as c:
        t0 = time.monotonic()
        await c.complete(prompt_ids=[8, 9], max_tokens=8, ignore_eos=True, temperature=0.0)
        return time.monotonic() - t0


def _idle_after(d: DaemonProcess, since: float, timeout: float = 120.0) -> float:
    """Seconds from ``since`` until no worker has a batch in flight or busy."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = d.status()
        if st.workers and all(w.batches_inflight == 0 and not w.busy for w in st.workers):
            return time.monotonic() - since
        time.sleep(0.02)
    return float("inf")


def _bystander_case(d: DaemonProcess, args: argparse.Namespace, conns: int, groups: bool) -> dict[str, Any]:
    burst = _Burst(d.sock, args.burst, args.burst_tokens, conns, groups)
    try:
        t_acc = burst.wait_for("accepted", 120)
        time.sleep(max(0.0, args.after - (time.monotonic() - t_acc)))
        waited = asyncio.run(_one(d.sock))
    finally:
        burst.hang_up()
    _idle_after(d, time.monotonic())
    return {"bystander_s": waited}


def _hang_up_case(d: DaemonProcess, args: argparse.Namespace) -> dict[str, Any]:
    burst = _Burst(d.sock, args.burst, args.burst_tokens, 64, False)
    t_acc = burst.wait_for("accepted", 120)
    time.sleep(max(0.0, args.after - (time.monotonic() - t_acc)))
    burst.hang_up()
    gone = time.monotonic()
    with ThreadPoolExecutor(1) as pool:  # watched from the hang-up on, beside the bystander
        idle = pool.submit(_idle_after, d, gone)
        time.sleep(max(0.0, gone + 1.0 - time.monotonic()))
        waited = asyncio.run(_one(d.sock))
        return {"bystander_s": waited, "idle_s": idle.result()}


def _throughput_case(d: DaemonProcess, args: argparse.Namespace) -> dict[str, Any]:
    burst = _Burst(d.sock, args.burst, args.burst_tokens, 8, False)
    t0 = time.monotonic()
    try:
        burst.wait_for("done", 600)
    finally:
        burst.hang_up()
    took = time.monotonic() - t0
    tokens = args.burst * args.burst_tokens
    ideal = tokens * args.decode_s / (args.workers * args.max_rows)
    return {"tokens_per_s": tokens / took, "row_use": ideal / took, "seconds": took}


def run(args: argparse.Namespace) -> int:
    sections: dict[str, dict[str, Any]] = {
        "model": {"name": "fake"},
        "scheduler": {"policy": "scls-cb", **({} if args.grant_lookahead is None
                                              else {"grant_lookahead": args.grant_lookahead})},
        "workers": {"spawn": args.workers, "engine": "fake",
                    "options": {"decode_s": args.decode_s, "max_rows": args.max_rows}},
    }
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    known = {"one-connection", "64-connections", "256-groups", "hang-up", "throughput"}
    if unknown := [c for c in cases if c not in known]:
        print(f"sclsd-bench fairness: unknown case(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}",
              file=sys.stderr)
        return 2
    results: dict[str, dict[str, Any]] = {}
    with launch(sections, wait_workers=args.workers) as d:
        alone = asyncio.run(_one(d.sock))
        print(f"  bystander alone: {alone:.2f}s", file=sys.stderr, flush=True)
        for case in cases:
            if case == "one-connection":
                r = _bystander_case(d, args, 1, False)
            elif case == "64-connections":
                r = _bystander_case(d, args, 64, False)
            elif case == "256-groups":
                r = _bystander_case(d, args, 1, True)
            elif case == "hang-up":
                r = _hang_up_case(d, args)
            else:
                r = _throughput_case(d, args)
            results[case] = r
            print(f"  {case}: " + ", ".join(f"{k} {v:.2f}" for k, v in r.items()), file=sys.stderr, flush=True)
    print(f"bystander alone: {alone:.2f} s\n")
    print("| case | bystander end-to-end s | workers idle after the hang-up s |\n|---|---:|---:|")
    for case in ("one-connection", "64-connections", "256-groups", "hang-up"):
        if case in results:
            r = results[case]
            idle = f"{r['idle_s']:.2f}" if "idle_s" in r else ""
            print(f"| {case} | {r['bystander_s']:.2f} | {idle} |")
    if "throughput" in results:
        r = results["throughput"]
        print(f"\nthe burst alone: {r['tokens_per_s']:.0f} output tokens/s, {r['seconds']:.1f} s, "
              f"{100 * r['row_use']:.0f} % of the workers' row-steps")
    return 0
