"""``sclsd-bench grammars``: what other clients' hostile grammars cost a bystander.

One daemon (``--engine hf-cb`` on ``--model tiny-random`` by default, the default
``[grammar]``: 2 child processes, 5 s a check) and two cases:

* **http**: ``sclsd-http`` in front of it (its 4 daemon connections carry every HTTP
  user). ``--bystanders`` threads of user ``bystander`` send plain 8-token completions
  one after another, while ``--attackers`` requests of user ``attacker`` each ask for
  ``n = --n`` choices under a hostile JSON schema (an ``allOf`` of ``--patterns``
  patterns, about 5 KB: it runs llguidance out of time or memory, and is refused).
  Reported: the bystander's latencies while the attack lasts (p50, max), alone before
  it (p50), and how long the attack took to be refused.
* **unix**: ``--hostile`` clients on the Unix socket each send one hostile grammar at
  once (distinct schemas, so no check is shared or cached), then a bystander sends one
  small request under a valid schema ``--after`` seconds later: first from the hostile
  clients' own process (each of them is a group of that process: the bystander's turn
  comes after each one's first try), then from a process of its own (the next turn goes
  to another process). Reported: the bystander's end-to-end seconds each way, and when
  the hostile ones were refused (the first way; the second way they disconnect once the
  bystander is served, which stops their checks).

Progress goes to stderr; the table to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import statistics
import sys
import threading
import time
from typing import Any

from .. import protocol as P
from ..client import AsyncClient, RequestError
from ..http.process import start_http, stop_http
from ..launch import launch

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


def hostile_schema(patterns: int, salt: int = 0) -> dict[str, Any]:
    """An ``allOf`` of ``patterns`` regexes: llguidance builds their intersection, which
    takes it past ``grammar.timeout_s`` or ``memory_bytes`` (tests/integration/
    test_hostile_grammars.py's ``all_of``); ``salt`` makes distinct schemas."""
    pats = [{"pattern": f"^(a|b)*{'x' * (i % 7)}.*c{i}.*$"} for i in range(patterns)]
    return {"type": "string", "allOf": pats, "description": f"s{salt}"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", default="hf-cb")
    p.add_argument("--model", default="tiny-random")
    p.add_argument("--case", choices=["http", "unix", "both"], default="both")
    p.add_argument("--n", type=int, default=24, help="choices of each hostile HTTP request")
    p.add_argument("--attackers", type=int, default=1, help="hostile HTTP requests at once")
    p.add_argument("--bystanders", type=int, default=4, help="threads sending plain HTTP completions")
    p.add_argument("--patterns", type=int, default=150, help="patterns in the hostile allOf")
    p.add_argument("--hostile", type=int, default=16, help="hostile grammars at once on the Unix socket")
    p.add_argument("--after", type=float, default=0.3, help="seconds between them and the bystander")
    p.add_argument("--limit", type=float, default=900.0, help="give up on the attack after this many seconds")


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _post(url: str, body: dict[str, Any], timeout: float) -> tuple[int, float, str]:
    """(HTTP status, seconds, body's start) of one POST /v1/completions."""
    host = url.split("//", 1)[1].rstrip("/")
    conn = http.client.HTTPConnection(host, timeout=timeout)
    t0 = time.monotonic()
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        text = resp.read().decode(errors="replace")
        return resp.status, time.monotonic() - t0, text[:200]
    finally:
        conn.close()


def _plain(url: str, limit: float) -> tuple[int, float, str]:
    return _post(url, {"prompt": "Hello there", "max_tokens": 8, "temperature": 0, "user": "bystander"}, limit)


def http_case(url: str, args: argparse.Namespace) -> dict[str, Any]:
    alone = [_plain(url, args.limit)[1] for _ in range(8)]
    _say(f"  bystander alone: p50 {statistics.median(alone):.2f}s")
    stop = threading.Event()
    during: list[float] = []
    failed: list[str] = []

    def bystander() -> None:
        while not stop.is_set():
            status, took, text = _plain(url, args.limit)
            (during.append(took) if status == 200 else failed.append(f"{status} {text}"))

    attack_out: list[tuple[int, float, str]] = []

    def attacker(i: int) -> None:
        body = {"prompt": "Write JSON", "max_tokens": 8, "n": args.n, "temperature": 1.0, "user": "attacker",
                "response_format": {"type": "json_schema", "json_schema": {
                    "name": "x", "schema": hostile_schema(args.patterns, i)}}}
        attack_out.append(_post(url, body, args.limit))

    threads = [threading.Thread(target=bystander, daemon=True) for _ in range(args.bystanders)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    size = len(json.dumps(hostile_schema(args.patterns)))
    _say(f"  {args.attackers} attacker(s): n = {args.n}, schema {size} bytes ...")
    t0 = time.monotonic()
    attackers = [threading.Thread(target=attacker, args=(i,), daemon=True) for i in range(args.attackers)]
    for t in attackers:
        t.start()
    seen = 0
    while any(t.is_alive() for t in attackers):
        time.sleep(1.0)
        if len(during) != seen:
            seen = len(during)
            _say(f"  {time.monotonic() - t0:5.0f}s: {seen} bystander completions, slowest {max(during):.2f}s")
    attack_s = time.monotonic() - t0
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join(args.limit)
    statuses = sorted({s for s, _, _ in attack_out})
    _say(f"  attack answered {statuses} in {attack_s:.1f}s: {attack_out[0][2][:120] if attack_out else ''}")
    return {"alone_p50_s": statistics.median(alone), "during_p50_s": statistics.median(during) if during else None,
            "during_max_s": max(during) if during else None, "during_count": len(during),
            "failed": failed[:3], "attack_s": attack_s, "attack_status": statuses}


#: The bystander of the Unix case in a process of its own: prints its end-to-end seconds.
_OTHER_PROCESS = ("import asyncio, json, sys, time; from sclsd.client import AsyncClient; "
                  "from sclsd import protocol as P\n"
                  "async def go():\n"
                  "    async with AsyncClient(sys.argv[1]) as c:\n"
                  "        t = time.monotonic()\n"
                  "        await c.complete(prompt='json please', max_tokens=8, temperature=0.0, "
                  "structured=P.Structured(kind='json_schema', value=sys.argv[2]))\n"
                  "        print(time.monotonic() - t)\n"
                  "asyncio.run(go())")


async def unix_case(sock: str, args: argparse.Namespace, own_process: bool) -> dict[str, Any]:
    refused: list[float] = []
    t0 = time.monotonic()
    salt = 2000 if own_process else 1000

    async def hostile(i: int) -> None:
        async with AsyncClient(sock) as c:
            s = P.Structured(kind="json_schema", value=json.dumps(hostile_schema(args.patterns, salt + i)))
            try:
                await c.complete(prompt="hostile", max_tokens=8, structured=s)
            except RequestError:
                refused.append(time.monotonic() - t0)

    tasks = [asyncio.create_task(hostile(i)) for i in range(args.hostile)]
    await asyncio.sleep(args.after)
    schema = json.dumps({**SCHEMA, "description": f"bystander {salt}"})  # not in the cache
    if own_process:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", _OTHER_PROCESS, sock, schema,
                                                    stdout=asyncio.subprocess.PIPE)
        out, _ = await proc.communicate()
        waited = float(out.decode().split()[-1])
        _say(f"  valid-schema bystander in its own process: {waited:.2f}s; the hostile clients leave")
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return {"bystander_s": waited}
    async with AsyncClient(sock) as c:
        t1 = time.monotonic()
        done = await c.complete(prompt="json please", max_tokens=8, temperature=0.0,
                                structured=P.Structured(kind="json_schema", value=schema))
        waited = time.monotonic() - t1
    _say(f"  valid-schema bystander in their process: {waited:.2f}s ({done.finish_reason}); waiting for "
         "the hostile ones ...")
    await asyncio.gather(*tasks)
    _say(f"  {len(refused)}/{args.hostile} hostile refused, the last at {max(refused or [0]):.1f}s")
    return {"bystander_s": waited, "refused": len(refused), "last_refused_s": max(refused or [0.0])}


def run(args: argparse.Namespace) -> int:
    sections: dict[str, dict[str, Any]] = {
        "model": {"name": args.model},
        "scheduler": {"policy": "scls-cb" if args.engine == "hf-cb" else "scls"},
        "workers": {"spawn": 1, "engine": args.engine},
    }
    _say(f"starting sclsd ({args.engine} on {args.model}) ...")
    out: dict[str, Any] = {}
    with launch(sections, wait_workers=1, timeout=600) as d:
        if args.case in ("http", "both"):
            proc, url = start_http(d.sock, d.status_sock)
            try:
                _say(f"http case through sclsd-http at {url}:")
                out["http"] = http_case(url, args)
            finally:
                stop_http(proc)
        if args.case in ("unix", "both"):
            _say("unix case:")
            out["unix"] = asyncio.run(unix_case(d.sock, args, own_process=False))
            out["unix_other"] = asyncio.run(unix_case(d.sock, args, own_process=True))
    if "http" in out:
        h = out["http"]
        print(f"| sclsd-http, {args.attackers} × n = {args.n} hostile | |\n|---|---:|\n"
              f"| bystander alone, p50 s | {h['alone_p50_s']:.2f} |\n"
              f"| bystander during the attack, p50 s | {h['during_p50_s'] or 0:.2f} |\n"
              f"| bystander during the attack, max s | {h['during_max_s'] or 0:.2f} |\n"
              f"| bystander completions during it | {h['during_count']} |\n"
              f"| attack refused after s (HTTP {h['attack_status']}) | {h['attack_s']:.1f} |")
    if "unix" in out:
        u = out["unix"]
        print(f"\n| Unix socket, {args.hostile} hostile grammars at once | |\n|---|---:|\n"
              f"| valid-schema bystander in the hostile clients' process, s | {u['bystander_s']:.2f} |\n"
              f"| valid-schema bystander in a process of its own, s | {out['unix_other']['bystander_s']:.2f} |\n"
              f"| hostile refused | {u['refused']} / {args.hostile} |\n"
              f"| last hostile refused after s | {u['last_refused_s']:.1f} |")
    print(json.dumps(out), file=sys.stderr)
    return 0
