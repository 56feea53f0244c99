"""The daemon's guarantees about its workers, each against a real daemon.

Forged workers are refused; spawned workers die with the daemon; workers that
crash in a loop make the daemon say it cannot serve (``serving = false``,
``no_workers``); spawned workers run the installed ``worker`` package whatever
lies in the daemon's working directory. Helpers: ``test_guarantees.py``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

from sclsd import protocol as P
from sclsd.client import Client
from sclsd.launch import DaemonProcess as Daemon

from .opshelp import reference_tokens
from .rawclient import Raw
from .test_guarantees import READY_S, daemon_factory, finish, greedy, launch, poll


@pytest.fixture
def started(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    with daemon_factory(tmp_path) as make:
        yield make


# --------------------------------------------------------------------------- forged workers


def forged_register(auth: str) -> bytes:
    return P.encode(P.Register(worker_id="w0", engine="fake", model="fake", device="cpu",
                               kv_bytes_per_token=46_080, mem_available=4 * 1024**3, pid=4242,
                               eos_token_ids=[2], vocab_size=1000, auth=auth))


def test_forged_worker_is_refused_and_the_real_one_keeps_serving(started: Callable[..., Daemon]) -> None:
    d = started()
    ipc = d.endpoint[len("ipc://"):]
    assert stat.S_IMODE(os.stat(ipc).st_mode) == 0o600, oct(os.stat(ipc).st_mode)
    prompt = [11, 12, 13, 14]
    before = greedy(d, prompt)
    assert before == reference_tokens(prompt, 12)
    real = {w.id: w.pid for w in d.status().workers}

    ctx = zmq.Context()
    socks = []
    try:
        for i, auth in enumerate(("", "00" * 32)):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            if i:
                s.setsockopt(zmq.ROUTING_ID, b"w0")  # a chosen routing id gains nothing either
            socks.append(s)
            s.connect(d.endpoint)
            s.send(forged_register(auth))
            assert s.poll(10_000), f"no answer to a forged register (auth={auth!r})"
            assert isinstance(P.to_worker_decoder.decode(s.recv()), P.Shutdown)
        # Work arriving now goes to the real workers only.
        with Client(d.sock, timeout=30) as c:
            for i in range(8):
                c.complete(prompt_ids=[20 + i, 3], max_tokens=9, ignore_eos=True)
        after = greedy(d, prompt)
        for s in socks:
            while s.poll(0):
                msg = P.to_worker_decoder.decode(s.recv())
                assert not isinstance(msg, P.BatchMsg), msg
    finally:
        for s in socks:
            s.close(0)
        ctx.term()
    assert after == before
    st = d.status()
    assert {w.id: w.pid for w in st.workers} == real
    assert all(w.state == "active" for w in st.workers)
    assert st.counters["workers_refused"] == 2, st.counters
    log = d.log.read_text()
    assert log.count("worker='w0' pid=4242 registration refused: missing or wrong worker secret") == 2, \
        d.log_text()
    assert "worker=w0 lost" not in log


# --------------------------------------------------------------------------- orphans


def _gone(pid: int) -> bool:
    """Exited (a zombie waiting for a reaper counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def test_workers_exit_when_the_daemon_is_killed(started: Callable[..., Daemon]) -> None:
    d = started()
    pids = [w.pid for w in d.status().workers]
    assert len(pids) == 2 and not any(_gone(p) for p in pids)
    os.kill(d.proc.pid, signal.SIGKILL)
    assert d.proc.wait(timeout=10) == -signal.SIGKILL
    try:
        poll(lambda: all(_gone(p) for p in pids), 10, f"workers {pids} to exit after the daemon died", d)
    finally:
        for p in pids:  # never leave an orphan behind, even when the test failed
            if not _gone(p):
                os.kill(p, signal.SIGKILL)


# --------------------------------------------------------------------------- crash-looping workers


def test_crash_looping_workers_make_the_daemon_say_it_cannot_serve(started: Callable[..., Daemon],
                                                                    tmp_path: Path) -> None:
    # Workers that exit as they start, whatever the config says (a broken install: the first
    # ``worker`` package on their path fails), so the supervisor starts them again.
    broken = tmp_path / "broken" / "worker"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("")
    (broken / "main.py").write_text("def main(argv):\n    print('this worker cannot start')\n    return 1\n")
    path = os.pathsep.join(p for p in (str(broken.parent), os.environ.get("PYTHONPATH")) if p)
    d = started(workers={"quick_failure_s": 30.0, "max_quick_failures": 2, "restart_backoff_s": 0.05,
                         "restart_backoff_max_s": 0.05},
                env={"PYTHONPATH": path}, wait=0)
    st = poll(lambda: (s := d.status()) and not s.serving and s, 20, "serving == False", d)
    assert st.why and "w0" in st.why and "w1" in st.why, st.why
    assert st.workers == []

    async def run() -> P.Error:
        c = await Raw.open(d.sock)
        c.send(P.Generate(id="nw", prompt_ids=[3, 4], max_tokens=4))
        ev = await c.recv(10)
        await c.close()
        return ev

    ev = asyncio.run(run())
    assert isinstance(ev, P.Error) and ev.code == "no_workers" and ev.id == "nw", ev
    assert d.proc.poll() is None
    log = d.log.read_text()
    for wid in ("w0", "w1"):
        assert f"ERROR sclsd.workers: local worker {wid} exited 2 times in a row" in log, d.log_text()


# --------------------------------------------------------------------------- decoy worker/ package


def test_a_worker_package_in_the_working_directory_is_not_run(tmp_path: Path) -> None:
    decoy = tmp_path / "cwd"
    (decoy / "worker").mkdir(parents=True)
    (decoy / "worker" / "__init__.py").write_text('raise SystemExit("DECOY")\n')
    (decoy / "worker" / "main.py").write_text('raise SystemExit("DECOY")\n')
    (tmp_path / "d").mkdir()
    d = launch(tmp_path / "d", cwd=decoy, wait=0)
    try:
        poll(lambda: "DECOY" in d.log.read_text() or len(d.status().workers) == 2, READY_S,
             "2 workers registered", d)
        assert "DECOY" not in d.log.read_text(), d.log_text()
        assert greedy(d, [6, 5, 4]) == reference_tokens([6, 5, 4], 12)
        assert {w.id for w in d.status().workers} == {"w0", "w1"}
    finally:
        rc = finish(d)
    assert rc == 0, d.log_text()
    assert "DECOY" not in d.log.read_text()
