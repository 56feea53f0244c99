"""The stages of ``sclsd-bench gpu-check``, each run by the check in a process of its own.

::

    python -m sclsd.bench.gpu_stages setup --work DIR [--bundle DIR]
    python -m sclsd.bench.gpu_stages facts --device cuda:0
    python -m sclsd.bench.gpu_stages engine --variant hf|hf-cb|hf-static-cb|generate --model M --device D --dtype T
                                            --shapes 32x256,64x256 --gen 64 [--opts k=v;k=v] [--ab]
    python -m sclsd.bench.gpu_stages profile --model M --device D --dtype T --out P --budget-s B --slice-len S
    python -m sclsd.bench.gpu_stages live --policy scls|ils|scls-cb [--engine E] --model M ... --trace CSV --log FILE
    python -m sclsd.bench.gpu_stages tests [-k EXPR]

Each prints its results as JSON objects, one a line, on stdout (the check appends them
to ``results.jsonl`` as they come and names the stage); everything else goes to stderr,
the stage's log. The engines, the profiler, the launcher and the replay are the
project's own (:mod:`sclsd.bench.engine`, ``sclsd-worker profile``, :mod:`sclsd.launch`,
:mod:`sclsd.bench.replay`). Nothing heavy is imported at module level: ``setup`` runs
before the project's dependencies may be importable.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from . import gpu_report
from .gpu_runner import LAUNCH_ENV


def emit(row: dict[str, Any]) -> None:
    """One result row on stdout, flushed (the runner reads it at once)."""
    print(json.dumps(row, default=str), flush=True)


def since_launch() -> float | None:
    """Seconds since the runner launched this process, or None outside the runner."""
    t = os.environ.get(LAUNCH_ENV)
    return round(time.time() - float(t), 2) if t else None


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:600]


def _on_sigterm(signum: int, _frame: Any) -> None:
    # The runner's SIGTERM at the end of a cap: unwind, so that finally blocks stop a daemon.
    raise SystemExit(128 + signum)


# --------------------------------------------------------------------------- setup


def cmd_setup(args: argparse.Namespace) -> int:
    """Install a bundle beside the box's own torch and check what serving imports
    (:func:`sclsd.bench.gpu_bundle.install`); emit the ``PYTHONPATH`` the later stages need."""
    from .gpu_bundle import install

    row = install(Path(args.bundle) if args.bundle else None, Path(args.work))
    emit(row)
    return 1 if row.get("failed") else 0


# --------------------------------------------------------------------------- facts


def cmd_facts(args: argparse.Namespace) -> int:
    """Versions, and the card when there is one (memory in bytes and GiB, bandwidth)."""
    import platform
    import shutil
    from importlib import metadata

    f: dict[str, Any] = {"phase": "facts", "python": platform.python_version(), "executable": sys.executable}
    for mod in ("torch", "transformers", "tokenizers", "numpy", "scipy", "zmq", "msgspec", "prometheus_client",
                "pytest"):
        try:
            f[mod] = getattr(__import__(mod), "__version__", "?")
        except Exception as exc:  # noqa: BLE001 - a missing module is a fact to report
            f[mod] = f"MISSING ({_error(exc)[:80]})"
    for dist in ("triton", "flash-attn", "deepspeed", "llguidance"):
        try:  # metadata only: importing these is slow or has side effects
            f[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            f[dist] = None
    f["cc"] = shutil.which("cc") or shutil.which("gcc")  # inductor builds its launchers with it
    try:
        import torch

        f["cuda_available"] = torch.cuda.is_available()
        if f["cuda_available"] and not args.device.startswith("cpu"):
            dev = torch.device(args.device if ":" in args.device else "cuda:0")
            p = torch.cuda.get_device_properties(dev)
            free, total = torch.cuda.mem_get_info(dev)
            f.update(gpu=p.name, capability=f"{p.major}.{p.minor}", gpus=torch.cuda.device_count(),
                     mem_total=int(total), mem_free=int(free), mem_total_gib=round(total / 2**30, 2),
                     cuda=torch.version.cuda)  # fmt: skip
    except Exception as exc:  # noqa: BLE001
        f["torch_error"] = _error(exc)
    try:
        import sclsd
        import worker  # noqa: F401

        f["sclsd"] = sclsd.__version__
    except Exception as exc:  # noqa: BLE001
        f["sclsd"] = f"MISSING ({_error(exc)})"
    emit(f)
    return 0 if "torch_error" not in f and not str(f["sclsd"]).startswith("MISSING") else 1


# --------------------------------------------------------------------------- engine


def graph_facts(engine: Any) -> dict[str, Any]:
    """The hf engine's static path: its arena, buckets and captured decode graphs."""
    st = getattr(engine, "static", None)
    if st is None:
        return {}
    return {"graphs_on": bool(st.graphs_on), "captured": len(st.captured()), "buckets": len(st.buckets()),
            "capture_s": round(float(st.capture_s), 2), "arena_tokens": int(st.arena.tokens),
            "arena_gib": round(st.arena.nbytes / 2**30, 3)}  # fmt: skip


def graphs_kept(engine: Any, n: int, need: int) -> bool:
    """Whether a batch of ``n`` rows needing ``need`` cache columns decodes in a captured graph."""
    st = getattr(engine, "static", None)
    if st is None or not st.graphs_on or not st.captured():
        return False
    plan = st.plan(n, need)
    return plan is not None and bool(plan.graph)


class _Keep:
    """An engine whose ``serve`` keeps its last outputs (the A/B compares their tokens)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.outs: list[Any] = []

    def serve(self, batch: Any, emit: Any = None) -> Any:
        outs, stats = self.engine.serve(batch, emit)
        self.outs = outs
        return outs, stats


def _ab(engine: Any, n: int, p: Any, gen: int, vocab: int) -> dict[str, Any]:
    """The same batch with the captured graphs and eagerly: ms/step and whether the greedy
    tokens agree (fp16 reduction order may legitimately move a row)."""
    from . import engine as eb

    st, keep = engine.static, _Keep(engine)
    row: dict[str, Any] = {}
    tokens = {}
    for label, use in (("graphs", True), ("eager", False)):
        st.use_graphs = use
        try:
            _, row[f"{label}_ms_per_step"] = eb._serve_call(keep, eb._batch(9000 + n, n, p, gen, vocab))
            tokens[label] = [o.token_ids for o in keep.outs]
        finally:
            st.use_graphs = True
    same = sum(a == b for a, b in zip(tokens["graphs"], tokens["eager"], strict=True))
    row["rows_identical"] = f"{same}/{n}"
    return row


def _cb_facts(engine: Any) -> dict[str, Any]:
    """hf-cb's cache and the step shapes its warm-up captured (``warmed_shapes``: captured,
    of how many)."""
    mgr = getattr(engine, "_mgr", None)
    cfg = getattr(mgr, "continuous_batching_config", None)
    keys = ("use_cuda_graph", "num_blocks", "max_batch_tokens", "page_size", "max_memory_percent")
    return {"cache_tokens": getattr(engine, "cache_tokens", None),
            "cb": {k: getattr(cfg, k, None) for k in keys} if cfg is not None else None,
            "warmed_shapes": getattr(engine, "warmed_shapes", None)}  # fmt: skip


def parse_opts(text: str) -> dict[str, Any]:
    """``k=v;k=v`` (``--opts``) as typed values, as ``sclsd-worker`` takes them; a later key
    wins over an earlier one (an engine variant's option over the same in ``--arena-opts``)."""
    from worker.main import parse_value

    return {k.strip(): parse_value(v) for k, _, v in (kv.partition("=") for kv in text.split(";") if kv)}


def cmd_engine(args: argparse.Namespace) -> int:
    """Load one engine variant, warm it up, time each shape cold and warm (``sclsd-bench
    engine``'s measurement), with the graphs' state of every shape."""
    import logging

    from ..defaults import force_offline

    force_offline()
    from worker.engines import create_engine

    from . import engine as eb

    warnings: list[str] = []

    class Warnings(logging.Handler):  # graphs dropped, captures failed: said in the summary
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(f"{record.name}: {record.getMessage()[:300]}")

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().addHandler(Warnings(logging.WARNING))
    engine_name, opts = eb.VARIANTS[args.variant]
    opts = {**opts, "dtype": args.dtype}
    opts.update(parse_opts(args.opts))
    if args.device == "cpu":
        opts.setdefault("threads", 1)
    base = {"variant": args.variant, "model": args.model, "device": args.device}
    t0 = time.perf_counter()
    try:
        eng: Any = create_engine(engine_name, args.model, device=args.device, **opts)
        load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        eng.warm_up(lambda step: print(step, file=sys.stderr, flush=True))
    except Exception as exc:  # noqa: BLE001 - an engine that does not start is the result
        traceback.print_exc()
        emit({**base, "phase": "load", "error": _error(exc), "warnings": warnings[-5:]})
        return 1
    emit({**base, "phase": "ready", "load_s": round(load_s, 2), "warm_up_s": round(time.perf_counter() - t0, 2),
          "ready_since_launch_s": since_launch(), "graphs": graph_facts(eng), **_cb_facts(eng),
          "warnings": warnings[-8:]})  # fmt: skip
    vocab = min(int(eng.config.vocab_size), 32000)
    rc, bid = 0, 0
    try:
        for n, p in eb.parse_shapes(args.shapes):
            for call in ("cold", "warm"):
                bid += 1
                row: dict[str, Any] = {**base, "phase": "shape", "n": n, "p": p, "gen": args.gen, "call": call}
                try:
                    if args.variant == "generate":
                        prefill, ms = eb._generate_call(eng, n, p, args.gen, bid)
                    else:
                        prefill, ms = eb._serve_call(eng, eb._batch(bid, n, p, args.gen, vocab))
                    row.update(prefill_s=round(prefill, 4), ms_per_step=round(ms, 3))
                    if getattr(eng, "static", None) is not None:
                        row["graphs_kept"] = graphs_kept(eng, n, eb.widest(p) + args.gen - 1)
                except Exception as exc:  # noqa: BLE001 - a failing shape is a result
                    traceback.print_exc()
                    row["error"] = _error(exc)
                    rc = 1
                emit(row)
            if args.ab and graphs_kept(eng, n, eb.widest(p) + args.gen - 1):
                try:
                    emit({**base, "phase": "ab", "n": n, "p": p, **_ab(eng, n, p, args.gen, vocab)})
                except Exception as exc:  # noqa: BLE001
                    emit({**base, "phase": "ab", "n": n, "p": p, "error": _error(exc)})
        emit({**base, "phase": "after", "graphs": graph_facts(eng), "warnings": warnings[-20:]})
    finally:
        eng.close()
    return rc


# --------------------------------------------------------------------------- profile


def check_profile(path: Path) -> dict[str, Any]:
    """A fitted profile's RMSE against its own samples per kind, absolute and over the mean
    measured time, judged against :data:`gpu_report.RMSE_LIMITS`; the worst decode samples
    (where a step function, bucket or graph against eager, breaks the linear fit)."""
    from ..core.estimator import batch_rmse, decode_rmse, prefill_rmse
    from ..core.profiles import load_profile

    prof = load_profile(path)
    est, s = prof.estimator, prof.samples
    rows: list[dict[str, Any]] = []
    for kind, fn in (("prefill", prefill_rmse), ("decode", decode_rmse), ("batch", batch_rmse)):
        times = [x[-1] for x in s.get(kind, [])]
        limit = gpu_report.RMSE_LIMITS[kind]
        if not times:
            rows.append({"samples": kind, "n": 0, "rmse_s": None, "mean_s": None, "relative": None, "limit": limit})
            continue
        rmse, mean = float(fn(est, s[kind])), sum(times) / len(times)
        rows.append({"samples": kind, "n": len(times), "rmse_s": rmse, "mean_s": mean,
                     "relative": rmse / mean if mean > 0 else None, "limit": limit})  # fmt: skip
    worst = sorted(((abs(est.tau_decode(ctx, n) - t) / t, n, ctx, t) for n, ctx, t in s.get("decode", [])
                    if t > 0), reverse=True)[:4]  # fmt: skip
    judged = [r for r in rows if r["relative"] is not None]
    return {"engine": prof.engine, "profile": path.name, "rows": rows, "coefficients": est.to_dict(),
            "kv_bytes_per_token": prof.kv_bytes_per_token, "mem_available": prof.mem_available,
            "ok": bool(judged) and all(r["relative"] <= r["limit"] for r in judged),
            "worst_decode": [{"n": n, "l": round(ctx, 1), "ms": round(1000 * t, 2), "rel_err": round(e, 3)}
                             for e, n, ctx, t in worst]}  # fmt: skip


def cmd_profile(args: argparse.Namespace) -> int:
    """``sclsd-worker profile`` within its budget, then its fit judged (:func:`check_profile`)."""
    cmd = [sys.executable, "-m", "worker.main", "profile", "--engine", "hf", "--model", args.model,
           "--device", args.device, "--out", args.out, "--budget-s", str(args.budget_s),
           "--slice-len", str(args.slice_len), "--opt", f"dtype={args.dtype}", "-v"]  # fmt: skip
    if args.smoke:  # the plumbing only: as few steps as give a fit
        cmd += ["--decode-steps", "4", "--repeats", "1", "--threads", "1"]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    assert proc.stdout is not None
    last = ""
    for line in proc.stdout:  # to the log as it comes; the last line says why it failed
        sys.stderr.write(line)
        last = line.strip() or last
    rc = proc.wait()
    emit({"phase": "profile", "rc": rc, "seconds": round(time.monotonic() - t0, 1), "path": args.out})
    if rc != 0 or not Path(args.out).is_file():
        emit({"phase": "check", "error": f"sclsd-worker profile exited {rc}: {last[:300]}"})
        return 1
    c = check_profile(Path(args.out))
    prof = json.loads(Path(args.out).read_text())
    emit({"phase": "check", "kinds": {r["samples"]: {k: r[k] for k in ("n", "rmse_s", "mean_s", "relative", "limit")}
                                      for r in c["rows"]},
          "ok": c["ok"], "coefficients": {k: float(f"{v:.4g}") for k, v in c["coefficients"].items()},
          "m_ava_gib": round(c["mem_available"] / 2**30, 2), "budget_s": args.budget_s,
          "elapsed_s": prof.get("extra", {}).get("elapsed_s"), "worst_decode": c["worst_decode"]})  # fmt: skip
    return 0


# --------------------------------------------------------------------------- live


def live_sections(policy: str, *, model: str, device: str, dtype: str, slice_len: int, max_input: int,
                  max_gen: int, profile: Path | None = None, options: dict[str, Any] | None = None,
                  engine: str | None = None) -> dict[str, dict[str, Any]]:  # fmt: skip
    """The daemon config of one live replay: ``scls`` on ``hf``; ``scls-cb`` (slice grants)
    and ``ils`` (every request to the worker on arrival, the continuous-batching baseline
    as ``sclsd-bench live`` runs it) on ``engine`` (default ``hf-cb``); one worker on ``device``."""
    engine = engine or ("hf-cb" if policy in ("ils", "scls-cb") else "hf")
    sched: dict[str, Any] = {"policy": policy, "slice_len": slice_len}
    if policy == "ils":
        sched.update(policy="sls", batch_size=1, gamma_s=0.05, work_conserving=False, kv_reuse=False)
    if profile is not None:
        sched["profile"] = str(profile.resolve())
    workers: dict[str, Any] = {"spawn": 1, "engine": engine, "device": device.split(":")[0], "threads": 1}
    if options:
        workers["options"] = dict(options)
    return {
        "daemon": {"heartbeat_timeout_s": 120.0, "drain_timeout_s": 30.0, "log_level": "info"},
        "model": {"name": model, "max_input": max_input, "max_gen": max_gen, "dtype": dtype},
        "scheduler": sched,
        "workers": workers,
    }


def log_facts(log: Path) -> dict[str, Any]:
    """What a daemon's log says of its worker: its own start-to-ready times, exits (a
    restart), graphs dropped, preemptions, tracebacks, and ``hf-static-cb``'s count of rows
    resumed in place, copied in from its store, spilled, moved and kept waiting."""
    if not log.is_file():
        return {}
    text = log.read_text(errors="replace")
    out: dict[str, Any] = {
        "worker_ready_in_s": [float(x) for x in re.findall(r"engine \S+ ready in ([0-9.]+)s", text)],
        "worker_exits": len(re.findall(r"exited rc=", text)), "graphs_dropped": text.count("dropping"),
        "preempted": text.count("preempted"), "tracebacks": text.count("Traceback")}  # fmt: skip
    # hf-static-cb's own account at close: how its grants' rows came back and what moved.
    m = re.search(r"rows resumed in place (\d+), copied in from the store (\d+), paused rows spilled (\d+), "
                  r"rows moved between slots (\d+), rows that waited for room (\d+)"
                  r"(?:; rows started from a cached prefix (\d+), finished rows cached as prefixes (\d+))?"
                  r"(?:; (\d+) decode steps of ([0-9.]+) rows on average, (\d+) prefill turns)?"
                  r"(?:; (\d+) KV columns read per step, (\d+) % of them the rows' own; (\d+) relayouts, "
                  r"([0-9.]+) s of prefill)?(?:, ([0-9.]+) s in turns: ([0-9.]+) ms a step besides prefill)?"
                  r"(?:; (\d+) steps outside the buckets)?(?:, (\d+) regroups)?"
                  r"(?:, (\d+) spills dropped for want of device memory)?"
                  r"(?:, (\d+) turns out of device memory)?(?:, cached prefixes held to ([0-9.]+) GiB since)?", text)
    cut = re.search(r"captures took ([0-9.]+) s of their [0-9.]+ s \(graph_capture_s\): (\d+) smaller bucket shapes "
                    r"of (\d+) left out", text)
    if cut:  # the warm-up's captures ran out of their budget
        out["captures_cut"] = {"s": float(cut.group(1)), "left_out": int(cut.group(2)), "shapes": int(cut.group(3))}
    flex = re.search(r'decode_attention = "flex" failed \((.*?)\); decode attends with SDPA', text)
    if flex:
        out["flex_failed"] = flex.group(1)[:300]
    if m:
        keys = ("resumed", "loaded", "spilled", "moved", "waited", "shared", "cached", "steps", "rows_per_step", "prefills",
                "cols_per_step", "own_pct", "relayouts", "prefill_s", "turns_s", "ms_per_step", "loose_steps", "regroups",
                "spill_oom", "oom_turns", "prefix_limit_gib")
        floats = ("rows_per_step", "prefill_s", "turns_s", "ms_per_step", "prefix_limit_gib")
        out["arena_rows"] = {k: (float(v) if k in floats else int(v))
                             for k, v in zip(keys, m.groups(), strict=True) if v is not None}
        # The columns a step read that were not the rows' own, by why (``StepTally.pad``).
        pad = re.search(r"padding read per step: ([^\n;]*)", text[m.start():])
        if pad:
            out["arena_rows"]["padding"] = {why: int(n) for why, n in re.findall(r"([a-z' ]+?) (\d+)(?:, |$)",
                                                                                pad.group(1).strip())}
        shapes = re.search(r"steps by shape: ([^\n;]*)", text[m.start():])
        if shapes:  # the buckets the steps ran in, the busiest first
            out["arena_rows"]["shapes"] = [[int(n), int(c), int(k)]
                                           for n, c, k in re.findall(r"(\d+)×(\d+) (\d+)", shapes.group(1))]
    return out


#: What the daemon logs when it stops restarting a worker that keeps failing at its start.
GAVE_UP = "not restarting it"


def wait_ready(d: Any, timeout: float) -> float:
    """Seconds until the daemon's worker registered; RuntimeError (the log's tail) when the
    daemon exits, gives the worker up, or ``timeout`` passes: a worker that cannot start
    should not hold the stage for its whole cap."""
    t0 = time.monotonic()
    while True:
        left = timeout - (time.monotonic() - t0)
        try:
            d.wait_workers(1, timeout=max(0.1, min(5.0, left)), progress=True)
            return time.monotonic() - t0
        except RuntimeError:
            if d.proc.poll() is not None or left <= 5.0 or GAVE_UP in d.log_text(50_000):
                raise


def why_not_ready(text: str) -> str:
    """A start-up failure in one line: what failed and the last error the log shows."""
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    errors = [x for x in lines if re.search(r"\w+(Error|Exception)\b|ERROR", x)]
    head = lines[0] if lines else "worker not ready"
    return f"{head} | {errors[-1]}"[:600] if errors else head[:600]


#: Replay summary keys kept in the results.
REPLAY_KEYS = ("requests", "completed", "errors", "duration_s", "throughput_rps", "output_tps", "avg_latency_s",
               "p95_latency_s", "avg_ttft_s", "p95_ttft_s", "avg_tpot_s", "max_gap_s", "p50_gap_s", "p95_gap_s", "goodput_rps",
               "avg_batch_size", "slices_per_req", "pad_tokens_per_req", "preemptions", "kv_peak_tokens",
               "estimator_mean_abs_error_s", "wall_s", "arrivals_s", "late_starts", "late_start_s")  # fmt: skip


def cmd_live(args: argparse.Namespace) -> int:
    """A daemon with one worker, one replay of the trace, the daemon stopped."""
    signal.signal(signal.SIGTERM, _on_sigterm)
    from ..launch import launch
    from . import replay

    profile = Path(args.profile) if args.profile and Path(args.profile).is_file() else None
    options = parse_opts(args.opts)
    sections = live_sections(args.policy, model=args.model, device=args.device, dtype=args.dtype,
                             slice_len=args.slice_len, max_input=args.max_input, max_gen=args.max_gen,
                             profile=profile, options=options, engine=args.engine or None)  # fmt: skip
    base = {"policy": args.policy, "engine": sections["workers"]["engine"],
            "profile": str(profile) if profile else "the default profile", "max_tokens_cap": args.max_tokens_cap}
    t0 = time.monotonic()
    d = launch(sections, log=args.log)
    try:
        try:
            ready = wait_ready(d, args.ready_timeout)
        except RuntimeError as exc:
            emit({**base, "phase": "ready", "error": why_not_ready(str(exc))})
            return 1
        emit({**base, "phase": "ready", "ready_s": round(ready, 1)})
        json_out = Path(args.log).with_suffix(".json")
        rargs = replay.replay_args(
            socket=d.sock, status_socket=d.status_sock, trace=args.trace, rate=args.rate, num=args.num,
            offset=0, max_input=args.max_input, max_gen=args.max_gen, scale=args.scale, id_range=20000,
            connections=4, seed=0, label=args.policy, json_out=str(json_out), no_progress=True,
            max_tokens_cap=args.max_tokens_cap)
        rc = replay.run(rargs)
        s = json.loads(json_out.read_text()) if json_out.is_file() else {}
        emit({**base, "phase": "replay", "rc": rc, "rate": args.rate, **{k: s.get(k) for k in REPLAY_KEYS}})
        return rc
    finally:
        d.stop(timeout=8)
        emit({**base, "phase": "stopped", "total_s": round(time.monotonic() - t0, 1), **log_facts(Path(args.log))})


# --------------------------------------------------------------------------- tests


def cmd_tests(args: argparse.Namespace) -> int:
    """``pytest tests/gpu`` (deepspeed's tests left out unless ``-k`` says otherwise)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", "-k", args.k, "tests/gpu"]
    if importlib.util.find_spec("pytest_timeout") is not None:
        cmd[3:3] = ["--timeout", "200"]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=sys.stderr, text=True)
    sys.stderr.write(proc.stdout)
    found = re.findall(r"^.*\d+ (?:passed|failed|skipped|error).*$", proc.stdout, re.M)
    emit({"phase": "result", "rc": proc.returncode, "summary": found[-1].strip("= ") if found else None})
    return proc.returncode


# --------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m sclsd.bench.gpu_stages", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("setup")
    s.add_argument("--work", required=True)
    s.add_argument("--bundle", default="")
    f = sub.add_parser("facts")
    f.add_argument("--device", default="cuda:0")
    common = argparse.ArgumentParser(add_help=False)
    for flag, default in (("--model", None), ("--device", "cuda:0"), ("--dtype", "float16")):
        common.add_argument(flag, default=default, required=default is None)
    e = sub.add_parser("engine", parents=[common])
    e.add_argument("--variant", required=True, choices=("hf", "hf-cb", "hf-static-cb", "generate", "hf-eager",
                                                        "hf-static"))
    e.add_argument("--shapes", default="32x256")
    e.add_argument("--gen", type=int, default=64)
    e.add_argument("--opts", default="", help="engine options k=v;k=v")
    e.add_argument("--ab", action="store_true", help="also serve each shape without its graphs")
    p = sub.add_parser("profile", parents=[common])
    p.add_argument("--out", required=True)
    p.add_argument("--budget-s", type=float, default=95.0)
    p.add_argument("--slice-len", type=int, default=128)
    p.add_argument("--smoke", action="store_true")
    lv = sub.add_parser("live", parents=[common])
    lv.add_argument("--policy", required=True, choices=("scls", "ils", "scls-cb"))
    lv.add_argument("--engine", default="", help="the worker's engine (default: hf-cb for ils and scls-cb, else hf)")
    lv.add_argument("--trace", required=True)
    lv.add_argument("--log", required=True, help="the daemon's log (its summary beside it, .json)")
    lv.add_argument("--profile", default="")
    lv.add_argument("--opts", default="", help="workers.options k=v;k=v")
    for flag, count in (("--num", 40), ("--max-input", 1024), ("--max-gen", 1024), ("--slice-len", 128)):
        lv.add_argument(flag, type=int, default=count)
    lv.add_argument("--max-tokens-cap", type=int, default=0,
                    help="requests ask this max_tokens and the client ends each at its trace length "
                         "(sclsd-bench replay --max-tokens-cap; 0: max_tokens = the trace length)")
    for flag, value in (("--rate", 4.0), ("--scale", 0.5), ("--ready-timeout", 150.0)):
        lv.add_argument(flag, type=float, default=value)
    t = sub.add_parser("tests")
    t.add_argument("-k", default="not deepspeed")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return {"setup": cmd_setup, "facts": cmd_facts, "engine": cmd_engine, "profile": cmd_profile,
            "live": cmd_live, "tests": cmd_tests}[args.cmd](args)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
