"""``sclsd-bench rates``: the daemon at GPU token rates.

A daemon under the default policy (``scls-cb``) with ``--workers`` fake workers that batch
continuously (:mod:`worker.engines.fake_cb`): each runs up to ``--rows`` rows and gives
every one a token each ``--decode-s`` (8 workers × 64 rows at 10 ms: 51,200 tokens/s
offered, what a box of eight GPUs serving a 7B model decodes). ``--clients`` streaming
clients (:class:`sclsd.client.AsyncClient`, spread over ``--connections`` connections to
the Unix socket and ``--client-procs`` processes) each keep one request in flight, a
closed loop: ``--prompt-len`` prompt token ids, ``--tokens`` output tokens (``ignore_eos``,
greedy). After ``--warmup`` seconds the run is measured for ``--duration``:

* tokens/s delivered to the clients (in ``delta`` events) against those offered
  (``workers × rows / decode_s``), and the share delivered;
* the CPU of the daemon's process (user + system seconds over the wall time, from
  ``/proc/<pid>/stat``: the cores it used), and its CPU-µs per streamed token; the
  workers' and the clients' CPU likewise, since on a small machine they share its cores;
* grants per second and the share of them sent whole (the daemon's ``grants``,
  ``migrations`` and ``accepted`` counters: a request's first grant, and one placed away
  from the worker that holds it, carry its context; the others are deltas), and from
  those the bytes a grant takes on the worker link (:func:`link_bytes`);
* each request's longest wait between two deltas (p50, p99) and whether every request got
  exactly ``--tokens`` tokens.

``--short-tokens N`` runs a second phase with N-token outputs on the same daemon: the
daemon's CPU per streamed token at short against long outputs. The bytes of one grant as
the daemon encodes it (:func:`grant_bytes`: the request sent whole, its later grants to the
worker that holds it, one moved to another worker) are computed for ``--contexts`` without
a daemon.

``--cprofile PATH`` runs the daemon under ``python -m cProfile`` (its event loop's thread)
and writes the profile at its exit; the timings of such a run are not the daemon's own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import queue
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .. import protocol as P
from ..defaults import offline_env
from ..launch import DaemonProcess, launch, short_dir, toml_text

#: Llama-2's vocabulary: token ids as a 7B model's contexts hold them (msgpack: 3 bytes each).
DEFAULT_VOCAB = 32_000


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``sclsd-bench rates``."""
    p.add_argument("--workers", type=int, default=8, help="fake workers the daemon spawns")
    p.add_argument("--rows", type=int, default=64, help="rows each worker runs at once (max_rows)")
    p.add_argument("--decode-s", type=float, default=0.01, help="seconds per step of every row")
    p.add_argument("--clients", type=int, default=512, help="streaming requests kept in flight")
    p.add_argument("--connections", type=int, default=64, help="client connections they share")
    p.add_argument("--client-procs", type=int, default=1, help="processes the clients run in")
    p.add_argument("--tokens", type=int, default=1024, help="output tokens per request")
    p.add_argument("--short-tokens", type=int, default=0, help="a second phase with this many (0: none)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt token ids per request")
    p.add_argument("--slice-len", type=int, default=128, help="S: tokens per grant")
    p.add_argument("--grant-lookahead", type=float, help="scheduler.grant_lookahead (default: the daemon's own)")
    p.add_argument("--duration", type=float, default=20.0, help="seconds measured per phase")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds of load before measuring")
    p.add_argument("--contexts", default="128,1024,4096", help="context lengths of the bytes-per-grant table")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="the daemon's log level (info: the shipped default)")
    p.add_argument("--cprofile", help="run the daemon under cProfile, its profile written here")
    p.add_argument("--json", dest="json_out", help="write the result here")
    p.add_argument("--md", help="write the tables here (markdown)")
    p.add_argument("--no-progress", action="store_true")


# --------------------------------------------------------------------------- bytes per grant


def grant_bytes(contexts: list[int], slice_len: int = 128, vocab: int = DEFAULT_VOCAB,
                seed: int = 0) -> list[dict[str, int]]:
    """What one grant of ``slice_len`` tokens costs on the worker link, as the daemon encodes
    it, for each context length: ``whole`` (the request new to the worker: its context by ids
    and its parameters, as :meth:`~sclsd.daemon.serving.dispatch.DispatchBook.message` sends
    it, also when it moved to another worker), ``delta`` (a later grant to the worker that
    holds its record: a :class:`~sclsd.protocol.ContinueRow`), and what comes back for the
    grant's tokens: streamed at two tokens a message (20 ms at 10 ms a step), its ``tokens``
    messages, and its ``result`` with the last two, still pending when the slice ended."""
    rng = random.Random(seed)
    rows = []
    for n in contexts:
        ids = [rng.randrange(vocab) for _ in range(n)]
        out = [rng.randrange(vocab) for _ in range(slice_len)]
        generated = max(0, n // 2)
        whole = P.BatchMsg(batch_id=123_456, slice_len=slice_len, requests=[P.BatchRequest(
            rid="7:0123456789abcdef", token_ids=ids, max_new_tokens=1024 - min(generated, 1023), temperature=0.0,
            generated=generated, stop_token_ids=[2], ignore_eos=True)])
        delta = P.BatchMsg(batch_id=123_456, slice_len=slice_len, requests=[], cont=[P.ContinueRow(
            rid="7:0123456789abcdef", max_new_tokens=1024 - min(generated, 1023), known=n, generated=generated)])
        # The last two tokens were still pending when the slice ended: the result brings them.
        result = P.Result(worker_id="w0", batch_id=123_456, outputs=[P.RequestOutput(
            rid="7:0123456789abcdef", token_ids=out[-2:], start=slice_len - 2, kv_tokens=n + slice_len - 1,
            reused_tokens=n - 1)],
            stats=P.BatchStats(prefill_s=0.001, decode_s=1.28, iterations=slice_len, batch_size=1, input_len=n,
                               prefill_tokens=1, reused_tokens=n - 1, kv_peak_tokens=80_000))
        tokens = sum(len(P.encode(P.Tokens(worker_id="w0", batches=[P.BatchTokens(batch_id=123_456, outputs=[
            P.RequestOutput(rid="7:0123456789abcdef", token_ids=out[i:i + 2], start=i)])])))
            for i in range(0, slice_len - 2, 2))
        rows.append({"context": n, "whole": len(P.encode(whole)), "delta": len(P.encode(delta)),
                     "result": len(P.encode(result)), "tokens_messages": tokens})
    return rows


def link_bytes(prompt_len: int, tokens: int, slice_len: int, new_share: float,
               moved_share: float) -> dict[str, float]:
    """Bytes on the worker link for one phase's requests (``prompt_len`` prompt tokens of the
    fake model's byte vocabulary, ``tokens`` out, grants of ``slice_len``), when
    ``new_share`` of the grants are requests' first (sent whole, the prompt as context) and
    ``moved_share`` are placed away from the worker holding the request (sent whole, the
    context taken as the prompt and half the output); the rest are deltas. ``to_worker``:
    bytes per grant; ``from_worker``: bytes per generated token (``tokens`` and ``result``
    messages)."""
    s = min(slice_len, tokens)
    (new,) = grant_bytes([prompt_len], s, vocab=256)
    (moved,) = grant_bytes([prompt_len + tokens // 2], s, vocab=256)
    delta_share = max(0.0, 1.0 - new_share - moved_share)
    per_grant = new_share * new["whole"] + moved_share * moved["whole"] + delta_share * new["delta"]
    return {"to_worker": round(per_grant), "from_worker": round((new["result"] + new["tokens_messages"]) / s, 1)}


# --------------------------------------------------------------------------- /proc


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc; 0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


# --------------------------------------------------------------------------- the clients


def _client_proc(idx: int, sock: str, streams: int, conns: int, spec: dict[str, Any], go: Any,
                 start: Any, q: Any) -> None:
    """One client process: ``streams`` closed-loop streams over ``conns`` connections, from
    ``start.value`` (wall clock, set by the parent once every process is connected) for
    ``spec['warmup'] + spec['duration']`` seconds; reports progress and its counts to ``q``."""
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:  # pragma: no cover
        runner = asyncio.run
    q.put(("result", idx, runner(_clients(idx, sock, streams, conns, spec, go, start, q))))


async def _clients(idx: int, sock: str, streams: int, conns: int, spec: dict[str, Any], go: Any,
                   start: Any, q: Any) -> dict[str, Any]:
    from ..client import AsyncClient, Delta, Done, RequestError

    clients = [await AsyncClient(sock).connect() for _ in range(max(1, min(conns, streams)))]
    q.put(("ready", idx, None))
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, go.wait)
    t_start = start.value
    t_measure, t_end = t_start + spec["warmup"], t_start + spec["warmup"] + spec["duration"]
    c: dict[str, Any] = {"tokens": 0, "done": 0, "wrong_length": 0, "errors": {}, "at_measure": None,
                         "at_end": None, "max_gaps": []}
    rng = random.Random(idx)

    async def stream(i: int) -> None:
        cl = clients[i % len(clients)]
        while time.time() < t_end:
            # The fake model's tokenizer reads ids as bytes: below 256, past the special ones.
            prompt = [rng.randrange(3, 256) for _ in range(spec["prompt_len"])]
            last = None
            worst = 0.0
            try:
                async for ev in cl.stream(prompt_ids=prompt, max_tokens=spec["tokens"], ignore_eos=True,
                                          temperature=0.0):
                    if isinstance(ev, Delta):
                        now = time.time()
                        c["tokens"] += len(ev.token_ids)
                        if last is not None:
                            worst = max(worst, now - last)
                        last = now
                    elif isinstance(ev, Done):
                        c["done"] += 1
                        if ev.usage.completion_tokens != spec["tokens"]:
                            c["wrong_length"] += 1
                        if t_measure <= time.time() <= t_end:
                            c["max_gaps"].append(worst)
            except RequestError as exc:
                c["errors"][exc.code] = c["errors"].get(exc.code, 0) + 1
                if exc.code not in ("overloaded", "starting"):
                    return  # the request itself is wrong: asking again would only spin
                await asyncio.sleep(0.1)
            except ConnectionError:
                c["errors"]["connection_lost"] = c["errors"].get("connection_lost", 0) + 1
                return

    async def clock() -> None:
        marks = [("at_measure", t_measure), ("at_end", t_end)]
        while marks:
            now = time.time()
            if now >= marks[0][1]:
                c[marks.pop(0)[0]] = (c["tokens"], c["done"], now)
                continue
            await asyncio.sleep(min(1.0, marks[0][1] - now))
            q.put(("progress", idx, (c["tokens"], c["done"], sum(c["errors"].values()))))

    tasks = [asyncio.create_task(stream(i)) for i in range(streams)]
    await clock()
    for t in tasks:  # requests still running are cancelled with their connections
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for cl in clients:
        await cl.close()
    return c


# --------------------------------------------------------------------------- one phase


class Probe:
    """CPU and I/O of the daemon, its workers and the client processes, and the daemon's
    counters, sampled at the start and at the end of the measured window."""

    def __init__(self, d: DaemonProcess, clients: list[int]) -> None:
        self.d = d
        st = d.status()
        self.workers = [w.pid for w in st.workers if w.pid]
        self.clients = clients

    def sample(self) -> dict[str, Any]:
        """Processes first, at once; then the daemon's counters (a status round trip, which a
        loaded daemon may answer late)."""
        out: dict[str, Any] = {"t": time.time(), "daemon": cpu_s(self.d.proc.pid),
                               "workers": sum(map(cpu_s, self.workers)), "clients": sum(map(cpu_s, self.clients))}
        t0 = time.monotonic()
        try:
            counters = self.d.status(timeout=60).counters
        except OSError:  # a timeout included: the figures that need the counters stay out
            counters = {}
        out["status_s"] = time.monotonic() - t0
        out.update({k: counters.get(k) for k in ("grants", "migrations", "accepted")})
        return out


def run_phase(d: DaemonProcess, args: argparse.Namespace, tokens: int, say: Any) -> dict[str, Any]:
    """One closed-loop phase of ``tokens``-token outputs against the running daemon ``d``."""
    ctx = mp.get_context("fork")
    q: Any = ctx.Queue()
    go = ctx.Event()
    start = ctx.Value("d", 0.0)
    spec = {"tokens": tokens, "prompt_len": args.prompt_len, "warmup": args.warmup, "duration": args.duration}
    n = max(1, args.client_procs)
    procs = [ctx.Process(target=_client_proc, daemon=True, args=(
        i, d.sock, args.clients // n + (i < args.clients % n), max(1, args.connections // n), spec, go, start, q))
        for i in range(n)]
    for p in procs:
        p.start()
    ready = 0
    while ready < n:
        kind, _, _ = q.get(timeout=120)
        ready += kind == "ready"
    probe = Probe(d, [p.pid for p in procs if p.pid])
    start.value = time.time() + 0.2
    go.set()
    t_measure = start.value + args.warmup
    t_end = t_measure + args.duration
    first = last = None
    progress: dict[int, tuple[int, int, int]] = {}
    results: dict[int, dict[str, Any]] = {}
    shown = 0.0
    while len(results) < n:
        now = time.time()
        if first is None and now >= t_measure:
            first = probe.sample()
        if last is None and now >= t_end:
            last = probe.sample()
        wait = min([x - now for x in (t_measure, t_end) if x > now] + [0.5])
        try:
            kind, idx, body = q.get(timeout=max(0.01, wait))
        except queue.Empty:  # time to sample
            continue
        if kind == "progress":
            progress[idx] = body
            if time.time() - shown >= 1.0:
                shown = time.time()
                toks, done, errs = (sum(x) for x in zip(*progress.values(), strict=True))
                phase = "warm-up" if shown < t_measure else "measuring"
                say(f"  {tokens}-token outputs, {phase} t={shown - start.value:5.1f}s: {toks:,} tokens, "
                    f"{done:,} done, {errs} errors")
        elif kind == "result":
            results[idx] = body
    for p in procs:
        p.join(timeout=30)
    assert first is not None
    if last is None:
        last = probe.sample()
    return summarize(args, tokens, list(results.values()), first, last)


def summarize(args: argparse.Namespace, tokens: int, parts: list[dict[str, Any]], first: dict[str, Any],
              last: dict[str, Any]) -> dict[str, Any]:
    """The figures of one phase from the client processes' counts and two probe samples."""
    wall = last["t"] - first["t"]
    spans = [(p["at_end"][0] - p["at_measure"][0], p["at_end"][1] - p["at_measure"][1],
              p["at_end"][2] - p["at_measure"][2]) for p in parts if p["at_end"] and p["at_measure"]]
    # Each client process counted over its own window (its clock marks the same instants).
    rate = sum(toks / max(1e-9, span) for toks, _, span in spans)
    finished_rate = sum(done / max(1e-9, span) for _, done, span in spans)
    delivered = rate * wall  # tokens delivered in the window the CPU was sampled over
    offered = args.workers * args.rows / args.decode_s
    counted = all(x[k] is not None for x in (first, last) for k in ("grants", "migrations", "accepted"))
    grants = last["grants"] - first["grants"] if counted else 0
    new = last["accepted"] - first["accepted"] if counted else 0
    moved = last["migrations"] - first["migrations"] if counted else 0
    whole = new + moved
    link = link_bytes(args.prompt_len, tokens, args.slice_len, new / grants if grants else 0.0,
                      moved / grants if grants else 0.0)
    gaps = [g for p in parts for g in p["max_gaps"]]
    errors: dict[str, int] = {}
    for p in parts:
        for k, v in p["errors"].items():
            errors[k] = errors.get(k, 0) + v
    daemon_cpu = last["daemon"] - first["daemon"]
    return {
        "output_tokens": tokens,
        "offered_tokens_per_s": round(offered),
        "load_tokens_per_s": round(min(args.clients, args.workers * args.rows) / args.decode_s),
        "delivered_tokens_per_s": round(rate),
        "delivered_pct": round(100 * rate / offered, 1),
        "requests_per_s": round(finished_rate, 2),
        "daemon_cores": round(daemon_cpu / wall, 3),
        "daemon_cpu_us_per_token": round(daemon_cpu / delivered * 1e6, 2) if delivered else None,
        "workers_cores": round((last["workers"] - first["workers"]) / wall, 3),
        "clients_cores": round((last["clients"] - first["clients"]) / wall, 3),
        "grants_per_s": round(grants / wall, 1) if counted else None,
        "whole_grants_pct": round(100 * whole / grants, 1) if grants else None,
        "bytes_per_grant": link["to_worker"] if grants else None,
        # How long the status socket took to answer (the same event loop serves it).
        "status_s": round(max(first["status_s"], last["status_s"]), 3),
        "bytes_per_token_from_worker": link["from_worker"],
        "max_gap_p50_s": percentile(gaps, 0.5),
        "max_gap_p99_s": percentile(gaps, 0.99),
        "wrong_length": sum(p["wrong_length"] for p in parts),
        "errors": errors,
        "measured_s": round(wall, 2),
    }


# --------------------------------------------------------------------------- the run


def sections(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The daemon's config: the shipped defaults but for the fake workers and what is measured.
    Δ = 4,096 bytes a token keeps memory from binding before ``--rows`` do."""
    return {
        "daemon": {"log_level": args.log_level},
        "model": {"name": "fake", "max_gen": max(1024, args.tokens), "max_input": max(1024, args.prompt_len)},
        "scheduler": {"policy": "scls-cb", "slice_len": args.slice_len,
                      **({} if args.grant_lookahead is None else {"grant_lookahead": args.grant_lookahead})},
        "workers": {"spawn": args.workers, "engine": "fake", "threads": 1,
                    "options": {"decode_s": args.decode_s, "max_rows": args.rows, "kv_bytes_per_token": 4096}},
    }


def _start(args: argparse.Namespace) -> DaemonProcess:
    """The daemon (under cProfile with ``--cprofile``), its workers registered."""
    secs = sections(args)
    if not args.cprofile:
        return launch(secs, wait_workers=args.workers, timeout=300)
    d = short_dir()
    daemon = {"socket": f"{d}/sclsd.sock", "status_socket": f"{d}/status.sock",
              "worker_endpoint": f"ipc://{d}/workers.ipc", **secs["daemon"]}
    cfg = d / "sclsd.toml"
    cfg.write_text(toml_text({**secs, "daemon": daemon}))
    with open(d / "sclsd.log", "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "cProfile", "-o", str(Path(args.cprofile).resolve()),
                                 "-m", "sclsd.daemon", "--config", str(cfg)], stdout=out, stderr=subprocess.STDOUT,
                                env={**offline_env(), "PYTHONUNBUFFERED": "1"})
    dp = DaemonProcess(proc, d, cfg, daemon["socket"], daemon["status_socket"], daemon["worker_endpoint"],
                       d / "sclsd.log", True)
    dp.wait_workers(args.workers, timeout=300)
    return dp


def markdown(result: dict[str, Any]) -> str:
    """The result's tables."""
    lines = ["| output tokens | offered tok/s | delivered tok/s | delivered | daemon cores | daemon CPU-µs/token "
             "| workers cores | clients cores | grants/s | whole grants | bytes/grant | p50 / p99 longest gap s "
             "| status answered in s |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for ph in result["phases"]:
        gaps = " / ".join("-" if g is None else f"{g:.2f}" for g in (ph["max_gap_p50_s"], ph["max_gap_p99_s"]))
        lines.append(f"| {ph['output_tokens']:,} | {ph['offered_tokens_per_s']:,} | {ph['delivered_tokens_per_s']:,} "
                     f"| {ph['delivered_pct']} % | {ph['daemon_cores']} | {ph['daemon_cpu_us_per_token']} "
                     f"| {ph['workers_cores']} | {ph['clients_cores']} | {ph['grants_per_s']} "
                     f"| {ph['whole_grants_pct']} % | {ph['bytes_per_grant']} | {gaps} | {ph['status_s']} |")
    lines += ["", "| context tokens | grant sent whole (new or moved) | later grant (delta) | result of the grant "
              "| its tokens messages |", "|---:|---:|---:|---:|---:|"]
    for g in result["grant_bytes"]:
        lines.append(f"| {g['context']:,} | {g['whole']:,} | {g['delta']:,} | {g['result']:,} "
                     f"| {g['tokens_messages']:,} |")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    """Start the daemon, run the phases, print and write the result."""
    say = (lambda *_: None) if args.no_progress else (lambda m: print(m, file=sys.stderr, flush=True))
    contexts = [int(x) for x in args.contexts.split(",") if x.strip()]
    bad = [f"--{k} must be {why}" for k, ok, why in (
        ("workers", args.workers >= 1, ">= 1"), ("rows", args.rows >= 1, ">= 1"),
        ("decode-s", args.decode_s > 0, "> 0"), ("clients", args.clients >= 1, ">= 1"),
        ("tokens", args.tokens >= 1, ">= 1"), ("duration", args.duration > 0, "> 0")) if not ok]
    if bad:
        print(f"sclsd-bench rates: {'; '.join(bad)}", file=sys.stderr)
        return 2
    result: dict[str, Any] = {"grant_bytes": grant_bytes(contexts, args.slice_len), "phases": []}
    offered = args.workers * args.rows / args.decode_s
    say(f"sclsd-bench rates: {args.workers} fake workers x {args.rows} rows at {args.decode_s * 1e3:g} ms a step "
        f"({offered:,.0f} tokens/s offered), {args.clients} streaming clients on {args.connections} connections "
        f"in {args.client_procs} process(es), {os.cpu_count()} CPUs")
    d = _start(args)
    try:
        for tokens in [args.tokens] + ([args.short_tokens] if args.short_tokens else []):
            result["phases"].append(run_phase(d, args, tokens, say))
            ph = result["phases"][-1]
            say(f"  {tokens}-token outputs: {ph['delivered_tokens_per_s']:,} tokens/s delivered "
                f"({ph['delivered_pct']} % of offered), daemon {ph['daemon_cores']} cores, "
                f"{ph['daemon_cpu_us_per_token']} CPU-µs per token")
            _settle(d, 120)
        rc = d.stop()
    finally:
        d.stop()
    result["daemon_exit"] = rc
    result["config"] = {k: getattr(args, k) for k in ("workers", "rows", "decode_s", "clients", "connections",
                                                        "client_procs", "tokens", "short_tokens", "prompt_len",
                                                        "slice_len", "duration", "warmup", "log_level")}
    result["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(),
                         "platform": platform.platform(), "load_avg": os.getloadavg()}
    print(json.dumps(result, indent=2))
    print(markdown(result))
    for path, text in ((args.json_out, json.dumps(result, indent=2) + "\n"), (args.md, markdown(result))):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)
    ok = rc == 0 and all(not ph["errors"] and ph["wrong_length"] == 0 for ph in result["phases"])
    if not ok:
        print("sclsd-bench rates: requests failed or came short (see errors above)", file=sys.stderr)
    return 0 if ok else 1


def _settle(d: DaemonProcess, timeout: float) -> None:
    """Wait until the daemon holds no request (the cancelled ones gone) before the next phase."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if d.status(timeout=60).live_requests == 0:
                return
        except OSError:
            pass
        time.sleep(0.2)
