"""The worker's link to its daemon, in process: a WorkerRuntime (fake engine) on a thread
against a bare ROUTER bound by the test."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

zmq = pytest.importorskip("zmq")

from sclsd import protocol as P  # noqa: E402
from worker.engines.fake import FakeEngine  # noqa: E402
from worker.runtime import RuntimeOptions, WorkerRuntime  # noqa: E402

#: Generous deadline for things that must happen (never asserted as a duration).
PATIENCE = 30.0


class Router:
    """The test's stand-in for the daemon: a ROUTER that keeps messages in arrival order."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.endpoint = endpoint
        self.backlog: list[tuple[bytes, object]] = []

    def recv(
        self, kind: type | tuple[type, ...], keepalive: bytes | None = None
    ) -> tuple[bytes, object]:
        """The oldest message of ``kind`` with its routing id; others stay in the backlog.

        ``keepalive``: answer every heartbeat from that routing id with a Keepalive while
        waiting, as a live daemon would.
        """
        for i, (ident, msg) in enumerate(self.backlog):
            if isinstance(msg, kind):
                del self.backlog[i]
                return ident, msg
        deadline = time.monotonic() + PATIENCE
        while time.monotonic() < deadline:
            if self.sock.poll(100):
                ident, body = self.sock.recv_multipart()
                msg = P.worker_decoder.decode(body)
                if isinstance(msg, kind):
                    return ident, msg
                if isinstance(msg, P.Heartbeat) and ident == keepalive:
                    self.send(ident, P.Keepalive())
                if not isinstance(msg, P.Heartbeat):  # heartbeats are only ever wanted fresh
                    self.backlog.append((ident, msg))
        raise AssertionError(f"no {kind} within {PATIENCE}s")

    def send(self, ident: bytes, msg: object) -> None:
        self.sock.send_multipart([ident, P.encode(msg)])

    def welcome(self, hb: float = 0.2) -> tuple[bytes, P.Register]:
        ident, reg = self.recv(P.Register)
        self.send(ident, P.Welcome(heartbeat_interval_s=hb))
        return ident, reg  # type: ignore[return-value]

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def router() -> Iterator[Router]:
    # ipc:// paths are limited to about 107 bytes, so not pytest's deep tmp_path.
    d = Path(tempfile.mkdtemp(prefix="wl-", dir=os.environ.get("SCLSD_TEST_TMP", "/tmp")))
    r = Router(f"ipc://{d}/w.ipc")
    yield r
    r.close()
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def start(router: Router) -> Iterator:
    """Start a worker runtime on a thread; it is abandoned (no batch waited for) at teardown."""
    running: list[tuple[WorkerRuntime, threading.Thread]] = []

    def go(engine: FakeEngine | None = None, **opts: object) -> WorkerRuntime:
        rt = WorkerRuntime(
            engine or FakeEngine(),
            RuntimeOptions(endpoint=router.endpoint, worker_id="w0", **opts),  # type: ignore[arg-type]
        )
        t = threading.Thread(target=rt.run, name="worker-receive", daemon=True)
        t.start()
        running.append((rt, t))
        return rt

    yield go
    for rt, t in running:
        rt.request_stop("test over", abandon=True)
        t.join(PATIENCE)
        assert not t.is_alive()


def batch(batch_id: int, iterations: int = 2) -> P.BatchMsg:
    req = P.BatchRequest(
        rid=f"r{batch_id}",
        token_ids=[5, batch_id + 3],
        max_new_tokens=iterations,
        ignore_eos=True,
        temperature=0.0,
    )
    return P.BatchMsg(batch_id=batch_id, slice_len=iterations, requests=[req])


def test_register_carries_auth_and_vocab_on_a_daemon_chosen_routing_id(router, start):
    start(FakeEngine(vocab=500), auth="00c0ffee")
    ident, reg = router.welcome()
    assert reg.worker_id == "w0"
    assert reg.auth == "00c0ffee" and reg.vocab_size == 500
    # The ROUTER chose the routing id: the worker id is not a peer-chosen identity.
    assert ident != b"w0"


def test_batch_is_acknowledged_before_its_result(router, start):
    start()
    ident, _ = router.welcome()
    router.send(ident, batch(7))
    _, first = router.recv((P.BatchAck, P.Result))
    assert first == P.BatchAck(worker_id="w0", batch_id=7)
    _, res = router.recv(P.Result)
    assert res.batch_id == 7 and res.error is None


def test_keepalives_hold_the_link_and_silence_restarts_it(router, start):
    timeout = 1.5
    # 100 iterations of 0.06 s: batch 1 runs for 6 s, well past the silence.
    start(FakeEngine(decode_s=0.06), daemon_timeout_s=timeout)
    ident, _ = router.welcome(hb=0.1)

    # Keepalives (one per heartbeat received) for two silence timeouts: no re-register.
    until = time.monotonic() + 2 * timeout
    while time.monotonic() < until:
        router.recv(P.Heartbeat)
        router.send(ident, P.Keepalive())
    assert not [m for _, m in router.backlog if isinstance(m, P.Register)]

    # A long batch starts, a second one queues behind it; then the daemon falls silent.
    router.send(ident, batch(1, iterations=100))
    router.send(ident, batch(2))
    acked = {router.recv(P.BatchAck)[1].batch_id for _ in range(2)}
    assert acked == {1, 2}

    again, reg = router.welcome(hb=0.1)
    assert reg.worker_id == "w0"
    assert again != ident  # a fresh connection, so a fresh routing id
    beat_from, beat = router.recv(P.Heartbeat)
    assert beat_from == again and beat.busy and beat.queued_batches == 0  # batch 2 dropped
    router.send(again, batch(3))
    # Batch 2 was queued before batch 3: were it served, its result would come first.
    seen = []
    while not seen or seen[-1] != 3:
        ident_res, res = router.recv(P.Result, keepalive=again)
        assert ident_res == again and res.error is None
        seen.append(res.batch_id)
    assert 2 not in seen
    assert set(seen) <= {1, 3}  # the running batch may still report on the new connection


def test_refused_batch_gets_an_error_result_and_no_ack(router, start):
    start()
    ident, _ = router.welcome()
    router.send(ident, P.Drain())
    router.send(ident, batch(4))
    _, res = router.recv(P.Result)
    assert res.batch_id == 4 and res.error and "draining" in res.error
    router.send(ident, P.Resume())
    router.send(ident, batch(5))
    _, res = router.recv(P.Result)
    assert res.batch_id == 5 and res.error is None
    acks = [m.batch_id for _, m in router.backlog if isinstance(m, P.BatchAck)]
    assert acks == [5]


def wait_until(pred, what: str) -> None:
    """Poll ``pred`` (state another thread changes) until it holds, within PATIENCE."""
    deadline = time.monotonic() + PATIENCE
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {PATIENCE}s")
        time.sleep(0.01)


def unfinished(batch_id: int, iterations: int) -> P.BatchMsg:
    """A batch whose one row outlives the slice (its worker keeps its KV)."""
    req = P.BatchRequest(rid=f"r{batch_id}", token_ids=[5, 6], max_new_tokens=100, ignore_eos=True,
                         temperature=0.0)
    return P.BatchMsg(batch_id=batch_id, slice_len=iterations, requests=[req])


def test_tokens_stream_before_the_result_and_release_drops_kept_kv(router, start):
    eng = FakeEngine(decode_s=0.01)
    start(eng)
    ident, _ = router.welcome()
    router.send(ident, unfinished(9, 12))
    streamed: list[list[int]] = []
    while True:
        _, msg = router.recv((P.Tokens, P.Result), keepalive=ident)
        if isinstance(msg, P.Result):
            break
        (part,) = msg.batches
        assert part.batch_id == 9 and msg.worker_id == "w0" and [o.rid for o in part.outputs] == ["r9"]
        # Each part starts where the previous one ended: the stream's sequence number.
        assert part.outputs[0].start == sum(map(len, streamed))
        streamed.append(part.outputs[0].token_ids)
    (out,) = msg.outputs
    assert len(streamed) >= 3  # 12 steps of 10 ms, at most one message per 20 ms
    flat = [t for ts in streamed for t in ts]
    # The result carries only what no tokens message did: the slice is the two together.
    assert out.start == len(flat) and len(flat) + len(out.token_ids) == 12
    assert flat + out.token_ids == FakeEngine().serve(unfinished(9, 12))[0][0].token_ids
    assert out.finish_reason is None and out.kv_tokens == 2 + 12 - 1
    assert eng.kv is not None and eng.kv.store.held() == {"r9": 13}
    router.send(ident, P.Release(rids=["r9"]))
    wait_until(lambda: eng.kv.store.held() == {}, "release")


def test_registering_again_drops_all_kept_kv(router, start):
    eng = FakeEngine()
    start(eng)
    ident, _ = router.welcome()
    router.send(ident, unfinished(3, 4))
    router.recv(P.Result)
    assert eng.kv is not None and set(eng.kv.store.held()) == {"r3"}
    router.send(ident, P.Reregister())  # the daemon forgot us, and what we hold
    router.welcome()
    assert eng.kv.store.held() == {}


def test_a_slow_first_register_goes_out_once_and_a_resend_is_the_same_message(router, start,
                                                                             monkeypatch):
    # Building the first Register takes longer than the retry interval (a slow first import
    # on a busy machine): the retry timer starts after the send, so one Register goes out
    # and no second follows at once.
    monkeypatch.setenv("SCLSD_WORKER_REGISTER_DELAY_S", "1.0")
    eng = FakeEngine()
    released: list[object] = []
    real_release = eng.release

    def release(rids=None):  # noqa: ANN001, ANN202 - a spy on the engine's hook
        released.append(rids)
        real_release(rids)

    eng.release = release  # type: ignore[method-assign]
    start(eng, register_retry_s=0.5)
    ident, first = router.recv(P.Register)
    sent_at = time.monotonic()
    # No Welcome: the worker sends Register again, but only a retry interval after the send.
    again_ident, again = router.recv(P.Register)
    assert time.monotonic() - sent_at >= 0.4
    assert again_ident == ident and again == first
    assert released == [None]  # built once: kept KV dropped once, not at every re-send
    router.send(ident, P.Welcome(heartbeat_interval_s=0.1))
    _, beat = router.recv(P.Heartbeat)
    assert beat.worker_id == "w0"


def test_heartbeats_name_the_batches_held_and_how_long_the_engine_has_not_moved(router, start):
    start(FakeEngine(decode_s=0.05))
    ident, _ = router.welcome(hb=0.1)
    _, idle = router.recv(P.Heartbeat)
    assert idle.batches == [] and idle.stalled_s == 0.0
    router.send(ident, batch(11, iterations=60))  # about 3 s of steps, each one progress
    router.send(ident, batch(12))
    router.recv(P.BatchAck)
    seen: list[P.Heartbeat] = []
    while len(seen) < 5:
        _, beat = router.recv(P.Heartbeat, keepalive=ident)
        if beat.batches:
            seen.append(beat)
    assert all(b.batches == [11, 12] for b in seen)  # running and queued behind it
    assert all(b.stalled_s < 1.0 for b in seen)  # it moves: tokens every step
