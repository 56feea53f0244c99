"""Tokens streamed during a slice, and the daemon's bookkeeping of KV that workers keep.

The serving core is driven synchronously (:class:`~.driving.WorkerDriver`, a fake clock):
workers are ``fake`` engines served by hand; they stream each iteration's tokens as a
``tokens`` message, and with ``serve(..., hold=True)`` the batch's ``result`` waits until
the test delivers it (``finish``), as if the slice were still running.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from sclsd import protocol as P
from sclsd.tokenizer import ByteTokenizer
from worker.engines.fake import FakeEngine

from .driving import WorkerDriver

PROMPT = "hello"


def reference(max_tokens: int, prompt: str = PROMPT) -> list[int]:
    """The fake engine's output for ``prompt`` in one pass (slicing does not change it)."""
    req = P.BatchRequest(rid="ref", token_ids=list(prompt.encode()), max_new_tokens=max_tokens,
                         temperature=0.0, ignore_eos=True)
    outs, _ = FakeEngine(kv_reuse=False).serve(P.BatchMsg(batch_id=1, slice_len=max_tokens, requests=[req]))
    return outs[0].token_ids


def streamed_ids(drv: WorkerDriver, rid: str, client: str = "c") -> list[int]:
    return [t for d in drv.events(client, P.Delta) if d.id == rid for t in d.token_ids]


def req(drv: WorkerDriver, rid: str) -> Any:
    """The scheduler's request of the live request ``rid``."""
    e = drv.core.table.get(rid)
    assert e is not None, f"{rid} is not live"
    return e.req


def kv_reuse(drv: WorkerDriver, on: bool = True) -> None:
    """Switch the daemon's policy to KV reuse (``scheduler.kv_reuse``): batches ask workers
    to use and keep KV across slices."""
    drv.core.sched.policy = dataclasses.replace(drv.core.sched.policy, kv_reuse=on)


@pytest.fixture
def drv(tmp_path: Path) -> WorkerDriver:
    return WorkerDriver(tmp_path)


def test_first_delta_arrives_before_its_slice_ends(drv: WorkerDriver) -> None:
    drv.join("w0")
    drv.submit("c", "s", max_tokens=20, stream=True, ignore_eos=True)  # at 100.0
    drv.step()
    drv.now += 0.5
    drv.serve("w0", hold=True)  # the slice's tokens stream at 100.5, its result waits
    # The slice's result has not been sent: the client already has tokens.
    assert len(drv.held_results["w0"]) == 1 and not drv.terminal("c", "s")
    first = drv.events("c", P.Delta)[0]
    assert first.token_ids == reference(20)[:1]
    assert req(drv, "s").first_token is not None
    assert drv.counters()["slices"] == 0  # the scheduler has not acted yet
    while not drv.terminal("c", "s"):
        drv.now += 0.5
        drv.finish("w0")
        drv.step()
        drv.serve("w0", hold=True)
    (done,) = drv.terminal("c", "s")
    assert done.finish_reason == "length" and done.timings.slices == 3  # S = 8
    # Every token once, in order, none twice (the results added nothing streamed again).
    assert streamed_ids(drv, "s") == reference(20)
    # The first token's time is when it streamed, not when its slice's result came (101.0).
    assert done.timings.ttft_s == 0.5 and done.timings.ttft_s < done.timings.e2e_s


class PartlyStreaming(FakeEngine):
    """Streams only the first token of each row per slice: the result brings the rest."""

    def serve(self, batch: P.BatchMsg, emit: Any = None) -> Any:
        def first_only(outputs: list[P.RequestOutput]) -> None:
            if emit is not None and not sent:
                sent.append(True)
                emit(outputs)

        sent: list[bool] = []
        return super().serve(batch, first_only)


def test_result_sends_only_what_was_not_streamed(drv: WorkerDriver) -> None:
    drv.join("w0", engine=PartlyStreaming())
    drv.submit("c", "s", max_tokens=20, stream=True, ignore_eos=True)
    drv.until_done("c", "s", stream=True)
    deltas = drv.events("c", P.Delta)
    # Per slice (8, 8, 4 tokens): one streamed token, then the result's remainder.
    assert [len(d.token_ids) for d in deltas] == [1, 7, 1, 7, 1, 3]
    assert streamed_ids(drv, "s") == reference(20)
    assert drv.terminal("c", "s")[0].usage.completion_tokens == 20


def test_non_streaming_request_gets_ttft_from_the_first_tokens(drv: WorkerDriver) -> None:
    drv.join("w0")
    drv.submit("c", "n", max_tokens=4, stream=False, ignore_eos=True)  # at 100.0
    drv.step()
    drv.now += 0.25
    drv.serve("w0", hold=True)  # its tokens at 100.25, its result held
    assert len(drv.held_results["w0"]) == 1
    assert req(drv, "n").first_token is not None
    assert not drv.events("c", P.Delta)
    drv.now += 0.25
    drv.finish("w0")
    (done,) = drv.terminal("c", "n")
    assert done.token_ids == reference(4) and done.timings.ttft_s == 0.25


def test_streamed_tokens_stand_when_the_worker_is_lost(drv: WorkerDriver) -> None:
    drv.join("w0")
    drv.submit("c", "s", max_tokens=20, stream=True, ignore_eos=True)
    drv.step()
    drv.serve("w0", hold=True)
    assert len(streamed_ids(drv, "s")) == 8  # the whole first slice
    drv.run(drv.core.worker_lost("w0", "test", "exited", drv.now))  # its result never comes
    r = req(drv, "s")
    assert r.num_generated == 8 and drv.core.table.get("s").out.ids == reference(20)[:8]
    drv.join("w1")
    drv.until_done("c", "s", wid="w1", stream=True)
    (done,) = drv.terminal("c", "s")
    assert done.worker == "w1" and done.usage.completion_tokens == 20
    assert streamed_ids(drv, "s") == reference(20)  # continued after them, none repeated


def test_streamed_end_of_a_row_finishes_it_when_the_worker_is_lost(drv: WorkerDriver) -> None:
    drv.join("w0")
    drv.submit("c", "s", max_tokens=5, stream=True, ignore_eos=True)
    drv.step()
    drv.serve("w0", hold=True)
    assert len(streamed_ids(drv, "s")) == 5 and not drv.terminal("c", "s")
    drv.run(drv.core.worker_lost("w0", "test", "exited", drv.now))  # no other worker: it ends there
    (done,) = drv.terminal("c", "s")
    assert done.finish_reason == "length" and done.usage.completion_tokens == 5
    assert streamed_ids(drv, "s") == reference(5)


def test_tokens_are_checked_like_results(drv: WorkerDriver) -> None:
    drv.join("w0")
    drv.join("w1")
    drv.submit("c", "s", max_tokens=3, stream=True, ignore_eos=True)
    drv.step()
    owner, other = ("w0", "w1") if drv.batches("w0") else ("w1", "w0")
    (b,) = drv.batches(owner)
    bid = b.batch_id

    def tokens(wid: str, batch_id: int, rid: str, ids: list[int]) -> None:
        drv.message(wid, P.Tokens(worker_id=wid, batches=[P.BatchTokens(
            batch_id=batch_id, outputs=[P.RequestOutput(rid=rid, token_ids=ids)])]))

    tokens(other, bid, "s", [7])  # not its batch
    tokens(owner, bid + 100, "s", [7])  # no such batch
    tokens(owner, bid, "nobody", [7])  # not a row of the batch
    tokens(owner, bid, "s", [50, 51, 52, 53, 54])  # past the budget of 3: capped
    assert streamed_ids(drv, "s") == [50, 51, 52]
    # The result is authoritative for the scheduler; nothing more goes out.
    drv.serve(owner)
    (done,) = drv.terminal("c", "s")
    assert streamed_ids(drv, "s") == [50, 51, 52]
    assert done.usage.completion_tokens == 3


# --------------------------------------------------------------------------- retained KV


def test_kv_worker_follows_results_and_ended_requests_are_released(drv: WorkerDriver) -> None:
    kv_reuse(drv)
    drv.join("w0")
    drv.submit("c", "k", max_tokens=40, ignore_eos=True)
    drv.step()
    drv.serve("w0")  # first slice: 8 tokens
    drv.now += 1.0
    drv.step()
    assert drv.batches("w0")  # the second slice is on its way: the first's result was applied
    r = req(drv, "k")
    assert r.kv_worker == "w0" and r.kv_tokens == len(PROMPT) + 8 - 1
    assert drv.engines["w0"].kv.store.held() == {"k": len(PROMPT) + 7}
    drv.serve("w0")
    drv.now += 1.0
    drv.step()
    assert drv.batches("w0")
    assert drv.counters()["reused_tokens"] == len(PROMPT) + 7
    assert drv.counters()["prefill_tokens"] == len(PROMPT) + 1
    drv.run(drv.core.cancel("k", drv.now, requester="c"))
    assert [m.rids for m in drv.to_worker["w0"] if isinstance(m, P.Release)] == [["k"]]
    assert drv.engines["w0"].kv.store.held() == {}


def test_a_request_moving_to_another_worker_is_released_on_the_old_one(drv: WorkerDriver) -> None:
    kv_reuse(drv)
    drv.join("w0")
    drv.submit("c", "m", max_tokens=20, ignore_eos=True)
    drv.step()
    assert drv.batches("w0")
    drv.run(drv.core.drain_worker("w0", False, "admin"))  # its next slice must go elsewhere
    drv.serve("w0")
    drv.now += 1.0
    drv.step()  # nowhere to go
    assert req(drv, "m").num_generated == 8
    assert req(drv, "m").kv_worker == "w0"  # kept there while it waits
    assert not any(isinstance(m, P.Release) for m in drv.to_worker["w0"])
    drv.join("w1")
    drv.step()
    assert drv.batches("w1")
    assert [m.rids for m in drv.to_worker["w0"] if isinstance(m, P.Release)] == [["m"]]
    assert drv.engines["w0"].kv.store.held() == {}
    assert req(drv, "m").kv_worker is None
    drv.until_done("c", "m", wid="w1")
    (done,) = drv.terminal("c", "m")
    assert done.worker == "w1" and done.token_ids == reference(20)


def test_evicted_kv_is_forgotten(drv: WorkerDriver) -> None:
    kv_reuse(drv)
    drv.submit("c", "a", max_tokens=20, ignore_eos=True)
    drv.submit("c", "b", max_tokens=20, ignore_eos=True)
    # Room for one retained context (5 + 7 tokens of 46,080 bytes), not two.
    drv.join("w0", kv_retain_bytes=20 * 46_080)
    drv.step()
    assert [len(b.requests) for b in drv.batches("w0")] == [2]  # both waited: one batch
    drv.serve("w0")
    drv.now += 1.0
    drv.step()
    kept = {rid: req(drv, rid).kv_worker for rid in ("a", "b")}
    assert sorted(kept.values(), key=str) == [None, "w0"]  # the first kept was evicted
    assert drv.counters()["kv_evicted"] == 1
    drv.serve("w0")
    drv.until_done("c", "a", "b")
    assert [drv.terminal("c", r)[0].token_ids for r in ("a", "b")] == [reference(20)] * 2


def test_dead_worker_forgets_its_kv(drv: WorkerDriver) -> None:
    kv_reuse(drv)
    drv.join("w0")
    drv.submit("c", "d", max_tokens=20, ignore_eos=True)
    drv.step()
    drv.serve("w0")
    drv.now += 1.0
    drv.step()
    assert req(drv, "d").kv_worker == "w0"
    drv.run(drv.core.worker_lost("w0", "test", "exited", drv.now))
    assert req(drv, "d").kv_worker is None and req(drv, "d").kv_tokens == 0


def test_without_kv_reuse_workers_keep_nothing(drv: WorkerDriver) -> None:
    kv_reuse(drv, False)
    drv.join("w0")
    drv.submit("c", "p", max_tokens=20, ignore_eos=True)
    drv.until_done("c", "p")
    sent = [m for m in drv.to_worker["w0"] if isinstance(m, P.BatchMsg)]
    assert len(sent) == 3 and all(not b.kv_reuse for b in sent)
    assert drv.counters()["reused_tokens"] == 0
    assert drv.terminal("c", "p")[0].token_ids == reference(20)


def test_a_stop_string_seen_in_streamed_text_ends_the_request_and_its_row_at_once(drv: WorkerDriver) -> None:
    full = ByteTokenizer().decode(reference(20))
    stop = "s"  # completed by the fifth token, in the first slice
    assert full.index(stop) > 0 and ByteTokenizer().decode(reference(20)[:5]).endswith(stop)

    drv.join("w0")
    drv.submit("c", "s", max_tokens=20, stream=True, ignore_eos=True, stop=[stop])
    drv.step()
    (batch,) = drv.serve("w0", hold=True)
    assert drv.events("c", P.Delta)
    (done,) = drv.terminal("c", "s")  # as the stop string streamed, not at the slice's end
    assert done.finish_reason == "stop" and done.timings.slices == 0
    # Its worker is told to end the row: the engine computes nothing more for it.
    cancels = [m for m in drv.to_worker["w0"] if isinstance(m, P.CancelRows)]
    assert cancels == [P.CancelRows(rows=[P.CancelRow(batch.batch_id, "s")])]
    drv.finish("w0")  # the slice's result changes nothing
    assert drv.terminal("c", "s") == [done]
    text = "".join(d.text for d in drv.events("c", P.Delta))
    assert stop not in text and full.startswith(text)
    assert streamed_ids(drv, "s") == reference(20)[:5]  # up to the one completing it
    assert done.usage.completion_tokens == 5


def test_done_counts_the_prompt_tokens_a_slice_took_from_kept_kv(drv: WorkerDriver) -> None:
    kv_reuse(drv)
    drv.join("w0")
    drv.submit("c", "one", max_tokens=4, ignore_eos=True)  # a single slice
    drv.submit("c", "many", max_tokens=30, ignore_eos=True)  # slices 2.. reuse the prompt
    drv.until_done("c", "one", "many")
    (one,), (many,) = drv.terminal("c", "one"), drv.terminal("c", "many")
    assert one.usage.cached_tokens == 0
    assert many.usage.cached_tokens == many.usage.prompt_tokens == len(PROMPT)
