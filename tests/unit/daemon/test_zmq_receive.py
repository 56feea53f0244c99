"""The workers' ROUTER reads what is queued in bursts: every message arrives, once, in the
order each worker sent it, and a malformed one among them is dropped alone."""

from __future__ import annotations

import asyncio
from pathlib import Path

import zmq
import zmq.asyncio

from sclsd import protocol as P
from sclsd.daemon.transport.zmq_router import DRAIN_BATCH, ZmqTransport

from .conftest import make_config


class Sink:
    def __init__(self, want: int) -> None:
        self.got: list[tuple[bytes, P.WorkerMsg]] = []
        self.want = want
        self.all_in = asyncio.Event()

    def on_message(self, peer: bytes, msg: P.WorkerMsg) -> None:
        self.got.append((peer, msg))
        if len(self.got) >= self.want:
            self.all_in.set()


def test_a_burst_from_two_workers_arrives_whole_and_in_order(tmp_path: Path) -> None:
    n = 5 * DRAIN_BATCH + 3  # several drains' worth each

    async def main() -> None:
        cfg = make_config(tmp_path)
        transport = ZmqTransport(cfg)
        sink = Sink(2 * n)
        await transport.start(sink)
        ctx = zmq.asyncio.Context()
        try:
            socks = []
            for wid in ("w0", "w1"):
                s = ctx.socket(zmq.DEALER)
                s.connect(cfg.daemon.worker_endpoint)
                socks.append((wid, s))
            for i in range(n):  # interleaved, all queued before the daemon's loop runs again
                for wid, s in socks:
                    s.send(P.encode(P.Tokens(worker_id=wid, batches=[P.BatchTokens(batch_id=i, outputs=[])])),
                           zmq.NOBLOCK)
                    if i == n // 2:
                        s.send(b"\xc1 not msgpack", zmq.NOBLOCK)
            await asyncio.wait_for(sink.all_in.wait(), 10)
            for wid, _ in socks:
                mine = [m for _, m in sink.got if isinstance(m, P.Tokens) and m.worker_id == wid]
                assert [m.batches[0].batch_id for m in mine] == list(range(n))
            assert len(sink.got) == 2 * n and transport.bad_messages == 2
            for _, s in socks:
                s.close(0)
        finally:
            ctx.term()
            await transport.stop()

    asyncio.run(main())
