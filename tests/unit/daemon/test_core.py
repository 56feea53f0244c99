"""The serving core as plain synchronous calls: no event loop, no sockets, a clock of our own.

:class:`Driver` plays the shell: it feeds the core inputs, runs the detokenizing the
core asks for inline, and keeps what the core said to each client and worker. Workers
are ``fake`` engines served by hand, so a test decides when each batch's tokens and
result arrive.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import pytest

from sclsd import protocol as P
from sclsd.core.decisions import Releases
from sclsd.daemon.cost import DaemonCost
from sclsd.daemon.server import make_scheduler
from sclsd.daemon.serving.core import ServingCore
from sclsd.daemon.serving.effects import Effects
from sclsd.tokenizer import ByteTokenizer
from unit.inproc import stamped
from worker.engines.fake import FakeEngine
from worker.rows import RowBook, UnknownRows
from worker.serve import result_rows

from .conftest import make_config


class Driver:
    """The shell's part, synchronously (see the module docstring)."""

    def __init__(self, tmp: Path, **sections: dict[str, Any]) -> None:
        cfg = make_config(tmp, **sections)
        cost = DaemonCost.initial(cfg)
        self.tok = ByteTokenizer()
        self.core = ServingCore(cfg, make_scheduler(cfg, cost), cost, self.tok)
        self.now = 100.0
        self.to_client: dict[Hashable, list[Any]] = {}
        self.to_worker: dict[str, list[P.DaemonToWorkerMsg]] = {}
        self.engines: dict[str, FakeEngine] = {}
        self.rows: dict[str, RowBook] = {}
        """Each worker's records: batches reach its engine whole, as in a real worker."""
        self.whole: dict[int, P.BatchMsg | UnknownRows] = {}
        """Each batch as its worker made it whole on arrival (or why it could not)."""
        self.lost: list[str] = []
        self.served: set[int] = set()
        self.released: Counter[tuple[str, str]] = Counter()
        """Every (worker, request) whose KV a scheduler call released, as the calls returned."""
        self.releasers: Counter[str] = Counter()
        """The scheduler calls that released KV, by name."""
        self.told: Counter[tuple[str, str]] = Counter()
        """Every (worker, request) a ``release`` told a worker to drop."""
        self.stray: Counter[tuple[str, str]] = Counter()
        """Releases the daemon decided itself (a row it will not use came back with KV)."""
        self._watch_releases()

    def _watch_releases(self) -> None:
        """Record what every scheduler call that may release KV returned (the spies stand in
        for the methods on the scheduler object, which the whole core shares)."""
        sched = self.core.sched

        def spy(name: str) -> None:
            orig: Callable[..., Any] = getattr(sched, name)

            def call(*args: Any, **kw: Any) -> Any:
                value = orig(*args, **kw)
                rels: Releases = value if isinstance(value, tuple) else getattr(value, "releases", ())
                for rel in rels:
                    self.releasers[name] += 1
                    for rid in rel.rids:
                        self.released[rel.worker, rid] += 1
                return value

            setattr(sched, name, call)

        for name in ("schedule", "on_result", "cancel", "expire", "set_active", "remove_worker"):
            spy(name)
        book = self.core.dispatch
        release, apply = book.release, book.apply
        applying = [False]

        def apply_spy(*args: Any) -> None:
            applying[0] = True
            try:
                apply(*args)
            finally:
                applying[0] = False

        def release_spy(wid: str, rids: list[str], out: Effects) -> None:
            if not applying[0] and wid in self.core.members:
                self.stray.update((wid, rid) for rid in rids)
            release(wid, rids, out)

        book.apply = apply_spy  # type: ignore[method-assign]
        book.release = release_spy  # type: ignore[method-assign]

    def run(self, eff: Effects) -> Effects:
        """Record the effects; detokenize what they ask for, at once and in order."""
        for client, ev in eff.to_clients:
            self.to_client.setdefault(client, []).append(ev)
        for wid, msg in eff.worker_messages():
            self.to_worker.setdefault(wid, []).append(msg)
            if isinstance(msg, P.Release):
                self.told.update((wid, rid) for rid in msg.rids)
            if isinstance(msg, (P.Release, P.Forget)) and wid in self.rows:
                self.rows[wid].drop(msg.rids)
            elif isinstance(msg, P.BatchMsg) and wid in self.rows:
                try:  # on arrival, in order with release and forget, as a worker does
                    self.whole[msg.batch_id] = self.rows[wid].expand(msg)
                except UnknownRows as exc:
                    self.whole[msg.batch_id] = exc
        self.lost += [x.wid for x in eff.lost]
        for job in eff.decode:
            self.run(self.core.decoded(job, [self.tok.decode(s) for s in job.seqs], self.now))
        return eff

    # ------------------------------------------------------------------ clients

    def submit(self, client: Hashable, rid: str, prompt: str = "hello", **fields: Any) -> Effects:
        fields.setdefault("max_tokens", 16)
        fields.setdefault("stream", False)
        gen = P.Generate(id=rid, prompt=prompt, temperature=0.0, **fields)
        return self.run(self.core.submit(client, 1000, gen, rid, self.tok.encode(prompt), self.now))

    def events(self, client: Hashable, kind: type | tuple[type, ...] = object) -> list[Any]:
        return [e for e in self.to_client.get(client, []) if isinstance(e, kind)]

    def terminal(self, client: Hashable, rid: str) -> list[Any]:
        return [e for e in self.events(client, (P.Done, P.Error)) if e.id == rid]

    # ------------------------------------------------------------------ workers

    def join(self, wid: str, engine: FakeEngine | None = None, **opts: Any) -> Effects:
        """Register worker ``wid``: ``engine`` (any fake engine), else ``FakeEngine(**opts)``."""
        eng = self.engines[wid] = engine if engine is not None else FakeEngine(**opts)
        self.rows[wid] = RowBook()
        info = eng.info()
        reg = P.Register(worker_id=wid, engine=info.engine, model=info.model, device=info.device,
                         kv_bytes_per_token=info.kv_bytes_per_token, mem_available=info.mem_available,
                         pid=os.getpid(), eos_token_ids=list(info.eos_token_ids),
                         vocab_size=info.vocab_size, caps=info.caps)
        assert self.core.join_refusal(reg) is None
        return self.run(self.core.worker_joined(reg, self.now))

    def step(self) -> Effects:
        eff, _ = self.core.step(self.now)
        return self.run(eff)

    def batches(self, wid: str) -> list[P.BatchMsg]:
        """Batches sent to ``wid`` and not served yet."""
        return [m for m in self.to_worker.get(wid, []) if isinstance(m, P.BatchMsg)
                and m.batch_id not in self.served]

    def serve(self, wid: str, *, stream: bool = False, result: bool = True) -> list[P.BatchMsg]:
        """Serve ``wid``'s pending batches on its engine: their tokens as it streams them
        (``stream``) and their results (``result``)."""
        batches = self.batches(wid)
        for b in batches:
            self.served.add(b.batch_id)

            sent: dict[str, int] = {}

            def emit(outputs: list[P.RequestOutput], bid: int = b.batch_id, sent: dict[str, int] = sent) -> None:
                if stream:
                    self.message(wid, P.Tokens(worker_id=wid, batches=[P.BatchTokens(
                        batch_id=bid, outputs=stamped(outputs, sent))]))

            whole = self.whole.pop(b.batch_id)
            if isinstance(whole, UnknownRows):  # as the worker answers it
                self.message(wid, P.Result(worker_id=wid, batch_id=b.batch_id, error=str(whole),
                                           unknown=whole.rids))
                continue
            outputs, stats = self.engines[wid].serve(whole, emit)
            self.rows[wid].served(outputs)
            if result:
                self.message(wid, P.Result(worker_id=wid, batch_id=b.batch_id, outputs=result_rows(outputs, sent),
                                           stats=stats))
        return batches

    def message(self, wid: str, msg: P.WorkerMsg) -> Effects:
        return self.run(self.core.worker_message(wid, msg, self.now))

    def until_done(self, client: Hashable, *rids: str, wid: str = "w0", rounds: int = 50) -> None:
        """Run rounds and serve them until every request in ``rids`` ended."""
        for _ in range(rounds):
            if all(self.terminal(client, r) for r in rids):
                return
            self.now += 1.0
            self.step()
            self.serve(wid)
        raise AssertionError(f"not done after {rounds} rounds: {rids}")


@pytest.fixture
def drv(tmp_path: Path) -> Driver:
    return Driver(tmp_path)


def test_a_request_goes_from_submit_to_one_done(drv: Driver) -> None:
    drv.join("w0")
    eff = drv.submit("c", "r", max_tokens=20)
    assert eff.wake and drv.events("c") == [P.Accepted(id="r", prompt_tokens=5)]
    eff = drv.step()
    (batch,) = drv.batches("w0")
    assert batch.requests[0].token_ids == list(b"hello") and not eff.to_clients
    drv.until_done("c", "r")
    (done,) = drv.terminal("c", "r")
    assert isinstance(done, P.Done) and done.finish_reason == "length" and done.worker == "w0"
    assert done.usage.completion_tokens == 20 == len(done.token_ids or [])
    assert done.timings.slices == 3  # S = 8: 8 + 8 + 4
    assert len(drv.core.table) == 0 and not drv.core.sched.live


def test_streamed_tokens_become_deltas_and_the_result_adds_only_the_rest(drv: Driver) -> None:
    drv.join("w0")
    drv.submit("c", "s", max_tokens=20, stream=True, ignore_eos=True)
    for _ in range(3):
        drv.now += 1.0
        drv.step()
        drv.serve("w0", stream=True)
    (done,) = drv.terminal("c", "s")
    deltas = drv.events("c", P.Delta)
    ids = [t for d in deltas for t in d.token_ids]
    assert len(ids) == 20 == done.usage.completion_tokens  # each token once, none from the results
    assert all(len(d.token_ids) <= 1 for d in deltas)  # as the engine emitted them
    assert "".join(d.text for d in deltas) == drv.tok.decode(ids)


def test_a_lost_worker_keeps_what_it_streamed_and_its_requests_go_on_elsewhere(drv: Driver) -> None:
    drv.join("w0")
    drv.submit("c", "s", max_tokens=20, stream=True, ignore_eos=True)
    drv.step()
    drv.serve("w0", stream=True, result=False)  # the slice's 8 tokens streamed, no result
    streamed = [t for d in drv.events("c", P.Delta) for t in d.token_ids]
    assert len(streamed) == 8
    eff = drv.run(drv.core.worker_lost("w0", "test", "exited", drv.now))
    assert [x.wid for x in eff.lost] == ["w0"] and eff.wake
    e = drv.core.table.get("s")
    assert e is not None and e.req.num_generated == 8 and e.out.ids == streamed
    drv.join("w1")
    drv.until_done("c", "s", wid="w1")
    (done,) = drv.terminal("c", "s")
    assert done.worker == "w1" and done.usage.completion_tokens == 20
    assert [t for d in drv.events("c", P.Delta) for t in d.token_ids][:8] == streamed


def test_results_and_tokens_of_other_workers_batches_count_for_nothing(drv: Driver) -> None:
    drv.join("w0")
    drv.join("w1")
    drv.submit("c", "s", max_tokens=3, stream=True)
    drv.step()
    owner = "w0" if drv.batches("w0") else "w1"
    other = "w1" if owner == "w0" else "w0"
    (b,) = drv.batches(owner)
    row = [P.RequestOutput(rid="s", token_ids=[7, 8, 9], finish_reason="length")]
    drv.message(other, P.Tokens(worker_id=other, batches=[P.BatchTokens(batch_id=b.batch_id, outputs=row)]))
    drv.message(other, P.Result(worker_id=other, batch_id=b.batch_id, outputs=row))
    assert not drv.events("c", (P.Delta, P.Done))
    drv.message(owner, P.Tokens(worker_id=owner, batches=[P.BatchTokens(
        batch_id=b.batch_id, outputs=[P.RequestOutput(rid="s", token_ids=[50, 51, 52, 53])])]))
    assert [d.token_ids for d in drv.events("c", P.Delta)] == [[50, 51, 52]]  # capped at its budget


def test_cancel_is_for_the_owner_and_releases_the_kv_its_worker_keeps(drv: Driver) -> None:
    drv.core.sched.policy = dataclasses.replace(drv.core.sched.policy, kv_reuse=True)
    drv.join("w0")
    drv.submit("c", "k", max_tokens=40, ignore_eos=True)
    drv.step()
    drv.serve("w0")  # one slice: the worker keeps the request's KV
    e = drv.core.table.get("k")
    assert e is not None and e.req.kv_worker == "w0"
    eff = drv.run(drv.core.cancel("k", drv.now, requester="intruder"))
    assert [ev.code for ev in eff.to_clients[0][1:]] == ["unknown_id"] and "k" in drv.core.table
    eff = drv.run(drv.core.cancel("k", drv.now, requester="c"))
    (done,) = drv.terminal("c", "k")
    assert done.finish_reason == "cancelled" and [x.reason for x in eff.ended] == ["cancelled"]
    assert ("w0", P.Release(rids=["k"])) in eff.to_workers


def test_a_client_gone_cancels_its_requests_without_events(drv: Driver) -> None:
    drv.submit("c", "a")
    drv.submit("c", "b")
    drv.submit("d", "x")
    eff = drv.run(drv.core.client_gone("c", drv.now))
    assert sorted(x.rid for x in eff.ended) == ["a", "b"] and not eff.to_clients
    assert drv.core.table.ids() == ["x"]


def test_timeouts_end_requests_at_the_step(drv: Driver) -> None:
    drv.submit("c", "t", timeout=0.5)
    eff, wait = drv.core.step(drv.now)
    assert 0 < wait <= 0.5 and not drv.terminal("c", "t")
    drv.now += 1.0
    drv.step()
    (done,) = drv.terminal("c", "t")
    assert done.finish_reason == "timeout"


def test_the_tick_loses_silent_workers_and_those_that_leave_batches_unacknowledged(drv: Driver) -> None:
    drv.join("w0")
    drv.join("w1")
    eff = drv.run(drv.core.tick(drv.now + 1.0))
    assert [(w, m) for w, m in eff.to_workers] == [("w0", P.Keepalive()), ("w1", P.Keepalive())]
    drv.submit("c", "r")
    drv.step()
    (holder,) = [w for w in ("w0", "w1") if drv.batches(w)]  # it never acknowledges the batch
    ack_timeout = drv.core.cfg.daemon.batch_ack_timeout_s
    drv.now += ack_timeout + 0.1
    for w in ("w0", "w1"):
        drv.message(w, P.Heartbeat(worker_id=w))  # both alive
    drv.run(drv.core.tick(drv.now))
    assert drv.lost == [holder] and list(drv.core.sched.pool) == ["r"]  # back in the pool
    drv.now += drv.core.cfg.daemon.heartbeat_timeout_s + 0.1
    drv.run(drv.core.tick(drv.now))  # the other one went silent
    assert sorted(drv.lost) == ["w0", "w1"]


def test_registration_checks_the_model_and_welcomes_the_worker(drv: Driver) -> None:
    small = P.Register(worker_id="w9", engine="fake", model="fake", device="cpu", kv_bytes_per_token=1,
                       mem_available=1 << 30, pid=1, vocab_size=100)
    assert "vocabulary has 100 tokens" in (drv.core.join_refusal(small) or "")
    eff = drv.join("w0")
    assert eff.to_workers == [("w0", P.Welcome(heartbeat_interval_s=0.5))] and eff.wake
    assert "w0" in drv.core.members


def test_a_failed_batch_requeues_then_fails_for_good(drv: Driver) -> None:
    drv.join("w0")
    drv.submit("c", "f")
    for _ in range(drv.core.sched.max_failures + 1):
        drv.now += 1.0
        drv.step()
        (b,) = drv.batches("w0")
        drv.served.add(b.batch_id)
        drv.message("w0", P.Result(worker_id="w0", batch_id=b.batch_id, error="RuntimeError: boom"))
    (err,) = drv.terminal("c", "f")
    # An error event with the worker's reason, not a done whose reason a client must decode.
    assert isinstance(err, P.Error) and err.code == "engine_error" and err.id == "f"
    assert "worker w0: RuntimeError: boom" in err.message and "4 times" in err.message
    assert not drv.core.table.ids()


def test_out_of_memory_shrinks_the_workers_memory_and_charges_no_request(drv: Driver) -> None:
    drv.join("w0")
    for rid in ("a", "b", "c"):
        drv.submit("c", rid)
    before = drv.core.members.cost.memory["w0"][1]
    for k in range(drv.core.sched.max_failures + 2):  # more OOMs than a request may fail
        drv.now += 1.0
        drv.step()
        batch = drv.batches("w0")
        assert len(batch) == 1 and len(batch[0].requests) == 3, batch  # all three, at once
        drv.served.add(batch[0].batch_id)
        drv.message("w0", P.Result(worker_id="w0", batch_id=batch[0].batch_id,
                                   error="OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB"))
        assert abs(drv.core.members.cost.memory["w0"][1] - before * 0.85 ** (k + 1)) <= k + 1
    assert drv.terminal("c", "a") == [] and sorted(drv.core.table.ids()) == ["a", "b", "c"]
    assert all(drv.core.table.get(r).req.failures == 0 for r in ("a", "b", "c"))


def test_fail_all_ends_every_live_request_once(drv: Driver) -> None:
    drv.submit("c", "a")
    drv.submit("d", "b")
    eff = drv.run(drv.core.fail_all("shutdown", "bye", drv.now))
    assert sorted(x.rid for x in eff.ended) == ["a", "b"]
    assert [e.code for e in drv.events("c", P.Error)] == ["shutdown"]
    assert not drv.run(drv.core.fail_all("shutdown", "bye", drv.now)).to_clients


@pytest.mark.parametrize("policy", ["scls", "scls-cb"])
def test_every_release_a_scheduler_call_returns_reaches_its_worker_once(tmp_path: Path, policy: str) -> None:
    """Releases are returned, not polled: whatever entry point gave KV up (a round that moves
    a request, a result, a cancel, a timeout, a drain, a worker lost), the worker hears it
    exactly once. A driver path that dropped a returned value's releases fails here."""
    cb = policy == "scls-cb"
    drv = Driver(tmp_path, scheduler={"policy": policy, "kv_reuse": True, "work_conserving": True,
                                      "max_failures": 5})
    engine: dict[str, Any] = {"batching": "continuous"} if cb else {"mem_budget": 1 << 34}
    for w in ("w0", "w1"):
        drv.join(w, **engine)
    rids = [f"r{i}" for i in range(6)]
    for i, rid in enumerate(rids):
        drv.submit("c", rid, prompt=f"prompt {i}", max_tokens=60, ignore_eos=True,
                   **({"timeout": 2.5} if rid == "r5" else {}))

    def round_(serve: tuple[str, ...] = ("w0", "w1", "w2")) -> None:
        drv.now += 1.0
        drv.step()
        for w in serve:
            if w in drv.core.members:
                drv.serve(w)

    round_()
    round_()  # every request has had slices; the workers keep their KV between them
    drv.run(drv.core.cancel("r0", drv.now, requester="c"))  # in the pool, its KV kept
    drv.run(drv.core.drain_worker("w0", False, "admin"))  # its requests move on
    round_(serve=("w0",))
    pending = drv.batches("w1")
    if pending:  # a failed batch: what its worker kept is not vouched for
        b = pending[0]
        drv.served.add(b.batch_id)
        drv.message("w1", P.Result(worker_id="w1", batch_id=b.batch_id, error="RuntimeError: boom"))
    for _ in range(3):  # w0 stays drained: what it keeps for r1, r2 is left behind
        round_(serve=("w1",))
    drv.run(drv.core.drain_worker("w0", True, "admin"))
    round_(serve=())
    running = [r.rid for b in drv.core.sched.batches.values() for r in b.requests]
    drv.run(drv.core.cancel(running[0], drv.now, requester="c"))  # while its batch runs
    for w in ("w0", "w1"):
        drv.serve(w)
    drv.run(drv.core.worker_lost("w1", "test", "exited", drv.now))
    drv.join("w2", **engine)
    for _ in range(60):
        if all(drv.terminal("c", r) for r in rids):
            break
        round_()
    assert all(drv.terminal("c", r) for r in rids) and not drv.core.sched.live
    assert drv.released and drv.told == drv.released + drv.stray, (drv.told, drv.released, drv.stray)
    # The scenario makes each of these calls release (a drain releases under grants only; the
    # slice scheduler's round moves the drained worker's requests instead).
    assert set(drv.releasers) >= {"cancel", "expire", "on_result", "set_active" if cb else "schedule"}
