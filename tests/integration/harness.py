"""A real sclsd (and its worker processes) with the defaults of the daemon tests:
fake engine and model, two workers, slice 8, short heartbeats and Γ."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from sclsd import protocol as P
from sclsd.client import AsyncClient
from sclsd.launch import DaemonProcess, launch

#: The launcher's handle on a running daemon (status(), wait_workers(), log_text(), stop()).
DaemonProc = DaemonProcess


def start_daemon(tmp: Path, *, engine: str = "fake", model: str = "fake", workers: int = 2,
                 policy: str = "scls", slice_len: int = 8, daemon: dict[str, Any] | None = None,
                 scheduler: dict[str, Any] | None = None, worker_opts: dict[str, Any] | None = None,
                 wait: bool = True, ready_timeout: float = 120.0,
                 workers_cfg: dict[str, Any] | None = None) -> DaemonProc:
    """Start ``sclsd``; its log is ``tmp/sclsd.log`` (kept after ``stop()``)."""
    sections: dict[str, dict[str, Any]] = {
        "daemon": {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 30.0, "drain_timeout_s": 20.0,
                   "log_level": "debug", **(daemon or {})},
        "model": {"name": model},
        "scheduler": {"policy": policy, "slice_len": slice_len, "gamma_s": 0.05, **(scheduler or {})},
        "workers": {"spawn": workers, "engine": engine, "threads": 1, "restart_backoff_s": 0.2,
                    "options": dict(worker_opts or {}), **(workers_cfg or {})},
    }
    return launch(sections, log=tmp / "sclsd.log", wait_workers=workers if wait else None,
                  timeout=ready_timeout)


def hf_reference(prompts: list[str], max_tokens: int) -> list[list[int]]:
    """Greedy tokens of the static ``hf`` engine on ``tiny-random``, in one pass: what every
    engine and policy must give for these prompts."""
    from sclsd.tokenizer import load
    from worker.engines import create_engine

    tok = load("tiny-random")
    engine = create_engine("hf", "tiny-random")
    rows = [P.BatchRequest(rid=str(i), token_ids=tok.encode(p), max_new_tokens=max_tokens,
                           temperature=0.0, ignore_eos=True) for i, p in enumerate(prompts)]
    outs, _ = engine.serve(P.BatchMsg(batch_id=1, slice_len=1024, requests=rows))
    return [o.token_ids for o in outs]


async def complete_all(sock: str, prompts: list[str], max_tokens: int) -> list[P.Done]:
    """Every prompt at once over one connection, greedy, ``max_tokens`` each."""
    async with AsyncClient(sock) as c:
        return list(await asyncio.gather(*(
            c.complete(prompt=p, max_tokens=max_tokens, temperature=0.0, ignore_eos=True) for p in prompts)))
