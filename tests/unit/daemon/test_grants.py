"""``scheduler.policy = "scls-cb"`` in the daemon: slice grants through the in-process
transport (fake engines, which keep KV across slices like hf-cb does)."""

from __future__ import annotations

from typing import Any

import pytest

from sclsd import protocol as P
from sclsd.config import ConfigError, from_dict
from sclsd.core.decisions import Round
from sclsd.core.grant_scheduler import SliceGrantScheduler
from sclsd.daemon.admission import daemon_id

from .conftest import Harness, RecConn, held, until

CB = {"policy": "scls-cb", "slice_len": 8}


def _outputs(conn: RecConn, rids: list[str]) -> dict[str, list[int]]:
    return {rid: list(conn.terminal(rid)[0].token_ids or []) for rid in rids}


def _serve(daemon: Any, scheduler: dict[str, Any], n: int = 12) -> tuple[dict[str, list[int]], dict[str, int]]:
    out: dict[str, Any] = {}

    async def body(h: Harness) -> None:
        h.worker("w0")
        h.worker("w1")
        await h.registered("w0", "w1")
        conn = RecConn()
        rids = [f"r{i}" for i in range(n)]
        for i, rid in enumerate(rids):
            await h.submit(conn, id=rid, prompt=f"prompt {i} " * (1 + i % 3), max_tokens=10 + 7 * i)
        await h.finished(conn, *rids)
        for rid in rids:
            (done,) = conn.terminal(rid)
            assert isinstance(done, P.Done), done
            assert len(conn.events(rid, P.Accepted)) == 1
        out["tokens"] = _outputs(conn, rids)
        out["counters"] = h.counters()
        assert not h.server.sched.live and not h.server.sched.batches

    daemon(body, scheduler=scheduler)
    return out["tokens"], out["counters"]


def test_grants_serve_the_same_tokens_as_slice_rounds(daemon) -> None:
    got, counters = _serve(daemon, CB)
    want, _ = _serve(daemon, {"policy": "scls", "slice_len": 8})
    assert got == want
    # Long requests came back after S = 8 tokens and were granted again.
    assert counters["grants"] > len(got)
    assert counters["finished"] == len(got)


def test_grant_scheduler_is_built_for_scls_cb(daemon) -> None:
    async def body(h: Harness) -> None:
        s = h.server.sched
        assert isinstance(s, SliceGrantScheduler)
        assert s.policy.kv_reuse and s.grants.S == 8

    daemon(body, scheduler=CB)


def test_a_request_stays_on_the_worker_holding_its_kv(daemon) -> None:
    async def body(h: Harness) -> None:
        w0 = h.worker("w0")
        await h.registered("w0")
        conn = RecConn()
        await h.submit(conn, id="r", max_tokens=40, ignore_eos=True)
        await h.finished(conn, "r")
        batches = w0.served  # as the engine took them: rows whole
        assert len(batches) == 5 and all(b.slice_len == 8 and b.kv_reuse for b in batches)
        # Every grant after the first resumed the KV its predecessor kept: no re-prefill.
        assert [len(b.requests[0].token_ids) for b in batches] == [5 + 8 * k for k in range(5)]
        assert h.counters()["migrations"] == 0
        # On the wire the request went whole once; each later grant is its budget alone.
        sent = w0.batches()
        assert [len(b.requests) for b in sent] == [1, 0, 0, 0, 0]
        assert [(c.known, c.tail, c.max_new_tokens) for b in sent[1:] for c in b.cont] == [
            (5 + 8 * k, [], 40 - 8 * k) for k in range(1, 5)]

    daemon(body, scheduler=CB)


def test_reserved_kv_never_exceeds_the_budget(daemon) -> None:
    """A budget of ~100 tokens per worker: grants queue for room instead of overcommitting."""
    async def body(h: Harness) -> None:
        sched = h.server.sched
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
            h.worker(w, mem_budget=100 * 512, kv_bytes_per_token=512)
        await h.registered("w0", "w1")
        assert sched.token_budget() <= 100
        conn = RecConn()
        rids = [f"r{i}" for i in range(10)]
        for rid in rids:
            await h.submit(conn, id=rid, prompt="0123456789" * 2, max_tokens=30, ignore_eos=True)
        await h.finished(conn, *rids, timeout=10)
        assert all(isinstance(conn.terminal(r)[0], P.Done) for r in rids)
        assert max(seen) > 0.5 * sched.token_budget()  # the budget was the binding limit
        assert all(sched.grants.reserved(w) == 0 for w in sched.workers)

    daemon(body, scheduler=CB)


def test_worker_death_during_a_grant_loses_nothing(daemon) -> None:
    async def body(h: Harness) -> None:
        w0 = h.worker("w0", hold=True)
        await h.registered("w0")
        conn = RecConn()
        await h.submit(conn, id="a", max_tokens=20, ignore_eos=True)
        await h.submit(conn, id="b", max_tokens=20, ignore_eos=True)
        await held(w0, 2)
        w0.kill()
        h.tick(h.server.clock() + 60)
        assert "w0" not in h.members()
        assert h.server.sched.grants.queued == 2  # both wait again, first in line
        h.worker("w1")
        await h.finished(conn, "a", "b")
        for rid in ("a", "b"):
            (done,) = conn.terminal(rid)
            assert isinstance(done, P.Done) and done.worker == "w1"
            assert done.usage.completion_tokens == 20

    daemon(body, scheduler=CB)


def test_cancel_frees_the_grant_and_releases_kept_kv(daemon) -> None:
    async def body(h: Harness) -> None:
        w0 = h.worker("w0", hold=True)
        await h.registered("w0")
        conn = RecConn()
        await h.submit(conn, id="a", max_tokens=40, ignore_eos=True)
        await held(w0, 1)
        w0.release()  # first grant served: its KV is kept on w0
        await until(w0.got, lambda: len(w0.held) >= 1)
        h.server.on_client(conn, P.Cancel(id="a"))
        await conn.wait_for(lambda: bool(conn.terminal("a")))
        assert conn.terminal("a")[0].finish_reason == "cancelled"
        w0.release()  # the running grant's result comes back: the policy forgets "a"
        sched = h.server.sched
        a = daemon_id(conn, "a")  # what the daemon and its workers call it
        await until(h.wake, lambda: a not in sched.grants.grants_on("w0"))
        await until(w0.got, lambda: any(isinstance(m, P.Release) and a in m.rids for m in w0.received))
        assert sched.grants.reserved("w0") == 0 and sched.grants.queued == 0

    daemon(body, scheduler=CB)


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
