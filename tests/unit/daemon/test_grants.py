"""``scheduler.policy = "scls-cb"`` in the daemon: slice grants on the serving core driven
synchronously with a fake clock (:class:`~.driving.WorkerDriver`; ``fake`` engines with
continuous batching, which keep KV across slices like hf-cb does). What a worker's
registration on its connection and admission do runs the whole server over the
in-process transport."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from sclsd import protocol as P
from sclsd.config import ConfigError, from_dict
from sclsd.core.decisions import Round
from sclsd.core.grant_scheduler import SliceGrantScheduler
from sclsd.core.policy import GRANT_POLICIES

from .conftest import Harness, RecConn, until
from .driving import WorkerDriver

CB = {"policy": "scls-cb", "slice_len": 8}
#: How the daemon spawns fake workers under ``scls-cb`` (a static engine may not join).
CONTINUOUS: dict[str, Any] = {"batching": "continuous"}


def _serve(tmp: Path, scheduler: dict[str, Any], n: int = 12) -> tuple[dict[str, list[int]], dict[str, int]]:
    drv = WorkerDriver(tmp, scheduler=scheduler)
    engine = CONTINUOUS if scheduler["policy"] in GRANT_POLICIES else {}
    drv.join("w0", **engine)
    drv.join("w1", **engine)
    rids = [f"r{i}" for i in range(n)]
    for i, rid in enumerate(rids):
        drv.submit("c", rid, prompt=f"prompt {i} " * (1 + i % 3), max_tokens=10 + 7 * i)
    drv.until_done("c", *rids, wid=("w0", "w1"))
    for rid in rids:
        (done,) = drv.terminal("c", rid)
        assert isinstance(done, P.Done), done
        assert len([e for e in drv.events("c", P.Accepted) if e.id == rid]) == 1
    assert not drv.core.sched.live and not drv.core.sched.batches
    return {rid: list(drv.terminal("c", rid)[0].token_ids or []) for rid in rids}, drv.counters()


def test_grants_serve_the_same_tokens_as_slice_rounds(tmp_path: Path) -> None:
    got, counters = _serve(tmp_path, CB)
    want, _ = _serve(tmp_path, {"policy": "scls", "slice_len": 8})
    assert got == want
    # Long requests came back after S = 8 tokens and were granted again.
    assert counters["grants"] > len(got)
    assert counters["finished"] == len(got)


def test_grant_scheduler_is_built_for_scls_cb(tmp_path: Path) -> None:
    s = WorkerDriver(tmp_path, scheduler=CB).core.sched
    assert isinstance(s, SliceGrantScheduler)
    assert s.policy.kv_reuse and s.grants.S == 8


def test_a_request_stays_on_the_worker_holding_its_kv(tmp_path: Path) -> None:
    drv = WorkerDriver(tmp_path, scheduler=CB)
    drv.join("w0", **CONTINUOUS)
    drv.submit("c", "r", max_tokens=40, ignore_eos=True)
    drv.until_done("c", "r")
    batches = drv.taken["w0"]  # as the engine took them: rows whole
    assert len(batches) == 5 and all(b.slice_len == 8 and b.kv_reuse for b in batches)
    # Every grant after the first resumed the KV its predecessor kept: no re-prefill.
    assert [len(b.requests[0].token_ids) for b in batches] == [5 + 8 * k for k in range(5)]
    assert drv.counters()["migrations"] == 0
    # On the wire the request went whole once; each later grant is its budget alone.
    sent = [m for m in drv.to_worker["w0"] if isinstance(m, P.BatchMsg)]
    assert [len(b.requests) for b in sent] == [1, 0, 0, 0, 0]
    assert [(c.known, c.tail, c.max_new_tokens) for b in sent[1:] for c in b.cont] == [
        (5 + 8 * k, [], 40 - 8 * k) for k in range(1, 5)]


def test_reserved_kv_never_exceeds_the_budget(tmp_path: Path) -> None:
    """A budget of ~100 tokens per worker: grants queue for room instead of overcommitting."""
    drv = WorkerDriver(tmp_path, scheduler=CB)
    sched = drv.core.sched
    assert isinstance(sched, SliceGrantScheduler)
    seen: list[int] = []
    schedule = sched.schedule

    def checked(now: float) -> Round:
        out = schedule(now)
        for w in sched.workers:
            seen.append(sched.grants.reserved(w))
            assert sched.grants.reserved(w) <= sched.token_budget()
        return out

    sched.schedule = checked  # type: ignore[method-assign]
    for w in ("w0", "w1"):
        drv.join(w, mem_budget=100 * 512, kv_bytes_per_token=512, **CONTINUOUS)
    assert sched.token_budget() <= 100
    rids = [f"r{i}" for i in range(10)]
    for rid in rids:
        drv.submit("c", rid, prompt="0123456789" * 2, max_tokens=30, ignore_eos=True)
    drv.until_done("c", *rids, wid=("w0", "w1"))
    assert all(isinstance(drv.terminal("c", r)[0], P.Done) for r in rids)
    assert max(seen) > 0.5 * sched.token_budget()  # the budget was the binding limit
    assert all(sched.grants.reserved(w) == 0 for w in sched.workers)


def test_worker_death_during_a_grant_loses_nothing(tmp_path: Path) -> None:
    drv = WorkerDriver(tmp_path, scheduler=CB)
    drv.join("w0", **CONTINUOUS)
    drv.submit("c", "a", max_tokens=20, ignore_eos=True)
    drv.submit("c", "b", max_tokens=20, ignore_eos=True)
    drv.step()
    assert len(drv.batches("w0")) == 2  # a grant each, never served: w0 goes silent
    drv.now += 60.0
    eff = drv.run(drv.core.tick(drv.now))
    assert [(x.wid, x.reason) for x in eff.lost] == [("w0", "silent")]
    assert "w0" not in drv.core.members
    sched = drv.core.sched
    assert isinstance(sched, SliceGrantScheduler) and sched.grants.queued == 2  # both wait again, first in line
    drv.join("w1", **CONTINUOUS)
    drv.until_done("c", "a", "b", wid="w1")
    for rid in ("a", "b"):
        (done,) = drv.terminal("c", rid)
        assert isinstance(done, P.Done) and done.worker == "w1"
        assert done.usage.completion_tokens == 20


def test_cancel_frees_the_grant_and_releases_kept_kv(tmp_path: Path) -> None:
    drv = WorkerDriver(tmp_path, scheduler=CB)
    sched = drv.core.sched
    assert isinstance(sched, SliceGrantScheduler)
    drv.join("w0", **CONTINUOUS)
    drv.submit("c", "a", max_tokens=40, ignore_eos=True)
    drv.step()
    drv.serve("w0")  # first grant served: its KV is kept on w0
    drv.now += 1.0
    drv.step()
    assert len(drv.batches("w0")) == 1  # the second grant, running
    drv.run(drv.core.cancel("a", drv.now, requester="c"))
    assert drv.terminal("c", "a")[0].finish_reason == "cancelled"
    assert "a" in sched.grants.grants_on("w0")  # the running grant holds its reservation
    drv.serve("w0")  # the running grant's result comes back: the policy forgets "a"
    assert "a" not in sched.grants.grants_on("w0")
    told = [m for m in drv.to_worker["w0"] if isinstance(m, P.Release) and "a" in m.rids]
    assert len(told) == 1  # once: the scheduler's release, not also the daemon's for the stray row
    assert sched.grants.reserved("w0") == 0 and sched.grants.queued == 0


def test_config_refuses_scls_cb_with_a_static_engine(tmp_path) -> None:
    raw = {"scheduler": {"policy": "scls-cb"}, "workers": {"engine": "hf"},
           "daemon": {"socket": f"{tmp_path}/a.sock"}}
    with pytest.raises(ConfigError) as exc:
        from_dict(raw)
    assert exc.value.key == "workers.engine" and "hf-cb" in str(exc.value)
    from_dict({**raw, "workers": {"engine": "hf-cb"}})  # accepted


def test_a_static_worker_cannot_join_a_grant_daemon(daemon) -> None:
    async def body(h: Harness) -> None:
        from worker.engines.fake import FakeEngine

        # A static engine (its caps say so), whatever its name.
        w = h.transport.connect("w0", FakeEngine(batching="static"), auth=h.server.fleet.secret or "",
                                register=False)
        w.register()
        await until(w.got, lambda: any(isinstance(m, P.Shutdown) for m in w.received))
        assert "w0" not in h.members()

    daemon(body, scheduler=CB)


def test_sampling_is_refused_at_admission_when_hf_cb_is_greedy(daemon) -> None:
    async def body(h: Harness) -> None:
        conn = RecConn()
        await h.submit(conn, id="hot", temperature=0.7)
        (err,) = conn.terminal("hot")
        assert isinstance(err, P.Error) and err.code == "bad_request" and "greedy" in err.message
        await h.submit(conn, id="cold", temperature=0.0)
        assert not conn.terminal("cold")  # accepted: it waits for a worker

    daemon(body, scheduler=CB, workers={"engine": "hf-cb", "options": {"sampling": False}})


@pytest.mark.parametrize("options", [{"sampling": True}, {}], ids=["sampling", "by-default"])
def test_hf_cb_workers_take_sampling_and_seeds_before_any_registers(daemon, options) -> None:
    async def body(h: Harness) -> None:
        conn = RecConn()
        await h.submit(conn, id="hot", temperature=0.7)
        await h.submit(conn, id="seeded", temperature=0.7, seed=5)
        assert not conn.terminal("hot") and not conn.terminal("seeded")  # both wait for a worker

    daemon(body, scheduler=CB, workers={"engine": "hf-cb", "options": options})


def test_config_takes_sampling_only_for_hf_cb(tmp_path) -> None:
    base = {"daemon": {"socket": f"{tmp_path}/a.sock"}}
    from_dict({**base, "workers": {"engine": "hf-cb", "options": {"sampling": True}}})
    for policy, workers in (("scls", {"engine": "hf", "options": {"sampling": True}}),
                            ("scls", {"options": {"sampling": True}}),  # auto: hf for scls
                            ("scls-cb", {"engine": "hf-cb", "options": {"sampling": "yes"}})):
        with pytest.raises(ConfigError) as exc:
            from_dict({**base, "scheduler": {"policy": policy}, "workers": workers})
        assert exc.value.key == "workers.options.sampling"


def test_a_result_s_rows_hold_its_worker_to_them(tmp_path: Path) -> None:
    """An engine whose room changes with what runs (the arena) says so in each result: the
    daemon sends it no more rows than that until a result says otherwise (0: its caps')."""
    drv = WorkerDriver(tmp_path, scheduler={**CB, "grant_lookahead": 0})
    drv.join("w0", batching="continuous", max_rows=8)
    for i in range(30):
        drv.submit("c", f"r{i}", max_tokens=4)
    drv.step()
    assert len(drv.batches("w0")) == 8
    drv.serve("w0", hold=True)
    drv.held_results["w0"] = [msgspec.structs.replace(r, rows=2) for r in drv.held_results["w0"]]
    drv.finish("w0")
    drv.step()
    assert len(drv.batches("w0")) == 2  # the room it said, not its caps' eight
    drv.serve("w0", hold=True)
    drv.held_results["w0"] = [msgspec.structs.replace(r, rows=5) for r in drv.held_results["w0"]]
    drv.finish("w0")
    drv.step()
    assert len(drv.batches("w0")) == 5
    drv.serve("w0")  # results that say nothing: its caps' eight again
    drv.step()
    assert len(drv.batches("w0")) == 8
    drv.message("w0", P.Result(worker_id="w0", batch_id=10_000, rows=64))  # never above its caps
    assert drv.core.members.workers["w0"].rows == 8


def _next_turn_worker(tmp: Path, share: bool, routing: bool = True) -> tuple[str, str, Any, int]:
    """A request finishes on one of two idle workers; another whose prompt begins with its
    context arrives: (where the first ran, where the second ran, the second's request, the
    daemon's hints)."""
    drv = WorkerDriver(tmp, scheduler={**CB, "prefix_routing": routing})
    for wid in ("w0", "w1"):
        drv.join(wid, share_prefixes=share, **CONTINUOUS)
    first = "You are a careful assistant. Answer in one line. What is 2 + 2?"
    drv.submit("c", "t1", prompt=first, max_tokens=6, ignore_eos=True)
    drv.until_done("c", "t1", wid=("w0", "w1"))
    (done,) = drv.terminal("c", "t1")
    turn = first + drv.tok.decode(done.token_ids) + " And 3 + 3?"
    drv.submit("c", "t2", prompt=turn, max_tokens=4, ignore_eos=True)
    req = drv.core.sched.get("t2")
    drv.until_done("c", "t2", wid=("w0", "w1"))
    (done2,) = drv.terminal("c", "t2")
    return done.worker, done2.worker, req, drv.core.routes.hints


def test_a_new_request_goes_where_its_prompt_s_prefix_was_served(tmp_path: Path) -> None:
    """With workers whose engines share prefixes, a chat's next turn (its prompt the turn
    before, answer included, and more) goes back to the worker that served that turn, where
    the rotation among idle workers would send it to the other; without, or with
    ``prefix_routing`` off, nothing is hinted."""
    w1, w2, req, hints = _next_turn_worker(tmp_path / "share", True)
    assert w2 == w1 and req.prefix_worker == w1 and hints == 1
    first = "You are a careful assistant. Answer in one line. What is 2 + 2?"
    assert req.prefix_tokens == (len(first) + 6) // 16 * 16  # whole blocks of the first turn's context
    w1, w2, req, hints = _next_turn_worker(tmp_path / "plain", False)
    assert w2 != w1 and req.prefix_worker is None and hints == 0
    w1, w2, req, hints = _next_turn_worker(tmp_path / "off", True, routing=False)
    assert w2 != w1 and req.prefix_worker is None and hints == 0
