"""Every scheduler entry point returns the KV it releases; nothing is left behind to poll for.

The property test drives either scheduler through random calls as a driver would (arrivals,
rounds, results, cancels, timeouts, drains, worker loss and rejoin, evictions), applying
only the releases the calls return to a model of the KV each worker keeps. After every
call nothing may be left inside the scheduler, and once every request has ended no
registered worker may still keep KV: an entry point whose releases were dropped fails it.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from sclsd.core.batch import BatchOutcome, RowOutcome
from sclsd.core.decisions import Release, Releases, releases_of
from sclsd.core.estimator import Estimator
from sclsd.core.grant_scheduler import SliceGrantScheduler
from sclsd.core.memory import KVMemory
from sclsd.core.policy import make_policy
from sclsd.core.profiles import ProfileCost
from sclsd.core.request import Request
from sclsd.core.scheduler import Scheduler

EST = Estimator(p1=2e-4, p2=1e-3, p3=1e-5, p4=0.02, d1=2e-6, d2=1e-4, d3=1e-6, d4=0.02)
S = 16


def cost(tokens: float = 1e6) -> ProfileCost:
    return ProfileCost(EST, KVMemory(1, tokens, 1.0))


def slices(wc: bool = False) -> Scheduler:
    return Scheduler(make_policy("scls", slice_len=S, gamma=1.0, kv_reuse=True, work_conserving=wc),
                     cost(), max_failures=1, max_worker_losses=2)


def grants(tokens: float = 1e6) -> SliceGrantScheduler:
    return SliceGrantScheduler(make_policy("scls-cb", slice_len=S), cost(tokens), max_failures=1,
                               max_worker_losses=2)


def req(i: int, plen: int = 40, max_tokens: int = 100, t: float = 0.0,
        deadline: float | None = None) -> Request:
    return Request(rid=f"r{i}", prompt_len=plen, max_tokens=max_tokens, arrival=t, deadline=deadline)


def test_release_groups_keep_the_order_of_decision() -> None:
    got = releases_of([("w1", "a"), ("w0", "b"), ("w1", "c")])
    assert got == (Release("w1", ("a", "c")), Release("w0", ("b",)))
    assert releases_of([]) == ()


# --------------------------------------------------------------------------- slice scheduler


def _held_on(s: Scheduler, wid: str, now: float) -> Request:
    """``r0`` served one slice on ``wid``, which keeps its KV; back in the pool."""
    s.add(req(0), now)
    rnd = s.schedule(now)
    (b,) = rnd.batches
    assert b.worker == wid
    r = b.requests[0]
    s.on_result(BatchOutcome(b.bid, [RowOutcome("r0", S, kv_tokens=r.input_len + S - 1)]), now + 1)
    assert r.kv_worker == wid
    return r


def test_slice_cancel_and_expire_return_the_kv_they_give_up() -> None:
    s = slices()
    s.add_worker("w0")
    _held_on(s, "w0", 0.0)
    c = s.cancel("r0", 2.0)
    assert c is not None and c.releases == (Release("w0", ("r0",)),)
    assert s.cancel("r0", 2.0) is None
    s2 = slices()
    s2.add_worker("w0")
    r = _held_on(s2, "w0", 0.0)
    r.deadline = 3.0
    s2._deadlines.append((3.0, "r0"))
    e = s2.expire(3.0)
    assert [x.rid for x in e.requests] == ["r0"] and e.releases == (Release("w0", ("r0",)),)


def test_slice_results_return_the_kv_of_failed_batches_and_of_rows_that_kept_none() -> None:
    s = slices()
    s.add_worker("w0")
    r = _held_on(s, "w0", 0.0)
    (b,) = s.schedule(5.0).batches
    failed = s.on_result(BatchOutcome(b.bid, ok=False), 6.0)
    assert failed.requeued == (r,) and failed.releases == (Release("w0", ("r0",)),)
    s2 = slices()
    s2.add_worker("w0")
    r = _held_on(s2, "w0", 0.0)
    (b,) = s2.schedule(5.0).batches
    kept_none = s2.on_result(BatchOutcome(b.bid, [RowOutcome("r0", S, kv_tokens=0)]), 6.0)
    assert kept_none.releases == (Release("w0", ("r0",)),) and r.kv_worker is None


# --------------------------------------------------------------------------- grant scheduler


def _granted(s: SliceGrantScheduler, now: float) -> tuple[str, int]:
    (b,) = s.schedule(now).batches
    assert b.worker is not None
    return b.worker, b.bid


def test_grant_results_release_a_failed_grants_kv_and_a_cancelled_ones() -> None:
    s = grants()
    s.add_worker("w0")
    s.add(req(0), 0.0)
    wid, bid = _granted(s, 0.0)
    assert s.on_result(BatchOutcome(bid, ok=False), 1.0).releases == (Release(wid, ("r0",)),)
    wid, bid = _granted(s, 2.0)
    c = s.cancel("r0", 2.5)
    assert c is not None and c.releases == ()  # its grant still runs: released at its end
    applied = s.on_result(BatchOutcome(bid, [RowOutcome("r0", S, kv_tokens=50)]), 3.0)
    assert applied.releases == (Release(wid, ("r0",)),)


def test_a_grant_that_fails_its_request_for_good_releases_what_its_worker_kept() -> None:
    s = grants()  # max_failures = 1: the second failure ends the request
    s.add_worker("w0")
    s.add(req(0), 0.0)
    wid, bid = _granted(s, 0.0)
    s.on_result(BatchOutcome(bid, [RowOutcome("r0", S, kv_tokens=40 + S - 1)]), 1.0)  # kept on w0
    for k in range(2):
        wid, bid = _granted(s, 2.0 + k)
        failed = s.on_result(BatchOutcome(bid, ok=False), 2.5 + k)
        assert failed.releases == (Release(wid, ("r0",)),)
    assert [r.rid for r in failed.ended] == ["r0"] and not s.live


def test_grant_cancel_and_drain_release_kv_kept_between_grants() -> None:
    for drain in (False, True):
        s = grants()
        s.add_worker("w0")
        s.add(req(0), 0.0)
        wid, bid = _granted(s, 0.0)
        back = s.on_result(BatchOutcome(bid, [RowOutcome("r0", S, kv_tokens=40 + S - 1)]), 1.0)
        assert back.releases == () and [r.rid for r in back.requeued] == ["r0"]  # w0 keeps it
        rel: Releases
        if drain:
            rel = s.set_active(wid, False)
        else:
            c = s.cancel("r0", 1.5)
            assert c is not None
            rel = c.releases
        assert rel == (Release(wid, ("r0",)),)


# --------------------------------------------------------------------------- no release left behind


class Drive:
    """A driver that applies only what the scheduler returns, with each worker's kept KV."""

    def __init__(self, s: Any, kv: bool) -> None:
        self.s = s
        self.kv = kv
        self.held: set[tuple[str, str]] = set()
        self.now = 0.0
        self.n = 0
        self.known: list[str] = []

    def got(self, releases: Releases) -> None:
        for rel in releases:
            assert rel.worker in self.s.workers  # only registered workers are told
            for rid in rel.rids:
                self.held.discard((rel.worker, rid))
        assert self.s._released() == ()  # nothing left for a later call

    def check(self) -> None:
        assert self.s._released() == ()

    # the calls
    def add(self, plen: int, gen: int, deadline: float | None) -> None:
        self.n += 1
        self.s.add(req(self.n, plen, gen, self.now, None if deadline is None else self.now + deadline),
                   self.now)
        self.check()

    def step(self) -> None:
        if self.s.due(self.now):
            self.got(self.s.schedule(self.now).releases)

    def result(self, k: int, ok: bool, finish: list[bool], keep: list[bool]) -> None:
        bids = sorted(self.s.batches)
        if not bids:
            return
        b = self.s.batches[bids[k % len(bids)]]
        w = b.worker
        rows: list[RowOutcome] = []
        for i, r in enumerate(b.requests if ok else ()):  # a failed batch: the worker keeps what it had
            if self.s.live.get(r.rid) is not r:
                self.held.discard((w, r.rid))  # cancelled meanwhile: the daemon releases its row
                continue
            new = min(b.slice_len, r.remaining)
            if finish[i % len(finish)] or r.remaining - new <= 0:
                rows.append(RowOutcome(r.rid, new, "stop"))
                self.held.discard((w, r.rid))  # a finished row keeps nothing
            elif self.kv and keep[i % len(keep)]:
                rows.append(RowOutcome(r.rid, new, kv_tokens=r.input_len + new - 1))
                self.held.add((w, r.rid))
            else:
                rows.append(RowOutcome(r.rid, new))
                self.held.discard((w, r.rid))
        self.got(self.s.on_result(BatchOutcome(b.bid, rows, ok=ok, elapsed=1.0), self.now).releases)

    def cancel(self, k: int) -> None:
        live = sorted(self.s.live)
        if live:
            c = self.s.cancel(live[k % len(live)], self.now)
            assert c is not None
            self.got(c.releases)

    def expire(self) -> None:
        self.got(self.s.expire(self.now).releases)

    def toggle(self, k: int) -> None:
        ws = sorted(self.s.workers)
        if ws:
            w = ws[k % len(ws)]
            self.got(self.s.set_active(w, not self.s.workers[w].active))

    def lose(self, k: int, charged: bool) -> None:
        ws = sorted(self.s.workers)
        if ws:
            w = ws[k % len(ws)]
            self.got(self.s.remove_worker(w, self.now, charged).releases)
            self.held = {x for x in self.held if x[0] != w}  # its KV died with it

    def join(self, k: int) -> None:
        w = f"w{k % 4}"
        if w not in self.s.workers:
            self.held = {x for x in self.held if x[0] != w}  # a new process keeps nothing
            self.s.add_worker(w)
            self.check()

    def evict(self, k: int) -> None:
        held = sorted(self.held)
        if held:
            w, rid = held[k % len(held)]
            self.held.discard((w, rid))
            self.s.kv_evicted(w, [rid])
            self.check()

    def finish_all(self) -> None:
        for w in sorted(self.s.workers):
            if not self.s.workers[w].active:
                self.got(self.s.set_active(w, True))
        if not self.s.workers:
            self.join(0)
        for _ in range(2000):
            if not self.s.live and not self.s.batches:
                break
            self.now += 1.0
            self.expire()
            self.step()
            for _ in range(len(self.s.batches)):
                self.result(0, True, [True], [False])
        assert not self.s.live and not self.s.batches
        leaked = {x for x in self.held if x[0] in self.s.workers}
        assert not leaked, f"workers still keep KV nobody will use: {sorted(leaked)}"


WEIGHTS = {"add": 4, "result": 4, "step": 1, "cancel": 1, "expire": 1, "toggle": 1, "lose": 0.2,
           "join": 0.3, "evict": 0.5}


def ops(rng: random.Random, n: int) -> list[tuple[float, str, tuple[Any, ...]]]:
    """``n`` random calls, each after a random pause."""
    names = list(WEIGHTS)
    out: list[tuple[float, str, tuple[Any, ...]]] = []
    for name in rng.choices(names, [WEIGHTS[x] for x in names], k=n):
        args: tuple[Any, ...] = ()
        if name == "add":
            args = (rng.randint(1, 200), rng.randint(1, 80),
                    None if rng.random() < 0.5 else rng.uniform(0.5, 8.0))
        elif name == "result":
            args = (rng.randint(0, 7), rng.random() < 0.85, [rng.random() < 0.25 for _ in range(4)],
                    [rng.random() < 0.8 for _ in range(4)])
        elif name == "lose":
            args = (rng.randint(0, 7), rng.random() < 0.5)
        elif name in ("cancel", "toggle", "join", "evict"):
            args = (rng.randint(0, 50),)
        out.append((rng.uniform(0.0, 2.0), name, args))
    return out


@pytest.mark.parametrize("kind", ["slices", "slices-wc", "grants", "grants-tight"])
@pytest.mark.parametrize("seed", range(50))
def test_every_release_is_returned_and_no_kept_kv_outlives_its_request(kind: str, seed: int) -> None:
    s: Any
    if kind.startswith("slices"):
        s = slices(wc=kind == "slices-wc")
    else:
        s = grants(400.0 if kind == "grants-tight" else 1e6)
    d = Drive(s, kv=True)
    d.join(0)
    d.join(1)
    for dt, name, args in ops(random.Random(seed), 300):
        d.now += dt
        getattr(d, name)(*args)
        d.step()  # as the daemon and the simulator do after every event
    d.finish_all()
