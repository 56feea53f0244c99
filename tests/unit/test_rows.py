"""A worker's records (:mod:`worker.rows`): continued rows come back whole, records grow
by what the worker generated and go when the row finishes, the daemon says so, or the
worker registers again; a row it holds no record of is named, nothing served."""

from __future__ import annotations

import threading

import msgspec
import pytest

from sclsd import protocol as P
from worker.rows import RowBook, UnknownRows


def whole(rid: str, ids: list[int], **kw: object) -> P.BatchRequest:
    return P.BatchRequest(rid=rid, token_ids=ids, max_new_tokens=8, temperature=0.5, seed=3,
                          grammar="start: /a+/", **kw)  # type: ignore[arg-type]


def test_a_continued_row_is_the_whole_row_with_its_context_grown() -> None:
    book = RowBook()
    first = P.BatchMsg(batch_id=1, slice_len=4, requests=[whole("a", [1, 2, 3])])
    assert book.expand(first) is first  # whole rows pass as they are
    book.served([P.RequestOutput(rid="a", token_ids=[7, 8])])
    nxt = book.expand(P.BatchMsg(batch_id=2, slice_len=4, requests=[],
                                 cont=[P.ContinueRow(rid="a", max_new_tokens=6, known=5, generated=2)]))
    (row,) = nxt.requests
    # Its prompt, parameters and grammar from the record; its budget and count from the delta.
    assert row == msgspec.structs.replace(whole("a", [1, 2, 3, 7, 8]), max_new_tokens=6, generated=2)
    assert nxt.cont == [] and nxt.batch_id == 2


def test_known_cuts_what_the_daemon_did_not_keep_and_tail_adds_what_the_worker_lacks() -> None:
    book = RowBook()
    book.expand(P.BatchMsg(batch_id=1, slice_len=4, requests=[whole("a", [1, 2])]))
    book.served([P.RequestOutput(rid="a", token_ids=[5, 6, 7])])
    out = book.expand(P.BatchMsg(batch_id=2, slice_len=4, requests=[],
                                 cont=[P.ContinueRow(rid="a", max_new_tokens=2, known=3, tail=[9, 9])]))
    assert out.requests[0].token_ids == [1, 2, 5, 9, 9] and book.context("a") == [1, 2, 5, 9, 9]


def test_records_go_when_finished_failed_forgotten_or_registered_again() -> None:
    book = RowBook()
    book.expand(P.BatchMsg(batch_id=1, slice_len=4,
                           requests=[whole(r, [1]) for r in ("done", "bad", "gone", "kept")]))
    book.served([P.RequestOutput(rid="done", token_ids=[2], finish_reason="stop"),
                 P.RequestOutput(rid="bad", token_ids=[], error="no grammar"),
                 P.RequestOutput(rid="kept", token_ids=[2])])
    assert "done" not in book and "bad" not in book and "kept" in book
    # Forgotten on the next batch, before its rows: a whole row of it makes a new record.
    book.expand(P.BatchMsg(batch_id=2, slice_len=4, requests=[], forget=["gone"]))
    assert "gone" not in book and len(book) == 1
    book.drop()
    assert len(book) == 0


def test_a_row_without_a_record_is_named_and_nothing_is_kept() -> None:
    book = RowBook()
    book.expand(P.BatchMsg(batch_id=1, slice_len=4, requests=[whole("a", [1, 2])]))
    with pytest.raises(UnknownRows) as e:
        book.expand(P.BatchMsg(batch_id=2, slice_len=4, requests=[whole("b", [4])],
                               cont=[P.ContinueRow(rid="a", max_new_tokens=1, known=2),
                                     P.ContinueRow(rid="x", max_new_tokens=1, known=0),
                                     P.ContinueRow(rid="a", max_new_tokens=1, known=9)]))
    assert e.value.rids == ["x", "a"] and "b" not in book  # known past what it holds: unknown too


def test_the_serve_thread_and_the_receive_thread_may_use_it_at_once() -> None:
    book = RowBook()
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            for i in range(2000):
                book.expand(P.BatchMsg(batch_id=i, slice_len=1, requests=[whole(f"r{i % 50}", [1])]))
                book.served([P.RequestOutput(rid=f"r{i % 50}", token_ids=[i])])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    t = threading.Thread(target=serve)
    t.start()
    for i in range(2000):
        book.drop([f"r{i % 50}"])
    t.join()
    assert not errors
