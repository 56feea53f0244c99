"""The daemon in-process: an :class:`InprocTransport` with ``fake`` engines, no sockets,
no processes. ``run(body)`` runs one test body on a fresh event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from sclsd import protocol as P
from sclsd.config import from_dict
from sclsd.core.policy import GRANT_POLICIES
from sclsd.daemon.server import Server
from sclsd.daemon.serving.core import ServingCore
from sclsd.daemon.serving.effects import Effects
from sclsd.daemon.serving.table import Entry, RequestTable
from sclsd.daemon.shell import Shell
from sclsd.daemon.sockets import Conn, PeerCred
from sclsd.tokenizer import ByteTokenizer
from unit.inproc import InprocTransport, InprocWorker
from worker.engines.fake import FakeEngine

TERMINAL = (P.Done, P.Error)


class RecConn(Conn):
    """A client connection that records what the daemon sends it."""

    def __init__(self, cid: int = 1, uid: int = 1000) -> None:
        super().__init__(writer=None, cid=cid, max_buffer=1 << 30, peer=PeerCred(1, uid, uid))  # type: ignore[arg-type]
        self.sent: list[Any] = []
        self.got = asyncio.Event()

    def send(self, msg: Any) -> None:
        if not self.closed:
            self.sent.append(msg)
            self.got.set()

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def events(self, rid: str, kind: type | tuple[type, ...] = object) -> list[Any]:
        return [m for m in self.sent if getattr(m, "id", None) == rid and isinstance(m, kind)]

    def terminal(self, rid: str) -> list[Any]:
        return self.events(rid, TERMINAL)

    async def wait_for(self, pred: Callable[[], bool], timeout: float = 5.0) -> None:
        """Wait until ``pred()`` holds, re-checking after each event sent to this connection."""
        await until(self.got, pred, timeout)


async def until(event: asyncio.Event, pred: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait until ``pred()`` holds, re-checking each time ``event`` is set."""
    async def loop() -> None:
        while not pred():
            event.clear()
            await event.wait()

    await asyncio.wait_for(loop(), timeout)


async def held(w: InprocWorker, n: int = 1) -> None:
    """Wait until the worker holds ``n`` batches."""
    await until(w.got, lambda: len(w.held) >= n)


class Harness:
    """A started :class:`Server` plus helpers to add workers and submit requests, and to feed
    the serving core what the shell would (a worker lost, a heartbeat tick)."""

    def __init__(self, server: Server, transport: InprocTransport) -> None:
        self.server = server
        self.transport = transport

    @property
    def shell(self) -> Shell:
        assert self.server.shell is not None, "the server is started"
        return self.server.shell

    @property
    def core(self) -> ServingCore:
        return self.shell.core

    @property
    def wake(self) -> asyncio.Event:
        """Set whenever the scheduling loop is asked to look again."""
        return self.shell.wake

    def deliver(self, eff: Effects) -> None:
        """Do what the core said, as the shell does."""
        self.shell.deliver(eff)

    @property
    def live(self) -> RequestTable:
        """The live requests."""
        return self.core.table

    def entry(self, rid: str) -> Entry:
        """The live request its client calls ``rid`` (the tests' clients use distinct ids)."""
        found = [e for e in self.live if e.client_id == rid]
        assert len(found) == 1, f"{rid} is not live" if not found else f"{rid} is live {len(found)} times"
        return found[0]

    def tick(self, now: float) -> None:
        """The heartbeat tick at ``now``: silent workers and overdue batches are lost."""
        self.deliver(self.core.tick(now))

    def lose(self, wid: str, why: str = "test", reason: P.LossReason = "exited") -> None:
        """Declare a worker lost, as a silence, a failed send or its exit would."""
        self.deliver(self.core.worker_lost(wid, why, reason, self.server.clock()))

    def drain(self, wid: str, resume: bool = False) -> None:
        """Take a worker out of rotation (or back in), as an admin's ``drain_worker`` does."""
        self.deliver(self.core.drain_worker(wid, resume, requester=RecConn(uid=0)))

    def members(self) -> dict[str, bytes]:
        """Registered workers and their peers."""
        return self.server.fleet.peers

    def worker(self, wid: str, *, auth: str | None = None, hold: bool = False, ack: bool = True,
               hold_results: bool = False, **engine: Any) -> InprocWorker:
        secret = self.server.fleet.secret if auth is None else auth
        if self.server.cfg.scheduler.policy in GRANT_POLICIES:
            engine.setdefault("batching", "continuous")  # as the supervisor spawns it
        return self.transport.connect(wid, FakeEngine(**engine), auth=secret or "", hold=hold, ack=ack,
                                      hold_results=hold_results)

    async def registered(self, *wids: str, timeout: float = 5.0) -> None:
        """Wait until the workers are members (registration goes through the loop)."""
        async def loop() -> None:
            while not all(w in self.server.fleet.peers for w in wids):
                await asyncio.sleep(0)  # one loop turn: the transport delivers on the next

        await asyncio.wait_for(loop(), timeout)

    async def submit(self, conn: RecConn, **fields: Any) -> None:
        fields.setdefault("max_tokens", 16)
        fields.setdefault("temperature", 0.0)
        fields.setdefault("stream", False)
        if "prompt" not in fields and "prompt_ids" not in fields and "messages" not in fields:
            fields["prompt"] = "hello"
        res = self.server.on_client(conn, P.Generate(**fields))
        if res is not None:
            await res

    def counters(self) -> dict[str, int]:
        """The daemon's counters as its status shows them (scheduler and engines)."""
        return dict(self.server.snapshot().counters)

    async def finished(self, conn: RecConn, *rids: str, timeout: float = 5.0) -> None:
        await conn.wait_for(lambda: all(conn.terminal(r) for r in rids), timeout)


def make_config(tmp: Path, **sections: dict[str, Any]) -> Any:
    raw: dict[str, dict[str, Any]] = {
        "daemon": {"socket": f"{tmp}/api.sock", "status_socket": f"{tmp}/status.sock",
                   "worker_endpoint": f"ipc://{tmp}/w.ipc", "heartbeat_interval_s": 0.5,
                   "heartbeat_timeout_s": 5.0},
        "model": {"name": "fake"},
        # The static policy: the in-process fake workers serve static batches (CB switches to grants).
        "scheduler": {"policy": "scls", "slice_len": 8, "gamma_s": 0.001},
        "workers": {"spawn": 0, "engine": "fake"},
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return from_dict(raw)


@pytest.fixture
def daemon(tmp_path: Path) -> Callable[..., Any]:
    """``daemon(body, **config_sections)``: run ``await body(harness)`` against a started server."""

    def run(body: Callable[[Harness], Awaitable[None]], **sections: dict[str, Any]) -> None:
        async def main() -> None:
            transport = InprocTransport()
            server = Server(make_config(tmp_path, **sections), transport=transport,
                            tokenizer=ByteTokenizer())
            await server.start(sockets=False, spawn=False)
            try:
                await body(Harness(server, transport))
            finally:
                await server.stop()

        asyncio.run(main())

    return run
