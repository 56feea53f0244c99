"""``sclsd --engine deepspeed`` end to end, and ``sclsd-bench gpu-check`` on the CPU.

On the CPU these check the deepspeed worker's integration with the daemon (spawn,
register, slices, streaming), not DeepSpeed's kernels: without kernel injection
DeepSpeed runs transformers' own modules.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sclsd.client import Client
from sclsd.launch import short_dir

from .harness import start_daemon

pytest.importorskip("torch")
pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install 'sclsd[deepspeed]')")

PROMPTS = ["The capital of France is", "One, two, three,", "Hello"]
REPO = Path(__file__).resolve().parents[2]
TRACE = REPO.parent / "shared" / "traces" / "sharegpt_lengths.csv"


def greedy_answers(engine: str, tmp: Path) -> tuple[list, list[str]]:
    """Serve PROMPTS greedily through a daemon whose workers run ``engine``; stop it."""
    d = start_daemon(tmp, engine=engine, model="tiny-random", workers=1, slice_len=4,
                     ready_timeout=180)  # fmt: skip
    try:
        with Client(d.sock, timeout=120) as c:
            done = [c.complete(prompt=p, max_tokens=11, temperature=0.0, ignore_eos=True)
                    for p in PROMPTS]  # fmt: skip
        engines = [w.engine for w in d.status().workers]
    finally:
        assert d.stop() == 0, d.log_text()
    return done, engines


def test_deepspeed_daemon_answers_equal_hf_daemon(tmp_path_factory: pytest.TempPathFactory) -> None:
    """``engine = "deepspeed"`` serves tiny-random in slices of 4 and its greedy answers equal
    an ``hf`` daemon's, token for token. On the CPU: the worker's integration, not DeepSpeed's
    kernels."""
    ds, ds_engines = greedy_answers("deepspeed", tmp_path_factory.mktemp("ds"))
    hf, hf_engines = greedy_answers("hf", tmp_path_factory.mktemp("hf"))
    assert ds_engines == ["deepspeed"] and hf_engines == ["hf"]
    for a, b in zip(ds, hf, strict=True):
        assert a.finish_reason == b.finish_reason == "length"
        assert a.timings.slices == 3  # ceil(11 / 4): resumed across slices
        assert a.token_ids == b.token_ids and len(a.token_ids) == 11
        assert a.text == b.text


def test_kernel_inject_on_the_cpu_is_refused_at_start() -> None:
    """``kernel_inject = true`` with CPU workers: the daemon exits 2 naming the key and why."""
    d = short_dir("ds-ki")
    cfg = d / "sclsd.toml"
    cfg.write_text('[model]\nname = "tiny-random"\n[scheduler]\npolicy = "scls"\n[workers]\nengine = "deepspeed"\n'
                   "[workers.options]\nkernel_inject = true\n")  # fmt: skip
    out = subprocess.run([sys.executable, "-m", "sclsd.daemon", "--config", str(cfg)],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 2
    assert "workers.options.kernel_inject" in out.stderr and "needs CUDA" in out.stderr

