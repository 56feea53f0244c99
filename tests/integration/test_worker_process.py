"""A real ``sclsd-worker`` process (fake engine) against a ROUTER bound by the test."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

zmq = pytest.importorskip("zmq")

from sclsd import protocol as P  # noqa: E402
from worker.engines.fake import FakeEngine  # noqa: E402

#: Generous deadline for things that must happen (never asserted as a duration).
PATIENCE = 60.0


def worker_command(endpoint: str, wid: str, *extra: str) -> list[str]:
    exe = shutil.which("sclsd-worker", path=str(Path(sys.executable).parent))
    base = [exe] if exe else [sys.executable, "-m", "worker.main"]
    if "--engine" not in extra:
        extra = ("--engine", "fake", *extra)
    return [*base, "--connect", endpoint, "--id", wid, *extra]


class Daemon:
    """The test's stand-in for the daemon: a ROUTER and a few helpers."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.endpoint = endpoint
        self.backlog: list[tuple[bytes, object]] = []

    def recv(
        self, kind: type | tuple[type, ...], timeout: float = PATIENCE
    ) -> tuple[bytes, object]:
        """Next message of ``kind`` with the sender's identity; others wait in a backlog."""
        for i, (ident, msg) in enumerate(self.backlog):
            if isinstance(msg, kind):
                del self.backlog[i]
                return ident, msg
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sock.poll(100):
                ident, body = self.sock.recv_multipart()
                msg = P.worker_decoder.decode(body)
                if isinstance(msg, kind):
                    return ident, msg
                if not isinstance(msg, P.Heartbeat):  # heartbeats are only ever wanted fresh
                    self.backlog.append((ident, msg))
        raise AssertionError(f"no {kind} within {timeout}s")

    def send(self, ident: bytes, msg: object) -> None:
        self.sock.send_multipart([ident, P.encode(msg)])

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def ipc_dir() -> Iterator[Path]:
    # ipc:// paths are limited to about 107 bytes, so not pytest's deep tmp_path.
    d = Path(tempfile.mkdtemp(prefix="sw-", dir=os.environ.get("SCLSD_TEST_TMP", "/tmp")))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def daemon(ipc_dir: Path) -> Iterator[Daemon]:
    d = Daemon(f"ipc://{ipc_dir}/w.ipc")
    yield d
    d.close()


@pytest.fixture
def spawn(ipc_dir: Path) -> Iterator:
    procs: list[subprocess.Popen[bytes]] = []

    def start(
        endpoint: str, wid: str = "w0", *extra: str, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        log = open(ipc_dir / f"{wid}.log", "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            worker_command(endpoint, wid, *extra),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=None if env is None else {**os.environ, **env},
        )
        proc.log_path = ipc_dir / f"{wid}.log"  # type: ignore[attr-defined]
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def log_of(proc: subprocess.Popen[bytes]) -> str:
    return proc.log_path.read_text(errors="replace")  # type: ignore[attr-defined]


def wait_exit(proc: subprocess.Popen[bytes]) -> int:
    try:
        return proc.wait(timeout=PATIENCE)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"worker did not exit:\n{log_of(proc)}") from None


def expected(batch: P.BatchMsg) -> list[P.RequestOutput]:
    outs, _ = FakeEngine().serve(batch)
    return outs


def whole(daemon: Daemon, res: P.Result) -> list[P.RequestOutput]:
    """The result's rows as the engine made them: the parts its ``tokens`` messages carried
    (received before it, each starting where the row's previous one ended), then its own."""
    got: dict[str, list[int]] = {}
    for _, msg in daemon.backlog:
        for part in msg.batches if isinstance(msg, P.Tokens) else []:
            if part.batch_id == res.batch_id:
                for o in part.outputs:
                    assert o.start == len(got.get(o.rid, []))
                    got.setdefault(o.rid, []).extend(o.token_ids)
    rows = []
    for o in res.outputs:
        assert o.start == len(got.get(o.rid, []))
        rows.append(msgspec.structs.replace(o, token_ids=got.get(o.rid, []) + o.token_ids, start=0))
    return rows


def register(daemon: Daemon, hb: float = 0.2) -> tuple[bytes, P.Register]:
    ident, reg = daemon.recv(P.Register)
    daemon.send(ident, P.Welcome(heartbeat_interval_s=hb))
    return ident, reg  # type: ignore[return-value]


def test_register_batch_heartbeat_shutdown(daemon, spawn):
    proc = spawn(daemon.endpoint, "w0", "--mem-budget", "12345", "--opt", "kv_bytes_per_token=99")
    ident, reg = register(daemon)
    assert ident != b"w0"  # the ROUTER assigns routing ids; the worker id is in the messages
    assert (reg.worker_id, reg.engine, reg.model, reg.device) == ("w0", "fake", "fake", "cpu")
    assert reg.kv_bytes_per_token == 99 and reg.mem_available == 12345
    assert reg.pid == proc.pid and reg.eos_token_ids == [2]
    assert reg.vocab_size == 1000 and reg.auth == ""

    hb = daemon.recv(P.Heartbeat)[1]
    assert hb.worker_id == "w0"

    batch = P.BatchMsg(
        batch_id=7,
        slice_len=5,
        requests=[
            P.BatchRequest(
                rid="a", token_ids=[5, 6, 7], max_new_tokens=3, ignore_eos=True, temperature=0.0
            ),
            P.BatchRequest(
                rid="b", token_ids=[9] * 4, max_new_tokens=50, ignore_eos=True, temperature=0.0
            ),
        ],
    )
    daemon.send(ident, batch)
    res = daemon.recv(P.Result)[1]
    assert (res.worker_id, res.batch_id, res.error) == ("w0", 7, None)
    rows = whole(daemon, res)
    assert rows == expected(batch)
    assert [len(o.token_ids) for o in rows] == [3, 5]
    assert [o.finish_reason for o in res.outputs] == ["length", None]
    assert res.stats.batch_size == 2 and res.stats.iterations == 5 and res.stats.input_len == 4

    daemon.send(ident, P.Shutdown())
    assert wait_exit(proc) == 0, log_of(proc)
    assert "w0" in log_of(proc)


def test_engine_error_yields_error_result_and_worker_continues(daemon, spawn):
    proc = spawn(daemon.endpoint, "w1")
    ident, _ = register(daemon)
    bad = P.BatchMsg(
        batch_id=1,
        slice_len=4,
        requests=[P.BatchRequest(rid="x", token_ids=[10**6], max_new_tokens=4, temperature=0.0)],
    )
    daemon.send(ident, bad)
    res = daemon.recv(P.Result)[1]
    assert res.batch_id == 1 and res.outputs == []
    assert res.error and "outside vocab" in res.error

    good = P.BatchMsg(
        batch_id=2,
        slice_len=4,
        requests=[P.BatchRequest(rid="y", token_ids=[4], max_new_tokens=4, temperature=0.0)],
    )
    daemon.send(ident, good)
    res = daemon.recv(P.Result)[1]
    assert res.batch_id == 2 and res.error is None and whole(daemon, res) == expected(good)
    proc.send_signal(signal.SIGTERM)
    assert wait_exit(proc) == 0, log_of(proc)


def test_results_in_order_and_drain_refuses_new_batches(daemon, spawn):
    proc = spawn(daemon.endpoint, "w2", "--decode-s", "0.01")
    ident, _ = register(daemon)
    batches = [
        P.BatchMsg(
            batch_id=i,
            slice_len=8,
            requests=[
                P.BatchRequest(rid=f"r{i}", token_ids=[3 + i, 4], max_new_tokens=8, temperature=0.0)
            ],
        )
        for i in range(3)
    ]
    for b in batches:
        daemon.send(ident, b)
    daemon.send(ident, P.Drain())
    late = P.BatchMsg(batch_id=99, slice_len=8, requests=batches[0].requests)
    daemon.send(ident, late)
    got = {}
    while len(got) < 4:
        res = daemon.recv(P.Result)[1]
        got[res.batch_id] = res
    for b in batches:  # queued before Drain: served
        assert got[b.batch_id].error is None and whole(daemon, got[b.batch_id]) == expected(b)
    assert got[99].error and "draining" in got[99].error
    # Every queued batch was acknowledged; the refused one was answered instead.
    assert sorted(m.batch_id for _, m in daemon.backlog if isinstance(m, P.BatchAck)) == [0, 1, 2]
    # Still alive and beating while drained.
    assert daemon.recv(P.Heartbeat)[1].worker_id == "w2"
    proc.send_signal(signal.SIGINT)
    assert wait_exit(proc) == 0, log_of(proc)


def test_waits_for_daemon_and_registers_when_it_appears(ipc_dir, spawn):
    endpoint = f"ipc://{ipc_dir}/late.ipc"
    proc = spawn(endpoint, "w3", "--register-retry", "0.5")
    time.sleep(0.5)  # the worker starts with nobody listening
    assert proc.poll() is None
    late = Daemon(endpoint)
    try:
        ident, reg = register(late)
        assert reg.worker_id == "w3"
        late.send(ident, P.Shutdown())
        assert wait_exit(proc) == 0, log_of(proc)
    finally:
        late.close()


def test_sigterm_finishes_running_batch(daemon, spawn):
    proc = spawn(daemon.endpoint, "w4", "--decode-s", "0.05")
    ident, _ = register(daemon)
    batch = P.BatchMsg(
        batch_id=5,
        slice_len=10,
        requests=[
            P.BatchRequest(
                rid="s", token_ids=[8], max_new_tokens=10, ignore_eos=True, temperature=0.0
            )
        ],
    )
    daemon.send(ident, batch)
    # Busy heartbeat: the batch is running when the signal arrives.
    while not daemon.recv(P.Heartbeat)[1].busy:
        pass
    proc.send_signal(signal.SIGTERM)
    res = daemon.recv(P.Result)[1]
    assert res.batch_id == 5 and res.error is None and whole(daemon, res) == expected(batch)
    assert wait_exit(proc) == 0, log_of(proc)


def test_bad_engine_exits_nonzero(daemon, spawn):
    proc = spawn(daemon.endpoint, "w5", "--opt", "no_such_option=1")
    assert wait_exit(proc) == 2
    assert "no_such_option" in log_of(proc)


def test_hf_engine_worker_serves_tiny_model(daemon, spawn):
    pytest.importorskip("torch")
    from worker.engines.hf import HFEngine

    proc = spawn(
        daemon.endpoint, "w6", "--engine", "hf", "--model", "tiny-random", "--threads", "1",
        "--mem-budget", "1000000",
    )  # fmt: skip
    ident, reg = register(daemon)
    assert (reg.engine, reg.model, reg.kv_bytes_per_token) == ("hf", "tiny-random", 512)
    assert reg.mem_available == 1_000_000 and reg.eos_token_ids == [2]
    assert reg.vocab_size == 49152  # the SmolLM2 tokenizer tiny-random shares
    batch = P.BatchMsg(
        batch_id=3,
        slice_len=4,
        requests=[
            P.BatchRequest(rid="a", token_ids=[11, 12, 13], max_new_tokens=9, temperature=0.0),
            P.BatchRequest(rid="b", token_ids=[14], max_new_tokens=2, temperature=0.0),
        ],
    )
    daemon.send(ident, batch)
    res = daemon.recv(P.Result)[1]
    assert res.error is None, res.error
    want, _ = HFEngine("tiny-random", threads=1).serve(batch)
    assert whole(daemon, res) == want
    assert [len(o.token_ids) for o in want] == [4, 2]
    daemon.send(ident, P.Shutdown())
    assert wait_exit(proc) == 0, log_of(proc)


def test_second_signal_abandons_running_batch(daemon, spawn):
    # A 100 s batch: only abandoning it lets the worker exit within PATIENCE.
    proc = spawn(daemon.endpoint, "w7", "--decode-s", "1.0")
    ident, _ = register(daemon)
    batch = P.BatchMsg(
        batch_id=8,
        slice_len=100,
        requests=[P.BatchRequest(rid="z", token_ids=[8], max_new_tokens=100, ignore_eos=True)],
    )
    daemon.send(ident, batch)
    while not daemon.recv(P.Heartbeat)[1].busy:
        pass
    proc.send_signal(signal.SIGTERM)
    daemon.recv(P.Heartbeat)  # still alive and beating after the first signal
    proc.send_signal(signal.SIGTERM)
    assert wait_exit(proc) == 0, log_of(proc)
    assert "abandon" in log_of(proc)


def test_registers_again_after_daemon_restart(ipc_dir, spawn):
    endpoint = f"ipc://{ipc_dir}/restart.ipc"
    first = Daemon(endpoint)
    proc = spawn(endpoint, "w8")
    try:
        register(first)
        first.recv(P.Heartbeat)
    finally:
        first.close()  # the daemon goes away ...
    second = Daemon(endpoint)  # ... and a new one (knowing nothing) takes its place
    try:
        ident, reg = register(second)
        assert reg.worker_id == "w8"
        job = P.BatchMsg(
            batch_id=1,
            slice_len=2,
            requests=[P.BatchRequest(rid="r", token_ids=[6], max_new_tokens=2, temperature=0.0)],
        )
        second.send(ident, job)
        assert whole(second, second.recv(P.Result)[1]) == expected(job)
        second.send(ident, P.Shutdown())
        assert wait_exit(proc) == 0, log_of(proc)
    finally:
        second.close()


# --------------------------------------------------------------------------- auth, parent


def secret_file(d: Path, text: str, mode: int) -> Path:
    path = d / f"secret-{mode:o}"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_secret_file_is_sent_as_auth(daemon, spawn, ipc_dir):
    path = secret_file(ipc_dir, "  00ff10ab\n", 0o600)
    proc = spawn(daemon.endpoint, "w9", "--secret-file", str(path), "--vocab", "321")
    ident, reg = register(daemon)
    assert reg.auth == "00ff10ab" and reg.vocab_size == 321
    daemon.send(ident, P.Shutdown())
    assert wait_exit(proc) == 0, log_of(proc)


def test_secret_file_from_the_environment(daemon, spawn, ipc_dir):
    path = secret_file(ipc_dir, "beef", 0o400)
    proc = spawn(daemon.endpoint, "w10", env={"SCLSD_WORKER_SECRET_FILE": str(path)})
    ident, reg = register(daemon)
    assert reg.auth == "beef"
    daemon.send(ident, P.Shutdown())
    assert wait_exit(proc) == 0, log_of(proc)


def test_secret_file_open_to_others_is_refused(daemon, spawn, ipc_dir):
    path = secret_file(ipc_dir, "00ff10ab", 0o644)
    proc = spawn(daemon.endpoint, "w11", "--secret-file", str(path))
    assert wait_exit(proc) == 2
    assert "mode 0644" in log_of(proc) and str(path) in log_of(proc)


def gone(pid: int) -> bool:
    """The process has exited (a zombie counts: it runs no more, its reaper may be slow)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False
    return stat.rpartition(")")[2].split()[0] in ("Z", "X")


PARENT = """
import os, signal, subprocess, sys
log = open(sys.argv[1], "wb")
subprocess.Popen(sys.argv[2:] + ["--parent-pid", str(os.getpid())],
                 stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
signal.pause()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_worker_dies_with_its_parent(daemon, ipc_dir):
    log_path = ipc_dir / "orphan.log"
    cmd = worker_command(daemon.endpoint, "w12")
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(log_path), *cmd])
    worker_pid = 0
    try:
        ident, reg = register(daemon)
        worker_pid = reg.pid
        assert worker_pid != parent.pid
        parent.kill()  # SIGKILL: the parent gets no chance to clean up
        parent.wait(PATIENCE)
        deadline = time.monotonic() + PATIENCE
        while not gone(worker_pid) and time.monotonic() < deadline:
            time.sleep(0.05)  # a bounded poll of the pid, not a synchronisation
        assert gone(worker_pid), log_path.read_text(errors="replace")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if worker_pid and not gone(worker_pid):
            os.kill(worker_pid, signal.SIGKILL)


def test_parent_already_gone_exits_at_once(daemon, spawn):
    done = subprocess.Popen(["true"])
    done.wait()  # a pid that is nobody's parent any more
    proc = spawn(daemon.endpoint, "w13", "--parent-pid", str(done.pid))
    assert wait_exit(proc) == 1
    assert f"parent process {done.pid} is gone" in log_of(proc)
