"""Helpers of the operations tests: a daemon with any config, reference outputs, event checks."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sclsd import protocol as P
from sclsd.bench.api_bench import ZERO_PROFILE
from sclsd.launch import launch, short_dir, toml_text
from sclsd.protocol import StatusSnapshot, WorkerStatus

from .harness import DaemonProc

__all__ = ["REPO", "DaemonProc", "check_exactly_once", "reference_tokens", "short_dir", "start", "stop",
           "toml", "wait_for", "wait_settled", "workers_by_id"]

REPO = Path(__file__).resolve().parents[2]

#: The config writer of the launcher.
toml = toml_text


def start(tmp: Path, *, daemon: dict[str, Any] | None = None, scheduler: dict[str, Any] | None = None,
          workers: dict[str, Any] | None = None, options: dict[str, Any] | None = None,
          model: str = "fake", env: dict[str, str] | None = None,
          preexec_fn: Callable[[], None] | None = None, wait: bool = True,
          fast_profile: bool = True, dir: Path | None = None) -> DaemonProc:
    """Start ``python -m sclsd.daemon`` on a config built from these sections.

    Defaults: fake model and workers, slice 8, Γ = 0.02 s and (``fast_profile``) a
    near-zero cost profile, so the interval is Γ and tests wait on the fake engine's
    sleeps only. The log is ``tmp/sclsd.log``; :func:`stop` removes the socket directory.
    """
    d = {"heartbeat_interval_s": 0.25, "heartbeat_timeout_s": 30.0, "drain_timeout_s": 20.0,
         "log_level": "debug", **(daemon or {})}
    s: dict[str, Any] = {"policy": "scls", "slice_len": 8, "gamma_s": 0.02}
    if fast_profile:
        prof = tmp / "zero-profile.json"
        prof.write_text(json.dumps(ZERO_PROFILE))
        s["profile"] = str(prof)
    s.update(scheduler or {})
    w: dict[str, Any] = {"spawn": 2, "engine": "fake", "threads": 1, "restart_backoff_s": 0.2}
    w.update(workers or {})
    w["options"] = {"decode_s": 0.0, **(options or {})}
    sections = {"daemon": d, "model": {"name": model}, "scheduler": s, "workers": w}
    return launch(sections, dir=dir or short_dir(), log=tmp / "sclsd.log", env=env,
                  preexec_fn=preexec_fn, cwd=REPO, wait_workers=w["spawn"] if wait else None,
                  timeout=120)


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


def wait_settled(d: DaemonProc, timeout: float = 30.0) -> StatusSnapshot:
    """Wait until the daemon holds no request and no worker has a batch out: after that no
    event of any request can come (a late or duplicate one would need a batch in flight)."""

    def settled() -> StatusSnapshot | None:
        st = d.status()
        return st if st.live_requests == 0 and not any(w.batches_inflight for w in st.workers) else None

    return wait_for(settled, timeout, "no request and no batch left", d)


def workers_by_id(d: DaemonProc) -> dict[str, WorkerStatus]:
    return {w.id: w for w in d.status().workers}


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
