"""Tables and target checks of ``sclsd-bench grants`` (see :mod:`sclsd.bench.grants`).

Everything here reads the rows the runs produced (one dict per simulated
run, as :func:`sclsd.bench.grants.run_cases` returns them) and nothing else:
the targets are computed from the numbers, so a table cannot claim a target
its runs did not meet.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "HEAVY_RATE", "LIGHT_RATES", "GOODPUT_RATES", "TRACE_LABELS", "COLUMNS", "COST_TERMS", "label", "find",
    "targets", "table", "cost_table", "target_table", "scale_table", "markdown",
]

#: Trace names as the tables print them (others print as given).
TRACE_LABELS: dict[str, str] = {"sharegpt": "ShareGPT", "azure-code": "Azure code", "mooncake": "Mooncake"}
#: The rate at which scls-cb must serve more than continuous batching (heavy load).
HEAVY_RATE = 20.0
#: Lighter rates at which it must answer no slower.
LIGHT_RATES: tuple[float, ...] = (5.0, 2.0)
#: Throughput scls-cb must reach, as a multiple of ils-paged's, at the heavy rate.
THROUGHPUT_TARGET = 1.03
#: Rates at which the default policy's goodput (:data:`sclsd.eval.metrics.DEFAULT_SLO`: TTFT
#: <= 2 s, no inter-token gap over 1 s) must be at least ils-paged's.
GOODPUT_RATES: tuple[float, ...] = LIGHT_RATES

#: Columns of the per-profile table after trace+rate and policy: (key, header, format).
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("throughput_rps", "req/s", "{:.3f}"),
    ("ct_std_s", "CT STD s", "{:.2f}"),
    ("avg_latency_s", "avg RT s", "{:.2f}"),
    ("avg_ttft_s", "avg TTFT s", "{:.2f}"),
    ("goodput_rps", "goodput req/s", "{:.3f}"),
    ("p50_gap_s", "gap p50 s", "{:.2f}"),
    ("p99_gap_s", "gap p99 s", "{:.2f}"),
    ("preemptions", "preemptions", "{:d}"),
    ("oom_events", "OOM events", "{:d}"),
    ("migrations", "migrations", "{:d}"),
    ("kv_drops", "KV drops", "{:d}"),
    ("reprefill_tokens_per_req", "re-prefill tok/req", "{:.0f}"),
    ("kv_used_pct", "KV used %", "{:.1f}"),
)

#: Terms of the cost model a run's worker-seconds go to (keys of ``cost_s``), as printed.
COST_TERMS: tuple[tuple[str, str], ...] = (
    ("decode_kv", "decode, KV reads"),
    ("decode_rows", "decode, per row"),
    ("decode_fixed", "decode, per step"),
    ("prefill_tokens", "prefill, per token"),
    ("prefill_fixed", "prefill, per forward"),
)


def label(trace: str) -> str:
    return TRACE_LABELS.get(trace, trace)


def find(rows: Sequence[dict[str, Any]], profile: str, trace: str, rate: float,
         policy: str) -> dict[str, Any] | None:
    """The run of ``policy`` on ``trace`` at ``rate`` under ``profile``, if any."""
    for r in rows:
        if (r["profile"], r["trace"], r["rate"], r["policy"]) == (profile, trace, rate, policy):
            return r
    return None


def _ratio(a: float, b: float) -> float:
    return a / b if b else (1.0 if a == 0 else float("inf"))


def _traces(rows: Sequence[dict[str, Any]], profile: str) -> list[str]:
    return list(dict.fromkeys(r["trace"] for r in rows if r["profile"] == profile))


def targets(rows: Sequence[dict[str, Any]], profile: str) -> list[dict[str, Any]]:
    """scls-cb's targets on one profile, each checked against the runs.

    Each entry: ``case`` (e.g. ``"ShareGPT 20"``), ``target``, ``measured``
    (text), ``ratio`` (the measured ratio, or the value itself for absolute
    targets) and ``met``; a throughput target also says ``reachable``: whether
    the arrivals let any policy reach it (``bound_rps``, the most any schedule
    can serve: every request alone on a worker from its arrival). A target
    whose runs are missing is left out.
    """
    out: list[dict[str, Any]] = []

    def add(case: str, target: str, measured: str, ratio: float, met: bool, **kw: Any) -> None:
        out.append({"case": case, "target": target, "measured": measured, "ratio": ratio,
                    "met": met, **kw})

    for trace in _traces(rows, profile):
        for rate in (HEAVY_RATE, *LIGHT_RATES):
            cb = find(rows, profile, trace, rate, "scls-cb")
            if cb is None:
                continue
            case = f"{label(trace)} {rate:g}"
            paged = find(rows, profile, trace, rate, "ils-paged")
            cons = find(rows, profile, trace, rate, "ils-conservative")
            if rate == HEAVY_RATE and paged is not None:
                x = _ratio(cb["throughput_rps"], paged["throughput_rps"])
                best = _ratio(cb.get("bound_rps", float("inf")), paged["throughput_rps"])
                note = f" (arrivals allow at most {best:.3f}×)" if best < THROUGHPUT_TARGET else ""
                add(case, f"throughput ≥ {THROUGHPUT_TARGET:g}× ils-paged",
                    f"{cb['throughput_rps']:.3f} / {paged['throughput_rps']:.3f} = {x:.3f}×{note}",
                    x, x >= THROUGHPUT_TARGET, reachable=best >= THROUGHPUT_TARGET)
            if rate == HEAVY_RATE and cons is not None:
                x = _ratio(cb["throughput_rps"], cons["throughput_rps"])
                add(case, "throughput ≥ 1.05× ils-conservative",
                    f"{cb['throughput_rps']:.3f} / {cons['throughput_rps']:.3f} = {x:.3f}×", x, x >= 1.05)
            add(case, "preemptions = 0", f"{cb['preemptions']:d}", float(cb["preemptions"]),
                cb["preemptions"] == 0)
            add(case, "OOM events = 0", f"{cb['oom_events']:d}", float(cb["oom_events"]),
                cb["oom_events"] == 0)
            if paged is not None:
                x = _ratio(cb["avg_latency_s"], paged["avg_latency_s"])
                add(case, "avg RT ≤ 1.0× ils-paged's",
                    f"{cb['avg_latency_s']:.2f} / {paged['avg_latency_s']:.2f} s = {x:.3f}×", x, x <= 1.0)
            if rate in GOODPUT_RATES and paged is not None and "goodput_rps" in cb \
                    and "goodput_rps" in paged:
                x = _ratio(cb["goodput_rps"], paged["goodput_rps"])
                add(case, "goodput ≥ ils-paged's (TTFT ≤ 2 s, no gap > 1 s)",
                    f"{cb['goodput_rps']:.3f} / {paged['goodput_rps']:.3f} req/s = {x:.3f}×",
                    x, cb["goodput_rps"] >= paged["goodput_rps"])
            if rate == HEAVY_RATE and cons is not None:
                x = _ratio(cb["ct_std_s"], cons["ct_std_s"])
                add(case, "CT STD ≤ 0.5× ils-conservative's",
                    f"{cb['ct_std_s']:.2f} / {cons['ct_std_s']:.2f} s = {x:.3f}×", x, x <= 0.5)
    return out


def table(rows: Sequence[dict[str, Any]], profile: str) -> str:
    """The runs of one profile as a Markdown table, a row per (trace, rate, policy)."""
    lines = [
        "| trace, rate | policy | " + " | ".join(h for _, h, _ in COLUMNS) + " |",
        "|---|---|" + "---:|" * len(COLUMNS),
    ]
    for r in rows:
        if r["profile"] != profile:
            continue
        cells = [fmt.format(r[k]) if k in r else "–" for k, _, fmt in COLUMNS]
        lines.append(f"| {label(r['trace'])} {r['rate']:g} | {r['policy']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def cost_table(rows: Sequence[dict[str, Any]], profile: str, rate: float = HEAVY_RATE) -> str:
    """Worker-milliseconds per completed request by term of the cost model, and idle, for the
    continuous-batching runs at ``rate``: where one policy spends more than another."""
    lines = [
        "| trace | policy | " + " | ".join(h for _, h in COST_TERMS) + " | idle | total |",
        "|---|---|" + "---:|" * (len(COST_TERMS) + 2),
    ]
    for r in rows:
        if r["profile"] != profile or r["rate"] != rate or "cost_s" not in r or not r["completed"]:
            continue
        per = 1000.0 / r["completed"]
        span = r["duration_s"] * r["workers"]
        spent = sum(r["cost_s"].values())
        cells = [f"{r['cost_s'][k] * per:.1f}" for k, _ in COST_TERMS]
        cells += [f"{max(0.0, span - spent) * per:.1f}", f"{span * per:.1f}"]
        lines.append(f"| {label(r['trace'])} {rate:g} | {r['policy']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def target_table(rows: Sequence[dict[str, Any]], profile: str) -> str:
    """:func:`targets` of one profile as a Markdown table."""
    lines = ["| case | scls-cb target | measured | met |", "|---|---|---|---|"]
    for t in targets(rows, profile):
        met = "yes" if t["met"] else ("no (not reachable)" if t.get("reachable") is False else "no")
        lines.append(f"| {t['case']} | {t['target']} | {t['measured']} | {met} |")
    return "\n".join(lines) + "\n"


def scale_table(scale: Sequence[dict[str, Any]]) -> str:
    """The many-worker runs: simulated wall time and, for scls-cb, the grant rounds' cost."""
    lines = [
        "| workers, trace, rate | policy | req/s | simulated in s | rounds | round p50 µs "
        "| round p99 µs | round max µs | targets |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in scale:
        us = r.get("round_us")
        cells = ["–"] * 4
        verdict = ""
        if us is not None:
            cells = [f"{us['count']:d}", f"{us['p50']:.0f}", f"{us['p99']:.0f}", f"{us['max']:.0f}"]
            verdict = (f"p99 ≤ 1000 µs: {'yes' if us['p99'] <= 1000 else 'no'}; "
                       f"≤ 60 s: {'yes' if r['wall_s'] <= 60 else 'no'}")
        lines.append(
            f"| {r['workers']}, {label(r['trace'])}, {r['rate']:g} | {r['policy']} | "
            f"{r['throughput_rps']:.3f} | {r['wall_s']:.1f} | " + " | ".join(cells) + f" | {verdict} |")
    return "\n".join(lines) + "\n"


def markdown(rows: Sequence[dict[str, Any]], scale: Sequence[dict[str, Any]] = ()) -> str:
    """Per profile: a heading, the runs, their costs at the heavy rate, the target checks;
    then the many-worker runs."""
    out: list[str] = []
    for prof in dict.fromkeys(r["profile"] for r in rows):
        out += [f"### {prof}\n", table(rows, prof),
                f"Worker-ms per request at rate {HEAVY_RATE:g}, by cost term:\n", cost_table(rows, prof),
                "Targets:\n", target_table(rows, prof)]
    if scale:
        out += ["### Many workers\n", scale_table(scale)]
    return "\n".join(out)
