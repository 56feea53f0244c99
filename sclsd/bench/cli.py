"""``sclsd-bench``: one entry point, a subcommand per benchmark.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; modules are imported only when their subcommand runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "batcher": ("sclsd.bench.batcher_bench", "time the DP batcher on trace lengths"),
    "sim": ("sclsd.sim.cli", "simulate a policy on a trace with a virtual clock"),
    "grants": ("sclsd.bench.grants", "scls-cb against continuous batching and scls in simulation"),
    "replay": ("sclsd.bench.replay", "replay a trace against a running daemon"),
    "live": ("sclsd.bench.live", "sls vs ils (hf-cb) vs scls on real CPU workers"),
    "streams": ("sclsd.bench.streams", "closed-loop streaming on real CPU workers: inter-token gaps per config"),
    "api": ("sclsd.bench.api_bench", "daemon request throughput with a zero-time fake engine"),
    "pipeline": ("sclsd.bench.pipeline", "many requests pipelined on one connection: none lost"),
    "chaos": ("sclsd.bench.chaos", "kill workers at random under a stream of requests: none lost or duplicated"),
    "figures": ("sclsd.bench.figures", "regenerate the figures of docs/benchmarks.md"),
    "gpu-check": ("sclsd.bench.gpu_check", "every GPU target in one call under a deadline: hf step, hf-cb, "
                   "profile RMSE, live scls/ils/scls-cb, compiled generate"),
    "gpu-bundle": ("sclsd.bench.gpu_bundle", "add to an offline GPU bundle every wheel sclsd imports that it "
                   "lacks, walked from the requirements"),
    "engine": ("sclsd.bench.engine", "ms per decode step of each engine, cold and warm"),
    "arena-grants": ("sclsd.bench.arena_grants", "hf-static-cb serving requests in slice grants against whole: "
                     "decode steps, rows per step, prefill turns, rows resumed in place"),
    "cpu": ("sclsd.bench.cpu", "sclsd on a CPU (llama engine) through sclsd-http beside llama.cpp's own greedy "
            "loop: one stream, N streams, time to first token"),
    "fairness": ("sclsd.bench.fairness", "how long a bystander waits behind another client's burst"),
    "grammars": ("sclsd.bench.grammars", "what other clients' hostile grammars cost a bystander (sclsd-http "
                 "and the Unix socket)"),
    "sampling": ("sclsd.bench.sampling", "what picking sampled tokens (temperature, top-p) costs a CPU decode "
                 "step, beside greedy"),
    "detok": ("sclsd.bench.detok", "the daemon's detokenizing cost per streamed message, by output length"),
    "chats": ("sclsd.bench.chats", "multi-turn chats sharing a system prompt through sclsd-http, with the "
              "engines' shared prefixes off and on: requests/s, first tokens, prompt tokens taken from KV"),
    "score": ("sclsd.bench.score", "scoring prompts as evaluation harnesses do (echo with logprobs) against "
              "plain one-token completions, through sclsd-http"),
    "tokenize-memory": ("sclsd.bench.tokmem", "what POST /tokenize of a large prompt costs sclsd-http in memory"),
    "rates": ("sclsd.bench.rates", "the daemon at GPU token rates: fake workers streaming 64 rows at 10 ms a "
              "step, 512 streaming clients: tokens/s delivered, daemon CPU, bytes per grant"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="sclsd-bench", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name, (_, help_) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        parser.parse_args(argv)  # prints usage / error and exits
        return 2
    module = importlib.import_module(SUBCOMMANDS[argv[0]][0])
    sp = argparse.ArgumentParser(prog=f"sclsd-bench {argv[0]}", description=SUBCOMMANDS[argv[0]][1])
    module.add_arguments(sp)
    args = sp.parse_args(argv[1:])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
