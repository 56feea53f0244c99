"""Faults lose nothing: killed and hung workers, worker drain, timeouts, SIGTERM drain.

A real daemon with real fake-engine worker processes. The fake engine's tokens
depend on the context only, so a request that lost a slice to a dead worker and
was served again must still stream exactly the one-pass reference tokens: proof
that the unfinished slice's tokens were dropped, not duplicated or skipped.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from sclsd import protocol as P
from sclsd.defaults import offline_env

from .opshelp import check_exactly_once, start, stop, wait_for, wait_settled, workers_by_id
from .rawclient import Raw

DECODE_S = 0.02  # a slice of 8 iterations takes ~0.16 s: long enough to be killed in


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    d = start(tmp_path_factory.mktemp("faults"),
              daemon={"heartbeat_interval_s": 0.25, "heartbeat_timeout_s": 3.0},
              options={"decode_s": DECODE_S})
    yield d
    assert stop(d) == 0, d.log_text()


def _specs(prefix: str, n: int, seed: int, lo: int = 9, hi: int = 40) -> list[P.Generate]:
    rng = random.Random(seed)
    return [P.Generate(id=f"{prefix}{i}", prompt_ids=[rng.randrange(3, 256) for _ in range(rng.randint(1, 30))],
                       max_tokens=rng.randint(lo, hi), temperature=0.0, ignore_eos=True) for i in range(n)]


async def _serve(d, specs: list[P.Generate], during=None, conns: int = 4) -> dict:
    """Send ``specs`` over ``conns`` connections of daemon ``d``, run ``during()`` (in a
    thread) meanwhile, read every request to its terminal event; returns all events by id."""
    cs = [await Raw.open(d.sock) for _ in range(conns)]
    for i, g in enumerate(specs):
        cs[i % conns].send(g)
    extra = None
    if during is not None:
        extra = await asyncio.to_thread(during)
    await asyncio.gather(*(c.until_terminal({g.id for j, g in enumerate(specs) if j % conns == k}, 120)
                           for k, c in enumerate(cs)))
    # A duplicate terminal event would come after: once no batch is out, a ping round trip
    # on each connection brings in everything the daemon sent.
    await asyncio.to_thread(wait_settled, d)
    events: dict = {}
    for c in cs:
        c.send(P.Ping(nonce=1))
        while not isinstance(await c.recv(), P.Pong):
            pass
        await c.close()
        events.update(c.events)
    events["_during"] = extra
    return events


def _inflight_pid(d, wid: str) -> int:
    """Wait until ``wid`` has a batch in flight; its process id."""
    w = wait_for(lambda: (x := workers_by_id(d).get(wid)) and x.batches_inflight > 0 and x,
                 30, f"{wid} busy", d)
    return w.pid


def test_sigkill_mid_batch_requeues_and_restarted_worker_gets_work(daemon) -> None:
    old = workers_by_id(daemon)["w0"].pid
    specs = _specs("k", 40, seed=1)

    def kill_w0() -> int:
        pid = _inflight_pid(daemon, "w0")
        os.kill(pid, signal.SIGKILL)
        return pid

    events = asyncio.run(_serve(daemon, specs, during=kill_w0))
    assert events["_during"] == old
    check_exactly_once(events, specs)
    log = daemon.log.read_text()
    assert "worker=w0 lost (exited): process exited rc=-9" in log
    assert "worker=w0 lost with" in log  # its batch went back to the pool

    # The supervisor restarts it; it registers again and is given work.
    wait_for(lambda: (w := workers_by_id(daemon).get("w0")) and w.pid != old, 60, "w0 back", daemon)
    specs2 = _specs("r", 24, seed=2, lo=17, hi=24)
    events = asyncio.run(_serve(daemon, specs2))
    check_exactly_once(events, specs2)
    assert workers_by_id(daemon)["w0"].batches_done > 0


def test_hung_worker_is_detected_by_heartbeat_timeout(daemon) -> None:
    specs = _specs("h", 30, seed=3)
    stopped: list[int] = []

    def hang_w1() -> int:
        pid = _inflight_pid(daemon, "w1")
        os.kill(pid, signal.SIGSTOP)  # alive but silent: only the heartbeat timeout can tell
        stopped.append(pid)
        return pid

    try:
        events = asyncio.run(_serve(daemon, specs, during=hang_w1))
    finally:
        for pid in stopped:  # never leave a stopped process behind
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    check_exactly_once(events, specs)
    assert "worker=w1 lost (silent): no heartbeat for" in daemon.log.read_text()
    # The daemon killed the hung process; the supervisor started a new one.
    wait_for(lambda: (w := workers_by_id(daemon).get("w1")) and w.pid != stopped[0], 60, "w1 back", daemon)


def _ctl(daemon, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sclsd.ctl", "--socket", daemon.sock,
                           "--status-socket", daemon.status_sock, *args],
                          capture_output=True, text=True, timeout=60)


def test_sclsctl_drain_takes_a_worker_out_without_losing_its_work(daemon) -> None:
    wait_for(lambda: len(daemon.status().workers) == 2, 60, "two workers", daemon)
    specs = _specs("d", 30, seed=4)
    out: dict = {}

    def drain_w0() -> None:
        from sclsd.client import Client

        with Client(daemon.sock, timeout=30) as c:  # in-process: while a batch is in flight
            for _ in range(5):  # a batch may end between the status poll and the drain: retry
                _inflight_pid(daemon, "w0")
                out["reply"] = c.drain_worker("w0")
                if out["reply"].batches_inflight > 0:
                    break
                c.drain_worker("w0", resume=True)
        # sclsctl drain is idempotent; --wait returns once nothing is in flight.
        out["drain"] = _ctl(daemon, "drain", "w0", "--wait", "--timeout", "60")

    events = asyncio.run(_serve(daemon, specs, during=drain_w0))
    rep = out["reply"]
    assert rep.state == "draining" and rep.batches_inflight > 0, rep
    r = out["drain"]
    assert r.returncode == 0, r.stderr
    assert "worker w0: drained" in r.stdout
    check_exactly_once(events, specs)  # what w0 held finished normally
    w0 = workers_by_id(daemon)["w0"]
    assert w0.state == "drained" and w0.batches_inflight == 0

    # Out of rotation: new work goes to w1 only.
    before = w0.batches_done
    specs2 = _specs("e", 12, seed=5)
    events = asyncio.run(_serve(daemon, specs2))
    dones = check_exactly_once(events, specs2)
    assert {d.worker for d in dones.values()} == {"w1"}
    assert workers_by_id(daemon)["w0"].batches_done == before

    r = _ctl(daemon, "drain", "w0", "--resume")
    assert r.returncode == 0 and "worker w0: active" in r.stdout, r.stderr
    specs3 = _specs("f", 24, seed=6, lo=17, hi=24)
    events = asyncio.run(_serve(daemon, specs3))
    check_exactly_once(events, specs3)
    assert workers_by_id(daemon)["w0"].batches_done > before

    r = _ctl(daemon, "drain", "nosuch")
    assert r.returncode == 1 and "unknown_worker" in r.stderr


def test_timeouts_fire_while_waiting_in_the_pool_and_while_running(daemon) -> None:
    for w in ("w0", "w1"):  # no worker in rotation: requests wait in the pool
        assert _ctl(daemon, "drain", w).returncode == 0

    async def run() -> tuple[P.Done, P.Done]:
        c = await Raw.open(daemon.sock)
        c.send(P.Generate(id="pooled", prompt_ids=[5, 6, 7], max_tokens=8, timeout=0.5))
        await c.until_terminal({"pooled"}, 30)
        for w in ("w0", "w1"):
            c.send(P.DrainWorker(worker=w, resume=True))
            assert isinstance(await c.recv(), P.WorkerStateReply)
        # 200 tokens take 25 slices (~4 s): the deadline passes while a batch runs.
        c.send(P.Generate(id="running", prompt_ids=[8, 9], max_tokens=200, ignore_eos=True, timeout=0.8))
        await c.until_terminal({"running"}, 30)
        await c.close()
        return c.events["pooled"][-1], c.events["running"][-1]

    pooled, running = asyncio.run(run())
    assert isinstance(pooled, P.Done) and pooled.finish_reason == "timeout", pooled
    assert pooled.usage.completion_tokens == 0 and pooled.timings.slices == 0
    assert 0.5 <= pooled.timings.e2e_s < 2.5, pooled.timings
    assert isinstance(running, P.Done) and running.finish_reason == "timeout", running
    assert 0 < running.usage.completion_tokens < 200
    assert 0.8 <= running.timings.e2e_s < 2.8, running.timings
    st = daemon.status()
    assert st.live_requests == 0 and st.queued_tokens == 0
    assert st.counters["timed_out"] >= 2


# --------------------------------------------------------------------------- SIGTERM


async def _drain_scenario(d, second_signal: bool) -> tuple[dict, float]:
    c = await Raw.open(d.sock)
    short = [P.Generate(id=f"s{i}", prompt_ids=[10 + i, 3], max_tokens=8, ignore_eos=True) for i in range(6)]
    long = [P.Generate(id=f"l{i}", prompt_ids=[40 + i], max_tokens=1000, ignore_eos=True) for i in range(3)]
    for g in short + long:
        c.send(g)
    for _ in range(len(short) + len(long)):
        assert isinstance(await c.recv(), P.Accepted)
    d.proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    await asyncio.to_thread(wait_for, lambda: d.status().draining, 10, "draining", d)
    # New requests are refused at once, on an old connection and on a new one.
    c.send(P.Generate(id="late1", prompt_ids=[1], max_tokens=1))
    c2 = await Raw.open(d.sock)
    c2.send(P.Generate(id="late2", prompt_ids=[1], max_tokens=1))
    ev = await c2.recv()
    assert isinstance(ev, P.Error) and ev.code == "draining" and ev.id == "late2", ev
    if second_signal:
        await c.until_terminal({g.id for g in short} | {"late1"}, 30)
        d.proc.send_signal(signal.SIGTERM)
    ended = {k for k, evs in c.events.items() if any(isinstance(e, (P.Done, P.Error)) for e in evs)}
    await c.until_terminal(({g.id for g in short + long} | {"late1"}) - ended, 60)
    # Then the daemon closes the connection: nothing more for anyone.
    with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
        while True:
            await c.recv(timeout=30)
    return c.events, t0


def test_sigterm_drains_in_flight_then_ends_the_rest_with_an_error(tmp_path) -> None:
    d = start(tmp_path, daemon={"drain_timeout_s": 3.0}, options={"decode_s": DECODE_S})
    try:
        events, t0 = asyncio.run(_drain_scenario(d, second_signal=False))
        assert d.proc.wait(timeout=60) == 0, d.log_text()
        elapsed = time.monotonic() - t0
    finally:
        stop(d)
    late = events["late1"]
    assert len(late) == 1 and isinstance(late[0], P.Error) and late[0].code == "draining"
    for i in range(6):  # in flight at SIGTERM, short: finished normally
        evs = events[f"s{i}"]
        assert isinstance(evs[-1], P.Done) and evs[-1].finish_reason == "length", evs[-1]
        assert sum(isinstance(e, (P.Done, P.Error)) for e in evs) == 1
    for i in range(3):  # could not finish in time: a terminal error, never silence
        evs = events[f"l{i}"]
        assert isinstance(evs[-1], P.Error) and evs[-1].code == "shutdown", evs[-1]
        assert sum(isinstance(e, (P.Done, P.Error)) for e in evs) == 1
        assert any(isinstance(e, P.Delta) for e in evs)  # they were running
    assert elapsed >= 3.0  # the long ones got the whole drain timeout
    log = d.log.read_text()
    assert "drain ended with 3 requests unfinished" in log and "sclsd stopped" in log


def test_second_sigterm_ends_the_drain_at_once(tmp_path) -> None:
    d = start(tmp_path, daemon={"drain_timeout_s": 120.0}, options={"decode_s": DECODE_S})
    try:
        events, t0 = asyncio.run(_drain_scenario(d, second_signal=True))
        assert d.proc.wait(timeout=60) == 0, d.log_text()
        elapsed = time.monotonic() - t0
    finally:
        stop(d)
    for i in range(3):
        assert isinstance(events[f"l{i}"][-1], P.Error) and events[f"l{i}"][-1].code == "shutdown"
    assert elapsed < 60  # far less than drain_timeout_s
    assert "second SIGTERM: ending 3 requests now" in d.log.read_text()


def test_hung_remote_worker_that_comes_back_registers_again(tmp_path) -> None:
    # Not spawned by the daemon (as with sclsd-worker@.service), so nobody kills it when
    # it hangs: declared dead, it must be told to register again when it is heard from.
    secret = tmp_path / "worker.secret"  # the daemon writes it; a worker not spawned reads it
    d = start(tmp_path, daemon={"heartbeat_interval_s": 0.25, "heartbeat_timeout_s": 1.0,
                                "worker_secret_file": str(secret)},
              workers={"spawn": 0})
    with open(tmp_path / "ext.log", "wb") as out:  # the worker keeps its own descriptor
        w = subprocess.Popen([sys.executable, "-m", "worker.main", "--connect", d.endpoint, "--id", "ext",
                              "--engine", "fake", "--decode-s", "0.005", "--secret-file", str(secret)],
                             stdout=out, stderr=subprocess.STDOUT, env=offline_env())
    try:
        wait_for(lambda: "ext" in workers_by_id(d), 60, "ext registered", d)
        w.send_signal(signal.SIGSTOP)
        wait_for(lambda: not workers_by_id(d), 30, "ext declared dead", d)

        async def run() -> P.Done:
            c = await Raw.open(d.sock)
            c.send(P.Generate(id="waits", prompt_ids=[4, 5, 6], max_tokens=20, ignore_eos=True))
            assert isinstance(await c.recv(), P.Accepted)
            w.send_signal(signal.SIGCONT)  # it wakes up and heartbeats as if nothing happened
            await c.until_terminal({"waits"}, 60)
            await c.close()
            return c.events["waits"][-1]

        done = asyncio.run(run())
        assert isinstance(done, P.Done) and done.finish_reason == "length" and done.worker == "ext"
        log = d.log.read_text()
        assert "worker=ext lost (silent): no heartbeat" in log
        assert "worker=ext unknown (heartbeat received): asking it to register again" in log
        assert "daemon asks us to register again" in (tmp_path / "ext.log").read_text()
    finally:
        w.send_signal(signal.SIGCONT)
        w.terminate()
        try:
            w.wait(timeout=30)
        except subprocess.TimeoutExpired:
            w.kill()
        stop(d)
