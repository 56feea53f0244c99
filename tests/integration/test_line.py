"""The daemon keeps its line (real daemon, real fake-engine workers, scls-cb): a worker holds
only the grants its rows run and a lookahead, the rest waits in the daemon, where fair turns
and cancels act on it; a bystander in another process is served in turn behind a burst that
spans 64 connections; a client that hangs up has its rows ended in the engines, not run out.

Assertions are about order and counts (what the daemon and the engines report), not time.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sclsd.bench.fairness import BURST_CLIENT
from sclsd.client import Client
from sclsd.launch import DaemonProcess as Daemon

from .test_guarantees import daemon_factory, poll

ROWS = 4
BURST_N = 128


@pytest.fixture
def started(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    with daemon_factory(tmp_path) as make:
        yield make


def _daemon(started: Callable[..., Daemon]) -> Daemon:
    return started(scheduler={"policy": "scls-cb", "slice_len": 32},
                   options={"decode_s": 0.01, "max_rows": ROWS, "batching": "continuous"},
                   daemon={"max_queued_requests": 4 * BURST_N})


def _burst(d: Daemon, tokens: int) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-c", BURST_CLIENT, d.sock, str(BURST_N), str(tokens), "64", "0"],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line.strip() == "accepted", f"the burst client said {line!r} (exit {p.poll()})"
    return p


def test_a_bystander_takes_its_turn_behind_a_burst_over_64_connections(started: Callable[..., Daemon]) -> None:
    d = _daemon(started)
    burst = _burst(d, tokens=64)
    try:
        st = d.status()
        # The line waits in the daemon: each worker holds its rows and one more, no more.
        assert all(w.batches_inflight <= ROWS + 1 for w in st.workers), st.workers
        assert st.pool_size >= BURST_N - 2 * (ROWS + 1) - st.counters["finished"]
        with Client(d.sock, timeout=60) as c:
            done = c.complete(prompt_ids=[8, 9], max_tokens=8, ignore_eos=True, temperature=0.0)
        assert done.usage.completion_tokens == 8
        # Served in its turn: most of the burst, sent before it, is still waiting.
        assert d.status().live_requests >= BURST_N // 2
    finally:
        burst.kill()
        burst.wait()


def test_a_client_that_hangs_up_has_its_rows_ended_in_the_engines(started: Callable[..., Daemon]) -> None:
    d = _daemon(started)
    burst = _burst(d, tokens=1024)
    burst.kill()  # its 64 connections close with every request in flight
    burst.wait()
    poll(lambda: (s := d.status()).live_requests == 0 and all(w.batches_inflight == 0 for w in s.workers),
         60, "the workers to let go of the gone client's rows", d)
    c = d.status().counters
    # Each row running or queued on a worker was told to end, and the engines ended them
    # early: the tokens their grants allowed and they did not generate were saved.
    # (a row whose grant had just ended there is not found: its result was on its way)
    assert 1 <= c["cancelled_rows"] <= c["cancels_sent"]
    assert c["cancel_saved_tokens"] > 0
    # Only what the workers held was told: the rest of the line never left the daemon.
    assert c["cancels_sent"] <= 2 * (ROWS + 1)
    with Client(d.sock, timeout=60) as cl:
        done = cl.complete(prompt_ids=[8, 9], max_tokens=8, ignore_eos=True, temperature=0.0)
    assert done.usage.completion_tokens == 8
