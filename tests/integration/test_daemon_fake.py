"""Daemon + fake workers as real processes: many concurrent streams, bad input."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from sclsd import protocol as P

from .harness import start_daemon
from .opshelp import wait_settled
from .rawclient import Raw


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    d = start_daemon(tmp_path_factory.mktemp("fake"), workers=2, slice_len=8,
                     daemon={"max_frame_bytes": 65536, "max_conn_buffer_bytes": 1048576},
                     worker_opts={"decode_s": 0.0005})
    yield d
    assert d.stop() == 0, d.log_text()


def test_200_concurrent_streams_each_end_exactly_once(daemon) -> None:
    rng = random.Random(7)
    specs = []
    for i in range(200):
        specs.append(P.Generate(
            id=f"c{i:03d}",
            prompt_ids=[rng.randrange(256) for _ in range(rng.randint(1, 60))],
            max_tokens=rng.randint(1, 40),
            ignore_eos=rng.random() < 0.5,
            temperature=0.0,
        ))

    async def run() -> list[Raw]:
        conns = [await Raw.open(daemon.sock) for _ in range(10)]
        for i, g in enumerate(specs):
            conns[i % 10].send(g)
        await asyncio.gather(*(c.until_terminal({g.id for j, g in enumerate(specs) if j % 10 == k})
                               for k, c in enumerate(conns)))
        # Anything after the terminal event would be a duplicate: once no batch is out, a
        # ping round trip on each connection brings in everything the daemon sent.
        await asyncio.to_thread(wait_settled, daemon)
        for c in conns:
            c.send(P.Ping(nonce=99))
            while not isinstance(await c.recv(), P.Pong):
                pass
            await c.close()
        return conns

    conns = asyncio.run(run())
    events = {}
    for c in conns:
        events.update({k: v for k, v in c.events.items() if k is not None})
    assert set(events) == {g.id for g in specs}
    for g in specs:
        evs = events[g.id]
        assert isinstance(evs[0], P.Accepted), evs[:2]
        assert isinstance(evs[-1], P.Done), evs[-1]
        assert sum(isinstance(e, (P.Done, P.Error)) for e in evs) == 1
        done = evs[-1]
        streamed = [t for e in evs if isinstance(e, P.Delta) for t in e.token_ids]
        assert len(streamed) == done.usage.completion_tokens
        assert done.usage.prompt_tokens == len(g.prompt_ids)
        assert 1 <= done.usage.completion_tokens <= g.max_tokens
        if g.ignore_eos:
            assert done.usage.completion_tokens == g.max_tokens and done.finish_reason == "length"
        # Slices of S = 8; a newcomer placed beside waiting work first runs S / 8 = 1 token
        # (core.policy.FIRST_SLICE_DIVISOR), which can add one slice.
        n = done.usage.completion_tokens
        assert done.finish_reason == "stop" or done.timings.slices in (-(-n // 8), 1 + -(-(n - 1) // 8))
    st = daemon.status()
    assert st.live_requests == 0 and st.queued_tokens == 0


def test_bad_input_gets_errors_and_hurts_no_one(daemon) -> None:
    async def run() -> None:
        good = await Raw.open(daemon.sock)
        good.send(P.Generate(id="bystander", prompt_ids=[1, 2, 3], max_tokens=30, ignore_eos=True))
        bad = await Raw.open(daemon.sock)

        async def expect(code: str) -> P.Error:
            ev = await bad.recv()
            assert isinstance(ev, P.Error), ev
            assert ev.code == code, ev
            assert ev.message
            return ev

        bad.send_bytes(b"\xc1\xc1\xc1")  # not msgpack
        await expect("bad_frame")
        bad.send_obj({"type": "explode"})
        await expect("unknown_type")
        bad.send_obj({"type": "generate", "prompt": 42})
        await expect("bad_request")
        bad.send_obj({"type": "cancel"})
        await expect("bad_request")
        bad.send_obj({"type": "generate", "prompt": "x", "temperature": -0.5})
        await expect("bad_request")
        bad.send_obj({"type": "generate", "prompt": "x", "top_p": 1.5})
        await expect("bad_request")
        bad.send_obj({"type": "generate", "prompt": "x", "max_tokens": 0})
        await expect("bad_request")
        bad.send_obj({"type": "generate", "prompt": "x", "prompt_ids": [1]})
        await expect("bad_request")
        bad.send_obj({"type": "generate"})
        await expect("bad_request")
        bad.send_obj({"type": "generate", "prompt_ids": [1, 5000]})
        await expect("bad_request")
        bad.send_obj({"type": "generate", "prompt_ids": [7] * 1025})
        await expect("prompt_too_long")
        # Ids are the connection's own: the bystander's is free here, a live one of its own is not,
        # and a cancel reaches its own request only.
        bad.send(P.Generate(id="bystander", prompt_ids=[1], max_tokens=1000, ignore_eos=True, stream=False))
        assert isinstance(await bad.recv(), P.Accepted)
        bad.send(P.Generate(id="bystander", prompt_ids=[1], max_tokens=1))
        await expect("duplicate_id")
        bad.send(P.Cancel(id="bystander"))
        done = await bad.recv()
        assert isinstance(done, P.Done) and done.finish_reason == "cancelled", done
        bad.send(P.Cancel(id="nobody"))
        await expect("unknown_id")
        # Deeply nested garbage is rejected, not recursed into.
        nested: object = 0
        for _ in range(200):
            nested = [nested]
        bad.send_obj({"type": "generate", "prompt": nested})
        await expect("bad_request")
        # The connection survived all of that.
        bad.send(P.Ping(nonce=5))
        assert isinstance(await bad.recv(), P.Pong)
        # An oversized frame: error, then the daemon closes this connection.
        bad.send_bytes(b"\x00" * 16, declared=10_000_000)
        await expect("frame_too_large")
        with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
            await bad.recv(timeout=5)
        await good.until_terminal({"bystander"})
        evs = good.events["bystander"]
        assert isinstance(evs[-1], P.Done) and evs[-1].usage.completion_tokens == 30
        assert not any(isinstance(e, P.Error) for e in evs)
        await good.close()

    asyncio.run(run())
    assert daemon.proc.poll() is None


def test_text_prompt_and_non_streaming(daemon) -> None:
    from sclsd.client import Client

    with Client(daemon.sock, timeout=30) as c:
        assert c.ping().protocol == P.PROTOCOL_VERSION
        done = c.complete(prompt="hello", max_tokens=5, ignore_eos=True)
    assert done.usage.prompt_tokens == 5  # byte tokenizer of the fake model
    assert len(done.token_ids) == 5 and isinstance(done.text, str)
    assert done.finish_reason == "length"


def test_status_and_metrics(daemon) -> None:
    from sclsd.client import status

    st = daemon.status()
    assert {w.id for w in st.workers} == {"w0", "w1"}
    assert all(w.engine == "fake" and w.state == "active" for w in st.workers)
    assert st.policy == "scls" and st.slice_len == 8
    # The fake workers' exact cost profile (decode_s = 0.0005 per iteration) replaced the default.
    assert st.estimator["d4"] == pytest.approx(0.0005) and st.estimator["p1"] == 0.0
    text = status(daemon.status_sock, metrics=True)
    assert "sclsd:num_requests_waiting" in text
    assert "sclsd:e2e_request_latency_seconds_bucket" in text
    assert 'sclsd:worker_load_seconds{model_name="fake",worker="w0"}' in text


def test_status_socket_is_read_only(daemon) -> None:
    async def run() -> None:
        s = await Raw.open(daemon.status_sock)
        s.send(P.Generate(prompt="x"))
        ev = await s.recv()
        assert isinstance(ev, P.Error) and ev.code == "unknown_type"
        await s.close()

    asyncio.run(run())


def test_socket_mode(daemon) -> None:
    assert (Path(daemon.sock).stat().st_mode & 0o777) == 0o660
