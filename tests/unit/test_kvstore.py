"""The retained-KV store (no torch: sizes only) and the worker's token stream coalescing."""

from __future__ import annotations

import threading

from sclsd import protocol as P
from worker.engines.kvstore import KVStore, Retained, common_prefix


def entry(tokens: list[int], per_token: int = 10) -> Retained:
    return Retained(list(tokens), len(tokens) * per_token)


def test_common_prefix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 3, 4], 3) == 3
    assert common_prefix([1, 2, 3], [1, 2, 3], 2) == 2  # capped: the last token is recomputed
    assert common_prefix([1, 9, 3], [1, 2, 3], 5) == 1
    assert common_prefix([5], [6], 1) == 0
    assert common_prefix([1, 2], [1, 2], -1) == 0


def test_take_checks_out_the_usable_prefix() -> None:
    s = KVStore(1000)
    assert s.put("a", entry([1, 2, 3, 4]))
    e, used = s.take("a", [1, 2, 3, 4, 5])
    assert e is not None and used == 4
    assert s.nbytes == 0 and s.held() == {}  # out for the batch
    s.done(["a"])
    assert s.put("a", entry([1, 2, 3, 4, 5, 6]))
    assert s.take("a", [7, 8])[1] == 0  # another context under the same id: not usable
    assert s.take("missing", [1]) == (None, 0)


def test_lru_eviction_within_the_budget_reports_each_once() -> None:
    s = KVStore(100)
    s.put("a", entry([1] * 4))
    s.put("b", entry([2] * 4))
    s.take("a", [1] * 5)
    s.done(["a"])
    s.put("a", entry([1] * 5))  # a is now the most recently used
    s.put("c", entry([3] * 4))  # 50 + 40 + 40 > 100: b goes
    assert list(s.held()) == ["a", "c"] and s.nbytes == 90
    assert s.take_evicted() == ["b"] and s.take_evicted() == []
    assert not s.put("huge", entry([0] * 11))  # larger than the whole budget: not kept
    assert list(s.held()) == ["a", "c"]


def test_make_room_beside_a_batch() -> None:
    s = KVStore(1000)
    for rid in "abc":
        s.put(rid, entry([ord(rid)] * 10))
    s.make_room(150)
    assert list(s.held()) == ["c"] and s.take_evicted() == ["a", "b"]
    s.make_room(-5)
    assert s.held() == {} and s.take_evicted() == ["c"]


def test_release_reaches_entries_out_for_a_batch() -> None:
    s = KVStore(1000)
    s.put("a", entry([1, 2]))
    s.put("b", entry([3, 4]))
    s.take("a", [1, 2, 3])
    s.release(["a", "b"])
    assert s.held() == {}
    assert not s.put("a", entry([1, 2, 3]))  # released while its batch ran
    s.done(["a"])
    assert s.put("a", entry([1, 2, 3]))  # a later batch may keep it again
    s.take("a", [1, 2, 3, 4])
    s.release()  # all, those out included
    assert not s.put("a", entry([1, 2, 3, 4])) and s.held() == {}
    assert s.take_evicted() == []  # released is not evicted


def test_concurrent_release_and_put_keep_the_byte_count_exact() -> None:
    s = KVStore(10**9)
    stop = threading.Event()

    def releaser() -> None:
        while not stop.is_set():
            s.release(["r3", "r7"])

    t = threading.Thread(target=releaser)
    t.start()
    try:
        for k in range(2000):
            rid = f"r{k % 10}"
            s.take(rid, [k, k + 1])
            s.put(rid, entry([k]))
            s.done([rid])
    finally:
        stop.set()
        t.join()
    assert s.nbytes == sum(v * 10 for v in s.held().values())


def test_token_stream_coalesces_every_running_batch_into_one_message() -> None:
    from worker.serve import TokenStream

    now = [0.0]
    sent: list[P.Tokens] = []
    stream = TokenStream(lambda b: sent.append(P.worker_decoder.decode(b)), "w", interval=0.02,
                         clock=lambda: now[0])

    def emit(bid: int, rid: str, *ids: int, reason: str | None = None) -> None:
        stream(bid, [P.RequestOutput(rid=rid, token_ids=list(ids), finish_reason=reason)])  # type: ignore[arg-type]

    def parts(m: P.Tokens) -> dict[int, list[P.RequestOutput]]:
        return {p.batch_id: p.outputs for p in m.batches}

    emit(7, "a", 1)  # a batch's first tokens go at once
    assert [parts(m) for m in sent] == [{7: [P.RequestOutput(rid="a", token_ids=[1])]}]
    now[0] = 0.005
    emit(7, "a", 2)
    emit(7, "b", 9)
    now[0] = 0.015
    emit(7, "a", 3, reason="length")
    assert len(sent) == 1  # within 20 ms of the last send: held
    emit(8, "c", 5)  # another batch's first tokens: out at once, with what was held
    assert len(sent) == 2 and sent[1].worker_id == "w"
    # Each row's part starts where its previous one ended (a's first part had one token).
    assert parts(sent[1]) == {7: [P.RequestOutput(rid="a", token_ids=[2, 3], start=1, finish_reason="length"),
                                  P.RequestOutput(rid="b", token_ids=[9])],
                              8: [P.RequestOutput(rid="c", token_ids=[5])]}
    now[0] = 0.02
    emit(7, "b", 10)
    emit(8, "c", 6)
    # Batch 8 ended: its pending tokens go with its result, after the one streamed.
    assert stream.end(8) == {"c": 1}
    now[0] = 0.04
    emit(7, "b", 11)
    assert len(sent) == 3 and parts(sent[2]) == {7: [P.RequestOutput(rid="b", token_ids=[10, 11], start=1)]}
    assert stream.sent == 3
    assert stream.end(7) == {"a": 3, "b": 3}


def test_host_tier_takes_what_does_not_fit_beside_a_batch() -> None:
    moved: list[list[int]] = []

    def to_host(e: Retained) -> Retained:
        moved.append(e.tokens)
        return Retained(e.tokens, e.nbytes, "copied")

    s = KVStore(1000, host_budget=90, to_host=to_host)
    for rid in "abc":
        s.put(rid, entry([ord(rid)] * 4))  # 40 bytes each
    s.make_room(50)  # a and b move out (a first: least recently used), c stays
    assert s.on_host() == ["a", "b"] and s.nbytes == 40 and s.host_nbytes == 80
    assert moved == [[97] * 4, [98] * 4] and s.take_evicted() == []
    e, used = s.take("a", [97] * 5)
    assert e is not None and e.kv == "copied" and e.on_host and used == 4
    assert s.host_nbytes == 40
    s.put("d", entry([100] * 5))
    s.make_room(0)  # c and d go to the host; b, the oldest there, is evicted to fit them
    assert s.on_host() == ["c", "d"] and s.nbytes == 0 and s.host_nbytes == 90
    assert s.take_evicted() == ["b"]
    s.release()
    assert s.host_nbytes == 0 and s.held() == {}


def test_a_result_carries_only_what_the_stream_did_not() -> None:
    from worker.serve import result_rows

    outs = [P.RequestOutput(rid="a", token_ids=[1, 2, 3, 4], finish_reason="stop",
                            logprobs=[P.TokenLogprobs(chosen=(i, -0.5)) for i in (1, 2, 3, 4)]),
            P.RequestOutput(rid="b", token_ids=[5, 6], kv_tokens=9),
            P.RequestOutput(rid="c", token_ids=[])]
    a, b, c = result_rows(outs, {"a": 3, "b": 2, "c": 0})
    assert (a.token_ids, a.start, a.finish_reason) == ([4], 3, "stop") and [x.chosen for x in a.logprobs] == [(4, -0.5)]
    assert (b.token_ids, b.start, b.kv_tokens) == ([], 2, 9)
    assert c == outs[2]
    (d,) = result_rows(outs[1:2], {})  # nothing streamed: the row as the engine gave it
    assert d == outs[1]


HEAD = list(range(100, 116))  # MIN_PREFIX tokens


def test_cached_prefixes_serve_the_longest_head_and_never_cost_kept_kv() -> None:
    """A cached prefix serves a context that begins with at least MIN_PREFIX of its tokens (the
    longest one, all but the context's last token at most); it takes only the room kept KV
    leaves, goes first when kept KV wants room (never reported evicted), goes when a newer one
    extends it, and a release of everything drops it."""
    s = KVStore(500)
    assert not s.keep_prefix(entry(HEAD[:15]))  # shorter than MIN_PREFIX
    assert s.keep_prefix(entry(HEAD + [1, 2, 3]))  # 190 bytes
    assert s.keep_prefix(entry(HEAD + [7]))  # 170 bytes
    assert s.prefix(HEAD[:15] + [0, 1]) == (None, 0)  # a head of 15 alike: too short
    got, used = s.prefix(HEAD + [1, 2, 9, 9])
    assert got is not None and got.tokens == HEAD + [1, 2, 3] and used == 18
    assert s.prefix(HEAD + [1, 2, 3])[1] == 18  # the context's last token is always computed
    assert s.prefix(HEAD + [7, 8], take=True)[1] == 17 and s.prefix_counts["hits"] == 1
    assert s.prefixes() == [19, 17]  # the one just taken is the most recently used
    assert s.held() == {}  # nobody's
    # A newer prefix that extends one replaces it.
    assert s.keep_prefix(entry(HEAD + [1, 2, 3, 4]))
    assert s.prefixes() == [17, 20] and s.nbytes == 370
    # Kept KV takes the room: the least recently used prefix goes first, unreported.
    assert s.put("a", entry([5] * 20))  # 200 bytes: 570 > 500
    assert s.prefixes() == [20] and s.take_evicted() == [] and s.held() == {"a": 20}
    # A prefix never costs kept KV: with no room left beside it, it is not kept.
    assert s.put("b", entry([6] * 12))  # 120 more: the last prefix goes too
    assert s.prefixes() == [] and s.take_evicted() == []
    assert not s.keep_prefix(entry(HEAD + [0] * 34))  # 500 bytes, 320 held by kept KV
    assert s.held() == {"a": 20, "b": 12} and s.nbytes == 320
    assert s.keep_prefix(entry(HEAD + [0] * 2))
    assert s.nbytes == s.prefix_bytes + 320 == 500
    s.release(["a"])
    assert s.prefixes() == [18]  # a request's release leaves the prefixes
    s.release()
    assert s.prefixes() == [] and s.nbytes == 0 and s.prefix_bytes == 0


def test_cached_prefixes_give_way_before_a_copy_needs_their_memory() -> None:
    s = KVStore(500)
    assert s.keep_prefix(entry(HEAD + [1] * 4)) and s.keep_prefix(entry([7] + HEAD + [2] * 3))  # 200 each
    s.free_room(100)  # 400 + 100 fit
    assert s.prefixes() == [20, 20]
    s.free_room(150)  # the least recently kept goes
    assert s.prefixes() == [20] and s.nbytes == 200
    s.free_room(1000)  # more than the budget: every prefix goes, nothing else
    assert s.prefixes() == [] and s.nbytes == 0


def test_a_turn_out_of_memory_halves_what_cached_prefixes_may_hold() -> None:
    """After a turn that ran out of device memory the prefixes go and may hold half of what
    they held then, again at each such turn; one that found none held changes nothing. New
    prefixes stay within the limit, copies are made only into room within it, and kept KV
    is never limited by it."""
    s = KVStore(1000)
    assert s.keep_prefix(entry(HEAD + [1] * 4)) and s.keep_prefix(entry([7] + HEAD + [2] * 3))  # 200 each
    assert s.prefix_room() == 1000
    assert s.shrink_prefixes(0.0) == (2, 200)  # they held 400
    assert s.prefixes() == [] and s.prefix_room() == 200 and s.prefix_bytes == 0
    assert s.keep_prefix(entry(HEAD + [3] * 4))
    assert s.keep_prefix(entry([8] + HEAD + [4] * 3))  # 200 + 200 > 200: the older goes
    assert s.prefixes() == [20] and s.prefix_bytes == 200
    assert not s.keep_prefix(entry(HEAD + [5] * 6))  # 220 on its own: over the limit
    s.free_room(100)  # kept KV: within the budget, the limit does not count
    assert s.prefixes() == [20]
    s.free_room(100, prefixes=True)  # a prefix's copy: only into room within the limit
    assert s.prefixes() == []
    assert s.put("a", entry([6] * 60))  # 600 bytes of kept KV, past the prefixes' limit
    assert s.keep_prefix(entry(HEAD + [9] * 4)) and s.shrink_prefixes(1.0) == (1, 100)
    assert s.shrink_prefixes(2.0) == (0, 100)  # none held: nothing to learn from
    assert s.held() == {"a": 60}


def test_cached_prefixes_may_hold_more_again_after_a_quiet_while() -> None:
    """After PREFIX_REGROW_S with no turn out of device memory the prefixes' limit doubles (at
    least an eighth of the budget more), again after each such wait, up to the budget; a turn
    out of memory in between halves it and restarts the wait. Without a limit it never moves."""
    from worker.engines.kvstore import PREFIX_REGROW_S as W

    s = KVStore(1600)
    assert not s.regrow_prefixes(10 * W) and s.prefix_limit == 1600
    assert s.keep_prefix(entry(HEAD + [1] * 4)) and s.keep_prefix(entry([7] + HEAD + [2] * 3))  # 200 each
    assert s.shrink_prefixes(now=100.0) == (2, 200)
    assert not s.regrow_prefixes(100.0 + W - 1) and s.prefix_limit == 200  # not yet
    assert s.regrow_prefixes(100.0 + W) and s.prefix_limit == 400  # twice 200
    assert not s.regrow_prefixes(100.0 + W + 1)  # the wait starts again
    assert s.keep_prefix(entry(HEAD + [3] * 4)) and s.keep_prefix(entry([8] + HEAD + [4] * 3))
    assert s.prefix_bytes == 400 and s.prefixes() == [20, 20]  # both fit the limit that grew
    assert s.shrink_prefixes(now=100.0 + 1.5 * W) == (2, 200)  # out of memory again: halved
    assert not s.regrow_prefixes(100.0 + 2 * W)  # half a wait since
    t = 100.0 + 2.5 * W
    for limit in (400, 800, 1600):
        assert s.regrow_prefixes(t) and s.prefix_limit == limit
        t += W
    assert not s.regrow_prefixes(t + 10 * W) and s.prefix_limit == 1600  # the budget: no limit left
    # From nothing held at all: an eighth of the budget more at each wait.
    s = KVStore(1600)
    s.prefix_limit = 0
    s.shrink_prefixes(now=0.0)
    assert s.regrow_prefixes(W) and s.prefix_limit == 200
