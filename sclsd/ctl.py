"""``sclsctl``: submit requests, look at a running sclsd, drain workers, make CURVE keys.

::

    sclsctl submit PROMPT [--stream] [--n K] one request (K choices)
    sclsctl status [--json]                workers (and those loading), pool, interval, counters
    sclsctl wait-ready [--timeout S]       exit 0 once the daemon serves with a worker registered
                                           (saying on stderr what each worker is doing meanwhile)
    sclsctl top [--interval S]             live view of the same, with rates
    sclsctl metrics                        Prometheus text exposition
    sclsctl tokenizer                      the model's tokenizer directory (for load generators)
    sclsctl drain WORKER [--resume|--wait] take a worker out of rotation (admin)
    sclsctl cancel ID                      cancel any client's request (admin)
    sclsctl keygen DIR --worker NAME ...   CURVE key pairs for workers on tcp://

Every subcommand finds the daemon's two sockets in one place (``--help`` says
which each one uses): ``--socket`` / ``--status-socket`` if given, else ``--run-dir
DIR`` (``DIR/sclsd.sock`` and ``DIR/status.sock``, the names the daemon uses in
``/run/sclsd``), else ``--config FILE`` (its ``[daemon] socket`` and
``status_socket``), else ``$SCLSD_SOCKET`` / ``$SCLSD_STATUS_SOCKET``, else the
system install's ``/run/sclsd/sclsd.sock`` and ``/run/sclsd/status.sock``. A socket it
cannot reach is named in the error with where its path came from.

Output piped into a command that stops reading early (``sclsctl status | head``)
ends sclsctl quietly with exit code 141, as a tool killed by SIGPIPE would.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from typing import Any

import msgspec

from . import defaults
from .client import Client, Delta, Done, RequestError, status
from .protocol import StatusSnapshot


def resolve_sockets(args: argparse.Namespace, env: dict[str, str] | None = None) -> None:
    """Set ``args.socket`` / ``args.status_socket`` by the rule of the module docstring, and
    ``args.sockets_from`` (where they came from, for error messages). Raises ``ValueError``
    for a config file that cannot be read."""
    env = dict(os.environ) if env is None else env
    if args.run_dir:
        sock, status_sock, _ = defaults.in_run_dir(args.run_dir)
        base: tuple[str, str, str] = (sock, status_sock, f"--run-dir {args.run_dir}")
    elif args.config:
        from .config import ConfigError, load

        try:
            d = load(args.config).daemon
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        base = (d.socket, d.status_socket, f"--config {args.config}")
    elif env.get("SCLSD_SOCKET") or env.get("SCLSD_STATUS_SOCKET"):
        base = (env.get("SCLSD_SOCKET", defaults.SOCKET),
                env.get("SCLSD_STATUS_SOCKET", defaults.STATUS_SOCKET), "$SCLSD_SOCKET/$SCLSD_STATUS_SOCKET")
    else:
        base = (defaults.SOCKET, defaults.STATUS_SOCKET, "the default")
    args.sockets_from = base[2]
    if args.socket is None:
        args.socket = base[0]
    if args.status_socket is None:
        args.status_socket = base[1]


def _where(args: argparse.Namespace, which: str) -> str:
    """Where the ``which`` socket's path came from ("socket" or "status_socket")."""
    if getattr(args, f"{which}_flag", None):
        return f"--{which.replace('_', '-')}"
    return getattr(args, "sockets_from", "the default")


def _why(exc: Exception) -> str:
    """The cause of an unreachable socket, without the client library's advice: sclsctl names
    the path and where it came from itself."""
    cause = exc.__cause__ if isinstance(exc.__cause__, OSError) else exc
    return (cause.strerror if isinstance(cause, OSError) else None) or str(cause)


def _client_error(args: argparse.Namespace, exc: Exception) -> int:
    """Report a refusal or an unreachable client socket; the exit code is 1 either way."""
    if isinstance(exc, RequestError):
        print(f"sclsctl: {exc}", file=sys.stderr)
    else:
        print(f"sclsctl: cannot reach sclsd at {args.socket} (from {_where(args, 'socket')}): "
              f"{_why(exc)}", file=sys.stderr)
    return 1


def _status_error(args: argparse.Namespace, exc: Exception) -> int:
    """Report a refusal or an unreachable status socket; the exit code is 1 either way."""
    if isinstance(exc, RequestError):
        print(f"sclsctl: {exc}", file=sys.stderr)
    else:
        print(f"sclsctl: cannot reach sclsd status at {args.status_socket} "
              f"(from {_where(args, 'status_socket')}): {_why(exc)}", file=sys.stderr)
    return 1


def _submit_params(args: argparse.Namespace) -> dict[str, Any]:
    params: dict[str, Any] = dict(max_tokens=args.max_tokens, temperature=args.temperature,
                                  top_p=args.top_p, stop=list(args.stop))
    if args.seed is not None:
        params["seed"] = args.seed
    if args.logprobs is not None:
        params.update(logprobs=True, top_logprobs=args.logprobs)
    if args.prompt_logprobs is not None:
        params["prompt_logprobs"] = args.prompt_logprobs
    if args.raw:
        if args.system is not None:
            raise ValueError("--system needs a chat prompt (drop --raw)")
        params["prompt"] = args.prompt
    else:
        system = [{"role": "system", "content": args.system}] if args.system is not None else []
        params["messages"] = [*system, {"role": "user", "content": args.prompt}]
    return params


def _print_logprobs(done: Done) -> None:
    """One line per token: its text, log-probability and the alternatives asked for."""
    for e in done.logprobs or []:
        alts = "  ".join(f"{a.token!r}:{a.logprob:.3f}" for a in e.top)
        print(f"  {e.chosen.token!r:>16} {e.chosen.logprob:9.4f}   {alts}")


def _print_prompt_logprobs(lps: list[Any] | None) -> None:
    """The prompt's tokens after the first, one a line as :func:`_print_logprobs` prints, then
    their sum and the perplexity it gives."""
    if not lps:
        return
    print("prompt:")
    for e in lps:
        alts = "  ".join(f"{a.token!r}:{a.logprob:.3f}" for a in e.top)
        print(f"  {e.chosen.token!r:>16} {e.chosen.logprob:9.4f}   {alts}")
    total = sum(e.chosen.logprob for e in lps)
    print(f"prompt log-probability {total:.4f} over {len(lps)} tokens, perplexity {math.exp(-total / len(lps)):.3f}")


def _summary(done: Done) -> str:
    t = done.timings
    ttft = f"{t.ttft_s:.2f}s" if t.ttft_s is not None else "-"
    return (f"[{done.finish_reason}] prompt={done.usage.prompt_tokens} output={done.usage.completion_tokens} "
            f"slices={t.slices} queued={t.queued_s:.2f}s ttft={ttft} e2e={t.e2e_s:.2f}s")


def _submit(args: argparse.Namespace) -> int:
    try:
        params = _submit_params(args)
    except ValueError as exc:
        print(f"sclsctl: {exc}", file=sys.stderr)
        return 2
    if args.n > 1 and args.stream:
        print("sclsctl: --stream shows one answer as it comes; drop --stream for --n > 1", file=sys.stderr)
        return 2
    try:
        with Client(args.socket) as c:
            if args.stream:
                done = None
                prompt_lps = None
                for ev in c.generate(stream=True, **params):
                    if isinstance(ev, Delta):
                        prompt_lps = prompt_lps or ev.prompt_logprobs
                        sys.stdout.write(ev.text)
                        sys.stdout.flush()
                    elif isinstance(ev, Done):
                        done = ev
                print()
                assert done is not None
                _print_prompt_logprobs(prompt_lps or done.prompt_logprobs)
                dones = [done]
            else:
                dones = c.complete(n=args.n, **params)
                for i, d in enumerate(dones):
                    if args.n > 1:
                        print(f"--- choice {i}")
                    print(d.text)
                    _print_logprobs(d)
                    if i == 0:  # every choice has the same prompt
                        _print_prompt_logprobs(d.prompt_logprobs)
    except (RequestError, OSError) as exc:
        return _client_error(args, exc)
    for i, d in enumerate(dones):
        print(("" if args.n == 1 else f"choice {i}: ") + _summary(d), file=sys.stderr)
    return 0


def format_status(st: StatusSnapshot, rates: dict[str, float] | None = None) -> str:
    """The status snapshot as a table (``sclsctl status``; ``top`` adds ``rates``)."""
    lines = [
        f"sclsd {st.version}  model={st.model}  policy={st.policy}  S={st.slice_len}  "
        f"T={st.interval_s:.2f}s  uptime={st.uptime_s:.0f}s" + ("  DRAINING" if st.draining else ""),
        f"pool={st.pool_size}  running={st.running_requests}  live={st.live_requests}  "
        f"admitting={st.admitting}  queued_tokens={st.queued_tokens}  connections={st.connections}",
    ]
    if st.tokenizer is not None and rates is None:
        lines.append(f"tokenizer={st.tokenizer}")
    if st.starting:
        lines.append(f"STARTING: {st.why or 'not serving yet'}")
    elif not st.serving:
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
    for lw in st.loading:
        lines.append(f"{lw.id:<10} {'':<6} {'':<22} {lw.state:<10} {lw.age_s:>6.0f}s  pid={lw.pid}  "
                     f"{lw.step or 'starting'}")
    if st.worker_losses:
        lines.append("")
        lines.append(f"{'dropped':<10} {'times':>5}  {'last (reason: why, when)':<40}  by reason")
        for wl in st.worker_losses:
            by = " ".join(f"{k}={v}" for k, v in sorted(wl.by_reason.items()))
            lines.append(f"{wl.id:<10} {wl.count:>5}  {wl.last_reason}: {wl.last_why} "
                         f"({wl.last_age_s:.0f}s ago)  {by}")
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


def readiness(st: StatusSnapshot, want: int | None = None) -> tuple[bool | None, str]:
    """(True: ready, False: still coming, None: will not come without help; what it is doing).

    Ready: the daemon serves and ``want`` workers are registered; ``want`` None: every
    worker its config starts (``expected_workers``) and any other it has (registered, or
    loading or restarting), at least one: ``1/2`` is not ready. A daemon that drains, or
    that cannot reach the target because no other worker is loading or restarting (given
    up), will not become ready by waiting.
    """
    n = len(st.workers)
    given_up = [w for w in st.loading if w.state == "given_up"]
    coming = n + len(st.loading) - len(given_up)
    target = want if want is not None else max(1, st.expected_workers, n + len(st.loading))
    loading = ", ".join(f"{w.id}: {w.step or 'starting'} ({w.age_s:.0f}s)" for w in st.loading
                        if w.state != "given_up")
    doing = f"{n}/{target} workers registered" + (f"; loading {loading}" if loading else "")
    if st.draining:
        return None, "the daemon is draining"
    if given_up and coming < target:
        return None, f"{doing}; given up: " + "; ".join(f"{w.id}: {w.step}" for w in given_up)
    if st.serving and n >= target:
        return True, doing
    if st.starting:
        return False, f"{st.why or 'starting'}; {doing}"
    if not st.serving and not st.loading:
        return None, st.why or "no worker can serve"
    return False, doing


#: While ``wait-ready`` waits, it says what it waits for when that changes and at least
#: this often (on stderr, from its first second on; ``--quiet`` says nothing).
PROGRESS_S = 5.0


def _wait_ready(args: argparse.Namespace) -> int:
    """Poll the status socket until :func:`readiness` says ready (0), never (1) or time is up
    (1), saying on stderr what each worker is doing while it waits."""
    start = time.monotonic()
    deadline = start + args.timeout
    last = "no answer yet"
    shown, shown_at = "", start
    while True:
        now = time.monotonic()
        # What it waits for, without the ages that change at every poll.
        what = re.sub(r" \(\d+s\)", "", last)
        if not args.quiet and now - start >= 1.0 and (what != shown or now - shown_at >= PROGRESS_S):
            print(f"sclsctl: waiting ({now - start:.0f}s): {last}", file=sys.stderr, flush=True)
            shown, shown_at = what, now
        try:
            ready, last = readiness(status(args.status_socket, timeout=max(0.5, min(5.0, args.timeout))),
                                    args.workers)
        except RequestError as exc:  # refused (forbidden): waiting does not help
            return _status_error(args, exc)
        except OSError as exc:  # not listening yet (or any more): a starting daemon, maybe
            ready, last = False, (f"cannot reach sclsd status at {args.status_socket} "
                                  f"(from {_where(args, 'status_socket')}): {_why(exc)}")
        if ready:
            if not args.quiet:
                print(f"ready: {last}")
            return 0
        if ready is None:
            print(f"sclsctl: not ready and will not be: {last}", file=sys.stderr)
            return 1
        if time.monotonic() >= deadline:
            print(f"sclsctl: not ready after {args.timeout:g}s: {last}", file=sys.stderr)
            return 1
        time.sleep(min(args.interval, max(0.0, deadline - time.monotonic())))


#: Seconds between the two snapshots the first frame of ``top`` takes its rates from.
FIRST_FRAME_S = 0.5


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
    """Redraw the status table every ``--interval`` seconds, with rates between frames; the
    first frame's rates come from two snapshots a short moment apart."""
    tty = sys.stdout.isatty()
    n = 0
    try:
        prev = status(args.status_socket)
        t_prev = time.monotonic()
        time.sleep(min(args.interval, FIRST_FRAME_S))
        while args.iterations is None or n < args.iterations:
            st = status(args.status_socket)
            now = time.monotonic()
            frame = format_status(st, _rates(prev, st, now - t_prev))
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
    except (RequestError, OSError) as exc:
        return _status_error(args, exc)
    except KeyboardInterrupt:
        pass
    return 0


def _drain(args: argparse.Namespace) -> int:
    if args.wait:
        # --wait watches the status socket: make sure it answers before changing anything,
        # rather than drain and then fail to wait (leaving the worker draining).
        try:
            status(args.status_socket)
        except (RequestError, OSError) as exc:
            _status_error(args, exc)
            print("sclsctl: nothing drained", file=sys.stderr)
            return 1
    try:
        with Client(args.socket, timeout=30) as c:
            rep = c.drain_worker(args.worker, resume=args.resume)
    except (RequestError, OSError) as exc:
        return _client_error(args, exc)
    print(f"worker {rep.worker}: {rep.state} ({rep.batches_inflight} batches in flight)")
    if args.wait and rep.state == "draining":
        deadline = time.monotonic() + args.timeout
        while time.monotonic() < deadline:
            try:  # the wait watches the status socket: report that one if it fails
                w = {x.id: x for x in status(args.status_socket).workers}.get(args.worker)
            except (RequestError, OSError) as exc:
                return _status_error(args, exc)
            if w is None or w.state == "drained":
                print(f"worker {args.worker}: drained" if w else f"worker {args.worker}: gone")
                return 0
            time.sleep(0.2)
        print(f"sclsctl: worker {args.worker} still has batches after {args.timeout:.0f}s", file=sys.stderr)
        return 1
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


def _tokenizer(args: argparse.Namespace) -> int:
    """Print the directory of the model's tokenizer (for load generators' ``--tokenizer``)."""
    try:
        st = status(args.status_socket)
    except (RequestError, OSError) as exc:
        return _status_error(args, exc)
    if st.tokenizer is None:
        why = "the daemon is still starting" if st.starting else (
            f"model {st.model} has no tokenizer files on disk (the fake model's is bytes)")
        print(f"sclsctl: no tokenizer directory: {why}", file=sys.stderr)
        return 1
    print(st.tokenizer)
    return 0


def _metrics(args: argparse.Namespace) -> int:
    try:
        print(status(args.status_socket, metrics=True), end="")
    except (RequestError, OSError) as exc:
        return _status_error(args, exc)
    return 0


_SOCKETS_HELP = """\
sockets: --socket / --status-socket if given, else --run-dir DIR (DIR/sclsd.sock and
DIR/status.sock), else --config FILE ([daemon] socket and status_socket), else
$SCLSD_SOCKET / $SCLSD_STATUS_SOCKET, else /run/sclsd/sclsd.sock and /run/sclsd/status.sock.
These options go before or after the subcommand."""


def _socket_options(p: argparse.ArgumentParser, default: Any) -> None:
    g = p.add_argument_group("where the daemon is (see 'sockets' below)")
    g.add_argument("--socket", default=default, help="the daemon's client socket")
    g.add_argument("--status-socket", default=default, help="the daemon's status socket")
    g.add_argument("--run-dir", default=default, metavar="DIR",
                   help="the daemon's run directory: DIR/sclsd.sock and DIR/status.sock")
    g.add_argument("--config", default=default, metavar="FILE",
                   help="the daemon's config: its [daemon] socket and status_socket")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sclsctl", description="control and inspect sclsd",
                                epilog=_SOCKETS_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    _socket_options(p, None)
    sub = p.add_subparsers(dest="cmd", required=True)

    def command(name: str, help: str, uses: str, defaults_shown: bool = False) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=f"{help}. Uses {uses}.",
                            epilog=_SOCKETS_HELP, formatter_class=_Formatter if defaults_shown
                            else argparse.RawDescriptionHelpFormatter)
        _socket_options(sp, argparse.SUPPRESS)  # after the subcommand too, without clobbering
        return sp

    s = command("submit", "send one prompt and print the answer", "the client socket", True)
    s.add_argument("prompt")
    s.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    s.add_argument("--raw", action="store_true", help="send as plain text, not as a chat message")
    s.add_argument("--system", help="system message before the prompt (chat only)")
    s.add_argument("--max-tokens", type=int, default=128,
                   help="most tokens to generate (the daemon caps it at model.max_gen)")
    s.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    s.add_argument("--seed", type=int, help="sampling seed (same seed, same answer)")
    s.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop string (repeatable); the answer ends before it")
    s.add_argument("--n", type=int, default=1, help="number of answers (choices) to generate")
    s.add_argument("--logprobs", type=int, nargs="?", const=0, metavar="K",
                   help="print each token's log-probability and the K most likely alternatives")
    s.add_argument("--prompt-logprobs", type=int, nargs="?", const=0, metavar="K",
                   help="print the prompt's log-probabilities (each token after the first, with the K most "
                   "likely alternatives), their sum and the perplexity")
    s.set_defaults(func=_submit)
    st = command("status", "workers, pool, interval, counters", "the status socket")
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=_status)
    wr = command("wait-ready", "wait until the daemon serves with its workers registered (for scripts)",
                 "the status socket", True)
    wr.add_argument("--timeout", type=float, default=300.0, help="seconds to wait; then exit 1 saying why")
    wr.add_argument("--min-workers", "--workers", dest="workers", type=int, default=None,
                    help="registered workers to wait for (default: every worker the daemon starts "
                    "(workers.spawn) and any other it has, at least 1)")
    wr.add_argument("--interval", type=float, default=0.2, help="seconds between status polls")
    wr.add_argument("--quiet", "-q", action="store_true",
                    help="print nothing while waiting (else a line on stderr when what it waits for "
                    f"changes and at least every {PROGRESS_S:g}s) nor when ready")
    wr.set_defaults(func=_wait_ready)
    m = command("metrics", "Prometheus text exposition", "the status socket")
    m.set_defaults(func=_metrics)
    tk = command("tokenizer", "print the directory of the model's tokenizer files (what load generators "
                 "such as guidellm and aiperf take as --processor / --tokenizer)", "the status socket")
    tk.set_defaults(func=_tokenizer)
    t = command("top", "live view of status, with request and token rates", "the status socket")
    t.add_argument("--interval", type=float, default=1.0, help="seconds between frames")
    t.add_argument("--iterations", type=int, default=None, help="stop after this many frames")
    t.set_defaults(func=_top)
    dr = command("drain", "take a worker out of rotation without losing its work (admin)",
                 "the client socket; --wait also the status socket (checked before draining)")
    dr.add_argument("worker", help="worker id (as in sclsctl status)")
    g = dr.add_mutually_exclusive_group()
    g.add_argument("--resume", action="store_true", help="put the worker back into rotation")
    g.add_argument("--wait", action="store_true", help="wait until its batches in flight are done")
    dr.add_argument("--timeout", type=float, default=600.0, help="longest --wait, seconds")
    dr.set_defaults(func=_drain)
    ca = command("cancel", "cancel a request of any client by id (admin)", "the client socket")
    ca.add_argument("id")
    ca.set_defaults(func=_cancel)
    k = command("keygen", "CURVE key pairs: the daemon's (once) and one per --worker", "no socket")
    k.add_argument("dir", help="directory for the key files (created 0750)")
    k.add_argument("--worker", action="append", default=[], metavar="NAME",
                   help="make a key pair for this worker and authorize it (repeatable)")
    k.set_defaults(func=_keygen)
    return p


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown, and the sockets epilog kept as written."""


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.socket_flag, args.status_socket_flag = args.socket, args.status_socket
    try:
        resolve_sockets(args)
    except ValueError as exc:
        print(f"sclsctl: {exc}", file=sys.stderr)
        return 2
    try:
        rc = int(args.func(args))
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (``| head``): no traceback, and no second error when Python
        # flushes stdout at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
