"""Helpers of the operations tests: a daemon with any config, reference outputs, event checks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sclsd import protocol as P
from sclsd.bench.api_bench import ZERO_PROFILE

from .harness import DaemonProc

REPO = Path(__file__).resolve().parents[2]


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    return repr(v)


def toml(sections: dict[str, dict[str, Any]]) -> str:
    lines: list[str] = []
    for name, values in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {_value(v)}" for k, v in values.items() if not isinstance(v, dict)]
        for k, sub in values.items():
            if isinstance(sub, dict):
                lines.append(f"[{name}.{k}]")
                lines += [f"{kk} = {_value(vv)}" for kk, vv in sub.items()]
        lines.append("")
    return "\n".join(lines)


def short_dir() -> Path:
    """ipc:// and Unix socket paths are limited to ~107 bytes: keep the directory short."""
    d = Path(os.environ.get("SCLSD_TEST_TMP", "/tmp")) / f"sclsd-{os.getpid()}-{time.monotonic_ns() % 10**9}"
    d.mkdir(parents=True)
    return d


def start(tmp: Path, *, daemon: dict[str, Any] | None = None, scheduler: dict[str, Any] | None = None,
          workers: dict[str, Any] | None = None, options: dict[str, Any] | None = None,
          model: str = "fake", env: dict[str, str] | None = None,
          preexec_fn: Callable[[], None] | None = None, wait: bool = True,
          fast_profile: bool = True, dir: Path | None = None) -> DaemonProc:
    """Start ``python -m sclsd.daemon`` on a config built from these sections.

    Defaults: fake model and workers, slice 8, Γ = 0.02 s and (``fast_profile``) a
    near-zero cost profile, so the interval is Γ and tests wait on the fake engine's
    sleeps only.
    """
    short = dir or short_dir()
    d = {"socket": f"{short}/api.sock", "status_socket": f"{short}/status.sock",
         "worker_endpoint": f"ipc://{short}/w.ipc", "heartbeat_interval_s": 0.25,
         "heartbeat_timeout_s": 30.0, "drain_timeout_s": 20.0, "log_level": "debug"}
    d.update(daemon or {})
    s: dict[str, Any] = {"policy": "scls", "slice_len": 8, "gamma_s": 0.02}
    if fast_profile:
        prof = tmp / "zero-profile.json"
        prof.write_text(json.dumps(ZERO_PROFILE))
        s["profile"] = str(prof)
    s.update(scheduler or {})
    w: dict[str, Any] = {"spawn": 2, "engine": "fake", "threads": 1, "restart_backoff_s": 0.2}
    w.update(workers or {})
    w["options"] = {"decode_s": 0.0, **(options or {})}
    cfg = tmp / "sclsd.toml"
    cfg.write_text(toml({"daemon": d, "model": {"name": model}, "scheduler": s, "workers": w}))
    log = tmp / "sclsd.log"
    full_env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    full_env.update(env or {})
    proc = subprocess.Popen([sys.executable, "-m", "sclsd.daemon", "--config", str(cfg)],
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=full_env,
                            preexec_fn=preexec_fn, cwd=REPO)
    dp = DaemonProc(proc, short, d["socket"], d["status_socket"], d["worker_endpoint"], log)
    if wait:
        dp.wait_workers(w["spawn"], 120)
    return dp


def stop(d: DaemonProc) -> int:
    """Stop the daemon (SIGTERM) and remove its socket directory; returns the exit code."""
    try:
        return d.stop()
    finally:
        shutil.rmtree(d.dir, ignore_errors=True)


def wait_for(pred: Callable[[], Any], timeout: float = 30.0, what: str = "condition",
             d: DaemonProc | None = None) -> Any:
    """Poll ``pred`` until it returns something truthy."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}" + (f":\n{d.log_text()}" if d else ""))


def workers_by_id(d: DaemonProc) -> dict[str, dict[str, Any]]:
    return {w["id"]: w for w in d.status()["workers"]}


def reference_tokens(prompt: list[int], max_tokens: int, ignore_eos: bool = True) -> list[int]:
    """What the fake engine generates for a greedy request served in one pass."""
    from worker.engines.fake import FakeEngine

    out, _ = FakeEngine().serve(P.BatchMsg(batch_id=1, slice_len=10**6, requests=[
        P.BatchRequest(rid="r", token_ids=list(prompt), max_new_tokens=max_tokens, temperature=0.0,
                       ignore_eos=ignore_eos)]))
    return out[0].token_ids


def check_exactly_once(events: dict[str | None, list[Any]], specs: list[P.Generate]) -> dict[str, P.Done]:
    """Every request: accepted first, exactly one terminal event, last; streamed tokens add up
    to the Done's count and equal the one-pass reference (slice-equivalent fake engine)."""
    dones: dict[str, P.Done] = {}
    for g in specs:
        evs = events[g.id]
        assert isinstance(evs[0], P.Accepted), (g.id, evs[:2])
        terminal = [e for e in evs if isinstance(e, (P.Done, P.Error))]
        assert len(terminal) == 1 and terminal[0] is evs[-1], (g.id, terminal)
        done = evs[-1]
        assert isinstance(done, P.Done), (g.id, done)
        streamed = [t for e in evs if isinstance(e, P.Delta) for t in e.token_ids]
        assert len(streamed) == done.usage.completion_tokens, g.id
        assert g.prompt_ids is not None
        assert streamed == reference_tokens(g.prompt_ids, g.max_tokens, g.ignore_eos), g.id
        dones[g.id] = done  # type: ignore[index]
    return dones
