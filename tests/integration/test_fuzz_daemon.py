"""Property-based fuzzing of every decoder and of the live daemon's three sockets.

Decoders: whatever the bytes (random, truncated, wrong types, huge declared
lengths, deep nesting), decoding returns a message or raises one of
``protocol.DecodeError``: nothing else can escape into a handler.

Live daemon: the offending peer gets an ``error`` (or is disconnected), the
daemon stays up, its workers stay registered and a bystander's request is
served as if nothing happened.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sclsd import protocol as P

from .opshelp import start, stop, wait_for

DECODERS = {
    "client": P.client_decoder,
    "server": P.server_decoder,
    "status": P.status_decoder,
    "status_reply": P.status_reply_decoder,
    "worker": P.worker_decoder,
    "to_worker": P.to_worker_decoder,
}

MESSAGES = [P.Generate, P.Cancel, P.Ping, P.DrainWorker, P.Accepted, P.Delta, P.Done, P.Error, P.Pong,
            P.WorkerStateReply, P.StatusRequest, P.MetricsRequest, P.StatusReply, P.MetricsReply,
            P.Register, P.Welcome, P.Heartbeat, P.BatchMsg, P.Result, P.Drain, P.Shutdown, P.Resume,
            P.Reregister]
TAGS = [m.__struct_config__.tag for m in MESSAGES]
FIELDS = sorted({f for m in MESSAGES for f in m.__struct_fields__})

scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=True)
           | st.text(max_size=40) | st.binary(max_size=40))
values = st.recursive(scalars, lambda kids: st.lists(kids, max_size=6)
                      | st.dictionaries(st.text(max_size=12), kids, max_size=6), max_leaves=30)
# Maps that look like messages: a known (or random) type and known field names with any values.
typed_maps = st.builds(
    lambda tag, fields: {"type": tag, **fields},
    st.sampled_from(TAGS) | st.text(max_size=12) | st.integers(-(2**63), 2**63 - 1),
    st.dictionaries(st.sampled_from(FIELDS), values, max_size=8),
)


def _valid_encodings() -> list[bytes]:
    return [P.encode(m) for m in (
        P.Generate(prompt="hi", max_tokens=3), P.Cancel(id="x"), P.Ping(nonce=3),
        P.StatusRequest(), P.Register(worker_id="w9", engine="fake", model="m", device="cpu",
                                      kv_bytes_per_token=1, mem_available=1, pid=1),
        P.Heartbeat(worker_id="w9"), P.Result(worker_id="w9", batch_id=1),
        P.BatchMsg(batch_id=1, slice_len=2, requests=[P.BatchRequest(rid="r", token_ids=[1],
                                                                     max_new_tokens=1)]),
    )]


truncated = st.builds(lambda body, cut: body[:cut], st.sampled_from(_valid_encodings()),
                      st.integers(0, 200))
# msgpack headers that declare far more than follows: array32, map32, str32, bin32, ext32.
huge = st.builds(lambda head, tail: head + b"\xff\xff\xff\xff" + tail,
                 st.sampled_from([b"\xdd", b"\xdf", b"\xdb", b"\xc6", b"\xc9"]), st.binary(max_size=16))
deep = st.builds(lambda n, opener: opener * n + b"\xc0", st.integers(100, 5000),
                 st.sampled_from([b"\x91", b"\x81\xa1a"]))
bodies = (st.binary(max_size=300) | typed_maps.map(msgspec.msgpack.encode)
          | values.map(msgspec.msgpack.encode) | truncated | huge | deep)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=bodies)
def test_decoders_only_ever_raise_decode_errors(body: bytes) -> None:
    for decoder in DECODERS.values():
        try:
            decoder.decode(body)
        except P.DecodeError:
            pass


@pytest.mark.parametrize("name", list(DECODERS))
def test_deep_nesting_and_huge_lengths_are_decode_errors(name: str) -> None:
    dec = DECODERS[name]
    profile_bomb = msgspec.msgpack.encode({"type": "register", "worker_id": "w", "engine": "e", "model": "m",
                                           "device": "d", "kv_bytes_per_token": 1, "mem_available": 1,
                                           "pid": 1, "profile": {"x": 0}})
    profile_bomb = profile_bomb.replace(b"\x81\xa1x\x00", b"\x81\xa1x" + b"\x91" * 100_000 + b"\x00")
    for body in (b"\x91" * 1_000_000 + b"\x00", b"\xdd\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xffabc",
                 profile_bomb, b"", b"\xc1"):
        t0 = time.monotonic()
        with pytest.raises(P.DecodeError):
            dec.decode(body)
        assert time.monotonic() - t0 < 5


# --------------------------------------------------------------------------- the live daemon


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    d = start(tmp_path_factory.mktemp("fuzz"),
              daemon={"max_frame_bytes": 65536, "max_conn_buffer_bytes": 1 << 20,
                      "max_worker_msg_bytes": 1 << 20, "log_level": "info"})
    yield d
    assert stop(d) == 0, d.log_text()


def _recv_frame(s: socket.socket) -> bytes | None:
    head = b""
    while len(head) < 4:
        chunk = s.recv(4 - len(head))
        if not chunk:
            return None
        head += chunk
    (n,) = P.FRAME_HEADER.unpack(head)
    body = b""
    while len(body) < n:
        chunk = s.recv(n - len(body))
        if not chunk:
            return None
        body += chunk
    return body


def _bystander(d) -> None:
    """A well-behaved client is served normally, and both workers are still there."""
    from sclsd.client import Client

    with Client(d.sock, timeout=30) as c:
        done = c.complete(prompt_ids=[9, 8, 7], max_tokens=5, ignore_eos=True)
    assert done.finish_reason == "length" and len(done.token_ids) == 5
    assert {w.id for w in d.status().workers} == {"w0", "w1"}
    assert d.proc.poll() is None


def _resume_all(d) -> None:
    # A fuzzed drain_worker could name a real worker: put them back.
    from sclsd.client import Client

    with Client(d.sock, timeout=30) as c:
        for w in ("w0", "w1"):
            c.drain_worker(w, resume=True)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(bodies=st.lists(bodies, min_size=1, max_size=4))
def test_client_socket_answers_garbage_with_errors(daemon, bodies: list[bytes]) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(daemon.sock)
        s.sendall(b"".join(P.FRAME_HEADER.pack(len(b)) + b for b in bodies) + P.frame(P.Ping(nonce=77)))
        while True:
            raw = _recv_frame(s)
            assert raw is not None, "the daemon closed a connection whose frames were all in bounds"
            ev = P.server_decoder.decode(raw)
            if isinstance(ev, P.Pong) and ev.nonce == 77:
                break
            # Garbage gets errors; a body that happens to be a valid message gets its answer.
            assert isinstance(ev, (P.Error, P.Accepted, P.Delta, P.Done, P.Pong, P.WorkerStateReply)), ev
            if isinstance(ev, P.Error):
                assert ev.code in {"bad_frame", "unknown_type", "bad_request", "unknown_id", "duplicate_id",
                                   "prompt_too_long", "unknown_worker", "forbidden", "overloaded"}, ev


def test_client_socket_after_fuzzing(daemon) -> None:
    _resume_all(daemon)
    _bystander(daemon)


def test_truncated_frame_then_hangup_and_oversized_header(daemon) -> None:
    for _ in range(20):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(daemon.sock)
            s.sendall(P.FRAME_HEADER.pack(1000) + b"\x82\xa4type")  # promises 1000 bytes, sends 7
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(daemon.sock)
        s.sendall(P.FRAME_HEADER.pack(0xFFFFFFFF) + b"\x00" * 64)
        ev = P.server_decoder.decode(_recv_frame(s) or b"")
        assert isinstance(ev, P.Error) and ev.code == "frame_too_large"
        assert _recv_frame(s) is None  # and the connection is closed
    _bystander(daemon)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(bodies=st.lists(bodies, min_size=1, max_size=3))
def test_status_socket_answers_garbage_with_errors(daemon, bodies: list[bytes]) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(daemon.status_sock)
        s.sendall(b"".join(P.FRAME_HEADER.pack(len(b)) + b for b in bodies) + P.frame(P.StatusRequest()))
        while True:
            raw = _recv_frame(s)
            assert raw is not None
            ev = P.status_reply_decoder.decode(raw)
            if isinstance(ev, P.StatusReply):
                break
            assert isinstance(ev, (P.Error, P.MetricsReply)), ev


def _dealer(ctx: zmq.Context, endpoint: str, ident: bytes) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, ident)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    return s


def _send_bad_worker_message(d) -> None:
    """Send one undecodable worker message and wait until the daemon counted it."""
    before = d.status().counters["bad_worker_messages"]
    s = _dealer(zmq.Context.instance(), d.endpoint, b"garbage")
    try:
        s.send(b"\xc1")  # never valid msgpack
        wait_for(lambda: d.status().counters["bad_worker_messages"] > before, 10, "bad message counted", d)
    finally:
        s.close(0)


def test_worker_socket_survives_garbage(daemon) -> None:
    ctx = zmq.Context.instance()

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(messages=st.lists(st.lists(bodies, min_size=1, max_size=3), min_size=1, max_size=5),
           ident=st.binary(min_size=1, max_size=20).filter(lambda b: b[0] != 0 and b not in (b"w0", b"w1")))
    def fuzz(messages: list[list[bytes]], ident: bytes) -> None:
        s = _dealer(ctx, daemon.endpoint, ident)
        for frames in messages:
            s.send_multipart(frames)
        s.close(linger=1000)  # what is queued still goes out, in the background
        assert daemon.proc.poll() is None

    fuzz()
    # Then a message of a peer of its own, counted only once the daemon got to it: the
    # daemon's receive loop is still alive after everything above.
    _send_bad_worker_message(daemon)
    _bystander(daemon)


def test_bad_worker_message_is_counted_and_dropped(daemon) -> None:
    _send_bad_worker_message(daemon)
    _bystander(daemon)


def test_unknown_worker_is_asked_to_register_and_impostors_are_ignored(daemon) -> None:
    ctx = zmq.Context.instance()
    s = _dealer(ctx, daemon.endpoint, b"ghost")
    try:
        s.send(P.encode(P.Heartbeat(worker_id="ghost")))
        assert s.poll(10_000), "no answer to an unknown worker's heartbeat"
        assert isinstance(P.to_worker_decoder.decode(s.recv()), P.Reregister)
        # A register whose protocol we do not speak is refused with a shutdown.
        s.send(P.encode(P.Register(worker_id="ghost", engine="fake", model="m", device="cpu",
                                   kv_bytes_per_token=1, mem_available=1, pid=1, protocol=999)))
        assert s.poll(10_000)
        assert isinstance(P.to_worker_decoder.decode(s.recv()), P.Shutdown)
        # A register under another worker's name (and without the worker secret) is refused.
        pid = {w.id: w.pid for w in daemon.status().workers}["w0"]
        s.send(P.encode(P.Register(worker_id="w0", engine="fake", model="m", device="cpu",
                                   kv_bytes_per_token=1, mem_available=1, pid=1)))
        assert s.poll(10_000), "no answer to an impostor's register"
        assert isinstance(P.to_worker_decoder.decode(s.recv()), P.Shutdown)
    finally:
        s.close(0)
    assert {w.id: w.pid for w in daemon.status().workers}["w0"] == pid  # not taken over
    assert "ghost" not in {w.id for w in daemon.status().workers}
    assert "registration refused" in daemon.log.read_text()
    _bystander(daemon)


def test_nesting_bomb_in_a_worker_profile_is_dropped(daemon) -> None:
    # Register.profile is free-form: msgspec recurses into it and gives up with a
    # RecursionError, which must count as a bad message, not kill the receive loop.
    body = msgspec.msgpack.encode({"type": "register", "worker_id": "bomb", "engine": "e", "model": "m",
                                   "device": "d", "kv_bytes_per_token": 1, "mem_available": 1, "pid": 1,
                                   "profile": {"x": 0}})
    body = body.replace(b"\x81\xa1x\x00", b"\x81\xa1x" + b"\x91" * 200_000 + b"\x00")
    before = daemon.status().counters["bad_worker_messages"]
    s = _dealer(zmq.Context.instance(), daemon.endpoint, b"bomb")
    try:
        s.send(body)
        wait_for(lambda: daemon.status().counters["bad_worker_messages"] > before, 10, "bomb dropped", daemon)
    finally:
        s.close(0)
    _bystander(daemon)


def test_oversized_worker_message_drops_only_that_peer(daemon) -> None:
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, b"bomber")
    s.setsockopt(zmq.LINGER, 0)
    mon = s.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)  # before connecting
    s.connect(daemon.endpoint)
    try:
        events: list[int] = []

        def next_event(timeout_ms: int = 10_000) -> Any:
            assert mon.poll(timeout_ms), f"no socket event (so far {events})"
            from zmq.utils.monitor import recv_monitor_message

            ev = recv_monitor_message(mon)["event"]
            events.append(ev)
            return ev

        assert next_event() == zmq.EVENT_CONNECTED
        s.send(b"\x00" * (2 << 20))  # 2 MiB > max_worker_msg_bytes (1 MiB)
        assert next_event() == zmq.EVENT_DISCONNECTED  # libzmq dropped us
    finally:
        s.disable_monitor()
        mon.close(0)
        s.close(0)
    wait_for(lambda: daemon.proc.poll() is None, 1)
    _bystander(daemon)
