"""``make demo``: the daemon with two CPU workers on the embedded model, serving real prompts.

Starts ``sclsd`` on the default config (policy ``scls-cb`` on ``llama`` workers, the
built-in model being a GGUF on the CPU; ``--policy scls`` for the paper's static policy,
``--engine hf-cb`` for transformers' engine) in a temporary directory and
``sclsd-http`` in front of it (http://127.0.0.1:8000 unless that port is taken; the
URL is printed), waits for its workers, sends the chat prompts of
``sclsd/data/prompts.txt`` concurrently, streams the first answer to the terminal and
prints a table per request, then sends one chat completion through ``sclsd-http``
as the OpenAI SDK does by default (no temperature given: 1, sampled). Run from a
terminal (or with ``--serve``) it then keeps serving, so the README's ``curl`` and
``openai`` examples can be tried against it, until Ctrl-C; otherwise it shuts
everything down.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from importlib import resources
from typing import TypeVar

from .client import AsyncClient, Delta, Done, RequestError
from .core.policy import GRANT_POLICIES
from .launch import DaemonProcess, launch

T = TypeVar("T")


#: The demo says something at least this often while it waits (a step, or progress).
PROGRESS_S = 5.0


def _waiting(what: str, fn: Callable[[], T], t0: float | None = None) -> T:
    """``fn()`` in a thread, a line saying it is still ``what`` every PROGRESS_S meanwhile."""
    start = time.monotonic() if t0 is None else t0
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(fn)
        while True:
            try:
                return fut.result(timeout=PROGRESS_S)
            except FuturesTimeout:
                print(f"  {time.monotonic() - start:5.1f}s  still {what}", flush=True)


def _prompts() -> list[str]:
    text = resources.files("sclsd").joinpath("data/prompts.txt").read_text()
    return [line.strip() for line in text.splitlines() if line.strip()]


def _sections(args: argparse.Namespace) -> dict[str, dict[str, object]]:
    # Policy, slice length and engine only when given: the demo shows the defaults.
    sched = {k: v for k, v in (("policy", args.policy), ("slice_len", args.slice_len)) if v is not None}
    workers: dict[str, object] = {"spawn": args.workers, "threads": 1, "mem_budget_bytes": 2 * 1024**3}
    if args.engine is not None:
        workers["engine"] = args.engine
    return {
        "daemon": {"heartbeat_timeout_s": 60.0, "drain_timeout_s": 60.0},
        "model": {"name": args.model, "max_gen": 1024},
        # Γ unset: the built-in profile's, sized for this model on a CPU.
        "scheduler": sched,
        "workers": workers,
    }


def _openai_default_request(url: str, model: str, timeout: float = 300.0) -> str:
    """One chat completion through sclsd-http with the OpenAI SDK's defaults (no
    temperature: 1, sampled); a line saying what came back."""
    body = json.dumps({"model": model, "max_tokens": 48,
                       "messages": [{"role": "user", "content": "Say hello in one short sentence."}]})
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=body.encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - our own local URL
        answer = json.load(resp)
    choice = answer["choices"][0]
    return (f"{choice['message']['content'].strip()!r} (finish_reason {choice['finish_reason']}, "
            f"{answer['usage']['completion_tokens']} tokens)")


async def _run_requests(sock: str, prompts: list[str], max_tokens: int) -> list[tuple[str, Done | str]]:
    t0 = time.monotonic()
    started: set[int] = set()
    ended: set[int] = set()
    first = {"streaming": True, "last": t0}  # the first answer is on the terminal meanwhile

    async def progress() -> None:
        """Once the first answer is out (or while it has not begun), a line every PROGRESS_S
        saying how many are done, generating and waiting."""
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            if (not first["streaming"] or 0 not in started) and now - first["last"] >= PROGRESS_S:
                first["last"] = now
                print(f"  {now - t0:5.1f}s  {len(ended)}/{len(prompts)} answered, "
                      f"{len(started - ended)} generating, {len(prompts) - len(started)} waiting "
                      "for a worker", flush=True)

    async with AsyncClient(sock) as client:

        async def one(i: int, prompt: str) -> tuple[str, Done | str]:
            done: Done | None = None
            try:
                async for ev in client.stream(messages=[{"role": "user", "content": prompt}],
                                              max_tokens=max_tokens, temperature=0.0, id=f"demo-{i:02d}"):
                    if isinstance(ev, Delta):
                        started.add(i)
                        if i == 0:
                            sys.stdout.write(ev.text)
                            sys.stdout.flush()
                            first["last"] = time.monotonic()
                    elif isinstance(ev, Done):
                        done = ev
            except RequestError as exc:
                return prompt, f"error: {exc}"
            finally:
                started.add(i)
                ended.add(i)
                if i == 0:
                    sys.stdout.write("\n\n")
                    first["streaming"] = False
            assert done is not None
            return prompt, done

        ticker = asyncio.create_task(progress())
        try:
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        finally:
            ticker.cancel()


def _wait_ready(d: DaemonProcess, n: int, timeout: float) -> None:
    """Wait for ``n`` registered workers, printing each loading step as the workers report it
    (the first start converts the model once, the later ones read it from the cache)."""
    t0 = time.monotonic()
    said = t0
    shown: set[tuple[str, str]] = set()
    while time.monotonic() - t0 < timeout:
        if d.proc.poll() is not None:
            raise RuntimeError(f"sclsd exited with code {d.proc.returncode} during start-up")
        try:
            st = d.status(timeout=2.0)
        except OSError:  # not listening yet
            time.sleep(0.1)
            continue
        lines = [(w.id, w.step) for w in st.loading if w.step]
        lines += [(w.id, "registered") for w in st.workers]
        for wid, step in lines:
            if (wid, step) not in shown:
                shown.add((wid, step))
                print(f"  {time.monotonic() - t0:5.1f}s  {wid}: {step}", flush=True)
                said = time.monotonic()
        if time.monotonic() - said >= PROGRESS_S:  # a long step: say it is still going
            said = time.monotonic()
            doing = ", ".join(f"{w.id}: {w.step or 'starting'} ({w.age_s:.0f}s since it was spawned)"
                              for w in st.loading) or "waiting for the workers to register"
            print(f"  {said - t0:5.1f}s  still {doing}", flush=True)
        if len(st.workers) >= n:
            return
        time.sleep(0.2)
    raise RuntimeError(f"{n} workers not registered within {timeout:.0f}s")


def _start_http(sock: str, status_sock: str, listen: str) -> tuple[subprocess.Popen[bytes], str]:
    """``sclsd-http`` in front of the daemon, on ``listen`` or, if that is taken, a free port."""
    for address in (listen, "127.0.0.1:0"):
        proc = subprocess.Popen([sys.executable, "-m", "sclsd.http", "--socket", sock, "--status-socket",
                                 status_sock, "--listen", address, "--log-level", "warning"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert proc.stdout is not None
        said: list[str] = []
        for raw in proc.stdout:  # its first line says where it listens, or why it cannot
            line = raw.decode(errors="replace")
            if line.startswith("sclsd-http listening on "):
                return proc, line.split()[3]
            said.append(line)
            if "cannot listen" in line:
                break
        proc.wait()
    tail = "".join(said[-20:]).strip()
    raise RuntimeError(f"sclsd-http did not start (rc {proc.returncode})" + (f": {tail}" if tail else ""))


def _try_it(url: str, model: str) -> str:
    """A request to paste into another terminal."""
    body = ('{"model": "' + model + '", "messages": [{"role": "user", "content": "Hi!"}], '
            '"max_tokens": 32}')
    return (f"  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
            f"    -d '{body}'")


def _table(results: list[tuple[str, Done | str]]) -> str:
    head = f"{'#':>2}  {'prompt':<42} {'in':>4} {'out':>4} {'slices':>6} {'queue':>7} {'ttft':>7} {'e2e':>7}  finish"
    rows = [head, "-" * len(head)]
    for i, (prompt, d) in enumerate(results):
        p = (prompt[:39] + "...") if len(prompt) > 42 else prompt
        if isinstance(d, str):
            rows.append(f"{i:>2}  {p:<42} {d}")
            continue
        t = d.timings
        ttft = f"{t.ttft_s:6.2f}s" if t.ttft_s is not None else "      -"
        rows.append(f"{i:>2}  {p:<42} {d.usage.prompt_tokens:>4} {d.usage.completion_tokens:>4} "
                    f"{t.slices:>6} {t.queued_s:6.2f}s {ttft} {t.e2e_s:6.2f}s  {d.finish_reason}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sclsd-demo", description=__doc__)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--engine", default=None, help="default: the one the policy and the model need (llama for "
                    "the built-in GGUF on the CPU)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--policy", default=None, help="default: the config's, scls-cb; scls: the paper's static policy")
    ap.add_argument("--slice-len", type=int, default=None, help="default: the config's (128)")
    ap.add_argument("--max-tokens", type=int, default=80)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--ready-timeout", type=float, default=240.0)
    ap.add_argument("--http-listen", default="127.0.0.1:8000", help="where sclsd-http listens")
    ap.add_argument("--serve", action=argparse.BooleanOptionalAction, default=None,
                    help="keep serving after the prompts until Ctrl-C (default: when run from a terminal)")
    args = ap.parse_args(argv)
    serve = sys.stdin.isatty() if args.serve is None else args.serve
    prompts = _prompts()[: args.prompts]
    t_start = time.monotonic()
    print(f"starting sclsd: {args.workers} workers on {args.model}, policy "
          f"{args.policy or 'default'}, engine {args.engine or 'auto'}", flush=True)
    d = launch(_sections(args))
    rc = 1
    http: subprocess.Popen[bytes] | None = None
    try:
        http, url = _waiting("starting sclsd-http", lambda: _start_http(d.sock, d.status_sock,
                                                                           args.http_listen), t_start)
        print(f"OpenAI-compatible API: {url}/v1 (sclsd-http)", flush=True)
        _wait_ready(d, args.workers, args.ready_timeout)
        t_ready = time.monotonic()
        print(f"\nsending {len(prompts)} chat prompts; streaming the first answer:\n")
        print(f"> {prompts[0]}\n", flush=True)
        results = asyncio.run(_run_requests(d.sock, prompts, args.max_tokens))
        t_served = time.monotonic() - t_ready
        print()
        print(_table(results))
        ok = [x for _, x in results if isinstance(x, Done)]
        out_tokens = sum(x.usage.completion_tokens for x in ok)
        print(f"\n{len(ok)}/{len(results)} requests served in {t_served:.1f}s "
              f"({len(ok) / t_served:.2f} req/s, {out_tokens / t_served:.1f} output tokens/s); "
              f"start-up took {t_ready - t_start:.1f}s")
        st = d.status()
        print(f"policy {st.policy}, slice length {st.slice_len}, workers: "
              + ", ".join(f"{w.id} ({w.engine})" for w in st.workers))
        e = st.estimator_error
        if e.batches and e.mean_abs_error_s is not None:
            print(f"batches: {st.counters.get('batches', 0)}; the scheduler's serving-time estimate "
                  f"of a batch missed its measured time by {e.mean_abs_error_s:.2f}s on average over "
                  f"the last {e.batches} (docs/estimator.md)")
            if st.policy in GRANT_POLICIES:
                print("  (under slice grants a worker serves its grants together: a grant's time is "
                      "weighed against its iterations at the cost of its worker's steps, the grants "
                      "beside it included)")
        rc = 0 if len(ok) == len(results) else 1
        if st.worker_losses:
            # A healthy demo loses no worker: a drop is a fault to see, not to pass over.
            for wl in st.worker_losses:
                print(f"worker {wl.id} was dropped {wl.count} time(s); last: {wl.last_reason}: "
                      f"{wl.last_why}", file=sys.stderr)
            rc = 1
        print("\nthrough sclsd-http with the OpenAI SDK's defaults (temperature 1):", flush=True)
        try:
            print("  " + _waiting("waiting for that answer",
                                 lambda: _openai_default_request(url, st.model)), flush=True)
        except OSError as exc:  # urllib's HTTPError and URLError are OSErrors
            detail = exc.read().decode(errors="replace") if isinstance(exc, urllib.error.HTTPError) else ""
            print(f"failed: {exc} {detail}", flush=True)
            rc = 1
        if serve:
            print(f"\nstill serving at {url}/v1 (model {st.model!r}) until Ctrl-C; try:\n"
                  + _try_it(url, st.model), flush=True)
            try:
                while d.proc.poll() is None and http.poll() is None:
                    time.sleep(0.5)
            except KeyboardInterrupt:
                print()
    except Exception as exc:  # noqa: BLE001 - report, show the log, clean up
        print(f"demo failed: {exc}", file=sys.stderr)
        print(d.log_text(), file=sys.stderr)
    finally:
        if http is not None and http.poll() is None:
            http.terminate()
            http.wait(timeout=30)
        code = d.stop(timeout=60)
        print(f"sclsd stopped (exit code {code}); total {time.monotonic() - t_start:.1f}s")
        if code != 0:
            rc = rc or 1
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
