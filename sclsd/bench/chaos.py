"""``sclsd-bench chaos``: kill workers at random under a stream of requests; nothing may be
lost or duplicated, and every token must be right.

Starts a daemon with ``--workers`` fake workers (``decode_s`` per iteration, so slices
take time and a kill lands in the middle of a batch), then for ``--minutes`` keeps
``--window`` greedy requests in flight on each of ``--clients`` connections (random
prompts and lengths, most of them streamed, some ending at their natural EOS) while a
killer SIGKILLs a registered worker every ``--kill-every`` seconds on average, one
with a batch in flight when there is one. The supervisor restarts each; the daemon
puts the dead worker's requests back in the pool.

The fake engine's tokens are a function of the prompt and the position, so a request
that lost slices to a kill and was served again must stream exactly the tokens of one
uninterrupted pass (:func:`reference_tokens`). Checked per request: ``accepted``, then
exactly one terminal event; streamed tokens equal to the reference and to the
``done``'s count. At the end, once the daemon holds no request and no batch is out, a
ping round trip on every connection brings in anything still on the way: an event of a
request that already ended counts as a duplicate.

Reported: sent, accepted, done, refused, errors (by code), **lost** (sent without a
terminal event), **duplicated**, **wrong** (tokens that differ), kills (and of those,
mid-batch), worker restarts, the requests the dead workers held (put back in the pool),
requests per second and e2e latency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import protocol as P
from ..client import status
from ..launch import launch
from .api_bench import ZERO_PROFILE


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=5.0, help="how long requests are sent and workers killed")
    p.add_argument("--workers", type=int, default=3, help="fake workers the daemon spawns")
    p.add_argument("--clients", type=int, default=4, help="client connections")
    p.add_argument("--window", type=int, default=4, help="requests in flight per connection")
    p.add_argument("--kill-every", type=float, default=2.0,
                   help="mean seconds between worker kills (0: none, a baseline)")
    p.add_argument("--decode-s", type=float, default=0.005, help="the fake engine's seconds per iteration")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--keep-dir", default=None, help="run the daemon in this directory and keep it (log)")


def reference_tokens(prompt: list[int], max_tokens: int, ignore_eos: bool) -> list[int]:
    """What the fake engine generates for a greedy request served in one pass."""
    from worker.engines.fake import FakeEngine

    out, _ = FakeEngine().serve(P.BatchMsg(batch_id=1, slice_len=10**6, requests=[
        P.BatchRequest(rid="r", token_ids=list(prompt), max_new_tokens=max_tokens, temperature=0.0,
                       ignore_eos=ignore_eos)]))
    return out[0].token_ids


@dataclass
class Tally:
    """What every connection saw, summed."""

    sent: int = 0
    accepted: int = 0
    done: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    duplicated: int = 0
    unexpected: int = 0
    """Events for no request sent on the connection (or none at all)."""
    wrong: int = 0
    latencies: list[float] = field(default_factory=list)
    examples: list[str] = field(default_factory=list)
    """The first few problems, for the report."""

    def problem(self, what: str) -> None:
        if len(self.examples) < 5:
            self.examples.append(what)


@dataclass
class _Req:
    spec: P.Generate
    t0: float
    accepted: bool = False
    tokens: list[int] = field(default_factory=list)


class ChaosClient:
    """One connection that keeps ``window`` requests in flight and checks what comes back."""

    def __init__(self, name: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 tally: Tally, window: int, rng: random.Random) -> None:
        self.name = name
        self.reader = reader
        self.writer = writer
        self.tally = tally
        self.rng = rng
        self.slots = asyncio.Semaphore(window)
        self.inflight: dict[str, _Req] = {}
        self.ended: set[str] = set()
        self.pong = asyncio.Event()
        self._n = 0

    def _next(self) -> P.Generate:
        self._n += 1
        rng = self.rng
        return P.Generate(id=f"{self.name}-{self._n}", max_tokens=rng.randint(1, 64), temperature=0.0,
                          prompt_ids=[rng.randrange(3, 256) for _ in range(rng.randint(1, 30))],
                          ignore_eos=rng.random() < 0.8, stream=rng.random() < 0.75)

    async def send_until(self, deadline: float) -> None:
        """Send requests, ``window`` at a time, until ``deadline`` (loop time)."""
        loop = asyncio.get_running_loop()
        while loop.time() < deadline:
            await self.slots.acquire()
            if loop.time() >= deadline:
                self.slots.release()
                return
            spec = self._next()
            assert spec.id is not None
            self.inflight[spec.id] = _Req(spec, loop.time())
            self.tally.sent += 1
            self.writer.write(P.frame(spec))

    async def read(self) -> None:
        """Read and check events until the connection closes."""
        while True:
            try:
                header = await self.reader.readexactly(P.FRAME_HEADER.size)
            except asyncio.IncompleteReadError:
                return
            (size,) = P.FRAME_HEADER.unpack(header)
            self._event(P.server_decoder.decode(await self.reader.readexactly(size)))

    def _event(self, ev: Any) -> None:
        if isinstance(ev, P.Pong):
            self.pong.set()
            return
        rid = getattr(ev, "id", None)
        if rid in self.ended:
            self.tally.duplicated += 1
            self.tally.problem(f"{type(ev).__name__} for {rid} after its terminal event")
            return
        req = self.inflight.get(rid) if isinstance(rid, str) else None
        if req is None:
            self.tally.unexpected += 1
            self.tally.problem(f"event for no request of ours: {ev!r}"[:200])
            return
        if isinstance(ev, P.Accepted):
            req.accepted = True
            self.tally.accepted += 1
        elif isinstance(ev, P.Delta):
            req.tokens += ev.token_ids
        elif isinstance(ev, (P.Done, P.Error)):
            self._end(req, ev)

    def _end(self, req: _Req, ev: P.Done | P.Error) -> None:
        spec = req.spec
        assert spec.id is not None and spec.prompt_ids is not None and spec.max_tokens is not None
        del self.inflight[spec.id]
        self.ended.add(spec.id)
        self.slots.release()
        t = self.tally
        if isinstance(ev, P.Error):
            (t.errors if req.accepted else t.refused)[ev.code] += 1
            t.problem(f"{spec.id}: error {ev.code}: {ev.message}")
            return
        t.done += 1
        t.latencies.append(asyncio.get_running_loop().time() - req.t0)
        got = req.tokens if spec.stream else (ev.token_ids or [])
        want = reference_tokens(spec.prompt_ids, spec.max_tokens, spec.ignore_eos)
        if not req.accepted or got != want or ev.usage.completion_tokens != len(got):
            t.wrong += 1
            t.problem(f"{spec.id}: {len(got)} tokens, {ev.usage.completion_tokens} counted, "
                      f"reference {len(want)}; equal: {got == want}")

    async def finish(self, timeout: float) -> None:
        """Wait (bounded) until every request sent has ended."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while self.inflight and loop.time() < end:
            await asyncio.sleep(0.05)

    async def ping(self, timeout: float = 30.0) -> None:
        """A round trip: whatever the daemon sent before the pong has been read."""
        self.pong.clear()
        self.writer.write(P.frame(P.Ping(nonce=1)))
        await asyncio.wait_for(self.pong.wait(), timeout)


@dataclass
class Killer:
    """SIGKILLs a registered worker every ``every`` seconds on average (one with a batch in
    flight when there is one)."""

    status_sock: str
    every: float
    rng: random.Random
    kills: int = 0
    mid_batch: int = 0

    async def run(self, deadline: float) -> None:
        """Kill until ``deadline`` (loop time); ``every = 0``: no kills (a baseline)."""
        loop = asyncio.get_running_loop()
        if self.every <= 0:
            return
        while True:
            wake = loop.time() + self.every * self.rng.uniform(0.5, 1.5)
            await asyncio.sleep(max(0.0, min(wake, deadline) - loop.time()))
            if loop.time() >= deadline:
                return
            st = await asyncio.to_thread(status, self.status_sock, timeout=10)
            busy = [w for w in st.workers if w.batches_inflight > 0]
            pool = busy or st.workers
            if not pool:
                continue  # every worker is restarting
            victim = self.rng.choice(pool)
            try:
                os.kill(victim.pid, signal.SIGKILL)
            except ProcessLookupError:
                continue  # it died already; the daemon has not seen it yet
            self.kills += 1
            self.mid_batch += bool(busy)


async def _progress(tally: Tally, killer: Killer, t0: float, deadline: float, every_s: float) -> None:
    """A line on stderr every ``every_s`` seconds while requests are sent."""
    loop = asyncio.get_running_loop()
    while (now := loop.time()) < deadline:
        await asyncio.sleep(min(every_s, deadline - now))
        print(f"  {loop.time() - t0:5.0f}s: {tally.sent} sent, {tally.done} done, {killer.kills} kills, "
              f"{tally.duplicated} duplicated, {tally.wrong} wrong", file=sys.stderr, flush=True)


async def drive(sock: str, status_sock: str, *, seconds: float, clients: int, window: int,
                kill_every: float, seed: int, settle_s: float = 120.0,
                progress_s: float = 0.0) -> dict[str, Any]:
    """Requests on ``clients`` connections and kills for ``seconds``; then wait for every
    request (at most ``settle_s``), a settled daemon and a ping round trip per connection.
    With ``progress_s`` > 0, a progress line on stderr that often."""
    rng = random.Random(seed)
    tally = Tally()
    conns = []
    for i in range(clients):
        reader, writer = await asyncio.open_unix_connection(sock, limit=1 << 22)
        conns.append(ChaosClient(f"c{i}", reader, writer, tally, window, random.Random(rng.random())))
    readers = [asyncio.create_task(c.read(), name=f"read-{c.name}") for c in conns]
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    deadline = t0 + seconds
    killer = Killer(status_sock, kill_every, random.Random(rng.random()))
    shown = (_progress(tally, killer, t0, deadline, progress_s),) if progress_s > 0 else ()
    await asyncio.gather(killer.run(deadline), *(c.send_until(deadline) for c in conns), *shown)
    await asyncio.gather(*(c.finish(settle_s) for c in conns))
    wall = loop.time() - t0
    st = await asyncio.to_thread(_settled, status_sock, settle_s)
    for c in conns:
        await c.ping()
        c.writer.close()
    await asyncio.gather(*readers)  # a reader's failure (a bad frame) is raised here
    lat = sorted(tally.latencies)
    return {
        "seconds": round(seconds, 1), "workers": len(st.workers), "clients": clients, "window": window,
        "sent": tally.sent, "accepted": tally.accepted, "done": tally.done,
        "refused": dict(tally.refused), "errors": dict(tally.errors),
        "lost": sum(len(c.inflight) for c in conns), "duplicated": tally.duplicated, "wrong": tally.wrong,
        "unexpected": tally.unexpected,
        "kills": killer.kills, "kills_mid_batch": killer.mid_batch,
        "worker_restarts": st.counters.get("worker_restarts", 0),
        "requests_per_s": round(tally.done / wall, 1) if wall > 0 else 0.0,
        "e2e_p50_s": round(lat[len(lat) // 2], 3) if lat else None,
        "e2e_p99_s": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))], 3) if lat else None,
        "problems": tally.examples,
    }


def _settled(status_sock: str, timeout: float) -> P.StatusSnapshot:
    """The daemon's status once it holds no request and no worker has a batch out (after
    that no event of any request can come)."""
    end = time.monotonic() + timeout
    while True:
        st = status(status_sock, timeout=10)
        if st.live_requests == 0 and not any(w.batches_inflight for w in st.workers):
            return st
        if time.monotonic() > end:
            raise RuntimeError(f"the daemon did not settle within {timeout:.0f}s: "
                               f"{st.live_requests} live requests")
        time.sleep(0.1)


def sections(workers: int, decode_s: float, profile: Path, log_level: str = "warning") -> dict[str, Any]:
    """The daemon's config: fake workers restarted at once and never given up on (each kill
    is deliberate, not a crash loop), and no failure limit per request (a request may lose
    any number of slices to kills, none of them its fault, and must still be served, so its
    tokens can be checked)."""
    return {
        "daemon": {"log_level": log_level, "heartbeat_interval_s": 0.25, "heartbeat_timeout_s": 5.0},
        "model": {"name": "fake"},
        "scheduler": {"policy": "scls", "slice_len": 8, "gamma_s": 0.02, "profile": str(profile),
                      "max_failures": 1_000_000, "max_worker_losses": 0},
        "workers": {"spawn": workers, "engine": "fake", "threads": 1, "restart_backoff_s": 0.2,
                    "quick_failure_s": 0.0, "options": {"decode_s": decode_s}},
    }


def run_chaos(*, seconds: float, workers: int = 3, clients: int = 4, window: int = 4, kill_every: float = 2.0,
              decode_s: float = 0.005, seed: int = 1, dir: str | None = None,
              log_level: str = "warning", progress_s: float = 0.0) -> dict[str, Any]:
    """Start a daemon, :func:`drive` it, stop it; the result, with the daemon's exit code."""
    with tempfile.TemporaryDirectory(prefix="sclsd-chaos-") as tmp:
        profile = Path(tmp) / "zero-profile.json"
        profile.write_text(json.dumps(ZERO_PROFILE))
        d = launch(sections(workers, decode_s, profile, log_level), dir=dir, wait_workers=workers)
        try:
            result = asyncio.run(drive(d.sock, d.status_sock, seconds=seconds, clients=clients, window=window,
                                       kill_every=kill_every, seed=seed, progress_s=progress_s))
            # The daemon logs each dead worker's requests as it puts them back in the pool.
            result["requests_hit_by_kills"] = sum(
                int(n) for n in re.findall(r"worker=\S+ lost with (\d+) requests", d.log.read_text()))
        except BaseException:
            print(d.log_text(), file=sys.stderr)
            raise
        finally:
            code = d.stop()
    result["daemon_exit"] = code
    return result


def ok(result: dict[str, Any]) -> bool:
    """Nothing lost, nothing duplicated, every token right, every request served."""
    return (result["lost"] == 0 and result["duplicated"] == 0 and result["wrong"] == 0
            and result["unexpected"] == 0 and not result["errors"] and result["daemon_exit"] == 0)


def run(args: argparse.Namespace) -> int:
    bad = [f"--{k.replace('_', '-')} must be {why}" for k, ok_, why in (
        ("minutes", args.minutes > 0, "> 0"), ("workers", 1 <= args.workers <= 64, "in 1..64"),
        ("clients", args.clients >= 1, ">= 1"), ("window", args.window >= 1, ">= 1"),
        ("kill_every", args.kill_every >= 0, ">= 0"), ("decode_s", args.decode_s >= 0, ">= 0")) if not ok_]
    if bad:
        print(f"sclsd-bench chaos: {'; '.join(bad)}", file=sys.stderr)
        return 2
    kills = f"a kill every ~{args.kill_every:g}s" if args.kill_every > 0 else "no kills"
    print(f"chaos: {args.workers} fake workers, {args.clients} clients x {args.window} requests, "
          f"{kills}, for {args.minutes:g} min ...", file=sys.stderr)
    result = run_chaos(seconds=args.minutes * 60, workers=args.workers, clients=args.clients,
                       window=args.window, kill_every=args.kill_every, decode_s=args.decode_s,
                       seed=args.seed, dir=args.keep_dir, progress_s=15.0)
    if args.json:
        print(json.dumps(result))
    else:
        print(", ".join(f"{k}={v}" for k, v in result.items()))
    return 0 if ok(result) else 1
