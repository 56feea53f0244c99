"""Request ids are scoped to their connection: no client can take or collide with another's
ids, each hears its own ids in every event, and an admin still cancels anyone's request,
by the daemon's id (``<connection>:<client id>``, as the logs show it) or by a client id
only one live request has."""

from __future__ import annotations

from sclsd import protocol as P
from sclsd.daemon.admission import daemon_id

from .conftest import Harness, RecConn, held, until

ADMIN = 0  # root: an admin by default


def test_two_connections_may_use_the_same_id_and_each_hears_only_its_own(daemon) -> None:
    async def body(h: Harness) -> None:
        w = h.worker("w0", hold=True)
        await h.registered("w0")
        a, b = RecConn(cid=1), RecConn(cid=2)
        await h.submit(a, id="x", max_tokens=8, ignore_eos=True, stream=True)
        await h.submit(b, id="x", max_tokens=8, ignore_eos=True, stream=True)
        assert [type(m) for m in a.sent] == [P.Accepted] and a.sent[0].id == "x"
        assert [type(m) for m in b.sent] == [P.Accepted] and b.sent[0].id == "x"
        assert len(h.live) == 2
        # The same connection may not reuse a live id of its own.
        await h.submit(a, id="x", max_tokens=8)
        assert isinstance(a.sent[-1], P.Error) and a.sent[-1].code == "duplicate_id"
        # Both rows held (one batch or two, as the policy groups them), then served.
        await until(w.got, lambda: sum(len(b.requests) + len(b.cont) for b in w.held) >= 2)
        w.release()
        await h.finished(a, "x")
        await h.finished(b, "x")
        for conn in (a, b):
            (done,) = conn.events("x", P.Done)
            assert done.finish_reason == "length"
            assert done.usage.completion_tokens == 8
            deltas = conn.events("x", P.Delta)
            assert sum(len(d.token_ids) for d in deltas) == 8, "each hears its own tokens, once"
        assert len(h.live) == 0

    daemon(body)


def test_a_client_cannot_cancel_or_take_another_clients_request(daemon) -> None:
    async def body(h: Harness) -> None:
        h.worker("w0", hold=True)
        await h.registered("w0")
        victim, other = RecConn(cid=1), RecConn(cid=2)
        await h.submit(victim, id="v", max_tokens=8)
        # Neither the client id nor the daemon's id reaches another connection's request.
        for asked in ("v", daemon_id(victim, "v")):
            h.server.on_client(other, P.Cancel(id=asked))
            assert isinstance(other.sent[-1], P.Error) and other.sent[-1].code == "unknown_id"
            assert other.sent[-1].id == asked
        h.server.on_client(other, P.Cancel(id="v", any_connection=True))
        assert other.sent[-1].code == "forbidden"
        assert not victim.terminal("v") and len(h.live) == 1

    daemon(body)


def test_an_admin_cancels_by_the_daemons_id_or_by_a_client_id_only_one_request_has(daemon) -> None:
    async def body(h: Harness) -> None:
        h.worker("w0", hold=True)
        await h.registered("w0")
        a, b = RecConn(cid=1), RecConn(cid=2)
        admin = RecConn(cid=3, uid=ADMIN)
        await h.submit(a, id="x", max_tokens=8)
        await h.submit(b, id="x", max_tokens=8)
        await h.submit(b, id="only", max_tokens=8)
        # Two live requests are called "x": the admin is told their daemon ids.
        h.server.on_client(admin, P.Cancel(id="x", any_connection=True))
        err = admin.sent[-1]
        assert isinstance(err, P.Error) and err.code == "unknown_id"
        assert daemon_id(a, "x") in err.message and daemon_id(b, "x") in err.message
        assert not a.terminal("x") and not b.terminal("x")
        # By the daemon's id: exactly that one.
        h.server.on_client(admin, P.Cancel(id=daemon_id(b, "x"), any_connection=True))
        (done,) = b.terminal("x")
        assert isinstance(done, P.Done) and done.finish_reason == "cancelled" and done.id == "x"
        assert not a.terminal("x")
        # By a client id one live request has.
        h.server.on_client(admin, P.Cancel(id="only", any_connection=True))
        assert b.terminal("only")[0].finish_reason == "cancelled"
        h.server.on_client(admin, P.Cancel(id="nothing", any_connection=True))
        assert admin.sent[-1].code == "unknown_id"
        assert [e.client_id for e in h.live] == ["x"] and len(a.terminal("x")) == 0

    daemon(body)


def test_a_request_without_an_id_hears_the_one_it_was_given(daemon) -> None:
    async def body(h: Harness) -> None:
        w = h.worker("w0", hold=True)
        await h.registered("w0")
        conn = RecConn()
        await h.submit(conn, max_tokens=4, ignore_eos=True)
        (acc,) = conn.sent
        assert isinstance(acc, P.Accepted) and acc.id
        await held(w)
        w.release()
        await h.finished(conn, acc.id)
        assert conn.terminal(acc.id)[0].usage.completion_tokens == 4

    daemon(body)
