"""Admission of requests with a grammar (:mod:`sclsd.daemon.admission`), in-process with a
fake grammar checker (:mod:`.fake_checks`): the bounds and the uid's share come before any
check, a request without a grammar is admitted while another's grammar is checked on the
same connection, and a cancel or a client leaving stops the check."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from sclsd import protocol as P
from sclsd.daemon.admission import daemon_id

from .conftest import Harness, RecConn, until
from .fake_checks import FakeChecker, schema

pytest.importorskip("llguidance")  # the fake workers enforce the grammars they are given

from sclsd.structured import compile_grammar  # noqa: E402

ADMIN = 0  # root: an admin by default
JSON_OBJECT, _ = compile_grammar(P.Structured(kind="json_object"))


async def ready(h: Harness, *, hold: bool = False) -> FakeChecker:
    """A fake checker in place of the grammar children, and a worker that enforces grammars."""
    fake = FakeChecker()
    assert JSON_OBJECT is not None
    fake.text = lambda v: JSON_OBJECT
    admission = h.server.admission
    assert admission is not None
    admission.grammars.children = fake
    h.worker("w1", grammar=True, hold=hold)  # hold: it keeps what it is sent, unserved
    await h.registered("w1")
    return fake


def kinds(conn: RecConn, rid: str) -> list[type]:
    return [type(m) for m in conn.events(rid)]


def test_a_request_without_a_grammar_is_admitted_while_another_is_checked_on_its_connection(
        daemon: Callable[..., Any]) -> None:
    async def body(h: Harness) -> None:
        fake = await ready(h)
        conn = RecConn()
        # Returns once everything but the check is done: the connection's next frame is read.
        await asyncio.wait_for(h.submit(conn, id="g", structured=schema("hold:g"), max_tokens=8), 5.0)
        await h.submit(conn, id="plain", max_tokens=8)
        await h.finished(conn, "plain")
        assert conn.events("g") == [] and fake.started == ["hold:g"]  # still being checked
        fake.release("hold:g")
        await h.finished(conn, "g")
        assert kinds(conn, "g")[0] is P.Accepted and isinstance(conn.terminal("g")[0], P.Done)
        assert conn.terminal("g")[0].finish_reason in ("stop", "length")

    daemon(body)


def test_the_uid_share_is_checked_before_the_grammar(daemon: Callable[..., Any]) -> None:
    async def body(h: Harness) -> None:
        fake = await ready(h)
        conn = RecConn(uid=1000)
        await h.submit(conn, id="first", structured=schema("hold:first"))
        await until(fake.changed, lambda: fake.started == ["hold:first"])
        # The first counts in its uid's share (one request) while it waits for its check.
        await h.submit(conn, id="second", structured=schema("hold:second"))
        [err] = conn.terminal("second")
        assert isinstance(err, P.Error) and err.code == "overloaded" and "uid_share" in err.message
        assert fake.started == ["hold:first"]  # never checked
        other = RecConn(cid=2, uid=1001)
        await h.submit(other, id="theirs", max_tokens=4)
        await h.finished(other, "theirs")
        fake.release("hold:first")
        await h.finished(conn, "first")
        assert isinstance(conn.terminal("first")[0], P.Done)

    daemon(body, daemon={"max_queued_requests": 8, "uid_share": 0.125})


def test_a_cancel_stops_the_check_and_the_request_ends_cancelled(daemon: Callable[..., Any]) -> None:
    async def body(h: Harness) -> None:
        fake = await ready(h)
        conn = RecConn()
        await h.submit(conn, id="g", structured=schema("hold:g"))
        await h.submit(conn, id="g", structured=schema("hold:g"))  # its id is taken meanwhile
        [dup] = conn.terminal("g")
        assert isinstance(dup, P.Error) and dup.code == "duplicate_id"
        conn.sent.clear()
        await until(fake.changed, lambda: fake.started == ["hold:g"])
        assert h.server.on_client(conn, P.Cancel(id="g")) is None
        await conn.wait_for(lambda: bool(conn.terminal("g")))
        assert kinds(conn, "g") == [P.Accepted, P.Done]
        assert conn.terminal("g")[0].finish_reason == "cancelled"
        await until(fake.changed, lambda: fake.stopped == ["hold:g"])
        assert h.server.admission is not None and not h.server.admission.checking
        assert len(h.live) == 0

    daemon(body)


def test_a_client_that_leaves_stops_its_checks(daemon: Callable[..., Any]) -> None:
    async def body(h: Harness) -> None:
        fake = await ready(h)
        conn, other = RecConn(), RecConn(cid=2)
        await h.submit(conn, id="a", structured=schema("hold:mine"))
        await h.submit(conn, id="b", structured=schema("hold:shared"))
        await h.submit(other, id="c", structured=schema("hold:shared"))  # waits for the same check
        await until(fake.changed, lambda: sorted(fake.started) == ["hold:mine", "hold:shared"])
        conn.closed = True
        h.server.on_client_close(conn)
        await until(fake.changed, lambda: fake.stopped == ["hold:mine"])
        admission = h.server.admission
        assert admission is not None and list(admission.checking) == [(other, "c")]
        fake.release("hold:shared")
        await h.finished(other, "c")
        assert isinstance(other.terminal("c")[0], P.Done) and conn.sent == []

    daemon(body, grammar={"processes": 2})


def test_a_failing_check_is_logged_and_its_request_answered(daemon: Callable[..., Any],
                                                           caplog: pytest.LogCaptureFixture) -> None:
    async def body(h: Harness) -> None:
        await ready(h)
        conn = RecConn()
        await h.submit(conn, id="g", structured=schema("boom:g"))
        await h.submit(conn, id="plain", max_tokens=2)
        await h.finished(conn, "g", "plain")
        [err] = conn.terminal("g")
        assert isinstance(err, P.Error) and err.code == "internal"
        assert isinstance(conn.terminal("plain")[0], P.Done)  # the connection goes on
        assert "a bug checking boom:g" in caplog.text

    daemon(body)


def test_an_admin_cancels_a_request_waiting_for_its_check(daemon: Callable[..., Any]) -> None:
    async def body(h: Harness) -> None:
        fake = await ready(h, hold=True)
        conn, other = RecConn(cid=1), RecConn(cid=2)
        admin = RecConn(cid=3, uid=ADMIN)
        await h.submit(conn, id="g", structured=schema("hold:g"))
        await h.submit(other, id="x", structured=schema("hold:x"))
        await h.submit(conn, id="x", max_tokens=8)  # a live request with the same client id
        await until(fake.changed, lambda: sorted(fake.started) == ["hold:g", "hold:x"])
        # "x" names a live request and one waiting for its check: the admin gets both ids.
        h.server.on_client(admin, P.Cancel(id="x", any_connection=True))
        err = admin.sent[-1]
        assert isinstance(err, P.Error) and err.code == "unknown_id"
        assert daemon_id(conn, "x") in err.message and daemon_id(other, "x") in err.message
        # By a client id only the waiting one has: it is accepted and ends cancelled.
        assert h.server.on_client(admin, P.Cancel(id="g", any_connection=True)) is None
        await conn.wait_for(lambda: bool(conn.terminal("g")))
        assert kinds(conn, "g") == [P.Accepted, P.Done]
        assert conn.terminal("g")[0].finish_reason == "cancelled"
        # By the daemon's id of the other waiting one.
        h.server.on_client(admin, P.Cancel(id=daemon_id(other, "x"), any_connection=True))
        await other.wait_for(lambda: bool(other.terminal("x")))
        assert other.terminal("x")[0].finish_reason == "cancelled"
        await until(fake.changed, lambda: sorted(fake.stopped) == ["hold:g", "hold:x"])
        assert not [m for m in admin.sent if not isinstance(m, P.Error)]
        assert len(admin.sent) == 1  # the one ambiguous try
        h.server.on_client(admin, P.Cancel(id="g", any_connection=True))
        assert admin.sent[-1].code == "unknown_id"  # nothing is called "g" any more
        assert not conn.terminal("x")  # the live one was never touched

    daemon(body)
