"""What streams tokens never waits behind what admits requests: with every admission thread
held (a client's huge prompt or grammar), a running stream still gets its deltas and ends."""

from __future__ import annotations

import threading

from sclsd import protocol as P

from .conftest import Harness, RecConn


def test_a_stream_flows_while_every_admission_thread_is_held(daemon) -> None:
    async def body(h: Harness) -> None:
        h.worker("w0", decode_s=0.001)
        await h.registered("w0")
        gate = threading.Event()
        pool = h.server.admit_pool
        held = [pool.submit(gate.wait, 30) for _ in range(pool._max_workers)]
        try:
            conn = RecConn()
            # Token ids: admitted without the pool; its text comes from detokenizing.
            await h.submit(conn, id="s", prompt_ids=[5, 6, 7], max_tokens=24, stream=True,
                           ignore_eos=True)
            await h.finished(conn, "s", timeout=10.0)
            (done,) = conn.terminal("s")
            deltas = [e for e in conn.sent if isinstance(e, P.Delta)]
            assert isinstance(done, P.Done) and done.usage.completion_tokens == 24
            assert deltas and "".join(d.text for d in deltas)  # detokenized meanwhile
            assert not any(f.done() for f in held)  # admission was held the whole time
        finally:
            gate.set()

    daemon(body)
