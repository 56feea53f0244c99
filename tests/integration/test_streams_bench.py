"""sclsd-bench streams' closed loop against a real daemon (fake workers): a warm-up serves its
prompts once, even with ``--duration``, and the measured loop reuses them until the time is up."""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from sclsd.bench import streams as S

from .harness import start_daemon


def test_the_warmup_serves_its_prompts_once_and_the_loop_runs_for_its_duration(tmp_path: Path) -> None:
    p = argparse.ArgumentParser()
    S.add_arguments(p)
    args = p.parse_args(["--duration", "1.5", "--concurrency", "2", "--output-tokens", "4",
                         "--prompt-tokens", "8"])
    work = [[5 + i, 6, 7, 8] for i in range(3)]
    d = start_daemon(tmp_path, policy="scls-cb", workers=1)
    try:
        warm = asyncio.run(S.drive(d.sock, "warm", work, args, warmup=True))
        assert [s.rid for s in warm] == ["warm-0", "warm-1", "warm-2"]  # once, not for 1.5 s
        t0 = time.monotonic()
        measured = asyncio.run(S.drive(d.sock, "m", work, args, progress=False))
        # Each client starts requests until the time is up (the prompts reused): the loop
        # cannot end sooner, however fast or slow the machine.
        assert time.monotonic() - t0 >= 1.5 and measured
        assert all(s.error is None and s.completion_tokens == 4 for s in warm + measured)
    finally:
        assert d.stop() == 0, d.log_text()
