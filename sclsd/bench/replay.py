"""``sclsd-bench replay``: replay a trace against a running daemon, measure what clients see.

Each request is sent at its arrival time (the trace's own, or Poisson at
``--rate``) as token ids: ``input_tokens`` random ids (seeded), ``ignore_eos``
with ``max_tokens`` = the trace's ``output_tokens``, so the daemon generates
exactly the trace's lengths. The scheduler never reads ``max_tokens`` to plan
batches (it only caps a request's budget and stops it there), but an engine may
size a row by it (``hf-static-cb``'s slot holds its context and the smaller of
its slice and what is left of ``max_tokens``), and then a whole-request grant
(``ils``) is sized to the exact output, which no server knows. With
``--max-tokens-cap N`` each request asks ``max_tokens = N`` instead, as clients
send a cap, and the client ends it at its trace length, as EOS would (it
leaves the stream: a ``cancel``, which ends the row at the engine's next step);
such a request counts as finished (``stop``) when its last trace token
arrives, with the trace's length. Its ``done`` never comes, so neither does its worker
(its completion time counts for none) nor its slices: ``slices_per_req`` is then the rows
the daemon's results carried over the run (its ``batch_rows`` counter, read once no worker
holds a batch) per request, the slice the cancel ended included.

Metrics are those of :mod:`sclsd.eval.metrics` (one definition for the
simulator and for replays). Times are the client's: arrival = when the request
was sent, first token = first ``delta``, completion = ``done``; a request's
maximum inter-token gap is the longest wait between two ``delta`` frames that
carry tokens (a stream frozen at a slice boundary shows there), and goodput
counts the requests within ``--slo-ttft`` and ``--slo-gap``. Worker
completion times (CT STD) come from the worker the daemon names in each
``done``; batch size, pad and invalid tokens and early returns from the
daemon's status counters before and after the run.

Whether the server kept up: ``arrivals_s`` is the span of the sends (first to last) and
``late_starts`` the requests whose first token came :data:`LATE_START_S` or more after
they were sent (or never came). With none late, every request started as it came: the replay measured the
trace's own pace (and its longest requests), not what the server can serve, and no
schedule could have served it faster; a comparison of capacity needs a rate at which
requests wait.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from contextlib import aclosing
from pathlib import Path
from typing import Any

import numpy as np

from ..client import AsyncClient, Delta, Done, RequestError, status
from ..eval.metrics import (
    DEFAULT_SLO,
    SLO,
    SUMMARY_KEYS,
    BatchStats,
    RequestRecord,
    max_gap,
    summarize,
)
from ..eval.traces import load_trace, poisson_arrivals

#: A request whose first token comes this many seconds or more after it was sent waited for
#: room (a prompt's prefill on a card takes a fraction of it): ``late_starts`` counts them.
LATE_START_S = 1.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", required=True, help="daemon client socket")
    p.add_argument("--status-socket", required=True, help="daemon status socket")
    p.add_argument("--trace", required=True, help="trace CSV (arrival_s,input_tokens,output_tokens)")
    p.add_argument("--rate", type=float, help="Poisson arrivals at this rate (req/s); default: the trace's times")
    p.add_argument("--num", type=int, default=100, help="requests to send (first N of the trace)")
    p.add_argument("--offset", type=int, default=0, help="skip this many trace rows first")
    p.add_argument("--max-input", type=int, default=1024, help="cap on input tokens")
    p.add_argument("--max-gen", type=int, default=1024, help="cap on output tokens")
    p.add_argument("--max-tokens-cap", type=int, default=0,
                   help="send max_tokens = this cap and end each request at its trace length from the "
                        "client, as EOS would (0: max_tokens = the trace length; module docstring)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply input and output lengths by this before capping (scaled workloads)")
    p.add_argument("--id-range", type=int, default=20000, help="prompt ids drawn from [3, id_range)")
    p.add_argument("--connections", type=int, default=4, help="client connections to spread requests over")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", default="", help="free text stored in the JSON (e.g. policy name)")
    p.add_argument("--json", dest="json_out", help="write the summary here")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--slo-ttft", type=float, default=DEFAULT_SLO.ttft_s,
                   help="goodput: first token within this many seconds")
    p.add_argument("--slo-gap", type=float, default=DEFAULT_SLO.gap_s,
                   help="goodput: no wait between two tokens longer than this many seconds")


def replay_args(**given: Any) -> argparse.Namespace:
    """The arguments of a replay run from code: the command's defaults, then ``given``
    (keyword names as the attributes, e.g. ``status_socket``, ``json_out``)."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--socket", "", "--status-socket", "", "--trace", ""])
    unknown = set(given) - set(vars(args))
    if unknown:
        raise TypeError(f"replay has no argument {sorted(unknown)}")
    vars(args).update(given)
    return args


def _lengths(args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    tr = load_trace(args.trace)
    sl = slice(args.offset, args.offset + args.num)
    inp = np.maximum(1, np.round(tr.input_tokens[sl] * args.scale)).astype(np.int64)
    out = np.maximum(1, np.round(tr.output_tokens[sl] * args.scale)).astype(np.int64)
    inp = np.minimum(inp, args.max_input)
    out = np.minimum(out, args.max_gen)
    if args.rate:
        arr = poisson_arrivals(len(inp), args.rate, args.seed)
    else:
        if not tr.has_arrivals:
            raise SystemExit(f"sclsd-bench replay: {args.trace} has no arrival times; give --rate")
        arr = tr.arrival[sl] - tr.arrival[sl][0]
    return arr, inp, out


async def _run(args: argparse.Namespace) -> tuple[list[RequestRecord], dict[str, str | None], list[str]]:
    arr, inp, out = _lengths(args)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, args.id_range) for _ in range(int(n))] for n in inp]
    clients = [await AsyncClient(args.socket).connect() for _ in range(max(1, args.connections))]
    records: list[RequestRecord] = []
    workers: dict[str, str | None] = {}
    errors: list[str] = []
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=len(prompts), desc="replay", unit="req", file=sys.stderr)
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    async def one(i: int) -> None:
        await asyncio.sleep(max(0.0, t0 + float(arr[i]) - loop.time()))
        rec = RequestRecord(rid=f"replay-{i}", arrival=loop.time(), prompt_len=len(prompts[i]))
        records.append(rec)
        token_times: list[float] = []
        want, cap = int(out[i]), int(args.max_tokens_cap)
        got = 0
        try:
            events = clients[i % len(clients)].stream(
                id=rec.rid, prompt_ids=prompts[i], max_tokens=max(cap, want) if cap else want, ignore_eos=True,
                temperature=0.0,
            )
            async with aclosing(events) as stream:  # leaving it early cancels the request
                async for ev in stream:
                    if isinstance(ev, Delta) and ev.token_ids:
                        token_times.append(loop.time())
                        if rec.first_token is None:
                            rec.first_token = token_times[0]
                        got += len(ev.token_ids)
                        if cap and got >= want:  # its EOS, which only the trace knows
                            rec.max_gap_s = max_gap(token_times)
                            rec.finished = token_times[-1]
                            rec.finish_reason = "stop"
                            rec.output_len = want
                            break
                    elif isinstance(ev, Done):
                        rec.max_gap_s = max_gap(token_times)
                        rec.finished = loop.time()
                        rec.finish_reason = ev.finish_reason
                        rec.output_len = ev.usage.completion_tokens
                        rec.slices = ev.timings.slices
                        workers[rec.rid] = ev.worker
        except RequestError as exc:
            errors.append(f"{rec.rid}: {exc}")
        finally:
            if bar is not None:
                bar.update(1)

    try:
        await asyncio.gather(*(one(i) for i in range(len(prompts))))
    finally:
        if bar is not None:
            bar.close()
        for c in clients:
            await c.close()
    return records, workers, errors


def run(args: argparse.Namespace) -> int:
    before = status(args.status_socket)
    wall0 = time.monotonic()
    records, req_worker, errors = asyncio.run(_run(args))
    wall = time.monotonic() - wall0
    after = settled(args.status_socket) if args.max_tokens_cap else status(args.status_socket)
    c0, c1 = before.counters, after.counters

    def diff(key: str) -> int:
        return int(c1.get(key, 0)) - int(c0.get(key, 0))

    batches = BatchStats(batches=diff("results"), size_sum=diff("batch_rows"),
                         early_returns=diff("early_returns"))
    completion: dict[str, float | None] = {w.id: None for w in after.workers}
    by_id = {r.rid: r for r in records}
    for rid, wid in req_worker.items():
        r = by_id[rid]
        if wid is not None and r.finished is not None:
            prev = completion.get(wid)
            completion[wid] = r.finished if prev is None else max(prev, r.finished)
    slo = SLO(ttft_s=args.slo_ttft, gap_s=args.slo_gap)
    summary: dict[str, Any] = summarize(records, batches, worker_completion=completion, slo=slo)
    done = max(1, summary["completed"])
    summary["pad_tokens_per_req"] = diff("pad_tokens") / done
    if args.max_tokens_cap:  # the requests' own counts never came (module docstring)
        summary["slices_per_req"] = diff("batch_rows") / done
    summary["invalid_tokens_per_req"] = diff("invalid_tokens") / done
    # Continuous engines: preemptions during the run, and the most KV any engine held.
    summary["preemptions"] = diff("preemptions")
    summary["kv_peak_tokens"] = int(c1.get("kv_peak_tokens", 0))
    summary["migrations"] = diff("migrations")
    summary.update(kept_up(records))
    est = after.estimator_error
    summary.update({
        "label": args.label,
        "policy": after.policy,
        "slice_len": after.slice_len,
        "model": after.model,
        "workers": len(after.workers),
        "rate": args.rate,
        "scale": args.scale,
        "trace": str(args.trace),
        "wall_s": wall,
        "errors": len(errors),
        "estimator_mean_abs_error_s": est.mean_abs_error_s,
        "estimator_mean_error_s": est.mean_error_s,
    })
    for e in errors[:5]:
        print(f"error {e}", file=sys.stderr)
    print(format_summary(summary))
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if not errors and summary["completed"] == summary["requests"] else 1


def kept_up(records: list[RequestRecord]) -> dict[str, float]:
    """``arrivals_s`` (the sends' span) and ``late_starts`` (first token :data:`LATE_START_S`
    or more after the send, or none at all): whether the server kept up (module docstring)."""
    sent = [r.arrival for r in records]
    late = sum(1 for r in records if r.first_token is None or r.first_token - r.arrival >= LATE_START_S)
    return {"arrivals_s": max(sent) - min(sent) if sent else 0.0, "late_starts": late, "late_start_s": LATE_START_S}


def settled(sock: str, timeout: float = 10.0) -> Any:
    """The daemon's status once no worker holds a batch (at most ``timeout`` seconds on): the
    rows the client's cancels ended reach the counters with their grants' results, a step or
    so after the client left."""
    deadline = time.monotonic() + timeout
    st = status(sock)
    while any(w.batches_inflight for w in st.workers) and time.monotonic() < deadline:
        time.sleep(0.02)
        st = status(sock)
    return st


def format_summary(s: dict[str, Any]) -> str:
    rows = [(k, s[k]) for k in SUMMARY_KEYS if k in s]
    rows += [(k, s[k]) for k in ("goodput_rps", "p50_gap_s", "p95_gap_s", "p99_gap_s", "max_gap_s") if k in s]
    rows += [(k, s[k]) for k in ("arrivals_s", "late_starts") if k in s]
    rows += [(k, s[k]) for k in ("estimator_mean_abs_error_s", "wall_s") if s.get(k) is not None]
    width = max(len(k) for k, _ in rows)
    title = f"replay: policy={s.get('policy')} S={s.get('slice_len')} workers={s.get('workers')} rate={s.get('rate')}"
    lines = [title, "-" * len(title)]
    for k, v in rows:
        lines.append(f"{k:<{width}}  {v:.3f}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    return "\n".join(lines)
