"""``make bench``: every benchmark in turn, results under ``out/`` and figures under ``docs/img/``.

    python -m sclsd.bench.all [--only batcher,figures,long,grants,sim,api,rates,fairness,grammars,chaos,chaos-llama,engine,sampling,cpu,score,chats,streams,live] [--skip live]

Steps (each is one ``sclsd-bench`` subcommand, run as its own process):

- ``batcher``: DP batcher time for n = 64 … 16384 (target: 4096 in ≤ 50 ms median);
- ``figures``: the paper's section 6 figures in simulation (docs/img/*.png);
- ``slicing``: scls with work-conserving rounds and KV reuse against the baselines
  and both oracles, in simulation (``python -m sclsd.sim.variants``, out/slicing.md);
- ``grants``: scls-cb (slice grants on continuous batching) against ils-paged,
  ils-conservative and scls, in simulation (``sclsd-bench grants``, out/grants.md);
- ``long``: the paper's long-generation scenario in simulation (60 % of requests over 512
  tokens, 8 req/s, the DS profile, S = 128 and 256: ``python -m sclsd.sim.grid --long-share
  0.6``, out/long-gen.json);
- ``sim``: simulator speed, 10 simulated minutes of 8 workers at 20 req/s;
- ``api``: the daemon's own request rate with a zero-time fake engine;
- ``rates``: the daemon at GPU token rates: 8 fake workers streaming 64 rows each at 10 ms a
  step (51,200 tokens/s offered) to 512 streaming clients: tokens/s delivered, the daemon's
  CPU per token at 1,024- and 64-token outputs, bytes per grant (out/rates.md);
- ``fairness``: a bystander's 8-token request behind another client's burst of 256, and after
  that client hangs up (fake workers; ``sclsd-bench fairness``);
- ``grammars``: plain requests while other clients send hostile grammars, through sclsd-http
  and the Unix socket (``sclsd-bench grammars``);
- ``chaos``: workers SIGKILLed at random under a stream of requests, some cancelled: none lost,
  none duplicated, every token one uninterrupted pass's (3 fake workers, a kill every ~2 s);
- ``chaos-llama``: the same on ``llama`` workers of ``tiny-random``'s GGUF, the CPU's default
  engine, greedy and seeded requests checked against ``llama``'s own one pass;
- ``engine``: ms per decode step of each engine on the default model, cold and warm, the
  ``llama`` engine beside llama.cpp's own loop (on a GPU box ``sclsd-bench gpu-check`` runs
  it on a 7B/13B model);
- ``sampling``: what a sampled token (temperature, top-p) costs the ``llama`` engine's step beside a
  greedy one, 8 rows (out/sampling/sampling.json; ``--rows 1`` for one stream);
- ``cpu``: the default on a CPU (``llama`` workers) through sclsd-http beside llama.cpp's own
  greedy loop: one stream, 8 streams, time to first token (out/cpu/cpu.md);
- ``score``: prompts scored as evaluation harnesses score them (``echo`` with ``logprobs``, the
  prompt's log-probabilities) against the same prompts for one plain token, through sclsd-http
  (out/score/score.md);
- ``chats``: multi-turn chats behind one system prompt through sclsd-http, on ``hf-static-cb`` and
  ``llama`` with their shared prefixes off and on: requests/s, first tokens, prompt tokens taken
  from KV, answers as with sharing off (out/chats/chats.md);
- ``streams``: the default (scls-cb; llama for the built-in GGUF) vs static scls vs ILS on real CPU workers under
  closed-loop streaming load: throughput, TTFT and the longest inter-token gap per stream;
- ``live``: sls vs ILS (hf-cb) vs scls on real CPU workers (the longest step).

docs/benchmarks.md quotes these outputs; rerun a step to check a number.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

TRACE = str(Path("..") / "shared" / "traces" / "sharegpt_lengths.csv")

#: Each step: a module run as ``python -m`` and its arguments.
STEPS: dict[str, list[str]] = {
    "batcher": ["sclsd.bench.cli", "batcher", "--sweep", "--trace", TRACE, "--json", "out/batcher.json"],
    "figures": ["sclsd.bench.cli", "figures", "--trace", TRACE, "--data", "out/figures.json", "--img", "docs/img",
                "--tables", "out/figures.md"],
    "slicing": ["sclsd.sim.variants", "--out", "out/slicing.json", "--md", "out/slicing.md"],
    "grants": ["sclsd.bench.cli", "grants", "--out", "out/grants.json", "--md", "out/grants.md"],
    "long": ["sclsd.sim.grid", "--trace", TRACE, "--profile", "a100-llama2-13b-ds", "--policies",
             "scls,scls-cb,ils-conservative,ils-paged", "--rates", "8", "--slice-lens", "128,256",
             "--long-share", "0.6", "--out", "out/long-gen.json"],
    "sim": ["sclsd.bench.cli", "sim", "--trace", TRACE, "--policy", "scls", "--profile", "a100-llama2-13b-hf",
            "--workers", "8", "--rate", "20", "--duration", "600", "--json", "out/sim-speed.json"],
    "api": ["sclsd.bench.cli", "api", "--json", "out/api.json"],
    "rates": ["sclsd.bench.cli", "rates", "--short-tokens", "64", "--json", "out/rates.json", "--md", "out/rates.md"],
    "fairness": ["sclsd.bench.cli", "fairness"],
    "grammars": ["sclsd.bench.cli", "grammars"],
    "chaos": ["sclsd.bench.cli", "chaos", "--minutes", "5"],
    "chaos-llama": ["sclsd.bench.cli", "chaos", "--engine", "llama", "--minutes", "3", "--workers", "2",
                    "--kill-every", "10", "--clients", "3", "--window", "4"],
    "engine": ["sclsd.bench.cli", "engine", "--model", "smollm2-135m-instruct", "--shapes", "1x64,8x128",
               "--gen", "16", "--out", "out/engine"],
    "sampling": ["sclsd.bench.cli", "sampling", "--out", "out/sampling"],
    "cpu": ["sclsd.bench.cli", "cpu", "--out", "out/cpu"],
    "score": ["sclsd.bench.cli", "score", "--out", "out/score"],
    "chats": ["sclsd.bench.cli", "chats", "--out", "out/chats"],
    "streams": ["sclsd.bench.cli", "streams", "--out", "out/streams"],
    "live": ["sclsd.bench.cli", "live", "--trace", TRACE, "--out", "out/live"],
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sclsd.bench.all", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="comma-separated steps to run")
    p.add_argument("--skip", default="", help="comma-separated steps to leave out")
    args = p.parse_args(argv)
    only = [s for s in args.only.split(",") if s]
    skip = {s for s in args.skip.split(",") if s}
    unknown = [s for s in [*only, *skip] if s not in STEPS]
    if unknown:
        p.error(f"unknown steps {unknown}; choose from {', '.join(STEPS)}")
    if not Path(TRACE).is_file():
        p.error(f"trace {TRACE} not found: make bench replays the request traces of ../shared/traces/ "
                "(see their README), so run it from a checkout that has ../shared beside it")
    Path("out").mkdir(exist_ok=True)
    failed = []
    for i, name in enumerate(only or list(STEPS), 1):
        if name in skip:
            continue
        cmd = [sys.executable, "-m", *STEPS[name]]
        print(f"\n[{i}/{len(only or STEPS)}] {name}: python -m {' '.join(STEPS[name])}", flush=True)
        t0 = time.monotonic()
        rc = subprocess.call(cmd)
        print(f"[{name}] exit {rc} after {time.monotonic() - t0:.0f}s", flush=True)
        if rc != 0:
            failed.append(name)
    if failed:
        print(f"failed steps: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
