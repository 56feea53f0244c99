"""``sclsd-bench fairness``: how long a bystander waits behind another client's burst.

A daemon with ``--workers`` fake workers under ``scls-cb`` (each decoding step
``--decode-s``) gets a burst of ``--burst`` requests from one client (as one HTTP request
with ``n = 64`` becomes), then, ``--after`` seconds later, one short request: first in the
burst's own group (what a first-come line gives it), then from another client (its own
group: fair turns in line). Reported: the bystander's end-to-end seconds each way.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

from ..client import AsyncClient
from ..launch import launch


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--burst", type=int, default=64)
    p.add_argument("--burst-tokens", type=int, default=32)
    p.add_argument("--decode-s", type=float, default=0.02)
    p.add_argument("--after", type=float, default=0.3, help="seconds between the burst and the bystander")


async def _bystander(sock: str, args: argparse.Namespace, own_group: bool) -> float:
    async with AsyncClient(sock) as a, AsyncClient(sock) as b:
        burst = [asyncio.create_task(a.complete(prompt_ids=[5, 6, 7], max_tokens=args.burst_tokens,
                                                ignore_eos=True, temperature=0.0, group="burst"))
                 for _ in range(args.burst)]
        await asyncio.sleep(args.after)
        t0 = time.monotonic()
        await (b if own_group else a).complete(prompt_ids=[8, 9], max_tokens=8, ignore_eos=True,
                                               temperature=0.0, group=None if own_group else "burst")
        waited = time.monotonic() - t0
        await asyncio.gather(*burst)
        return waited


def run(args: argparse.Namespace) -> int:
    sections: dict[str, dict[str, Any]] = {
        "model": {"name": "fake"},
        "scheduler": {"policy": "scls-cb", "slice_len": 32},
        "workers": {"spawn": args.workers, "engine": "fake", "mem_budget_bytes": 320 * 512,
                    "options": {"decode_s": args.decode_s, "kv_bytes_per_token": 512}},
    }
    with launch(sections, wait_workers=args.workers) as d:
        same = asyncio.run(_bystander(d.sock, args, own_group=False))
        print(f"  bystander in the burst's group: {same:.2f}s", file=sys.stderr, flush=True)
        own = asyncio.run(_bystander(d.sock, args, own_group=True))
    print(f"| bystander's group | end-to-end s |\n|---|---:|\n| the burst's (first come, first served) | "
          f"{same:.2f} |\n| its own (fair turns) | {own:.2f} |")
    return 0
