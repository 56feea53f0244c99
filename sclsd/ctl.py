"""``sclsctl``: submit requests, look at a running sclsd, drain workers, make CURVE keys.

::

    sclsctl submit PROMPT [--stream]       one request
    sclsctl status [--json]                workers, pool, interval, counters
    sclsctl top [--interval S]             live view of the same, with rates
    sclsctl metrics                        Prometheus text exposition
    sclsctl drain WORKER [--resume|--wait] take a worker out of rotation (admin)
    sclsctl cancel ID                      cancel any client's request (admin)
    sclsctl keygen DIR --worker NAME ...   CURVE key pairs for workers on tcp://
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import msgspec

from .client import DEFAULT_SOCKET, DEFAULT_STATUS_SOCKET, Client, Delta, Done, RequestError, status
from .protocol import StatusSnapshot


def _client_error(args: argparse.Namespace, exc: Exception) -> int:
    """Report a refusal or an unreachable client socket; the exit code is 1 either way."""
    if isinstance(exc, RequestError):
        print(f"sclsctl: {exc}", file=sys.stderr)
    else:
        print(f"sclsctl: cannot reach sclsd at {args.socket}: {exc}", file=sys.stderr)
    return 1


def _status_error(args: argparse.Namespace, exc: Exception) -> int:
    """Report a refusal or an unreachable status socket; the exit code is 1 either way."""
    if isinstance(exc, RequestError):
        print(f"sclsctl: {exc}", file=sys.stderr)
    else:
        print(f"sclsctl: cannot reach sclsd status at {args.status_socket}: {exc}", file=sys.stderr)
    return 1


def _submit(args: argparse.Namespace) -> int:
    params: dict[str, Any] = dict(max_tokens=args.max_tokens, temperature=args.temperature)
    if args.seed is not None:
        params["seed"] = args.seed
    if args.raw:
        params["prompt"] = args.prompt
    else:
        params["messages"] = [{"role": "user", "content": args.prompt}]
    try:
        with Client(args.socket) as c:
            if args.stream:
                done = None
                for ev in c.generate(stream=True, **params):
                    if isinstance(ev, Delta):
                        sys.stdout.write(ev.text)
                        sys.stdout.flush()
                    elif isinstance(ev, Done):
                        done = ev
                print()
            else:
                done = c.complete(**params)
                print(done.text)
    except (RequestError, OSError) as exc:
        return _client_error(args, exc)
    assert done is not None
    t = done.timings
    ttft = f"{t.ttft_s:.2f}s" if t.ttft_s is not None else "-"
    print(f"[{done.finish_reason}] prompt={done.usage.prompt_tokens} output={done.usage.completion_tokens} "
          f"slices={t.slices} queued={t.queued_s:.2f}s ttft={ttft} e2e={t.e2e_s:.2f}s", file=sys.stderr)
    return 0


def format_status(st: StatusSnapshot, rates: dict[str, float] | None = None) -> str:
    """The status snapshot as a table (``sclsctl status``; ``top`` adds ``rates``)."""
    lines = [
        f"sclsd {st.version}  model={st.model}  policy={st.policy}  S={st.slice_len}  "
        f"T={st.interval_s:.2f}s  uptime={st.uptime_s:.0f}s" + ("  DRAINING" if st.draining else ""),
        f"pool={st.pool_size}  running={st.running_requests}  live={st.live_requests}  "
        f"admitting={st.admitting}  queued_tokens={st.queued_tokens}  connections={st.connections}",
    ]
    if not st.serving:
        lines.append(f"NOT SERVING: {st.why or 'no worker can serve'}")
    if rates is not None:
        lines.append("  ".join(f"{k}={v:.1f}/s" for k, v in rates.items()))
    lines += [
        "",
        f"{'worker':<10} {'engine':<6} {'model':<22} {'state':<9} {'load_s':>8} {'queue':>5} {'inflight':>8} "
        f"{'batches':>8} {'tokens':>9} {'hb_age':>7}",
    ]
    for w in st.workers:
        lines.append(f"{w.id:<10} {w.engine:<6} {w.model[:22]:<22} {w.state:<9} "
                     f"{w.load_s:>8.2f} {w.queued_batches:>5} "
                     f"{w.batches_inflight:>8} {w.batches_done:>8} {w.tokens_done:>9} "
                     f"{w.heartbeat_age_s:>7.1f}")
    e = st.estimator_error
    if e.batches and e.mean_error_s is not None and e.mean_abs_error_s is not None:
        lines.append(f"\nestimator: {e.batches} batches, mean error {e.mean_error_s:+.3f}s, "
                     f"mean |error| {e.mean_abs_error_s:.3f}s")
    lines.append("counters: " + " ".join(f"{k}={v}" for k, v in st.counters.items()))
    return "\n".join(lines)


def _status(args: argparse.Namespace) -> int:
    try:
        st = status(args.status_socket)
    except (RequestError, OSError) as exc:
        return _status_error(args, exc)
    if args.json:
        print(msgspec.json.format(msgspec.json.encode(st), indent=2).decode())
    else:
        print(format_status(st))
    return 0


def _rates(prev: StatusSnapshot, cur: StatusSnapshot, dt: float) -> dict[str, float]:
    def total_tokens(st: StatusSnapshot) -> int:
        return sum(w.tokens_done for w in st.workers)

    pc, cc = prev.counters, cur.counters
    dt = max(dt, 1e-9)
    return {
        "accepted": (cc.get("accepted", 0) - pc.get("accepted", 0)) / dt,
        "finished": (cc.get("finished", 0) - pc.get("finished", 0)) / dt,
        "refused": (cc.get("refused", 0) - pc.get("refused", 0)) / dt,
        # Worker counters restart with a worker: never report a negative rate.
        "tokens": max(0, total_tokens(cur) - total_tokens(prev)) / dt,
    }


def _top(args: argparse.Namespace) -> int:
    """Redraw the status table every ``--interval`` seconds, with rates between frames."""
    tty = sys.stdout.isatty()
    prev: StatusSnapshot | None = None
    t_prev = 0.0
    n = 0
    try:
        while args.iterations is None or n < args.iterations:
            try:
                st = status(args.status_socket)
            except (RequestError, OSError) as exc:
                return _status_error(args, exc)
            now = time.monotonic()
            rates = _rates(prev, st, now - t_prev) if prev is not None else None
            frame = format_status(st, rates)
            if tty:
                sys.stdout.write("\x1b[H\x1b[2J")  # home + clear: a live view
            else:
                sys.stdout.write(f"--- {time.strftime('%H:%M:%S')}\n")
            sys.stdout.write(frame + "\n")
            sys.stdout.flush()
            prev, t_prev = st, now
            n += 1
            if args.iterations is None or n < args.iterations:
                time.sleep(args.interval)
    except KeyboardInterrupt:
        pass
    return 0


def _drain(args: argparse.Namespace) -> int:
    try:
        with Client(args.socket, timeout=30) as c:
            rep = c.drain_worker(args.worker, resume=args.resume)
        print(f"worker {rep.worker}: {rep.state} ({rep.batches_inflight} batches in flight)")
        if args.wait and rep.state == "draining":
            deadline = time.monotonic() + args.timeout
            while time.monotonic() < deadline:
                w = {x.id: x for x in status(args.status_socket).workers}.get(args.worker)
                if w is None or w.state == "drained":
                    print(f"worker {args.worker}: drained" if w else f"worker {args.worker}: gone")
                    return 0
                time.sleep(0.2)
            print(f"sclsctl: worker {args.worker} still has batches after {args.timeout:.0f}s", file=sys.stderr)
            return 1
    except (RequestError, OSError) as exc:
        return _client_error(args, exc)
    return 0


def _cancel(args: argparse.Namespace) -> int:
    try:
        with Client(args.socket, timeout=30) as c:
            c.cancel(args.id, any_connection=True)
    except (RequestError, OSError) as exc:
        return _client_error(args, exc)
    print(f"cancelled {args.id}")
    return 0


def _keygen(args: argparse.Namespace) -> int:
    from .keys import keygen

    try:
        written = keygen(args.dir, args.worker)
    except (OSError, ValueError) as exc:
        print(f"sclsctl: {exc}", file=sys.stderr)
        return 1
    for p in written:
        print(f"wrote {p}")
    d = os.path.abspath(args.dir)
    print(f"""
daemon (sclsd.toml, [daemon]):
  curve_keypair_file = "{d}/daemon.keypair"
  curve_authorized_keys = "{d}/authorized_workers"
worker NAME (copy its key pair and daemon.public to its host):
  sclsd-worker --connect tcp://HOST:PORT --id NAME \\
      --curve-server-key-file {d}/daemon.public --curve-keypair {d}/worker-NAME.keypair""")
    return 0


def _metrics(args: argparse.Namespace) -> int:
    try:
        print(status(args.status_socket, metrics=True), end="")
    except (RequestError, OSError) as exc:
        return _status_error(args, exc)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sclsctl", description="control and inspect sclsd")
    p.add_argument("--socket", default=DEFAULT_SOCKET, help="client API socket (env SCLSD_SOCKET)")
    p.add_argument("--status-socket", default=DEFAULT_STATUS_SOCKET, help="status socket (env SCLSD_STATUS_SOCKET)")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("submit", help="send one prompt and print the answer")
    s.add_argument("prompt")
    s.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    s.add_argument("--raw", action="store_true", help="send as plain text, not as a chat message")
    s.add_argument("--max-tokens", type=int, default=128)
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--seed", type=int)
    s.set_defaults(func=_submit)
    st = sub.add_parser("status", help="workers, pool, interval, counters")
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=_status)
    m = sub.add_parser("metrics", help="Prometheus text exposition")
    m.set_defaults(func=_metrics)
    t = sub.add_parser("top", help="live view of status, with request and token rates")
    t.add_argument("--interval", type=float, default=1.0, help="seconds between frames")
    t.add_argument("--iterations", type=int, default=None, help="stop after this many frames")
    t.set_defaults(func=_top)
    dr = sub.add_parser("drain", help="take a worker out of rotation without losing its work (admin)")
    dr.add_argument("worker", help="worker id (as in sclsctl status)")
    g = dr.add_mutually_exclusive_group()
    g.add_argument("--resume", action="store_true", help="put the worker back into rotation")
    g.add_argument("--wait", action="store_true", help="wait until its batches in flight are done")
    dr.add_argument("--timeout", type=float, default=600.0, help="longest --wait, seconds")
    dr.set_defaults(func=_drain)
    ca = sub.add_parser("cancel", help="cancel a request of any client by id (admin)")
    ca.add_argument("id")
    ca.set_defaults(func=_cancel)
    k = sub.add_parser("keygen", help="CURVE key pairs: the daemon's (once) and one per --worker")
    k.add_argument("dir", help="directory for the key files (created 0750)")
    k.add_argument("--worker", action="append", default=[], metavar="NAME",
                   help="make a key pair for this worker and authorize it (repeatable)")
    k.set_defaults(func=_keygen)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
