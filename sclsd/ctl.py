"""``sclsctl``: submit requests and look at a running sclsd."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from .client import Client, Delta, Done, RequestError, status

DEFAULT_SOCKET = os.environ.get("SCLSD_SOCKET", "/run/sclsd/sclsd.sock")
DEFAULT_STATUS = os.environ.get("SCLSD_STATUS_SOCKET", "/run/sclsd/status.sock")


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
    except RequestError as exc:
        print(f"sclsctl: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"sclsctl: cannot reach sclsd at {args.socket}: {exc}", file=sys.stderr)
        return 1
    assert done is not None
    t = done.timings
    ttft = f"{t.ttft_s:.2f}s" if t.ttft_s is not None else "-"
    print(f"[{done.finish_reason}] prompt={done.usage.prompt_tokens} output={done.usage.completion_tokens} "
          f"slices={t.slices} queued={t.queued_s:.2f}s ttft={ttft} e2e={t.e2e_s:.2f}s", file=sys.stderr)
    return 0


def format_status(st: dict[str, Any]) -> str:
    lines = [
        f"sclsd {st['version']}  model={st['model']}  policy={st['policy']}  S={st['slice_len']}  "
        f"T={st['interval_s']:.2f}s  uptime={st['uptime_s']:.0f}s" + ("  DRAINING" if st["draining"] else ""),
        f"pool={st['pool_size']}  live={st['live_requests']}  queued_tokens={st['queued_tokens']}",
        "",
        f"{'worker':<8} {'engine':<6} {'state':<9} {'load_s':>8} {'inflight':>8} {'batches':>8} "
        f"{'tokens':>9} {'hb_age':>7}",
    ]
    for w in st["workers"]:
        hb = f"{w['heartbeat_age_s']:.1f}" if w["heartbeat_age_s"] is not None else "-"
        lines.append(f"{w['id']:<8} {str(w['engine']):<6} {w['state']:<9} {w['load_s']:>8.2f} "
                     f"{w['batches_inflight']:>8} {w['batches_done']:>8} {w['tokens_done']:>9} {hb:>7}")
    e = st["estimator_error"]
    if e["batches"]:
        lines.append(f"\nestimator: {e['batches']} batches, mean error {e['mean_error_s']:+.3f}s, "
                     f"mean |error| {e['mean_abs_error_s']:.3f}s")
    c = st["counters"]
    lines.append("counters: " + " ".join(f"{k}={v}" for k, v in c.items()))
    return "\n".join(lines)


def _status(args: argparse.Namespace) -> int:
    try:
        st = status(args.status_socket)
    except OSError as exc:
        print(f"sclsctl: cannot reach sclsd status at {args.status_socket}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(st, indent=2) if args.json else format_status(st))
    return 0


def _metrics(args: argparse.Namespace) -> int:
    try:
        print(status(args.status_socket, metrics=True), end="")
    except OSError as exc:
        print(f"sclsctl: cannot reach sclsd status at {args.status_socket}: {exc}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sclsctl", description="control and inspect sclsd")
    p.add_argument("--socket", default=DEFAULT_SOCKET, help="client API socket (env SCLSD_SOCKET)")
    p.add_argument("--status-socket", default=DEFAULT_STATUS, help="status socket (env SCLSD_STATUS_SOCKET)")
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
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
