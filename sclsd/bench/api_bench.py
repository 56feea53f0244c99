"""``sclsd-bench api``: the daemon's own request rate, end to end through the Unix socket.

It starts its own daemon (in a temporary directory) with ``fake`` workers that
take zero time, so every microsecond measured is the daemon's: framing and
decoding on the client socket, admission, the scheduling round (DP batcher,
offloader), the ZeroMQ hop to a worker and back, detokenizing, the terminal
event and the metrics.

Two phases, after a warm-up:

* **throughput**: ``--connections`` client connections each keep ``--inflight``
  requests outstanding (a closed loop) for ``--duration`` seconds; ``rps`` is
  the number of requests that completed in that window divided by its length;
* **overhead**: one connection sends ``--latency-requests`` requests one after
  the other; since the engine takes no time, the client-measured end-to-end
  latency of each is the daemon's overhead (``p50/p99_overhead_ms``).

::

    sclsd-bench api --json out/api.json
    {"rps": ..., "p99_overhead_ms": ..., ...}

The scheduler runs the real ``scls`` policy on a near-zero cost profile (a
batch is estimated at tens of microseconds, so the adaptive interval is Γ,
``--gamma``). Requests are token ids (no tokenizer work) and non-streaming
unless ``--stream``.

``--http`` measures the same through one ``sclsd-http`` process in front of the
daemon (started here, or the one at ``--http-url``): ``POST /v1/completions``
with the prompt as token ids, HTTP/1.1 keep-alive, one request at a time per
connection (``--connections`` × ``--inflight`` connections).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import resource
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

import msgspec

from .. import protocol as P
from ..http.process import start_http, stop_http
from ..launch import launch

#: Cost profile of a zero-time engine: a few microseconds per batch and per row, so the
#: DP batcher still prefers one big batch to many small ones (as on a real engine).
ZERO_PROFILE: dict[str, Any] = {
    "name": "zero-time-fake",
    "engine": "fake",
    "model": "fake",
    "device": "cpu",
    "source": "design-table",
    "coefficients": {"p1": 0.0, "p2": 1e-6, "p3": 0.0, "p4": 2e-5,
                     "d1": 0.0, "d2": 0.0, "d3": 0.0, "d4": 1e-6},
    "kv_bytes_per_token": 46080,
    "mem_available": 4294967296.0,
    "rules": None,
    "notes": "sclsd-bench api: fake engine with decode_s = 0",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``sclsd-bench api``."""
    p.add_argument("--workers", type=int, default=2, help="fake workers the daemon spawns")
    p.add_argument("--connections", type=int, default=32, help="client connections (throughput phase)")
    p.add_argument("--inflight", type=int, default=16, help="outstanding requests per connection")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of the throughput phase")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds of load before measuring")
    p.add_argument("--latency-requests", type=int, default=1000,
                   help="sequential requests of the overhead phase")
    p.add_argument("--prompt-len", type=int, default=16, help="prompt tokens per request")
    p.add_argument("--max-tokens", type=int, default=4, help="tokens generated per request (ignore_eos)")
    p.add_argument("--slice-len", type=int, default=16, help="slice length S")
    p.add_argument("--gamma", type=float, default=0.002, help="scheduler.gamma_s (minimal interval Γ)")
    p.add_argument("--stream", action="store_true", help="streaming requests (a delta per slice)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="the daemon's log level (info, the default, logs a line per request)")
    p.add_argument("--json", dest="json_out", help="write the result here")
    p.add_argument("--keep-dir", help="run the daemon in this directory and keep it (logs)")
    p.add_argument("--socket", help="measure an already running daemon at this client socket instead "
                   "(e.g. one under a profiler); its config is then yours to choose")
    p.add_argument("--http", action="store_true",
                   help="through one sclsd-http process (POST /v1/completions) instead of the Unix socket")
    p.add_argument("--http-url", help="with --http: measure the sclsd-http at this URL instead of starting one")
    p.add_argument("--no-progress", action="store_true")


class _Conn(asyncio.Protocol):
    """A lean pipelining client connection: frames in, completions counted."""

    def __init__(self, bench: _Bench, cid: int) -> None:
        self.bench = bench
        self.cid = cid
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.sent: dict[str, float] = {}
        self.seq = 0
        self.lost = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(exc)
        self.bench.conn_lost(self, exc)

    def submit(self) -> None:
        self.seq += 1
        rid = f"{self.cid}-{self.seq}"
        self.sent[rid] = time.perf_counter()
        assert self.transport is not None
        self.transport.write(self.bench.frame_for(rid))

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        pos = 0
        n = len(buf)
        decode = P.server_decoder.decode
        while n - pos >= 4:
            size = int.from_bytes(buf[pos:pos + 4], "big")
            if n - pos - 4 < size:
                break
            ev = decode(buf[pos + 4:pos + 4 + size])
            pos += 4 + size
            if isinstance(ev, P.Done):
                t0 = self.sent.pop(ev.id)
                self.bench.completed(self, time.perf_counter() - t0, ev)
            elif isinstance(ev, P.Error):
                self.sent.pop(ev.id or "", None)
                self.bench.failed(self, ev)
        del buf[:pos]


class _Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        rng = random.Random(0)
        self.prompt = [rng.randrange(3, 256) for _ in range(args.prompt_len)]
        self.template = P.Generate(prompt_ids=self.prompt, max_tokens=args.max_tokens, temperature=0.0,
                                   ignore_eos=True, stream=args.stream, id="x")
        self.running = True
        self.measuring = False
        self.done = 0
        self.window_done = 0
        self.errors: dict[str, int] = {}
        self.lat: list[float] = []
        self.server_lat: list[float] = []
        self.wrong_length = 0
        self.idle = asyncio.Event()
        body = msgspec.json.encode({"model": "fake", "prompt": self.prompt, "max_tokens": args.max_tokens,
                                    "temperature": 0, "ignore_eos": True, "stream": False})
        self.http_request = (b"POST /v1/completions HTTP/1.1\r\nHost: sclsd\r\n"
                             b"Content-Type: application/json\r\nContent-Length: "
                             + str(len(body)).encode() + b"\r\n\r\n" + body)

    def frame_for(self, rid: str) -> bytes:
        return P.frame(msgspec.structs.replace(self.template, id=rid))

    def completed(self, conn: _Conn, seconds: float, ev: P.Done) -> None:
        self.done += 1
        if ev.usage.completion_tokens != self.args.max_tokens:
            self.wrong_length += 1
        if self.measuring:
            self.window_done += 1
            self.lat.append(seconds)
            self.server_lat.append(ev.timings.e2e_s)
        if self.running:
            conn.submit()
        elif not conn.sent:
            self.idle.set()

    def completed_http(self, conn: _HttpConn, seconds: float, tokens: int) -> None:
        """An HTTP completion (the server's timings are not in OpenAI's response)."""
        self.done += 1
        if tokens != self.args.max_tokens:
            self.wrong_length += 1
        if self.measuring:
            self.window_done += 1
            self.lat.append(seconds)
        if self.running:
            conn.submit()
        elif not conn.sent:
            self.idle.set()

    def failed(self, conn: _Conn | _HttpConn, ev: P.Error) -> None:
        self.errors[ev.code] = self.errors.get(ev.code, 0) + 1
        if not self.running and not conn.sent:
            self.idle.set()

    def conn_lost(self, conn: _Conn | _HttpConn, exc: Exception | None) -> None:
        if self.running:
            self.errors["connection_lost"] = self.errors.get("connection_lost", 0) + 1


class _HttpConn(asyncio.Protocol):
    """A keep-alive HTTP/1.1 connection to sclsd-http, one request at a time: the same
    counting as :class:`_Conn` (ids are the server's, so completions are matched in order)."""

    def __init__(self, bench: _Bench, cid: int) -> None:
        self.bench = bench
        self.cid = cid
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.sent: deque[float] = deque()
        self.lost = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(exc)
        self.bench.conn_lost(self, exc)

    def submit(self) -> None:
        self.sent.append(time.perf_counter())
        assert self.transport is not None
        self.transport.write(self.bench.http_request)

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(buf[:end]).lower()
            i = head.find(b"content-length:")
            size = int(head[i + 15:head.index(b"\r\n", i) if b"\r\n" in head[i:] else None]) if i >= 0 else 0
            if len(buf) < end + 4 + size:
                return
            body = bytes(buf[end + 4:end + 4 + size])
            del buf[:end + 4 + size]
            status = int(head[9:12])
            t0 = self.sent.popleft()
            doc = msgspec.json.decode(body)
            if status == 200:
                self.bench.completed_http(self, time.perf_counter() - t0, doc["usage"]["completion_tokens"])
            else:
                self.bench.failed(self, P.Error(code=doc["error"]["code"], message=doc["error"]["message"]))


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


async def _connect(bench: _Bench, path: str, cid: int) -> Any:
    """A connection to the daemon's socket, or to sclsd-http when ``path`` is a URL."""
    loop = asyncio.get_running_loop()
    if path.startswith("http://"):
        host, _, port = path.removeprefix("http://").rstrip("/").rpartition(":")
        _, hconn = await loop.create_connection(lambda: _HttpConn(bench, cid), host.strip("[]"), int(port))
        return hconn
    _, conn = await loop.create_unix_connection(lambda: _Conn(bench, cid), path)
    return conn


async def _throughput(args: argparse.Namespace, sock: str) -> dict[str, Any]:
    bench = _Bench(args)
    if sock.startswith("http://"):  # one request at a time per HTTP connection
        conns = [await _connect(bench, sock, i) for i in range(args.connections * args.inflight)]
        for c in conns:
            c.submit()
    else:
        conns = [await _connect(bench, sock, i) for i in range(args.connections)]
        for c in conns:
            for _ in range(args.inflight):
                c.submit()
    say = (lambda *_: None) if args.no_progress else (lambda m: print(m, file=sys.stderr, flush=True))
    t_start = time.perf_counter()
    await asyncio.sleep(args.warmup)
    say(f"  warm-up: {bench.done} requests in {args.warmup:.0f}s")
    bench.measuring = True
    t0 = time.perf_counter()
    last, last_t = bench.window_done, t0
    while time.perf_counter() - t0 < args.duration:
        await asyncio.sleep(min(1.0, args.duration - (time.perf_counter() - t0)))
        now = time.perf_counter()
        say(f"  t={now - t0:4.1f}s  done={bench.window_done}  "
            f"rate={(bench.window_done - last) / max(1e-9, now - last_t):.0f}/s  errors={sum(bench.errors.values())}")
        last, last_t = bench.window_done, now
    bench.measuring = False
    elapsed = time.perf_counter() - t0
    window = bench.window_done
    # Let every outstanding request finish: nothing may be lost.
    bench.running = False
    deadline = time.perf_counter() + 60
    while any(c.sent for c in conns) and time.perf_counter() < deadline:
        bench.idle.clear()
        try:
            await asyncio.wait_for(bench.idle.wait(), 1.0)
        except asyncio.TimeoutError:
            pass
    outstanding = sum(len(c.sent) for c in conns)
    for c in conns:
        assert c.transport is not None
        c.transport.close()
    return {
        "rps": window / elapsed,
        "measured_requests": window,
        "measured_s": elapsed,
        "total_requests": bench.done,
        "total_s": time.perf_counter() - t_start,
        "saturated_p50_ms": _pct(bench.lat, 0.50) * 1e3,
        "saturated_p99_ms": _pct(bench.lat, 0.99) * 1e3,
        "saturated_daemon_p99_ms": _pct(bench.server_lat, 0.99) * 1e3,
        "errors": dict(bench.errors),
        "lost": outstanding,
        "wrong_length": bench.wrong_length,
    }


async def _overhead_phase(args: argparse.Namespace, sock: str) -> dict[str, Any]:
    bench = _Bench(args)
    bench.running = False
    bench.measuring = True
    conn = await _connect(bench, sock, 10_000)
    for _ in range(args.latency_requests):
        bench.idle.clear()
        conn.submit()
        await asyncio.wait_for(bench.idle.wait(), 30)
    assert conn.transport is not None
    conn.transport.close()
    return {
        "p50_overhead_ms": _pct(bench.lat, 0.50) * 1e3,
        "p99_overhead_ms": _pct(bench.lat, 0.99) * 1e3,
        "max_overhead_ms": max(bench.lat) * 1e3 if bench.lat else float("nan"),
        "latency_requests": bench.done,
        "latency_errors": dict(bench.errors),
    }


def _cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc; None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _raise_nofile(want: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(want, soft)), hard))


def run(args: argparse.Namespace) -> int:
    """Start a daemon with zero-time fake workers, measure, print and write the JSON."""
    _raise_nofile(args.connections * (args.inflight if args.http else 1) + 64)
    profile_dir = tempfile.TemporaryDirectory(prefix="sclsd-api-")
    profile = Path(profile_dir.name) / "zero.json"
    profile.write_text(json.dumps(ZERO_PROFILE))
    sections = {
        "daemon": {"log_level": args.log_level, "heartbeat_interval_s": 1.0},
        "model": {"name": "fake"},
        "scheduler": {"policy": "scls", "slice_len": args.slice_len, "gamma_s": args.gamma,
                      "profile": str(profile)},
        "workers": {"spawn": args.workers, "engine": "fake", "threads": 1, "restart_backoff_s": 0.2,
                    "options": {"decode_s": 0.0}},
    }
    say = (lambda *_: None) if args.no_progress else (lambda m: print(m, file=sys.stderr, flush=True))
    runner: Any = asyncio.run
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover
        pass
    http: subprocess.Popen[str] | None = None
    if args.socket or (args.http and args.http_url):
        profile_dir.cleanup()
        target = args.http_url if args.http else args.socket
        thr = runner(_throughput(args, target))
        ovh = runner(_overhead_phase(args, target))
        st: dict[str, Any] = {"live_requests": None, "counters": {}}
        rc = 0
    else:
        d = launch(sections, dir=args.keep_dir)
        try:
            say(f"sclsd-bench api: daemon in {d.dir}, {args.workers} zero-time fake workers")
            d.wait_workers(args.workers, timeout=120, progress=not args.no_progress)
            target = d.sock
            if args.http:
                http, target = start_http(d.sock, d.status_sock)
                say(f"through sclsd-http at {target}: {args.connections * args.inflight} connections, "
                    "one request at a time each")
            say(f"throughput: {args.connections} connections x {args.inflight} in flight, "
                f"{args.duration:.0f}s after {args.warmup:.0f}s warm-up")
            cpu0 = _cpu_s(http.pid) if http is not None else None
            thr = runner(_throughput(args, target))
            cpu1 = _cpu_s(http.pid) if http is not None else None
            if cpu0 is not None and cpu1 is not None and thr["total_requests"]:
                # What one request costs sclsd-http: its ceiling on one core is 1e6 / this.
                thr["http_cpu_us_per_request"] = (cpu1 - cpu0) / thr["total_requests"] * 1e6
            say(f"overhead: {args.latency_requests} sequential requests on one connection")
            ovh = runner(_overhead_phase(args, target))
            st = msgspec.to_builtins(d.status())
            if http is not None and stop_http(http) != 0:
                thr["errors"]["http_exit"] = http.returncode
            rc = d.stop()
        finally:
            if http is not None and http.poll() is None:
                http.kill()
            d.stop()
            profile_dir.cleanup()
    result: dict[str, Any] = {
        "rps": round(thr["rps"], 1),
        "p99_overhead_ms": round(ovh["p99_overhead_ms"], 3),
        "p50_overhead_ms": round(ovh["p50_overhead_ms"], 3),
        "max_overhead_ms": round(ovh["max_overhead_ms"], 3),
        "saturated_p50_ms": round(thr["saturated_p50_ms"], 3),
        "saturated_p99_ms": round(thr["saturated_p99_ms"], 3),
        # None over HTTP: OpenAI's response carries no server-side timings.
        "saturated_daemon_p99_ms": (None if thr["saturated_daemon_p99_ms"] != thr["saturated_daemon_p99_ms"]
                                    else round(thr["saturated_daemon_p99_ms"], 3)),
        "measured_requests": thr["measured_requests"],
        "measured_s": round(thr["measured_s"], 3),
        "total_requests": thr["total_requests"] + ovh["latency_requests"],
        "errors": {**thr["errors"], **{f"latency_{k}": v for k, v in ovh["latency_errors"].items()}},
        "lost": thr["lost"],
        "http_cpu_us_per_request": (round(thr["http_cpu_us_per_request"], 1)
                                    if "http_cpu_us_per_request" in thr else None),
        "wrong_length": thr["wrong_length"],
        "daemon_live_after": st["live_requests"],
        "daemon_finished": (st.get("counters") or {}).get("finished"),
        "daemon_exit_code": rc,
        "config": {
            "workers": args.workers, "connections": args.connections, "inflight": args.inflight,
            "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "slice_len": args.slice_len,
            "gamma_s": args.gamma, "stream": args.stream, "daemon_log_level": args.log_level,
            "via": "http" if args.http else "unix",
        },
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform()},
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(text + "\n")
    ok = not result["errors"] and result["lost"] == 0 and result["wrong_length"] == 0 and rc == 0
    if not ok:
        print("sclsd-bench api: requests were lost or failed (see errors/lost above)", file=sys.stderr)
    return 0 if ok else 1
