"""``sclsd-bench rates``: its pure parts (bytes per grant, a phase's figures) and its place
among the benchmarks; the run itself needs a daemon and is not timed here."""

from __future__ import annotations

import argparse

from sclsd import protocol as P
from sclsd.bench import all as bench_all
from sclsd.bench import cli, rates


def test_a_whole_grant_grows_with_its_context_and_a_delta_does_not() -> None:
    rows = rates.grant_bytes([128, 1024, 4096], slice_len=128)
    by = {r["context"]: r for r in rows}
    # Ids of a 32,000-token vocabulary: mostly 3 bytes each in msgpack.
    grew = by[4096]["whole"] - by[128]["whole"]
    assert 2.9 * (4096 - 128) < grew <= 3 * (4096 - 128)
    assert max(r["delta"] for r in rows) - min(r["delta"] for r in rows) <= 8 and by[4096]["delta"] < 200
    # What comes back for a grant's 128 tokens does not depend on the context either.
    assert max(r["result"] for r in rows) - min(r["result"] for r in rows) <= 8
    assert all(r["tokens_messages"] > r["result"] for r in rows)  # 64 messages of 2 tokens each


def test_the_grants_measured_are_real_messages() -> None:
    """The sizes are those of messages the worker's decoder takes, as the daemon sends them."""
    whole = P.to_worker_decoder.decode(P.encode(P.BatchMsg(batch_id=1, slice_len=8, requests=[
        P.BatchRequest(rid="r", token_ids=[5] * 10, max_new_tokens=8)])))
    assert isinstance(whole, P.BatchMsg)
    (row,) = rates.grant_bytes([10], slice_len=8, vocab=6)
    assert row["whole"] > row["delta"] > 0


def test_link_bytes_weighs_whole_and_delta_grants() -> None:
    (g,) = rates.grant_bytes([100], slice_len=32, vocab=256)
    assert rates.link_bytes(100, 64, 32, 1.0, 0.0)["to_worker"] == g["whole"]
    assert rates.link_bytes(100, 64, 32, 0.0, 0.0)["to_worker"] == g["delta"]
    half = rates.link_bytes(100, 64, 32, 0.5, 0.0)["to_worker"]
    assert abs(half - (g["whole"] + g["delta"]) / 2) <= 1
    # A moved grant carries the output so far too.
    assert rates.link_bytes(100, 64, 32, 0.0, 1.0)["to_worker"] > g["whole"]
    assert rates.link_bytes(100, 64, 32, 0.0, 0.0)["from_worker"] == round(
        (g["result"] + g["tokens_messages"]) / 32, 1)


def test_a_phase_is_summarised_from_the_clients_counts_and_the_probes() -> None:
    args = argparse.Namespace(workers=2, rows=50, decode_s=0.01, clients=64, prompt_len=16, slice_len=128)
    parts = [{"at_measure": (1_000, 10, 100.0), "at_end": (21_000, 30, 110.0), "max_gaps": [0.02, 0.5],
              "errors": {}, "wrong_length": 0},
             {"at_measure": (0, 0, 100.5), "at_end": (20_000, 20, 110.5), "max_gaps": [0.03],
              "errors": {"overloaded": 2}, "wrong_length": 1}]
    first = {"t": 100.0, "daemon": 5.0, "workers": 1.0, "clients": 2.0, "grants": 100, "migrations": 0,
             "accepted": 50, "status_s": 0.01}
    last = {"t": 110.0, "daemon": 9.0, "workers": 3.0, "clients": 7.0, "grants": 140, "migrations": 5,
            "accepted": 70, "status_s": 1.5}
    out = rates.summarize(args, 256, parts, first, last)
    assert out["offered_tokens_per_s"] == 10_000 and out["load_tokens_per_s"] == 6_400
    assert out["delivered_tokens_per_s"] == 4_000 and out["delivered_pct"] == 40.0
    assert out["requests_per_s"] == 4.0
    assert out["daemon_cores"] == 0.4 and out["daemon_cpu_us_per_token"] == 100.0  # 4 s over 40,000 tokens
    assert out["workers_cores"] == 0.2 and out["clients_cores"] == 0.5
    assert out["grants_per_s"] == 4.0 and out["whole_grants_pct"] == 62.5
    assert out["errors"] == {"overloaded": 2} and out["wrong_length"] == 1
    assert out["max_gap_p99_s"] == 0.5 and out["status_s"] == 1.5
    # A status that did not answer leaves out what needs the counters, not the rest.
    late = rates.summarize(args, 256, parts, first, {**last, "grants": None, "migrations": None, "accepted": None})
    assert late["grants_per_s"] is None and late["bytes_per_grant"] is None and late["daemon_cores"] == 0.4


def test_registered_as_subcommand_and_bench_step() -> None:
    assert cli.SUBCOMMANDS["rates"][0] == "sclsd.bench.rates"
    assert bench_all.STEPS["rates"][:2] == ["sclsd.bench.cli", "rates"]
    p = argparse.ArgumentParser()
    rates.add_arguments(p)
    a = p.parse_args([])
    assert (a.workers, a.rows, a.decode_s, a.clients, a.tokens) == (8, 64, 0.01, 512, 1024)
