"""The targets of ``sclsd-bench gpu-check`` and its ``summary.md``, from ``results.jsonl``.

Every target gets one of three verdicts: **met**, **missed**, or **not measured** with
the reason (the stage was skipped for the deadline, timed out, failed, or did not run at
the target's shape or rate). The summary is rendered from the rows alone, so it can be
rewritten after every stage and again from a ``results.jsonl`` that came back from a box.
Standard library only, as the runner.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

#: hf decode: at most this many ms per step at :data:`HF_SHAPE`, its decode graphs kept.
HF_MS_LIMIT = 12.0
HF_SHAPE = (32, 256)
#: The live targets are stated for replays at this arrival rate (req/s).
LIVE_RATE = 4.0
#: scls: at least this throughput (req/s) with an average TTFT of at most SCLS_TTFT_S.
SCLS_RPS, SCLS_TTFT_S = 3.0, 2.0
#: ils and scls-cb (both on hf-cb): at least this throughput (req/s).
CB_RPS = 1.5
#: Profile fit: RMSE over the mean measured time, per sample kind, at most this.
RMSE_LIMITS = {"prefill": 0.10, "decode": 0.10, "batch": 0.15}
#: A worker from its start to ready (registered, or its engine warmed up), at most this.
READY_LIMIT_S = 60.0
#: hf-static-cb's decode step at most this many times hf's with its graphs, at each of these shapes.
ARENA_RATIO = 1.25
ARENA_SHAPES = ((32, 256), (64, 256))
#: The engine scls-cb is judged on at saturation and for its first tokens.
ARENA_ENGINE = "hf-static-cb"
#: Saturation replays count at this rate (req/s) and this many requests or more.
SAT_RATE, SAT_NUM = 8.0, 80
#: At saturation, scls-cb's output tokens/s on ARENA_ENGINE at least these times ils's on the same
#: engine and scls-cb's on hf-cb (what serves today).
SAT_VS_ILS, SAT_VS_HF_CB = 1.0, 2.0
#: scls-cb on ARENA_ENGINE at LIVE_RATE: average time to first token at most this.
FIRST_TOKEN_S = 0.5

MET, MISSED, NOT_MEASURED = "met", "missed", "not measured"


@dataclass(frozen=True)
class Verdict:
    """One target's line of the summary."""

    target: str
    measured: str
    verdict: str


class Rows:
    """The rows of one run, with the look-ups the verdicts need."""

    def __init__(self, rows: Iterable[dict[str, Any]]) -> None:
        self.rows = list(rows)

    def find(self, stage: str, **match: Any) -> list[dict[str, Any]]:
        return [r for r in self.rows if r.get("stage") == stage and all(r.get(k) == v for k, v in match.items())]

    def last(self, stage: str, **match: Any) -> dict[str, Any] | None:
        got = self.find(stage, **match)
        return got[-1] if got else None

    def why_not(self, stage: str, what: str = "") -> str:
        """Why ``stage`` gave no figure: its end row, or that it has not run (yet)."""
        end = self.last(stage, phase="end")
        err = next((r["error"] for r in reversed(self.find(stage)) if r.get("error")), None)
        if end is None:
            return f"{stage}: not run"
        status, note = end.get("status"), end.get("note") or ""
        if status == "skipped":
            return f"{stage}: {note}"
        if status == "timed out":
            return f"{stage}: timed out ({note})"
        if status == "failed" or err:
            return f"{stage}: failed ({_short(err or note)})"
        return f"{stage}: {what or 'no figure'}"


def _short(text: Any, n: int = 160) -> str:
    s = " ".join(str(text).split())
    return s if len(s) <= n else s[: n - 1] + "…"


def _f(v: Any, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


# --------------------------------------------------------------------------- verdicts


def hf_decode(rows: Rows) -> Verdict:
    """hf decode at N = 32, P = 256 (the warm call) within :data:`HF_MS_LIMIT` ms/step,
    the decode graphs kept (captured, and used for that shape)."""
    n, p = HF_SHAPE
    target = f"hf decode ≤ {HF_MS_LIMIT:g} ms/step at N = {n}, P = {p}, graphs kept"
    r = rows.last("hf", phase="shape", n=n, p=p, call="warm")
    if r is None or r.get("ms_per_step") is None:
        return Verdict(target, rows.why_not("hf", f"no N={n} P={p} shape"), NOT_MEASURED)
    ms, kept = r["ms_per_step"], bool(r.get("graphs_kept"))
    gen = rows.last("generate", phase="shape", n=n, p=p, call="warm")
    ref = f"; compiled generate {_f(gen.get('ms_per_step'))} ms" if gen and gen.get("ms_per_step") else ""
    measured = f"{ms:.2f} ms/step, graphs {'kept' if kept else 'NOT kept'}{ref}"
    return Verdict(target, measured, MET if ms <= HF_MS_LIMIT and kept else MISSED)


def cb_starts(rows: Rows) -> Verdict:
    """hf-cb loads and warms up with its default options."""
    target = "hf-cb starts with its defaults"
    err = next((r for r in rows.find("cb") if r.get("error")), None)
    if err is not None:
        return Verdict(target, f"{err.get('phase')}: {_short(err['error'])}", MISSED)
    ready = rows.last("cb", phase="ready")
    if ready is None:
        return Verdict(target, rows.why_not("cb", "no ready row"), NOT_MEASURED)
    step = rows.last("cb", phase="shape", n=HF_SHAPE[0], p=HF_SHAPE[1], call="warm")
    extra = f"; {_f(step.get('ms_per_step'))} ms/step at N={HF_SHAPE[0]}" if step else ""
    return Verdict(target, f"started: cache {ready.get('cache_tokens')} tokens{extra}", MET)


def arena_step(rows: Rows, n: int, p: int) -> Verdict:
    """hf-static-cb's warm decode step at ``n`` x ``p`` within :data:`ARENA_RATIO` of hf's
    with its graphs, both with their graphs kept."""
    target = f"{ARENA_ENGINE} decode ≤ {ARENA_RATIO:g}× `hf`'s with graphs at N = {n}, P = {p}"
    a = rows.last("arena", phase="shape", n=n, p=p, call="warm")
    h = rows.last("hf", phase="shape", n=n, p=p, call="warm")
    if a is None or a.get("ms_per_step") is None:
        return Verdict(target, rows.why_not("arena", f"no N={n} P={p} shape"), NOT_MEASURED)
    if h is None or h.get("ms_per_step") is None:
        return Verdict(target, f"{a['ms_per_step']:.2f} ms/step; " + rows.why_not("hf", f"no N={n} P={p} shape"),
                       NOT_MEASURED)
    cb = rows.last("cb", phase="shape", n=n, p=p, call="warm")
    ratio = a["ms_per_step"] / h["ms_per_step"]
    kept = bool(a.get("graphs_kept")) and bool(h.get("graphs_kept"))
    measured = (f"{a['ms_per_step']:.2f} vs {h['ms_per_step']:.2f} ms/step ({ratio:.2f}×), graphs "
                f"{'kept' if kept else 'NOT kept'}" + (f"; hf-cb {_f(cb.get('ms_per_step'))} ms" if cb else ""))
    return Verdict(target, measured, MET if ratio <= ARENA_RATIO and kept else MISSED)


def cb_warm_up(rows: Rows) -> Verdict:
    """hf-cb's graph warm-up, re-measured: its step shapes captured, none failed."""
    target = "hf-cb's graph warm-up captures its step shapes"
    r = rows.last("cb", phase="ready")
    if r is None:
        return Verdict(target, rows.why_not("cb", "no ready row"), NOT_MEASURED)
    failed = [w for w in r.get("warnings") or [] if "failed to capture" in w]
    use = (r.get("cb") or {}).get("use_cuda_graph")  # a flag, or one per step kind (varlen, decode)
    graphs = any(use) if isinstance(use, list) else bool(use)
    measured = (f"warm-up {_f(r.get('warm_up_s'))} s, graphs {'on' if graphs else 'off'}, "
                f"{r.get('warmed_shapes')} step shapes captured" + (f"; {_short(failed[-1])}" if failed else ""))
    if failed:
        return Verdict(target, measured, MISSED)
    return Verdict(target, measured, MET if graphs and r.get("warmed_shapes") else NOT_MEASURED)


def sat_engine(r: dict[str, Any]) -> str:
    """A saturation replay's engine as ``--sat`` named it (an option set: ``hf-static-cb-flex``)."""
    return str(r.get("stage")).removeprefix(f"sat-{r.get('policy')}-").removesuffix("-cap")


def capped(r: dict[str, Any]) -> bool:
    """Whether a replay's requests asked ``max_tokens`` as a cap (``--sat ...:cap``)."""
    return bool(r.get("max_tokens_cap")) or str(r.get("stage")).endswith("-cap")


def saturation(rows: Rows) -> Verdict:
    """At saturation: scls-cb on :data:`ARENA_ENGINE` serves at least :data:`SAT_VS_ILS` times
    ils's output tokens/s on the same engine and :data:`SAT_VS_HF_CB` times scls-cb's on hf-cb,
    every request served, no preemption. The pair with ``max_tokens`` as a cap, as clients send
    it, is judged where it ran (else the pair with the trace lengths as ``max_tokens``, which
    sizes each ``ils`` row to its exact output); hf-cb's replay of the same kind where there is
    one. Not measured where no request waited for room on either arena replay: the card kept
    up, and tokens/s were the trace's pace, not capacity."""
    target = (f"saturation (≥ {SAT_RATE:g} req/s, ≥ {SAT_NUM} requests): scls-cb on {ARENA_ENGINE} ≥ "
              f"{SAT_VS_ILS:g}× ils on it and ≥ {SAT_VS_HF_CB:g}× scls-cb on hf-cb (output tok/s), 0 preemptions")
    reps = {(r.get("policy"), sat_engine(r), capped(r)): r for r in rows.rows
            if str(r.get("stage", "")).startswith("sat-") and r.get("phase") == "replay" and r.get("output_tps") is not None}
    pairs = {cap: (reps[("scls-cb", ARENA_ENGINE, cap)], reps[("ils", ARENA_ENGINE, cap)]) for cap in (True, False)
             if ("scls-cb", ARENA_ENGINE, cap) in reps and ("ils", ARENA_ENGINE, cap) in reps}
    cap = next(iter(pairs), False)
    hf_cb = reps.get(("scls-cb", "hf-cb", cap)) or reps.get(("scls-cb", "hf-cb", not cap))
    for key, found in ((f"scls-cb-{ARENA_ENGINE}", pairs), (f"ils-{ARENA_ENGINE}", pairs), ("scls-cb-hf-cb", hf_cb)):
        if not found:  # why, from the stage of either kind that ran (or was skipped)
            stage = next((n for n in (f"sat-{key}-cap", f"sat-{key}") if rows.find(n)), f"sat-{key}-cap")
            return Verdict(target, rows.why_not(stage, "no replay row"), NOT_MEASURED)
    assert hf_cb is not None
    a, i = pairs[cap]
    got = (a, i, hf_cb)

    def kind(r: dict[str, Any]) -> str:
        return "max_tokens a cap" if capped(r) else "max_tokens the trace lengths"

    measured = (f"{_f(a['output_tps'], '{:.0f}')} vs ils {_f(i['output_tps'], '{:.0f}')} ({kind(a)}) and hf-cb "
                f"{_f(hf_cb['output_tps'], '{:.0f}')} ({kind(hf_cb)}) tok/s "
                f"({a['output_tps'] / max(i['output_tps'], 1e-9):.2f}×, "
                f"{a['output_tps'] / max(hf_cb['output_tps'], 1e-9):.2f}×); preemptions {a.get('preemptions')}")
    if len(pairs) == 2:  # the pair of exact lengths too, beside the capped one judged
        a2, i2 = pairs[False]
        measured += (f"; with {kind(a2)}: {_f(a2['output_tps'], '{:.0f}')} vs ils {_f(i2['output_tps'], '{:.0f}')} "
                     f"({a2['output_tps'] / max(i2['output_tps'], 1e-9):.2f}×)")
    small = [r for r in got if (r.get("rate") or 0) < SAT_RATE or (r.get("requests") or 0) < SAT_NUM]
    if small:
        return Verdict(target, f"{measured} (replayed at {small[0].get('rate')} req/s, {small[0].get('requests')} "
                               "requests)", NOT_MEASURED)
    if all(r.get("late_starts") == 0 for r in (a, i)):
        return Verdict(target, f"{measured}; on {ARENA_ENGINE} every request started within "
                               f"{_f(a.get('late_start_s'), '{:g}')} s of its send: the card kept up with the "
                               "arrivals, so these tokens/s are the trace's pace, not what either policy can "
                               "serve (raise --sat-rate)", NOT_MEASURED)
    whole = all(r.get("completed") == r.get("requests") and not r.get("errors") for r in got)
    ok = (whole and not a.get("preemptions") and a["output_tps"] >= SAT_VS_ILS * i["output_tps"]
          and a["output_tps"] >= SAT_VS_HF_CB * hf_cb["output_tps"])
    return Verdict(target, measured + ("" if whole else "; requests lost or failed"), MET if ok else MISSED)


def first_tokens(rows: Rows) -> Verdict:
    """scls-cb on :data:`ARENA_ENGINE` at :data:`LIVE_RATE`: average TTFT ≤ :data:`FIRST_TOKEN_S`."""
    target = f"first tokens at {LIVE_RATE:g} req/s: scls-cb on {ARENA_ENGINE} avg TTFT ≤ {FIRST_TOKEN_S:g} s"
    r = rows.last("live-scls-cb", phase="replay")
    if r is None or r.get("avg_ttft_s") is None:
        return Verdict(target, rows.why_not("live-scls-cb", "no replay row"), NOT_MEASURED)
    measured = f"{r['avg_ttft_s']:.2f} s (p95 {_f(r.get('p95_ttft_s'))} s) on {r.get('engine')}"
    if r.get("engine") != ARENA_ENGINE or r.get("rate") != LIVE_RATE:
        return Verdict(target, f"{measured} at {r.get('rate')} req/s", NOT_MEASURED)
    ok = r["avg_ttft_s"] <= FIRST_TOKEN_S and r.get("completed") == r.get("requests") and not r.get("errors")
    return Verdict(target, measured, MET if ok else MISSED)


def live(rows: Rows, policy: str, min_rps: float, max_ttft_s: float | None = None) -> Verdict:
    """A live replay at :data:`LIVE_RATE` req/s: every request served, throughput at least
    ``min_rps`` and, where given, average TTFT at most ``max_ttft_s``."""
    stage = f"live-{policy}"
    target = f"live at {LIVE_RATE:g} req/s: `{policy}` ≥ {min_rps:g} req/s" + (
        f", avg TTFT ≤ {max_ttft_s:g} s" if max_ttft_s is not None else "")
    r = rows.last(stage, phase="replay")
    if r is None or r.get("throughput_rps") is None:
        return Verdict(target, rows.why_not(stage, "no replay row"), NOT_MEASURED)
    rps, ttft = r["throughput_rps"], r.get("avg_ttft_s")
    measured = (f"{rps:.2f} req/s, avg TTFT {_f(ttft)} s, {r.get('completed')}/{r.get('requests')} done, "
                f"{r.get('errors') or 0} errors")
    if r.get("rate") != LIVE_RATE:
        return Verdict(target, f"{measured} (replayed at {r.get('rate')} req/s, not {LIVE_RATE:g})", NOT_MEASURED)
    ok = (rps >= min_rps and not r.get("errors") and r.get("completed") == r.get("requests")
          and (max_ttft_s is None or (ttft is not None and ttft <= max_ttft_s)))
    return Verdict(target, measured, MET if ok else MISSED)


def rmse_verdicts(check: dict[str, Any] | None, why: str) -> list[Verdict]:
    """One verdict per sample kind of a profile check row (:data:`RMSE_LIMITS`)."""
    out = []
    if check is not None and check.get("error"):
        why, check = f"profile: {_short(check['error'])}", None
    for kind, limit in RMSE_LIMITS.items():
        target = f"profile RMSE/mean ≤ {limit:.0%} ({kind})"
        r = (check or {}).get("kinds", {}).get(kind)
        if not r or r.get("relative") is None:
            out.append(Verdict(target, why if check is None else f"no {kind} samples", NOT_MEASURED))
            continue
        rel = r["relative"]
        measured = f"{rel:.1%} (RMSE {1000 * r['rmse_s']:.2f} ms over {r['n']} samples, mean {1000 * r['mean_s']:.2f} ms)"
        out.append(Verdict(target, measured, MET if rel <= limit else MISSED))
    return out


def ready_times(rows: Rows) -> list[tuple[str, float]]:
    """Every start-to-ready figure of the run: the engine stages' (process launch to warmed
    up) and the live daemons' (start to worker registered, and the worker's own clock)."""
    out: list[tuple[str, float]] = []
    for stage in ("hf", "arena", "cb", "generate"):
        for r in rows.find(stage, phase="ready"):
            if isinstance(r.get("ready_since_launch_s"), (int, float)):
                out.append((stage, float(r["ready_since_launch_s"])))
    for r in rows.rows:
        stage = str(r.get("stage", ""))
        if not stage.startswith(("live-", "sat-")):
            continue
        if r.get("phase") == "ready" and isinstance(r.get("ready_s"), (int, float)):
            out.append((stage, float(r["ready_s"])))
        if r.get("phase") == "stopped":
            out += [(f"{stage} worker", float(x)) for x in r.get("worker_ready_in_s") or []]
    return out


def ready(rows: Rows) -> Verdict:
    """Worker start to ready within :data:`READY_LIMIT_S` everywhere it was measured."""
    target = f"worker start to ready ≤ {READY_LIMIT_S:g} s"
    times = ready_times(rows)
    if not times:
        return Verdict(target, "no stage reached ready", NOT_MEASURED)
    worst = max(t for _, t in times)
    measured = ", ".join(f"{s} {t:.1f} s" for s, t in times)
    return Verdict(target, measured, MET if worst <= READY_LIMIT_S else MISSED)


def tests_gpu(rows: Rows) -> Verdict | None:
    """tests/gpu passing, when the stage was asked for."""
    end = rows.last("tests", phase="end")
    if end is None:
        return None
    r = rows.last("tests", phase="result")
    if r is None:
        return Verdict("`pytest tests/gpu` passes", rows.why_not("tests"), NOT_MEASURED)
    return Verdict("`pytest tests/gpu` passes", _short(r.get("summary")), MET if r.get("rc") == 0 else MISSED)


def verdicts(rows: Rows) -> list[Verdict]:
    """Every target, in the order of the summary."""
    out = [hf_decode(rows), *(arena_step(rows, n, p) for n, p in ARENA_SHAPES), cb_starts(rows), cb_warm_up(rows),
           live(rows, "scls", SCLS_RPS, SCLS_TTFT_S), live(rows, "ils", CB_RPS), live(rows, "scls-cb", CB_RPS),
           saturation(rows), first_tokens(rows)]
    out += rmse_verdicts(rows.last("profile", phase="check"), rows.why_not("profile", "no check row"))
    out.append(ready(rows))
    t = tests_gpu(rows)
    if t is not None:
        out.append(t)
    return out


# --------------------------------------------------------------------------- summary.md


def render(rows_in: Iterable[dict[str, Any]]) -> str:
    """``summary.md`` from the rows of ``results.jsonl``."""
    rows = Rows(rows_in)
    plan = rows.last("plan") or {}
    facts = rows.last("facts", phase="facts") or {}
    out = ["# sclsd-bench gpu-check", ""]
    if plan.get("smoke"):
        out += ["**Smoke run** (CPU plumbing check on a tiny model): its figures say nothing about a GPU.", ""]
    if facts:
        card = (f"{facts.get('gpu')} ({_f(facts.get('mem_total_gib'), '{:.1f}')} GiB, CUDA {facts.get('cuda')})"
                if facts.get("cuda_available") else "no CUDA device")
        out.append(f"{card}; Python {facts.get('python')}, torch {facts.get('torch')}, transformers "
                   f"{facts.get('transformers')}, triton {facts.get('triton')}, scipy {facts.get('scipy')}.")
    lacking = (rows.last("setup", phase="env") or {}).get("unimportable") or {}
    if lacking:
        out.append(f"**THE BOX CANNOT IMPORT {', '.join(f'`{m}`' for m in lacking)}** ("
                   + "; ".join(f"{m}: {_short(e)}" for m, e in lacking.items())
                   + "): what needs it will not start; `sclsd-bench gpu-bundle` adds the missing wheels.")
    if plan:
        out.append(f"Model `{plan.get('model')}` in {plan.get('dtype')} on {plan.get('device')}; trace "
                   f"{plan.get('trace_kind')} ({plan.get('trace')}); deadline {plan.get('deadline_s')} s; "
                   f"stages {', '.join(plan.get('stages', []))}.")
        if any(len(sat) > 2 and sat[2] for sat in plan.get("sat") or []):  # [policy, engine, cap]
            out.append("A replay marked `max_tokens N cap` asks `max_tokens` N, a cap, and the client ends each "
                       "request at its trace length, as EOS would (`--sat ...:cap`, `--sat-cap`).")
    if plan and not plan.get("smoke") and "llama2-7b" not in str(plan.get("model")):
        out.append(f"The targets are set for the 7B architecture (`random:llama2-7b`); this run served "
                   f"`{plan.get('model')}` (give `--model random:llama2-7b` to judge them).")
    out += ["", "| target | measured | verdict |", "|---|---|---|"]
    for v in verdicts(rows):
        out.append(f"| {v.target} | {v.measured} | {v.verdict} |")
    out += _engines(rows) + _profile(rows) + _live(rows) + _stages(rows)
    return "\n".join(out) + "\n"


def _engines(rows: Rows) -> list[str]:
    out: list[str] = []
    for stage, title in (("hf", "hf (static cache, captured decode graphs)"),
                         ("arena", f"{ARENA_ENGINE} (continuous batching on the static arena, captured decode graphs)"),
                         ("flex", f"{ARENA_ENGINE} with decode_attention = flex (FlexAttention over each row's "
                                  "own columns)"),
                         ("cb", "hf-cb (defaults)"),
                         ("generate", "transformers' compiled generate (the in-library reference)")):
        got = rows.find(stage)
        if not [r for r in got if r.get("phase") != "end"]:
            continue
        out += ["", f"## {title}", ""]
        for r in rows.find(stage, phase="ready"):
            g = r.get("graphs") or {}
            out.append(f"- ready {_f(r.get('ready_since_launch_s'), '{:.1f}')} s after launch (load "
                       f"{_f(r.get('load_s'))} s, warm-up {_f(r.get('warm_up_s'))} s)"
                       + (f"; {g.get('captured')} graphs captured of {g.get('buckets')} buckets in "
                          f"{_f(g.get('capture_s'))} s, arena {g.get('arena_tokens')} tokens" if g else "")
                       + (f"; cache {r.get('cache_tokens')} tokens" if r.get("cache_tokens") else "")
                       + (f", {r.get('warmed_shapes')} step shapes warmed" if r.get("warmed_shapes") is not None else ""))
        for r in rows.find(stage, phase="shape"):
            what = (f"ERROR {_short(r['error'])}" if r.get("error") else
                    f"{_f(r.get('ms_per_step'))} ms/step, prefill {_f(r.get('prefill_s'), '{:.3f}')} s"
                    + (f", graphs {'kept' if r.get('graphs_kept') else 'not kept'}" if "graphs_kept" in r else ""))
            out.append(f"- N={r.get('n')} P={r.get('p')} {r.get('call')}: {what}")
        for r in rows.find(stage, phase="ab"):
            out.append(f"- N={r.get('n')} P={r.get('p')}: graphs {_f(r.get('graphs_ms_per_step'))} ms vs eager "
                       f"{_f(r.get('eager_ms_per_step'))} ms; greedy rows identical {r.get('rows_identical')}")
        for r in rows.find(stage):
            if r.get("error") and r.get("phase") != "shape":
                out.append(f"- ERROR ({r.get('phase')}): {_short(r['error'], 400)}")
            if r.get("warnings"):
                out.append(f"- warnings: {_short('; '.join(r['warnings']), 600)}")
    return out


def _profile(rows: Rows) -> list[str]:
    check = rows.last("profile", phase="check")
    if check is None or "kinds" not in check:
        return []
    out = ["", "## profile (`sclsd-worker profile`)", "", "| samples | n | RMSE ms | mean ms | RMSE/mean | limit |",
           "|---|---:|---:|---:|---:|---:|"]
    for kind, r in check.get("kinds", {}).items():
        out.append(f"| {kind} | {r.get('n')} | {_f(r['rmse_s'] * 1000 if r.get('rmse_s') is not None else None)} | "
                   f"{_f(r['mean_s'] * 1000 if r.get('mean_s') is not None else None)} | "
                   f"{_f(r.get('relative'), '{:.1%}')} | {RMSE_LIMITS.get(kind, 0):.0%} |")
    out.append(f"\nBudget {check.get('budget_s')} s, profiled in {_f(check.get('elapsed_s'), '{:.0f}')} s; "
               f"M_ava {_f(check.get('m_ava_gib'), '{:.1f}')} GiB; coefficients {check.get('coefficients')}.")
    if check.get("worst_decode"):
        out.append(f"Worst decode samples: {check['worst_decode']}.")
    return out


def _live(rows: Rows) -> list[str]:
    reps = [r for r in rows.rows if str(r.get("stage", "")).startswith(("live-", "sat-")) and r.get("phase") == "replay"]
    if not reps:
        return []
    out = ["", "## live replays", "", "| policy | engine | rate | done | req/s | out tok/s | avg TTFT s | started late "
           "| avg TPOT s | p95 lat s | max gap s (p50 / max of requests) | slices | batch | preempt | errors |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in reps:
        stage = str(r.get("stage"))
        # A saturation stage is named for its engine as --sat gives it (an option set: hf-static-cb-flex).
        engine = sat_engine(r) if stage.startswith("sat-") else r.get("engine")
        if capped(r):
            engine = f"{engine}, max_tokens {r.get('max_tokens_cap') or 'a'} cap"
        out.append(f"| {r.get('policy')} | {engine} | {_f(r.get('rate'), '{:g}')} | "
                   f"{r.get('completed')}/{r.get('requests')} | {_f(r.get('throughput_rps'))} | "
                   f"{_f(r.get('output_tps'), '{:.0f}')} | {_f(r.get('avg_ttft_s'))} | {_late(r)} | "
                   f"{_f(r.get('avg_tpot_s'), '{:.3f}')} | "
                   f"{_f(r.get('p95_latency_s'), '{:.1f}')} | {_f(r.get('p50_gap_s'))} / {_f(r.get('max_gap_s'))} | "
                   f"{_f(r.get('slices_per_req'))} | {_f(r.get('avg_batch_size'), '{:.1f}')} | {r.get('preemptions')} | "
                   f"{r.get('errors')} |")
    for r in rows.rows:
        if str(r.get("stage", "")).startswith(("live-", "sat-")) and r.get("phase") == "stopped":
            arena = r.get("arena_rows")
            rows_of = (f"; arena rows resumed in place {arena['resumed']}, copied in {arena['loaded']}, spilled "
                       f"{arena['spilled']}, moved {arena['moved']}, waited {arena['waited']}") if arena else ""
            if arena and "shared" in arena:
                rows_of += f"; from a cached prefix {arena['shared']}, cached as prefixes {arena['cached']}"
            if arena and "steps" in arena:
                rows_of += (f"; {arena['steps']} steps of {arena['rows_per_step']:.1f} rows, "
                            f"{arena['prefills']} prefill turns")
            if arena and "cols_per_step" in arena:
                rows_of += (f"; {arena['cols_per_step']} KV columns read per step, {arena['own_pct']} % the rows' "
                            f"own; {arena['relayouts']} relayouts, {arena['prefill_s']:.1f} s of prefill")
            if arena and "turns_s" in arena:
                rows_of += (f", {arena['turns_s']:.1f} s in turns: {arena['ms_per_step']:.1f} ms a step besides "
                            "prefill")
            if arena and "loose_steps" in arena:
                rows_of += f"; {arena['loose_steps']} steps outside the buckets (eager with graphs)"
            if arena and "regroups" in arena:
                rows_of += f", {arena['regroups']} regroups"
            if arena and arena.get("spill_oom"):
                rows_of += f", {arena['spill_oom']} spills dropped for want of device memory"
            if arena and arena.get("oom_turns"):
                rows_of += f", {arena['oom_turns']} turns OUT OF DEVICE MEMORY"
            if arena and arena.get("prefix_limit_gib") is not None:
                rows_of += f" (cached prefixes held to {arena['prefix_limit_gib']:.2f} GiB since)"
            if arena and arena.get("padding"):
                rows_of += "; padding read per step: " + ", ".join(f"{k} {v}" for k, v in arena["padding"].items())
            if arena and arena.get("shapes"):
                rows_of += "; steps by shape: " + ", ".join(f"{n}×{c} {k}" for n, c, k in arena["shapes"])
            if r.get("captures_cut"):
                cut = r["captures_cut"]
                rows_of += (f"; graph captures CUT at {cut['s']:.1f} s (graph_capture_s): {cut['left_out']} of "
                            f"{cut['shapes']} bucket shapes left out")
            if r.get("flex_failed"):
                rows_of += f"; FlexAttention FAILED, decode fell back to SDPA: {_short(r['flex_failed'])}"
            out.append(f"- {r['stage']}: worker ready in {r.get('worker_ready_in_s')} s (its own clock); restarts "
                       f"{r.get('worker_exits')}, graphs dropped {r.get('graphs_dropped')}, tracebacks "
                       f"{r.get('tracebacks')}{rows_of}; {_f(r.get('total_s'), '{:.0f}')} s in all")
    return out


def _late(r: dict[str, Any]) -> str:
    """Requests that waited for room (first token ``late_start_s`` or more after the send)
    over the span of the sends: none late means the server kept up with the arrivals."""
    if r.get("late_starts") is None:
        return "-"
    return f"{r['late_starts']} (≥ {_f(r.get('late_start_s'), '{:g}')} s; sends over {_f(r.get('arrivals_s'), '{:.1f}')} s)"


def _stages(rows: Rows) -> list[str]:
    ends = [r for r in rows.rows if r.get("phase") == "end"]
    if not ends:
        return []
    out = ["", "## stages", "", "| stage | status | rc | seconds | note |", "|---|---|---:|---:|---|"]
    for r in ends:
        out.append(f"| {r.get('stage')} | {r.get('status')} | {_f(r.get('rc'), '{}')} | {_f(r.get('seconds'), '{:.0f}')} | "
                   f"{_short(r.get('note') or '', 200)} |")
    return out
