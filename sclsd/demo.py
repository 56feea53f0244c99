"""``make demo``: the daemon with two CPU workers on the embedded model, serving real prompts.

Starts ``sclsd`` in a temporary directory, waits for its workers, sends the
chat prompts of ``sclsd/data/prompts.txt`` concurrently, streams the first
answer to the terminal, prints a table per request and shuts everything down.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from importlib import resources

from .client import AsyncClient, Delta, Done, RequestError
from .launch import launch


def _prompts() -> list[str]:
    text = resources.files("sclsd").joinpath("data/prompts.txt").read_text()
    return [line.strip() for line in text.splitlines() if line.strip()]


def _sections(args: argparse.Namespace) -> dict[str, dict[str, object]]:
    return {
        "daemon": {"heartbeat_timeout_s": 60.0, "drain_timeout_s": 60.0},
        "model": {"name": args.model, "max_gen": 1024},
        # Γ unset: the built-in profile's, sized for this model on a CPU.
        "scheduler": {"policy": args.policy, "slice_len": args.slice_len},
        "workers": {"spawn": args.workers, "engine": args.engine, "threads": 1,
                    "mem_budget_bytes": 2 * 1024**3},
    }


async def _run_requests(sock: str, prompts: list[str], max_tokens: int) -> list[tuple[str, Done | str]]:
    async with AsyncClient(sock) as client:

        async def one(i: int, prompt: str) -> tuple[str, Done | str]:
            done: Done | None = None
            try:
                async for ev in client.stream(messages=[{"role": "user", "content": prompt}],
                                              max_tokens=max_tokens, temperature=0.0, id=f"demo-{i:02d}"):
                    if isinstance(ev, Delta) and i == 0:
                        sys.stdout.write(ev.text)
                        sys.stdout.flush()
                    elif isinstance(ev, Done):
                        done = ev
            except RequestError as exc:
                return prompt, f"error: {exc}"
            if i == 0:
                sys.stdout.write("\n")
            assert done is not None
            return prompt, done

        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


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
    ap.add_argument("--engine", default="hf")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--policy", default="scls")
    ap.add_argument("--slice-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=80)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--ready-timeout", type=float, default=240.0)
    args = ap.parse_args(argv)
    prompts = _prompts()[: args.prompts]
    t_start = time.monotonic()
    print(f"starting sclsd: {args.workers} {args.engine} workers on {args.model}, policy {args.policy}, "
          f"slice length {args.slice_len}", flush=True)
    d = launch(_sections(args))
    rc = 1
    try:
        d.wait_workers(args.workers, args.ready_timeout, progress=True)
        t_ready = time.monotonic()
        print(f"\nsending {len(prompts)} chat prompts; streaming the first answer:\n")
        print(f"> {prompts[0]}\n")
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
        e = st.estimator_error
        if e.batches and e.mean_abs_error_s is not None:
            print(f"batches: {st.counters.get('batches', 0)}, estimator mean |error| "
                  f"{e.mean_abs_error_s:.2f}s over the last {e.batches}")
        rc = 0 if len(ok) == len(results) else 1
    except Exception as exc:  # noqa: BLE001 - report, show the log, clean up
        print(f"demo failed: {exc}", file=sys.stderr)
        print(d.log_text(), file=sys.stderr)
    finally:
        code = d.stop(timeout=60)
        print(f"sclsd stopped (exit code {code}); total {time.monotonic() - t_start:.1f}s")
        if code != 0:
            rc = rc or 1
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
