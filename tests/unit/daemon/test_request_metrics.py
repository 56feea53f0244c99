"""The daemon's request metrics: through the in-process transport, the ``model_name``
label and refusals by reason (the shell's); on the serving core driven synchronously with
a fake clock (:mod:`.driving`), how requests end (completed, cancelled, failed) and the
durations: the queue time counting the time a batch waits in its worker's queue, and the
longest gap between a stream's deltas, each exact."""

from __future__ import annotations

import asyncio
from pathlib import Path

from sclsd import protocol as P
from sclsd.daemon.server import Server
from sclsd.tokenizer import ByteTokenizer
from unit.inproc import InprocTransport

from .conftest import Harness, RecConn, make_config
from .driving import TimedDriver, exported
from .scrape import scrape, value

# Fake-clock durations, binary fractions so that their sums are exact.
#: From acceptance to the dispatch of a batch (the scheduler's round).
DISPATCH_S = 0.125
#: A worker's queue wait the tests hold a batch for (the queue time must count it).
HOLD_S = 0.25
#: How long the engine runs a slice, from its start to its result.
RUN_S = 0.5


def test_every_series_carries_the_served_model_name(daemon) -> None:
    async def body(h: Harness) -> None:
        h.worker("w0")
        await h.registered("w0")
        conn = RecConn()
        await h.submit(conn, id="r", max_tokens=4)
        await h.finished(conn, "r")
        samples = scrape(h.server)
        names = {n for n, _ in samples}
        assert {"sclsd:request_success_total", "sclsd:e2e_request_latency_seconds_bucket",
                "sclsd:num_requests_waiting", "sclsd:worker_load_seconds"} <= names
        # Every series but the process's own (process_*: CPU, memory, descriptors).
        assert {dict(ls).get("model_name") for n, ls in samples if not n.startswith("process_")} == {
            "served-name"}

    daemon(body, http={"model_name": "served-name"})


def test_the_model_name_defaults_to_the_daemons_model(daemon) -> None:
    async def body(h: Harness) -> None:
        assert {dict(ls).get("model_name") for n, ls in scrape(h.server)
                if not n.startswith("process_")} == {"fake"}

    daemon(body)


def test_cancelled_and_failed_requests_are_not_successes(tmp_path: Path) -> None:
    drv = TimedDriver(tmp_path)
    drv.join("w0")
    drv.submit("k", "c", max_tokens=100)
    drv.step()
    assert drv.batches("w0")  # on the worker, not served
    drv.run(drv.core.cancel("c", drv.now, requester="k"))
    drv.submit("k", "t", max_tokens=100, timeout=0.05)
    drv.now += 0.05
    drv.step()  # its deadline: it ends where it waits
    drv.submit("k", "f", max_tokens=100)
    drv.run(drv.core.fail_all("shutdown", "test", drv.now))
    drv.serve("w0")  # the cancelled request's late result changes nothing
    drv.submit("k", "ok", max_tokens=8, ignore_eos=True)
    drv.until_done("k", "ok")
    assert [drv.terminal("k", r)[0].__class__.__name__ for r in ("c", "t", "f", "ok")] == [
        "Done", "Done", "Error", "Done"]
    s = exported(drv.metrics)
    assert value(s, "sclsd:request_success_total", finished_reason="length") == 1
    assert value(s, "sclsd:request_success_total", finished_reason="cancelled") == 0
    assert value(s, "sclsd:request_cancelled_total", reason="cancelled") == 1
    assert value(s, "sclsd:request_cancelled_total", reason="timeout") == 1
    assert value(s, "sclsd:request_failed_total", reason="shutdown") == 1
    # Each request in one series: two cancelled, one failed, one completed.
    assert sum(v for (n, _), v in s.items() if n == "sclsd:request_failed_total") == 1
    assert sum(v for (n, _), v in s.items() if n == "sclsd:request_success_total") == 1
    # Latency and size histograms count the completed request alone.
    assert value(s, "sclsd:e2e_request_latency_seconds_count") == 1
    assert value(s, "sclsd:request_generation_tokens_count") == 1


def test_refusals_are_counted_by_code_and_the_bound_that_refused(daemon) -> None:
    async def body(h: Harness) -> None:
        h.worker("w0", hold=True)
        await h.registered("w0")
        conn = RecConn(uid=1001)
        await h.submit(conn, id="a", max_tokens=100)
        await h.submit(conn, id="b", max_tokens=100)  # one uid holds at most 1 of 2
        await h.submit(RecConn(cid=2, uid=1002), id="c", prompt="x" * 40)  # 40 > 32 tokens
        await h.submit(conn, id="f", prompt="x", prompt_ids=[1])
        await h.submit(conn, id="g", min_tokens=200, max_tokens=10)
        await h.submit(RecConn(cid=3, uid=1003), id="d", max_tokens=100)
        await h.submit(RecConn(cid=4, uid=1004), id="e", max_tokens=100)  # 2 live: full
        s = scrape(h.server)
        refused = {(dict(ls)["code"], dict(ls)["reason"]): v for (n, ls), v in s.items()
                   if n == "sclsd:request_refused_total"}
        assert refused == {("overloaded", "uid_share"): 1, ("overloaded", "max_queued_tokens"): 1,
                           ("overloaded", "max_queued_requests"): 1, ("bad_request", "prompt_forms"): 1,
                           ("bad_request", "min_tokens"): 1}
        assert h.server.snapshot().counters["refused"] == 5

    daemon(body, daemon={"max_queued_requests": 2, "uid_share": 0.5, "max_queued_tokens": 32})


def test_a_daemon_still_starting_counts_its_refusals(tmp_path: Path) -> None:
    async def main() -> None:
        server = Server(make_config(tmp_path), transport=InprocTransport(), tokenizer=ByteTokenizer())
        try:
            conn = RecConn()
            server.on_client(conn, P.Generate(id="early", prompt="hi"))
            assert conn.sent[-1].code == "starting"
            assert server.metrics.refusals.values == {("starting", "starting"): 1.0}
        finally:
            await server.stop()

    asyncio.run(main())


def test_queue_time_counts_the_wait_in_the_workers_queue(tmp_path: Path) -> None:
    """The batch goes to the worker at once; it waits there before it runs. The queue time
    (the histogram and ``done.timings.queued_s``) is the dispatch plus that wait, not the
    dispatch's alone, nor the slice's run."""
    drv = TimedDriver(tmp_path)
    drv.join("w0")
    arrival = drv.now
    drv.submit("c", "q", max_tokens=8, ignore_eos=True)  # one slice
    drv.now += DISPATCH_S
    drv.step()
    (batch,) = drv.batches("w0")
    e = drv.core.table.get("q")
    assert e is not None and e.sent_at == arrival + DISPATCH_S
    drv.now += HOLD_S  # the batch waits in the worker's queue this long
    drv.serve("w0", run_s=RUN_S)
    (done,) = drv.terminal("c", "q")
    assert isinstance(done, P.Done) and done.usage.completion_tokens == 8
    assert done.timings.queued_s == DISPATCH_S + HOLD_S
    assert done.timings.e2e_s == DISPATCH_S + HOLD_S + RUN_S
    (ended,) = drv.ended
    assert ended.started and ended.timings == done.timings
    s = exported(drv.metrics)
    assert value(s, "sclsd:request_queue_time_seconds_count") == 1
    assert value(s, "sclsd:request_queue_time_seconds_bucket", le="0.25") == 0  # > HOLD_S alone
    assert value(s, "sclsd:request_queue_time_seconds_bucket", le="0.5") == 1
    assert value(s, "sclsd:request_queue_time_seconds_sum") == DISPATCH_S + HOLD_S
    assert value(s, "sclsd:e2e_request_latency_seconds_sum") == DISPATCH_S + HOLD_S + RUN_S


def test_a_request_no_worker_started_has_no_queue_time(tmp_path: Path) -> None:
    drv = TimedDriver(tmp_path)
    drv.submit("c", "t", timeout=0.5)  # no worker: it can only wait, then time out
    drv.now += 1.0
    drv.step()
    (done,) = drv.terminal("c", "t")
    assert done.finish_reason == "timeout"
    assert done.timings.queued_s == done.timings.e2e_s == 1.0  # it waited all its life
    (ended,) = drv.ended
    assert not ended.started
    s = exported(drv.metrics)
    assert value(s, "sclsd:request_queue_time_seconds_count") == 0
    assert value(s, "sclsd:request_cancelled_total", reason="timeout") == 1


def test_the_longest_gap_between_deltas_is_measured_per_request(tmp_path: Path) -> None:
    """A request served in two slices whose second batch waits in its worker's queue: the
    stream freezes between its deltas from the first slice's last token to the second
    slice's first (the round that dispatches it, then the wait). ``done.timings.max_gap_s``,
    the gap histogram and the inter-token latencies say so."""
    drv = TimedDriver(tmp_path)
    drv.join("w0")
    drv.submit("c", "g", max_tokens=16, ignore_eos=True, stream=True)  # 2 slices of 8
    drv.now += DISPATCH_S
    drv.step()
    drv.serve("w0", stream=True)  # the first slice runs at once: its 8 tokens stream now
    assert len(drv.events("c", P.Delta)) == 8 and not drv.terminal("c", "g")
    drv.now += DISPATCH_S
    drv.step()
    (second,) = drv.batches("w0")
    drv.now += HOLD_S  # held in the worker's queue: the stream freezes this long
    drv.serve("w0", stream=True)
    (done,) = drv.terminal("c", "g")
    assert done.timings.slices == 2 and done.usage.completion_tokens == 16
    assert done.timings.ttft_s == DISPATCH_S
    assert done.timings.max_gap_s == DISPATCH_S + HOLD_S
    assert done.timings.e2e_s - done.timings.ttft_s == DISPATCH_S + HOLD_S  # the one freeze
    (ended,) = drv.ended
    # Tokens of a slice arrive together; the freeze is the one gap that is not 0.
    assert sorted(ended.token_gaps) == [(0.0, 1)] * 14 + [(DISPATCH_S + HOLD_S, 1)]
    s = exported(drv.metrics)
    assert value(s, "sclsd:request_max_inter_token_gap_seconds_count") == 1
    assert value(s, "sclsd:request_max_inter_token_gap_seconds_bucket", le="0.25") == 0
    assert value(s, "sclsd:request_max_inter_token_gap_seconds_bucket", le="0.5") == 1
    assert value(s, "sclsd:request_max_inter_token_gap_seconds_sum") == DISPATCH_S + HOLD_S
    assert value(s, "sclsd:inter_token_latency_seconds_count") == 15
    assert value(s, "sclsd:inter_token_latency_seconds_sum") == DISPATCH_S + HOLD_S


def test_a_single_token_has_no_gap(daemon) -> None:
    async def body(h: Harness) -> None:
        h.worker("w0")
        await h.registered("w0")
        conn = RecConn()
        await h.submit(conn, id="one", max_tokens=1, stream=True)
        await h.finished(conn, "one")
        (done,) = conn.terminal("one")
        assert done.timings.max_gap_s is None
        assert value(scrape(h.server), "sclsd:request_max_inter_token_gap_seconds_count") == 0

    daemon(body)


def test_the_series_an_operator_of_vllm_expects(daemon) -> None:
    async def body(h: Harness) -> None:
        h.worker("w0")
        await h.registered("w0")
        conn = RecConn()
        await h.submit(conn, id="s", prompt_ids=[5, 6, 7], max_tokens=20, stream=True, ignore_eos=True)
        await h.finished(conn, "s")
        h.lose("w0", "test", "stalled")
        s = scrape(h.server)
        done = conn.terminal("s")[0]
        # One observation per token after the first, however the tokens were grouped.
        assert value(s, "sclsd:inter_token_latency_seconds_count") == done.usage.completion_tokens - 1
        assert value(s, "sclsd:request_prefill_time_seconds_count") == 1
        assert value(s, "sclsd:request_decode_time_seconds_count") == 1
        assert value(s, "sclsd:worker_restarts_total", reason="stalled") == 1
        assert value(s, "sclsd:worker_restarts_total", reason="exited") == 0  # preset at 0
        assert ("sclsd:num_preemptions_total", frozenset({("model_name", "fake")})) in s
        assert value(s, "sclsd:prefix_cache_queries_total") >= 3  # the prompt's context tokens
        assert any(n == "process_cpu_seconds_total" for n, _ in s)
        # sclsd's own come first, the process's after them (`sclsctl metrics | head`).
        names = [line.split("{")[0].split(" ")[0] for line in h.server.metrics.exposition().splitlines()
                 if line and not line.startswith("#")]
        assert names[0].startswith("sclsd:") and names[-1].startswith("process_")

    daemon(body)
