"""A row the engine could not serve (``RequestOutput.error``: its grammar did not build) ends
that request alone with ``bad_request``, once: never re-queued, its worker still a member,
its batch's other rows served as usual."""

from __future__ import annotations

from pathlib import Path

import pytest

from sclsd import protocol as P

from .test_core import Driver


@pytest.fixture
def drv(tmp_path: Path) -> Driver:
    return Driver(tmp_path)


def test_a_row_error_ends_that_request_with_bad_request_once_and_nothing_else(drv: Driver) -> None:
    drv.join("w0")
    drv.submit("c", "bad", max_tokens=20)
    drv.submit("c", "ok", max_tokens=20)
    drv.step()
    (batch,) = drv.batches("w0")
    assert {r.rid for r in batch.requests} == {"bad", "ok"}
    drv.served.add(batch.batch_id)
    drv.whole.pop(batch.batch_id)  # served by hand below (the worker keeps both records)
    rest = P.BatchMsg(batch_id=batch.batch_id, slice_len=batch.slice_len,
                      requests=[r for r in batch.requests if r.rid == "ok"], kv_reuse=batch.kv_reuse)
    outputs, stats = drv.engines["w0"].serve(rest)
    why = "request 'bad': its grammar could not be built: panic: too many symbols"
    outputs.append(P.RequestOutput(rid="bad", token_ids=[], error=why))
    drv.rows["w0"].served(outputs)
    drv.message("w0", P.Result(worker_id="w0", batch_id=batch.batch_id, outputs=outputs, stats=stats))

    (err,) = drv.terminal("c", "bad")
    assert isinstance(err, P.Error) and err.code == "bad_request" and err.message == why
    assert "bad" not in drv.core.table and "bad" not in drv.core.sched.live
    assert drv.lost == [] and "w0" in drv.core.members
    assert drv.core.sched.stats().failed == 1
    # The bystander goes on; the failed request never reaches a worker again.
    drv.until_done("c", "ok")
    (done,) = drv.terminal("c", "ok")
    assert isinstance(done, P.Done) and done.usage.completion_tokens == 20
    sent = [r.rid for m in drv.to_worker["w0"] if isinstance(m, P.BatchMsg) for r in m.requests]
    assert sent.count("bad") == 1 and len(drv.terminal("c", "bad")) == 1


def test_the_ended_request_counts_as_failed_with_its_code(drv: Driver) -> None:
    drv.join("w0")
    drv.submit("c", "bad")
    drv.step()
    (batch,) = drv.batches("w0")
    drv.served.add(batch.batch_id)
    eff = drv.core.worker_message("w0", P.Result(worker_id="w0", batch_id=batch.batch_id, outputs=[
        P.RequestOutput(rid="bad", token_ids=[], error="no grammar")]), drv.now)
    (job,) = eff.decode
    eff = drv.core.decoded(job, [drv.tok.decode(s) for s in job.seqs], drv.now)
    (ended,) = eff.ended
    assert ended.rid == "bad" and ended.reason == "error" and ended.code == "bad_request"


def test_a_row_carries_the_grammar_admission_compiled_with_the_configured_limits(tmp_path: Path) -> None:
    drv = Driver(tmp_path, grammar={"max_grammar_size": 1234})
    drv.join("w0")
    drv.submit("c", "g", structured=P.Structured(kind="json_object"))
    drv.submit("c", "plain")
    drv.core.table.get("g").grammar = "GRAMMAR TEXT"  # what admission's grammar child returned
    drv.step()
    (batch,) = drv.batches("w0")
    rows = {r.rid: r for r in batch.requests}
    assert rows["g"].grammar == "GRAMMAR TEXT" and rows["g"].grammar_limits == P.GrammarLimits(max_grammar_size=1234)
    assert rows["plain"].grammar is None and rows["plain"].grammar_limits is None
