"""Shutdown after serving: SIGTERM while workers keep KV for live requests (hf-cb in
transformers' paged cache; hf in its store, spilled to its host tier) ends with every
worker closing its engine and exiting on its own, none killed, the daemon exiting 0."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from sclsd.client import Client
from sclsd.launch import launch

pytest.importorskip("torch")

CASES = {
    # Slice grants on transformers' continuous batching: KV kept paused in its cache.
    "hf-cb": ({"policy": "scls-cb"}, {}),
    # Static slices, KV kept in the store with room for about one request on the "device"
    # and a host tier for the rest.
    "hf": ({"policy": "scls"}, {"kv_retain_bytes": 40_000, "kv_host_bytes": 64 * 1024 * 1024}),
}


@pytest.mark.parametrize("engine", sorted(CASES))
def test_sigterm_after_serving_with_kept_kv_exits_cleanly(engine: str, tmp_path: Path) -> None:
    sched, opts = CASES[engine]
    log = tmp_path / "sclsd.log"
    d = launch({"daemon": {"drain_timeout_s": 1.0, "log_level": "debug", "heartbeat_timeout_s": 60.0},
                "model": {"name": "tiny-random"}, "scheduler": {**sched, "slice_len": 4},
                "workers": {"engine": engine, "spawn": 2, "threads": 1, "options": opts}},
               log=log, wait_workers=2, timeout=300)
    ended: list[Any] = []

    def ask(i: int) -> None:
        try:
            with Client(d.sock) as c:
                ended.append(list(c.generate(prompt=f"request {i} " * (1 + i % 4), max_tokens=2000,
                                             temperature=0, ignore_eos=True))[-1])
        except Exception as exc:  # noqa: BLE001 - ended by the shutdown (an error event, or the socket)
            ended.append(exc)

    try:
        # First a few that end, then some that are still live (their KV kept) at SIGTERM.
        with Client(d.sock) as c:
            for i in range(3):
                assert list(c.generate(prompt=f"warm {i}", max_tokens=12, temperature=0,
                                       ignore_eos=True))[-1].finish_reason == "length"
        threads = [threading.Thread(target=ask, args=(i,), daemon=True) for i in range(6)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while True:  # until both workers hold KV for requests between slices
            st = d.status()
            if st.live_requests == 6 and all(w.batches_done >= 3 for w in st.workers) \
                    and st.kv_cache_usage > 0:
                break
            assert time.monotonic() < deadline, st
            time.sleep(0.2)
        if engine == "hf":
            deadline = time.monotonic() + 60
            while "moved to host memory" not in log.read_text():
                assert time.monotonic() < deadline, "the host tier was never used"
                time.sleep(0.2)
    finally:
        rc = d.stop(timeout=120)
    for t in threads:
        t.join(timeout=30)
    text = log.read_text()
    assert rc == 0, text[-3000:]
    # The stop's own kill (the crash above may log "killing its process" when a send finds it gone).
    assert "did not exit in time" not in text, text[-3000:]
    closed = re.findall(r"sclsd-worker\[(w\d)\] INFO worker: engine closed in [\d.]+ s: kept KV", text)
    assert sorted(closed) == ["w0", "w1"], text[-3000:]
    assert len(ended) == 6


def test_sigterm_while_a_restarted_worker_loads_stops_it_without_the_kill(tmp_path: Path) -> None:
    """A worker that is loading at SIGTERM (here: restarted after a crash) was told nothing over
    the socket: the daemon signals it, and it exits once loaded instead of registering and
    waiting to be killed (which took the daemon's whole 30 s of grace before)."""
    import os
    import signal

    log = tmp_path / "sclsd.log"
    d = launch({"daemon": {"drain_timeout_s": 1.0, "log_level": "info"}, "model": {"name": "tiny-random"},
                "scheduler": {"policy": "scls-cb", "slice_len": 4},
                "workers": {"engine": "hf-static-cb", "spawn": 2, "threads": 1, "restart_backoff_s": 0.0}},
               log=log, wait_workers=2, timeout=300)
    try:
        victim = next(w for w in d.status().workers if w.id == "w0")
        os.kill(victim.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        # Until it logged a loading step: its signal handler is installed by then (a signal
        # before that ends the bare interpreter, which proves nothing here).
        while not any(w.id == "w0" and w.state == "loading" and w.pid != victim.pid and w.step
                      for w in d.status().loading):
            assert time.monotonic() < deadline, d.status()
            time.sleep(0.05)
    finally:
        t0 = time.monotonic()
        rc = d.stop(timeout=120)
        took = time.monotonic() - t0
    text = log.read_text()
    assert rc == 0, text[-3000:]
    # The stop's own kill (the crash above may log "killing its process" when a send finds it gone).
    assert "did not exit in time" not in text, text[-3000:]
    assert re.search(r"worker=w0 pid=\d+ has not registered: SIGTERM", text), text[-3000:]
    # It exits at the end of its load (or, had it registered first, when turned away).
    assert re.search(r"sclsd-worker\[w0\] INFO worker: SIGTERM during start-up: exiting"
                     r"|worker=w0 pid=\d+ registered while the daemon stops", text), text[-3000:]
    assert took < 25, (took, text[-3000:])
