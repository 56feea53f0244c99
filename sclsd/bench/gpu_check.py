"""``sclsd-bench gpu-check``: one command that measures a box with CUDA, end to end.

::

    sclsd-bench gpu-check --out DIR [--device auto|cuda|cpu] [--model auto|SPEC]

Steps, each recorded in ``DIR`` (a failed step is reported and the others still run):

1. **Profile** ``hf`` and ``deepspeed`` (``sclsd-worker profile``, one process per
   engine) on a random-weights model sized to the card: the largest of
   ``random:llama2-13b`` / ``random:llama2-7b`` whose fp16 weights take at most
   :data:`WEIGHT_SHARE` of its memory (``tiny-random`` in fp32 on the CPU).
   Writes ``profile-ENGINE.json`` and ``profile-ENGINE.log``.
2. **Check** each fitted profile against its own measurements: the RMSE of the
   prefill, decode and whole-slice samples, absolute and relative to the mean
   measured time, with a verdict (relative RMSE at most :data:`RMSE_OK`).
3. **Engines**: ms per decode step of every engine variant, cold and warm, beside
   transformers' own compiled ``generate`` and the card's bandwidth floor
   (``sclsd-bench engine``, in ``engine/``).
4. **Live replay**: a daemon per policy (``ils``: the ``hf-cb`` engine given every
   request on arrival, the continuous-batching baseline; ``sls``, ``scls``; and
   ``scls-cb`` on ``hf-cb``) with the ``hf`` profile as its estimator, the ShareGPT
   lengths scaled and capped, Poisson arrivals (``sclsd-bench replay``). Writes
   ``live-POLICY.json`` and ``live-POLICY.log``.
5. **Report**: ``report.md`` (Markdown, for docs/benchmarks.md) and
   ``gpu-check.json`` (everything above).

On a CPU the same steps run on ``tiny-random`` with small budgets (a few minutes
on two cores): that is how the command itself is tested; its numbers say nothing
about a GPU. The exit status is 0 when every step succeeded.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from .. import models
from ..defaults import offline_env

#: Largest share of the card's memory the fp16 weights of the chosen model may take
#: (the rest is KV cache and the engine's workspace).
WEIGHT_SHARE = 0.45
#: Random-weight models tried on a GPU, largest first.
GPU_MODELS = ("random:llama2-13b", "random:llama2-7b")
#: A fitted profile passes when every RMSE is at most this share of the mean measured time.
RMSE_OK = 0.2
#: Engine each live policy runs on ("" = the engine under test, ``--live-engine``); ``ils``
#: is the continuous-batching baseline (hf-cb, every request dispatched on arrival).
LIVE_ENGINES = {"ils": "hf-cb", "sls": "", "scls": "", "scls-cb": "hf-cb"}


@dataclass
class Plan:
    """What the check runs; sized to the device unless given on the command line."""

    device: str
    model: str
    dtype: str
    engines: list[str]
    workers: int
    profile_budget_s: float
    slice_len: int
    live_engine: str
    policies: list[str]
    trace: str
    num: int
    rate: float
    scale: float
    max_input: int
    max_gen: int
    batch_size: int
    facts: dict[str, Any] = field(default_factory=dict)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="directory for report.md and the JSONs")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda or cpu")
    p.add_argument("--model", default="auto", help="model spec; auto sizes a random Llama to the card")
    p.add_argument("--dtype", default="auto", help="auto (float16 on CUDA, float32 on the CPU)")
    p.add_argument("--engines", default="hf,deepspeed", help="engines to profile")
    p.add_argument("--workers", type=int, default=0, help="live workers (0: one per GPU, 1 on the CPU)")
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="profiling budget per engine, seconds (0: 180 on CUDA, 20 on the CPU)")
    p.add_argument("--slice-len", type=int, default=0, help="S (0: 128 on CUDA, 8 on the CPU)")
    p.add_argument("--live-engine", default="hf", help="engine of the sls and scls replays")
    p.add_argument("--policies", default="", help="live policies (default: sls,scls and scls-cb if present)")
    p.add_argument("--trace", default="../shared/traces/sharegpt_lengths.csv")
    p.add_argument("--num", type=int, default=0, help="requests per replay (0: 48 on CUDA, 8 on the CPU)")
    p.add_argument("--rate", type=float, default=0.0, help="Poisson rate, req/s (0: 1.0 CUDA, 2.0 CPU)")
    p.add_argument("--scale", type=float, default=0.0, help="length scale (0: 0.5 CUDA, 1/32 CPU)")
    p.add_argument("--max-input", type=int, default=0, help="input cap (0: 1024 CUDA, 64 CPU)")
    p.add_argument("--max-gen", type=int, default=0, help="generation cap (0: 1024 CUDA, 64 CPU)")
    p.add_argument("--batch-size", type=int, default=16, help="fixed batch size of sls")
    p.add_argument("--skip-live", action="store_true", help="profile and check only")
    p.add_argument("--skip-engine", action="store_true", help="no engine table (sclsd-bench engine)")


# --------------------------------------------------------------------------- planning


#: Run in a child process: a CUDA context in this process would hold GPU memory (and
#: shrink the M_ava the profiled workers measure) for the whole check.
_PROBE = """
import json, platform, sys, torch
want = sys.argv[1]
f = {"python": platform.python_version(), "torch": torch.__version__,
     "cuda_available": torch.cuda.is_available()}
if want != "cpu" and torch.cuda.is_available():
    dev = torch.device(want if ":" in want else "cuda:0")
    free, total = torch.cuda.mem_get_info(dev)
    p = torch.cuda.get_device_properties(dev)
    f.update(device="cuda", gpu=p.name, capability=f"{p.major}.{p.minor}",
             gpus=torch.cuda.device_count(), mem_total=int(total), mem_free=int(free),
             cuda=torch.version.cuda)
    clock, bus = getattr(p, "memory_clock_rate", 0), getattr(p, "memory_bus_width", 0)
    if clock and bus:  # kHz and bits; double data rate
        f["bandwidth"] = 2 * clock * 1000 * bus / 8
else:
    f.update(device="cpu", cpu=platform.processor() or platform.machine())
print(json.dumps(f))
"""


def device_facts(device: str) -> dict[str, Any]:
    """Versions and, on CUDA, the card (name, capability, total and free bytes, count),
    probed in a child process; ``device`` is ``auto``, ``cpu`` or ``cuda[:N]``.

    DeepSpeed's version is read from its package metadata: the check imports
    deepspeed only inside the workers it profiles.
    """
    out = subprocess.run([sys.executable, "-c", _PROBE, device], capture_output=True, text=True,
                         timeout=300, check=True)  # fmt: skip
    facts: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    for pkg in ("transformers", "deepspeed"):
        try:
            facts[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            facts[pkg] = None
    return facts


def param_count(config: Any) -> int:
    """Parameters of a Llama-style config (embedding, attention, gated MLP, norms, head)."""
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    hd = getattr(config, "head_dim", None) or h // heads
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h
    per_layer = attn + 3 * h * inter + 2 * h
    emb = config.vocab_size * h
    head = 0 if getattr(config, "tie_word_embeddings", False) else emb
    return emb + layers * per_layer + h + head


def choose_model(mem_total: int) -> str:
    """The largest random Llama whose fp16 weights fit :data:`WEIGHT_SHARE` of ``mem_total``."""
    for spec in GPU_MODELS:
        if 2 * param_count(models.load_config(spec)) <= WEIGHT_SHARE * mem_total:
            return spec
    return "tiny-random"


def make_plan(args: argparse.Namespace) -> Plan:
    """Fill every 0/auto option from the device (see :func:`add_arguments`)."""
    if not (args.device in ("auto", "cpu") or args.device.startswith("cuda")):
        raise SystemExit(f"sclsd-bench gpu-check: --device {args.device!r}: auto, cpu or cuda[:N]")
    facts = device_facts(args.device)
    if args.device.startswith("cuda") and not facts["cuda_available"]:
        raise SystemExit("sclsd-bench gpu-check: --device cuda but torch sees no CUDA device")
    gpu = facts["device"] == "cuda"
    device = args.device if args.device.startswith("cuda") else facts["device"]
    model = args.model
    if model == "auto":
        model = choose_model(facts["mem_total"]) if gpu else "tiny-random"
    dtype = args.dtype if args.dtype != "auto" else ("float16" if gpu else "float32")
    from ..core.policy import POLICIES

    policies = [p for p in args.policies.split(",") if p] or [
        p for p in LIVE_ENGINES if p in POLICIES or p == "ils"
    ]

    def pick(value: float, on_gpu: float, on_cpu: float) -> Any:
        return value or (on_gpu if gpu else on_cpu)

    return Plan(
        device=device, model=model, dtype=dtype,
        engines=[e for e in args.engines.split(",") if e],
        workers=args.workers or (facts.get("gpus", 1) if gpu else 1),
        profile_budget_s=pick(args.budget_s, 180.0, 20.0),
        slice_len=pick(args.slice_len, 128, 8),
        live_engine=args.live_engine, policies=policies, trace=args.trace,
        num=pick(args.num, 48, 8), rate=pick(args.rate, 1.0, 2.0),
        scale=pick(args.scale, 0.5, 1 / 32), max_input=pick(args.max_input, 1024, 64),
        max_gen=pick(args.max_gen, 1024, 64), batch_size=args.batch_size, facts=facts,
    )  # fmt: skip


# --------------------------------------------------------------------------- steps


def profile_engine(plan: Plan, engine: str, out: Path) -> dict[str, Any]:
    """Step 1 for one engine: ``sclsd-worker profile`` in its own process."""
    path, log_path = out / f"profile-{engine}.json", out / f"profile-{engine}.log"
    device = "cuda:0" if plan.device == "cuda" else plan.device
    cmd = [sys.executable, "-m", "worker.main", "profile", "--engine", engine, "--model", plan.model,
           "--device", device, "--out", str(path), "--budget-s", str(plan.profile_budget_s),
           "--slice-len", str(plan.slice_len), "--name", f"{engine}-{plan.model}-{plan.device}",
           "--opt", f"dtype={plan.dtype}"]  # fmt: skip
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        try:
            rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=offline_env(),
                                 timeout=plan.profile_budget_s + 600)  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = -1
    result: dict[str, Any] = {"engine": engine, "rc": rc, "seconds": round(time.monotonic() - t0, 1),
                              "log": log_path.name}  # fmt: skip
    if rc == 0 and path.is_file():
        result["profile"] = path.name
    else:
        # The last line says why (progress bars redraw with carriage returns before it).
        lines = log_path.read_text(errors="replace").replace("\r", "\n").strip().splitlines()
        result["error"] = lines[-1] if lines else f"exit status {rc}"
    return result


def check_profile(path: Path) -> dict[str, Any]:
    """Step 2: the fitted profile's RMSE against its own samples, absolute and relative."""
    from ..core.estimator import batch_rmse, decode_rmse, prefill_rmse
    from ..core.profiles import load_profile

    prof = load_profile(path)
    est, s = prof.estimator, prof.samples
    rows: list[dict[str, Any]] = []
    for kind, fn, times in (
        ("prefill", prefill_rmse, [x[-1] for x in s.get("prefill", [])]),
        ("decode", decode_rmse, [x[-1] for x in s.get("decode", [])]),
        ("batch", batch_rmse, [x[-1] for x in s.get("batch", [])]),
    ):
        if not times:
            rows.append({"samples": kind, "n": 0, "rmse_s": None, "mean_s": None, "relative": None})
            continue
        rmse = float(fn(est, s[kind]))
        mean = sum(times) / len(times)
        rows.append({"samples": kind, "n": len(times), "rmse_s": rmse, "mean_s": mean,
                     "relative": rmse / mean if mean > 0 else None})  # fmt: skip
    rel = [r["relative"] for r in rows if r["relative"] is not None]
    return {"engine": prof.engine, "profile": path.name, "rows": rows,
            "coefficients": est.to_dict(), "kv_bytes_per_token": prof.kv_bytes_per_token,
            "mem_available": prof.mem_available,
            "ok": bool(rel) and max(rel) <= RMSE_OK}  # fmt: skip


def live_sections(plan: Plan, policy: str, profile: Path | None) -> dict[str, dict[str, Any]]:
    """The daemon config of one live replay."""
    engine = LIVE_ENGINES.get(policy) or plan.live_engine
    sched: dict[str, Any] = {"policy": policy, "slice_len": plan.slice_len,
                             "batch_size": plan.batch_size}  # fmt: skip
    if policy == "ils":  # every request to a worker as soon as it arrives (sclsd-bench live's ils)
        sched.update(policy="sls", batch_size=1, gamma_s=0.05, work_conserving=False, kv_reuse=False)
    if profile is not None:
        sched["profile"] = str(profile.resolve())
    return {
        "daemon": {"heartbeat_timeout_s": 120.0, "drain_timeout_s": 120.0, "log_level": "info"},
        "model": {"name": plan.model, "max_input": plan.max_input, "max_gen": plan.max_gen},
        "scheduler": sched,
        "workers": {"spawn": plan.workers, "engine": engine, "device": plan.device.split(":")[0],
                    "threads": 1, "options": {"dtype": plan.dtype}},
    }  # fmt: skip


def engine_table(plan: Plan, out: Path) -> dict[str, Any]:
    """Step 3: ``sclsd-bench engine`` in its own process (small shapes on the CPU)."""
    where = out / "engine"
    cmd = [sys.executable, "-m", "sclsd.bench.cli", "engine", "--out", str(where), "--model", plan.model,
           "--device", plan.device, "--dtype", plan.dtype]
    if not plan.device.startswith("cuda"):
        cmd += ["--engines", "hf,hf-static,generate", "--shapes", "1x16,8x32", "--gen", "8"]
    t0 = time.monotonic()
    with open(out / "engine.log", "wb") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=offline_env(), timeout=3600)
    result: dict[str, Any] = {"rc": rc, "seconds": round(time.monotonic() - t0, 1), "log": "engine.log"}
    if (where / "engine.md").is_file():
        result["markdown"] = (where / "engine.md").read_text()
        result["data"] = json.loads((where / "engine.json").read_text())
    return result


def live_replay(plan: Plan, policy: str, out: Path, profile: Path | None) -> dict[str, Any]:
    """Step 3 for one policy: a daemon, one replay, the daemon stopped."""
    from ..launch import launch
    from . import replay

    path, log_path = out / f"live-{policy}.json", out / f"live-{policy}.log"
    t0 = time.monotonic()
    try:
        with launch(live_sections(plan, policy, profile), log=log_path, wait_workers=plan.workers,
                    timeout=900) as d:  # fmt: skip
            rargs = replay.replay_args(
                socket=d.sock, status_socket=d.status_sock, trace=plan.trace, rate=plan.rate,
                num=plan.num, offset=0, max_input=plan.max_input, max_gen=plan.max_gen,
                scale=plan.scale, id_range=20000, connections=4, seed=0, label=policy,
                json_out=str(path), no_progress=True,
            )
            rc = replay.run(rargs)
    except (RuntimeError, OSError) as exc:
        return {"policy": policy, "rc": -1, "error": str(exc).splitlines()[0], "log": log_path.name}
    result: dict[str, Any] = {"policy": policy, "rc": rc, "seconds": round(time.monotonic() - t0, 1),
                              "log": log_path.name}  # fmt: skip
    if path.is_file():
        result["summary"] = json.loads(path.read_text())
    return result


# --------------------------------------------------------------------------- report


def _num(v: Any, fmt: str = "{:.4g}") -> str:
    return "-" if v is None else fmt.format(v) if isinstance(v, (int, float)) else str(v)


def report(plan: Plan, profiles: list[dict[str, Any]], checks: list[dict[str, Any]],
           live: list[dict[str, Any]], engines: dict[str, Any] | None = None) -> str:
    """``report.md``: the machine, the plan, the profiles and their RMSE, the replays."""
    f = plan.facts
    where = (f"{f.get('gpu')} (sm_{str(f.get('capability', '')).replace('.', '')}, "
             f"{f.get('mem_total', 0) / 2**30:.1f} GiB, {f.get('gpus')} GPU(s), CUDA {f.get('cuda')})"
             if plan.device.startswith("cuda") else f"CPU ({f.get('cpu')}), no GPU")  # fmt: skip
    lines = [
        f"# sclsd-bench gpu-check: {where}", "",
        f"torch {f.get('torch')}, transformers {f.get('transformers')}, "
        f"deepspeed {f.get('deepspeed') or 'not installed'}, Python {f.get('python')}.", "",
        f"Model `{plan.model}` in {plan.dtype}; S = {plan.slice_len}; profiling budget "
        f"{plan.profile_budget_s:g} s per engine.", "",
        "## Profiles (`sclsd-worker profile`) and their fit", "",
        "| engine | samples | n | RMSE s | mean s | RMSE / mean | fit |", "|---|---|---:|---:|---:|---:|---|",
    ]  # fmt: skip
    by_engine = {c["engine"]: c for c in checks}
    for p in profiles:
        c = by_engine.get(p["engine"])
        if c is None:
            lines.append(f"| {p['engine']} | failed: {p.get('error', '')} | | | | | |")
            continue
        for r in c["rows"]:
            verdict = "ok" if r["relative"] is not None and r["relative"] <= RMSE_OK else "high"
            lines.append(f"| {p['engine']} | {r['samples']} | {r['n']} | {_num(r['rmse_s'])} | "
                         f"{_num(r['mean_s'])} | {_num(r['relative'], '{:.1%}')} | "
                         f"{verdict if r['n'] else '-'} |")  # fmt: skip
    lines += ["", "Coefficients (prefill p1..p4, decode d1..d4) per engine:", ""]
    for c in checks:
        coef = ", ".join(f"{k} {v:.3g}" for k, v in c["coefficients"].items())
        lines.append(f"- {c['engine']}: {coef}; Δ {c['kv_bytes_per_token']} B/token, "
                     f"M_ava {c['mem_available'] / 2**30:.1f} GiB")  # fmt: skip
    lines += ["", "## Engines: ms per decode step (`sclsd-bench engine`)", ""]
    if engines is None:
        lines.append("(skipped)")
    elif "markdown" in engines:
        lines.append(engines["markdown"].rstrip())
    else:
        lines.append(f"(failed: exit {engines['rc']}; see {engines['log']})")
    lines += ["", f"## Live replay: {', '.join(plan.policies)} ({plan.num} ShareGPT requests, "
              f"lengths x{plan.scale:g} capped at {plan.max_input}/{plan.max_gen}, Poisson "
              f"{plan.rate:g} req/s, {plan.workers} worker(s), engine {plan.live_engine})", ""]  # fmt: skip
    if live:
        from .live import markdown

        rows = [r["summary"] for r in live if "summary" in r]
        if rows:
            lines.append(markdown(rows))
        for r in live:
            if "summary" not in r or r.get("rc"):
                lines.append(f"\n- {r['policy']}: failed ({r.get('error') or 'exit ' + str(r['rc'])}; "
                             f"see {r['log']})")  # fmt: skip
    else:
        lines.append("(skipped)")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plan = make_plan(args)
    print(f"gpu-check: {plan.model} ({plan.dtype}) on {plan.device}; engines {plan.engines}",
          file=sys.stderr, flush=True)  # fmt: skip
    profiles, checks = [], []
    for engine in plan.engines:
        print(f"== profile {engine} ({plan.profile_budget_s:g} s budget)", file=sys.stderr, flush=True)
        res = profile_engine(plan, engine, out)
        profiles.append(res)
        if "profile" in res:
            checks.append(check_profile(out / res["profile"]))
        else:
            print(f"   failed: {res['error']}", file=sys.stderr, flush=True)
    engines = None
    if not args.skip_engine:
        print("== engine table", file=sys.stderr, flush=True)
        engines = engine_table(plan, out)
    live: list[dict[str, Any]] = []
    if not args.skip_live:
        est = out / f"profile-{plan.live_engine}.json"
        for policy in plan.policies:
            print(f"== live {policy}", file=sys.stderr, flush=True)
            live.append(live_replay(plan, policy, out, est if est.is_file() else None))
    text = report(plan, profiles, checks, live, engines)
    (out / "report.md").write_text(text)
    (out / "gpu-check.json").write_text(json.dumps(
        {"plan": asdict(plan), "profiles": profiles, "checks": checks, "engines": engines, "live": live},
        indent=2) + "\n")
    print(text)
    ok = all("profile" in p for p in profiles) and all(
        r.get("rc") == 0 and "summary" in r for r in live
    ) and (engines is None or engines["rc"] == 0)
    return 0 if ok else 1
