"""``sclsd-worker profile``: measure an engine's latency grids and fit the estimator.

Runs synthetic batches through the :class:`~worker.engines.base.Engine`
interface only (``engine.serve(BatchMsg)``), so it profiles whatever engine
the worker would serve with:

1. **Grid** (about 70% of the budget): for batch sizes N and input lengths L,
   one batch of ``--decode-steps + 1`` iterations each. Its ``prefill_s`` is a
   prefill sample ``(N, L, s)``; its ``decode_s / (iterations - 1)`` a
   one-iteration decode sample at the mean context ``L + (k + 1) / 2`` (the
   prefill yields the first token; decode step j attends over L + j tokens).
2. **Validation** (the rest): whole batches of ``--slice-len`` iterations,
   never used for fitting, give the S-iteration batch RMSE (paper Fig. 9b).

On a GPU the first call of a shape costs several times a later one (kernel selection,
allocation, lazy initialisation), and a profile is about later ones: with
``--warm-shapes`` (the default on CUDA) every shape runs once untimed before it is timed,
grid points are timed ``--repeats`` times (3 on CUDA) and the median kept, and decode
samples span ``--decode-steps`` steps (32 on CUDA, 8 on the CPU). The engine's own
warm-up (its captured graphs) runs before anything is timed, as in a worker. Stats are
host times taken after the step's tokens reached the host, so they are synchronised.

Points are visited in an order that covers the (N, L) plane early and are
skipped when the current fit predicts they would overrun the budget, so the
command always ends in time. The result is a profile JSON
(:mod:`sclsd.core.profiles`) with ``"source": "measured"``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from sclsd.core.estimator import Estimator, batch_rmse, decode_rmse, fit, prefill_rmse
from sclsd.core.profiles import DEFAULT_PROFILE, Profile, load_profile, save_profile
from sclsd.defaults import force_offline
from sclsd.protocol import BatchMsg, BatchRequest

log = logging.getLogger("worker.profile")

#: Grid points (N, L) in visiting order: corners and the middle first, then filling in,
#: so that a budget cut leaves a spread of points rather than only small ones.
GRID: tuple[tuple[int, int], ...] = (
    (1, 32), (1, 1024), (32, 32), (8, 256), (4, 512), (16, 64), (2, 128), (1, 256),
    (8, 1024), (32, 128), (16, 512), (4, 64), (2, 1024), (1, 512), (8, 32), (4, 256),
    (16, 256), (32, 256), (2, 512), (1, 128), (4, 1024), (8, 128), (16, 128), (2, 32),
    (32, 512), (16, 1024), (32, 1024),
)  # fmt: skip
#: Whole-slice validation batches (N, L), in visiting order.
VALIDATION: tuple[tuple[int, int], ...] = (
    (1, 64), (4, 256), (8, 128), (2, 512), (16, 64), (1, 1024), (8, 512), (32, 32),
)  # fmt: skip
GRID_SHARE = 0.7
#: Points cheaper than this are measured twice and the faster run kept (noise is one-sided).
REPEAT_BELOW_S = 2.0


class Budget:
    """Wall-clock budget for the whole command, model loading included."""

    def __init__(self, seconds: float) -> None:
        self.start = time.perf_counter()
        self.seconds = seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.seconds - self.elapsed()


def synthetic_batch(bid: int, n: int, L: int, slice_len: int, vocab: int) -> BatchMsg:
    """``n`` rows of exactly ``L`` token ids (no padding), greedy, EOS ignored."""
    span = max(1, min(vocab, 32000) - 3)
    reqs = [
        BatchRequest(
            rid=f"p{bid}-{r}",
            # Deterministic, varied ids; 0-2 are special tokens in the SmolLM2 vocabulary.
            token_ids=[3 + (i * 7919 + r * 104729 + bid) % span for i in range(L)],
            max_new_tokens=slice_len,
            temperature=0.0,
            ignore_eos=True,
        )
        for r in range(n)
    ]
    return BatchMsg(batch_id=bid, slice_len=slice_len, requests=reqs)


class Profiler:
    """Drives one engine through the grid and the validation batches."""

    def __init__(self, engine: Any, budget: Budget, slice_len: int, decode_steps: int,
                 warm_shapes: bool = False, repeats: int = 2) -> None:
        self.engine = engine
        self.budget = budget
        self.slice_len = slice_len
        self.k = decode_steps
        self.warm_shapes = warm_shapes
        """Run every shape once untimed before timing it (GPUs: the first call is cold)."""
        self.repeats = max(1, repeats)
        """Timed runs per grid point: the median is kept (two: the faster, noise being one-sided)."""
        info = engine.info()
        self.info = info
        self.vocab = int(info.vocab_size or 49152)
        self.max_context = int(info.caps.max_context or 0) or 1 << 30
        # A batch whose KV the engine cannot hold at once is no point of its profile (the
        # llama engine's context holds its cells, not 32 rows of 1,024 tokens).
        self.kv_tokens = info.mem_available // info.kv_bytes_per_token if info.kv_bytes_per_token else 1 << 40
        self.prefill: list[list[float]] = []
        self.decode: list[list[float]] = []
        self.batch: list[list[float]] = []
        self._bid = 0
        # Predicts the cost of the next point until enough of our own samples exist.
        self.guess: Estimator = load_profile(DEFAULT_PROFILE).estimator

    def _serve(self, n: int, L: int, slice_len: int) -> Any:
        self._bid += 1
        return self.engine.serve(synthetic_batch(self._bid, n, L, slice_len, self.vocab))[1]

    def predict(self, n: int, L: int, iterations: int) -> float:
        """Seconds for a batch of ``iterations`` (the prefill yields the first token)."""
        return self.guess.t_prefill(n, L) + self.guess.t_decode(n, L, max(0, iterations - 1))

    def _refit(self) -> None:
        if len(self.prefill) >= 5 and len(self.decode) >= 5:
            self.guess, _ = fit(self.prefill, self.decode)

    def warm_up(self) -> None:
        """First calls pay one-off costs (allocations, lazy init) that are not serving time."""
        self._serve(1, 8, 3)
        self._serve(2, 16, 3)

    def measure_point(self, n: int, L: int) -> None:
        """One grid point: a prefill sample and a one-iteration decode sample."""
        if self.warm_shapes:
            self._serve(n, L, self.k + 1)  # untimed: the shape's first call
        pre: list[float] = []
        dec: list[float] = []
        steps = 0
        for attempt in range(self.repeats):
            st = self._serve(n, L, self.k + 1)
            steps = st.iterations - 1
            pre.append(st.prefill_s)
            if steps > 0:
                dec.append(st.decode_s / steps)
            if attempt + 1 >= self.repeats:
                break
            # Cheap points only, and only while the budget allows (the CPU's rule without warm-up).
            if not self.warm_shapes and st.prefill_s + st.decode_s >= REPEAT_BELOW_S:
                break
            if self.budget.left() < 3 * (st.prefill_s + st.decode_s):
                break
        self.prefill.append([n, L, self._keep(pre)])
        if dec:
            self.decode.append([n, L + (steps + 1) / 2, self._keep(dec)])
        self._refit()

    def fits(self, n: int, tokens: int) -> bool:
        """Whether ``n`` rows of ``tokens`` tokens of KV fit the memory the engine reported."""
        return n * tokens <= self.kv_tokens

    def _keep(self, times: list[float]) -> float:
        """The sample a point keeps: the median of three or more runs, else the fastest."""
        return statistics.median(times) if len(times) >= 3 else min(times)

    def run_grid(self, grid_deadline: float, bar: Any) -> None:
        """Visit GRID; points predicted to overrun are retried once the fit has improved."""
        todo = [(n, L) for n, L in GRID if L + self.k + 1 <= self.max_context and self.fits(n, L + self.k + 1)]
        bar.update(len(GRID) - len(todo))
        for _pass in range(2):
            skipped = []
            for n, L in todo:
                # Margin for noise; larger while the prediction is not yet ours.
                cost = self.predict(n, L, self.k + 1) * (1.5 if len(self.prefill) >= 5 else 3)
                if self.budget.elapsed() + cost > grid_deadline:
                    skipped.append((n, L))
                    continue
                self.measure_point(n, L)
                bar.update(1)
                bar.set_postfix(left=f"{self.budget.left():.0f}s")
            todo = skipped
        for n, L in todo:
            log.info("skipped grid point N=%d L=%d (predicted past the budget)", n, L)
        bar.update(len(todo))

    def run_validation(self, reserve: float, bar: Any) -> None:
        S = self.slice_len
        for n, L in VALIDATION:
            if L + S > self.max_context or not self.fits(n, L + S):
                bar.update(1)
                continue
            cost = self.predict(n, L, S) * 1.3
            if cost > self.budget.left() - reserve:
                log.info("skip validation batch N=%d L=%d (predicted %.1f s)", n, L, cost)
                bar.update(1)
                continue
            if self.warm_shapes:
                self._serve(n, L, 2)  # untimed: the prefill shape's first call
            st = self._serve(n, L, S)
            # Whole batch as the scheduler sees it: prefill + all its decode steps.
            self.batch.append([n, L, st.iterations, st.prefill_s + st.decode_s])
            bar.update(1)
            bar.set_postfix(left=f"{self.budget.left():.0f}s")


def _progress(total: int, desc: str) -> Any:
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, file=sys.stderr, leave=True)
    except ImportError:  # pragma: no cover - tqdm is a dependency; stay usable without it
        class _Bar:
            def update(self, k: int) -> None: ...
            def set_postfix(self, **kw: Any) -> None: ...
            def close(self) -> None: ...

        return _Bar()


def profile_engine(
    engine: Any,
    *,
    budget: Budget,
    slice_len: int = 128,
    decode_steps: int = 8,
    name: str | None = None,
    device_label: str | None = None,
    extra: dict[str, Any] | None = None,
    warm_shapes: bool = False,
    repeats: int = 2,
) -> Profile:
    """Measure, fit and return a profile of ``engine`` within ``budget``."""
    prof = Profiler(engine, budget, slice_len, decode_steps, warm_shapes, repeats)
    prof.warm_up()
    usable = max(0.0, budget.left())
    grid_deadline = budget.elapsed() + GRID_SHARE * usable
    bar = _progress(len(GRID), "grid")
    prof.run_grid(grid_deadline, bar)
    bar.close()
    if len(prof.prefill) < 4 or len(prof.decode) < 4:
        raise RuntimeError(
            f"only {len(prof.prefill)} grid points fit in the budget; need 4 (raise --budget-s)"
        )
    est, rmse = fit(prof.prefill, prof.decode)
    prof.guess = est
    bar = _progress(len(VALIDATION), f"validation S={slice_len}")
    prof.run_validation(reserve=0.02 * budget.seconds, bar=bar)
    bar.close()
    rmse = {
        "prefill_s": prefill_rmse(est, prof.prefill),
        "decode_s": decode_rmse(est, prof.decode),
    }
    if prof.batch:
        rmse["batch_s"] = batch_rmse(est, prof.batch)
    info = prof.info
    device = device_label or info.device
    return Profile(
        name=name or f"{info.engine}-{info.model}-{info.device}",
        engine=info.engine,
        model=info.model,
        device=device,
        estimator=est,
        kv_bytes_per_token=int(info.kv_bytes_per_token),
        mem_available=float(info.mem_available),
        source="measured",
        rmse={k: round(v, 6) for k, v in rmse.items()},
        slice_len=slice_len,
        samples={
            "prefill": [[n, L, round(t, 6)] for n, L, t in prof.prefill],
            "decode": [[n, l, round(t, 6)] for n, l, t in prof.decode],  # noqa: E741
            "batch": [[n, L, S, round(t, 6)] for n, L, S, t in prof.batch],
        },
        notes=(
            "Measured by `sclsd-worker profile`: prefill samples (N, L, s), one-iteration "
            "decode samples (N, mean context, s), whole-batch validation samples "
            "(N, L, iterations, s); fitted with scipy curve_fit, coefficients >= 0."
        ),
        extra={**(extra or {}), "elapsed_s": round(budget.elapsed(), 1)},
    )


def _parse_opts(pairs: list[str]) -> dict[str, Any]:
    """``--opt KEY=VALUE`` pairs: an engine option typed by its declaration (as
    ``sclsd-worker``'s flags: ``kv_reuse=false`` is False, not the text), another key by
    the look of its value."""
    from sclsd.engine_options import OPTIONS, parse_option

    out: dict[str, Any] = {}
    for p in pairs:
        key, sep, val = p.partition("=")
        if not sep:
            raise SystemExit(f"--opt wants KEY=VALUE, got {p!r}")
        try:
            out[key] = parse_option(key, val) if key in OPTIONS else _number_or_text(val)
        except ValueError as exc:
            raise SystemExit(f"--opt {p!r}: {exc}") from None
    return out


def _number_or_text(val: str) -> Any:
    for conv in (int, float):
        try:
            return conv(val)
        except ValueError:
            continue
    return val


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="sclsd-worker profile",
        description="Measure prefill/decode latency grids on an engine and write a profile JSON.",
    )
    ap.add_argument("--engine", default="hf", help="engine name (hf, fake, ...)")
    ap.add_argument("--model", default=None, help="model spec (default: the engine's default)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", required=True, help="profile JSON to write")
    ap.add_argument("--budget-s", type=float, default=540.0,
                    help="wall-clock budget in seconds, model loading included (default 540)")
    ap.add_argument("--slice-len", type=int, default=128, help="S of the validation batches")
    ap.add_argument("--decode-steps", type=int, default=None,
                    help="decode steps per grid point (default 32 on CUDA, 8 on the CPU)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="timed runs per grid point, the median kept (default 3 on CUDA, up to 2 on "
                         "the CPU: the faster)")
    ap.add_argument("--warm-shapes", action=argparse.BooleanOptionalAction, default=None,
                    help="run each shape once untimed before timing it (default: on CUDA)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default 1 on the CPU, the engine's choice elsewhere)")
    ap.add_argument("--name", default=None, help="profile name (default engine-model-device)")
    ap.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE",
                    help="extra engine constructor option (repeatable)")
    ap.add_argument("-v", "--verbose", action="store_true")
    return ap  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``sclsd-worker profile``; returns the exit status."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
    cuda = args.device.startswith("cuda")
    if args.decode_steps is None:
        args.decode_steps = 32 if cuda else 8
    if args.repeats is None:
        args.repeats = 3 if cuda else 2
    if args.warm_shapes is None:
        args.warm_shapes = cuda
    if args.slice_len < 2 or args.decode_steps < 1 or args.budget_s <= 0 or args.repeats < 1:
        print("error: --slice-len >= 2, --decode-steps >= 1, --repeats >= 1 and --budget-s > 0",
              file=sys.stderr)
        return 2
    force_offline()
    threads = args.threads
    if threads is None and args.device == "cpu":
        threads = 1  # profiles must match how a CPU worker serves: one thread unless told
    budget = Budget(args.budget_s)
    from worker.engines import create_engine

    opts = _parse_opts(args.opt)
    if threads:
        opts["threads"] = threads
    print(f"loading {args.engine} {args.model or '(default model)'} on {args.device} ...",
          file=sys.stderr)  # fmt: skip
    engine = create_engine(args.engine, args.model, device=args.device, **opts)
    engine.warm_up(lambda step: print(step, file=sys.stderr))  # as a worker does before serving
    try:
        label = f"{args.device} ({threads} thread{'s' if threads != 1 else ''})" if threads else None
        prof = profile_engine(
            engine,
            budget=budget,
            slice_len=args.slice_len,
            decode_steps=args.decode_steps,
            name=args.name,
            device_label=label,
            extra={"threads": threads, "budget_s": args.budget_s,
                   "load_s": round(budget.elapsed(), 1), "warm_shapes": args.warm_shapes,
                   "repeats": args.repeats, "decode_steps": args.decode_steps},
            warm_shapes=args.warm_shapes,
            repeats=args.repeats,
        )  # fmt: skip
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        engine.close()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    save_profile(prof, args.out)
    r = prof.rmse
    print(
        f"wrote {args.out}: {len(prof.samples['prefill'])} grid points, "
        f"{len(prof.samples['batch'])} validation batches in {prof.extra['elapsed_s']} s; "
        f"RMSE prefill {r['prefill_s']:.3f} s, decode {r['decode_s'] * 1e3:.2f} ms, "
        f"batch {r.get('batch_s', float('nan')):.3f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
