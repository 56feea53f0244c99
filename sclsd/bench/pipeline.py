"""``sclsd-bench pipeline``: many requests pipelined on one connection, nothing lost.

Starts a daemon with zero-time ``fake`` workers, writes ``--requests`` generate
frames on one connection in one go (the client does not wait for anything),
then reads until every request has its terminal event. Reports how many were
accepted, refused, finished and lost (accepted without a terminal event), and the
wall time. The daemon's admission bounds are raised so that every request fits:
the point is the path from admission to the terminal event under load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from typing import Any

from .. import protocol as P
from ..launch import launch


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=9000, help="requests pipelined on one connection")
    p.add_argument("--tokens", type=int, default=128, help="max_tokens of each (EOS ignored)")
    p.add_argument("--slice-len", type=int, default=16)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600.0, help="give up after this many seconds")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--keep-dir", default=None, help="run the daemon in this directory and keep it (log)")


async def _pipeline(sock: str, frames: list[bytes], n: int, timeout: float) -> dict[str, Any]:
    from tqdm import tqdm

    reader, writer = await asyncio.open_unix_connection(sock, limit=1 << 24)
    t0 = time.perf_counter()
    writer.write(b"".join(frames))
    open_ids: set[str] = set()
    counts = {"accepted": 0, "refused": 0, "done": 0, "error": 0, "duplicate_terminal": 0}
    ended: set[str] = set()
    bar = tqdm(total=n, desc="terminal events", unit="req", file=sys.stderr, mininterval=1.0)
    try:
        while len(ended) + counts["refused"] < n:
            header = await asyncio.wait_for(reader.readexactly(P.FRAME_HEADER.size), timeout)
            (size,) = P.FRAME_HEADER.unpack(header)
            ev = P.server_decoder.decode(await reader.readexactly(size))
            if isinstance(ev, P.Accepted):
                counts["accepted"] += 1
                open_ids.add(ev.id)
            elif isinstance(ev, (P.Done, P.Error)) and ev.id is not None:
                if ev.id in ended:
                    counts["duplicate_terminal"] += 1
                elif ev.id in open_ids:
                    open_ids.discard(ev.id)
                    ended.add(ev.id)
                    counts["done" if isinstance(ev, P.Done) else "error"] += 1
                else:
                    counts["refused"] += 1
                bar.update(1)
    except asyncio.TimeoutError:
        pass
    finally:
        bar.close()
        writer.close()
    wall = time.perf_counter() - t0
    return {**counts, "lost": len(open_ids), "wall_s": round(wall, 2),
            "requests_per_s": round((counts["done"] + counts["error"]) / wall, 1)}


def run(args: argparse.Namespace) -> int:
    rng = random.Random(1)
    frames = [P.frame(P.Generate(id=f"p{i}", prompt_ids=[rng.randrange(3, 256) for _ in range(rng.randint(1, 24))],
                                 max_tokens=args.tokens, temperature=0.0, ignore_eos=True, stream=False))
              for i in range(args.requests)]
    sections = {
        "daemon": {"max_queued_requests": max(10_000, 2 * args.requests), "uid_share": 1.0,
                   "max_queued_tokens": 100_000_000, "log_level": "warning"},
        "model": {"name": "fake"},
        "scheduler": {"policy": "scls", "slice_len": args.slice_len, "gamma_s": 0.002},
        "workers": {"spawn": args.workers, "engine": "fake", "options": {"decode_s": 0.0}},
    }
    print(f"starting sclsd with {args.workers} zero-time fake workers ...", file=sys.stderr)
    with launch(sections, dir=args.keep_dir, wait_workers=args.workers, progress=True) as d:
        result = asyncio.run(_pipeline(d.sock, frames, args.requests, args.timeout))
        st = d.status()
        result["daemon_live_after"] = st.live_requests
    result.update(requests=args.requests, tokens=args.tokens, slice_len=args.slice_len, workers=args.workers)
    if args.json:
        print(json.dumps(result))
    else:
        print(", ".join(f"{k}={v}" for k, v in result.items()))
    return 0 if result["lost"] == 0 and result["duplicate_terminal"] == 0 else 1
