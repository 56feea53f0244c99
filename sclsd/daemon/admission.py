"""Admission: validate a ``generate``, tokenize it off the loop, check the bounds, accept.

A request is refused (an ``error`` with its code, nothing queued) rather than
accepted when it cannot be served: a malformed prompt, one longer than
``model.max_input`` (checked on its character count before any tokenizing
when even the longest tokens could not make it fit), the daemon draining or
without workers, or a bound passed: ``daemon.max_queued_requests`` /
``max_queued_tokens`` for everyone, ``daemon.uid_share`` of them per client uid.
A ``max_tokens`` above ``model.max_gen`` is lowered to it, or refused when the
request says ``cap_max_tokens = false`` (the HTTP front end does, as vLLM
refuses); chat messages for a model whose tokenizer has no chat template are
refused rather than rendered in a made-up format.
A request id is the client's own: unique among that connection's live requests
only (``duplicate_id`` otherwise), so no client can take or collide with another's
ids; the daemon knows the request by ``<connection>:<client id>``
(:func:`daemon_id`), which its logs show and an admin may cancel by.
Tokenizing runs in the thread pool, at most ``daemon.max_tokenizing`` prompts at
once; a connection's frames are handled one after another up to that point, so one
client cannot queue more than one prompt there. Every bound (the client uid's share
included) is checked before a grammar is: a request with ``structured`` then waits
for its check (:mod:`.grammar`: fair turns between groups, once per content) while
the connection's next frames are read and admitted, so a request without a grammar
never waits behind a compile. Such a request counts against the bounds as a live one
does, and its id is taken on its connection until it is admitted or refused; a
``cancel`` of it, or its client leaving, stops the wait (and the check, when no other
request waits for it). An admitted request goes to the serving core
(:meth:`~sclsd.daemon.serving.core.ServingCore.submit`); admission returns the
core's effects, or the refusal, for the shell to deliver, and delivers those of a
request whose grammar it waited for itself (:attr:`Admission.deliver`).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass

import msgspec

from .. import protocol as P
from ..config import Config
from ..tokenizer import Tokenizer, max_prompt_chars
from .grammar import GrammarChecks, GrammarUnavailable
from .metrics import Metrics
from .request_checks import feature_refusal, has_chat_template, sampling_refusal
from .serving.core import ServingCore, fair_group
from .serving.effects import Effects
from .sockets import Conn

log = logging.getLogger("sclsd")


@dataclass(eq=False)
class _Checking:
    """A request whose grammar is being checked: everything else about it was admitted."""

    conn: Conn
    g: P.Generate
    client_id: str
    uid: int | None
    ids: list[int]
    task: asyncio.Task[None] | None = None
    cancelled: bool = False
    """Its client cancelled it: it is accepted and ends at once, ``cancelled``, as a
    cancel right after its acceptance would end it."""


class _Held:
    """Requests and their prompt tokens, in all and by client uid (counted in the bounds)."""

    def __init__(self) -> None:
        self.requests = 0
        self.tokens = 0
        self.by_uid: dict[int | None, tuple[int, int]] = {}

    def add(self, uid: int | None, requests: int, tokens: int = 0) -> None:
        self.requests += requests
        self.tokens += tokens
        r, t = self.by_uid.get(uid, (0, 0))
        if r + requests:
            self.by_uid[uid] = (r + requests, t + tokens)
        else:
            self.by_uid.pop(uid, None)


def daemon_id(conn: Conn, client_id: str) -> str:
    """The daemon's id for the request ``conn`` calls ``client_id``: unique among live
    requests, as a client's ids are unique among its own (the connection number has no
    ``:``, so no two pairs give one string)."""
    return f"{conn.cid}:{client_id}"


class Admission:
    """Turns ``generate`` frames into live requests or refusals."""

    def __init__(self, cfg: Config, core: ServingCore, tok: Tokenizer, pool: Executor,
                 metrics: Metrics, clock: Callable[[], float], is_draining: Callable[[], bool],
                 not_serving: Callable[[], str | None]) -> None:
        self.cfg = cfg
        self.core = core
        self.live = core.table
        self.tok = tok
        self.pool = pool
        self.metrics = metrics
        self.clock = clock
        self.is_draining = is_draining
        self.not_serving = not_serving
        d = cfg.daemon
        self.max_chars = max_prompt_chars(tok, cfg.model.max_input)
        self.tokenizing = asyncio.Semaphore(d.max_tokenizing)
        #: Requests between frame and admission: counted against the bounds so a flood
        #: of text prompts cannot queue unbounded tokenizer work.
        self.entering = _Held()
        #: Grammars are compiled in child processes, never here (:mod:`.grammar`).
        self.grammars = GrammarChecks(cfg.grammar, metrics.grammar_refused, on_outcome=metrics.grammar_checked)
        self.checking: dict[tuple[Conn, str], _Checking] = {}
        """Requests waiting for their grammar's check, by connection and client id."""
        self.waiting = _Held()
        """Requests and prompt tokens of ``checking`` (they count as live ones)."""
        self.deliver: Callable[[Effects], None] = self._undelivered
        """Delivers the effects of a request admitted after its grammar's check (the shell's)."""

    @property
    def pending(self) -> int:
        """Requests between their frame and admission: being checked and tokenized, or
        waiting for their grammar's check."""
        return self.admitting + len(self.checking)

    @property
    def admitting(self) -> int:
        """Requests being checked and tokenized (before their grammar's check)."""
        return self.entering.requests

    def refuse(self, conn: Conn, code: P.ErrorCode, message: str, rid: str | None,
               reason: str | None = None) -> Effects:
        """Answer ``error`` ``code``; ``reason`` names the check that refused, for the metrics
        (the bound passed, the field at fault; the code itself by default)."""
        self.metrics.refused(code, reason or code)
        log.info("refused id=%s conn=%d code=%s: %s", rid, conn.cid, code, message)
        out = Effects()
        out.send(conn, P.Error(code=code, message=message, id=rid))
        return out

    async def on_generate(self, conn: Conn, g: P.Generate) -> Effects:
        """Admit ``g`` (the core's effects: ``accepted`` and the rest) or refuse it; a request
        whose grammar must be checked first returns nothing here and is answered when its
        check ends (:attr:`deliver`)."""
        uid = conn.peer.uid if conn.peer is not None else None
        self.entering.add(uid, 1)
        try:
            out = await self._admit(conn, g, uid)
        finally:
            self.entering.add(uid, -1)
        if isinstance(out, _Checking):
            self._check(out)
            return Effects()
        return out

    def cancel(self, conn: Conn, client_id: str) -> bool:
        """``conn`` cancels its request ``client_id``, which waits for its grammar's check:
        the wait stops (the check too when nobody else waits for it), and the request is
        accepted and ends ``cancelled``. False: no such request waits."""
        c = self.checking.get((conn, client_id))
        if c is None or c.task is None:
            return False
        c.cancelled = True
        c.task.cancel()
        return True

    def waiting_for(self, asked: str) -> list[tuple[Conn, str]]:
        """The requests waiting for their grammar's check that an admin may mean by
        ``asked``: the daemon's id, or the client's id, of each."""
        return [(conn, cid) for (conn, cid), c in self.checking.items()
                if c.task is not None and asked in (cid, daemon_id(conn, cid))]

    def client_gone(self, conn: Conn) -> None:
        """``conn`` closed: its requests waiting for a grammar's check stop waiting (their
        checks stop when nobody else waits for them); nothing is sent."""
        for (c, _), checking in list(self.checking.items()):
            if c is conn and checking.task is not None:
                checking.task.cancel()

    def close(self) -> None:
        """The daemon stops: every wait and check stops."""
        for checking in list(self.checking.values()):
            if checking.task is not None:
                checking.task.cancel()
        self.grammars.close()

    def _overloaded(self, uid: int | None, prompt_tokens: int) -> tuple[str, str] | None:
        """(the bound passed, why) when admitting would pass one. Requests waiting for their
        grammar's check count as live ones."""
        d = self.cfg.daemon
        live = self.live
        # ``admitting`` includes the request being checked.
        waiting = len(self.checking)
        if len(live) + waiting + self.admitting > d.max_queued_requests:
            return "max_queued_requests", (f"{len(live)} requests queued (+{waiting} waiting for a grammar's "
                                           f"check, +{self.admitting - 1} being admitted), the limit is "
                                           f"{d.max_queued_requests}; retry later")
        queued = live.queued_tokens + self.waiting.tokens
        if queued + prompt_tokens > d.max_queued_tokens:
            return "max_queued_tokens", (f"{queued} prompt tokens queued, +{prompt_tokens} "
                                         f"exceeds the limit of {d.max_queued_tokens}; retry later")
        if d.uid_share < 1.0:
            reqs, toks = live.by_uid.get(uid, (0, 0))
            w_reqs, w_toks = self.waiting.by_uid.get(uid, (0, 0))
            reqs, toks = reqs + w_reqs, toks + w_toks
            others = self.entering.by_uid.get(uid, (1, 0))[0] - 1  # besides this one
            cap_r = max(1, int(d.uid_share * d.max_queued_requests))
            cap_t = max(1, int(d.uid_share * d.max_queued_tokens))
            if reqs + others + 1 > cap_r or toks + prompt_tokens > cap_t:
                return "uid_share", (f"uid {uid} holds {reqs} requests / {toks} prompt tokens; one uid "
                                     f"may hold {cap_r} / {cap_t} (daemon.uid_share); retry later")
        return None

    def _check_state(self, conn: Conn, client_id: str) -> tuple[P.ErrorCode, str] | None:
        if self.is_draining():
            return "draining", "the daemon is shutting down"
        why = self.not_serving()
        if why is not None:
            return "no_workers", why
        if self.live.find(conn, client_id) is not None or (conn, client_id) in self.checking:
            return "duplicate_id", f"request id {client_id!r} is already live on this connection"
        return None

    async def _admit(self, conn: Conn, g: P.Generate, uid: int | None) -> Effects | _Checking:
        """Every check but the grammar's: the refusal, the core's effects, or (a request with
        ``structured``) what its grammar's check needs."""
        m = self.cfg.model
        client_id = g.id or uuid.uuid4().hex[:16]
        if len(self.live) + len(self.checking) + self.admitting > self.cfg.daemon.max_queued_requests:
            # Refuse before any other work.
            bound, message = self._overloaded(uid, 0) or ("max_queued_requests", "overloaded")
            return self.refuse(conn, "overloaded", message, g.id, bound)
        forms = sum(x is not None for x in (g.prompt, g.prompt_ids, g.messages))
        if forms != 1:
            return self.refuse(conn, "bad_request", "give exactly one of prompt, prompt_ids, messages",
                               g.id, "prompt_forms")
        if g.max_tokens is not None and g.max_tokens > m.max_gen and not g.cap_max_tokens:
            return self.refuse(conn, "bad_request", f"max_tokens: {g.max_tokens} is more than this "
                               f"daemon's limit of {m.max_gen} tokens (model.max_gen)", g.id, "max_tokens")
        if g.temperature > 0 and (why := sampling_refusal(self.cfg, self.core.members.caps(), g)) is not None:
            # Refused here rather than by every worker it would be sent to.
            return self.refuse(conn, "bad_request", why, g.id, "sampling")
        if (feature := feature_refusal(self.cfg, self.core.members.caps(), self.tok, g)) is not None:
            return self.refuse(conn, "bad_request", feature[1], g.id, feature[0])
        if g.messages is not None and not has_chat_template(self.tok):
            return self.refuse(conn, "bad_request", "messages: the model's tokenizer has no chat "
                               "template; send a prompt instead", g.id, "chat_template")
        bad = self._check_state(conn, client_id)
        if bad is not None:
            return self.refuse(conn, *bad, g.id)
        over = self._overloaded(uid, 0)
        if over is not None:  # the uid's share, before any tokenizing work
            return self.refuse(conn, "overloaded", over[1], g.id, over[0])
        if g.prompt_ids is not None:
            ids = g.prompt_ids
            vocab = self.tok.vocab_size
            if any(i >= vocab for i in ids):
                return self.refuse(conn, "bad_request", f"prompt_ids must be < vocab size {vocab}", g.id,
                                   "prompt_ids")
        else:
            chars = len(g.prompt) if g.prompt is not None else sum(len(x.content) for x in g.messages or ())
            if chars > self.max_chars:
                return self.refuse(conn, "prompt_too_long", f"prompt has {chars} characters: more than "
                                   f"{m.max_input} tokens whatever the tokenizer does", g.id, "prompt_chars")
            try:
                ids = await self._tokenize(g)
            except Exception as exc:  # noqa: BLE001 - a tokenizer error is the request's fault
                return self.refuse(conn, "bad_request", f"cannot tokenize: {exc}", g.id, "tokenize")
            if conn.closed:
                return Effects()
            bad = self._check_state(conn, client_id)  # the world may have changed while we tokenized
            if bad is not None:
                return self.refuse(conn, *bad, g.id)
        if not ids:
            return self.refuse(conn, "bad_request", "empty prompt", g.id, "empty_prompt")
        if len(ids) > m.max_input:
            return self.refuse(conn, "prompt_too_long",
                               f"prompt has {len(ids)} tokens, the limit is {m.max_input}", g.id, "max_input")
        over = self._overloaded(uid, len(ids))
        if over is not None:
            return self.refuse(conn, "overloaded", over[1], g.id, over[0])
        if conn.closed:
            return Effects()  # the client went away while we checked: nobody to serve
        if g.structured is not None:
            return _Checking(conn, g, client_id, uid, list(ids))
        return self._submit(conn, g, client_id, uid, list(ids), None)

    def _submit(self, conn: Conn, g: P.Generate, client_id: str, uid: int | None, ids: list[int],
                grammar: str | None) -> Effects:
        if g.id is None:  # the id it hears in every event of the request (refusals say None)
            g = msgspec.structs.replace(g, id=client_id)
        rid = daemon_id(conn, client_id)
        out = self.core.submit(conn, uid, g, rid, ids, self.clock(),
                               pid=conn.peer.pid if conn.peer is not None else None)
        entry = self.live.get(rid)
        if entry is not None and entry.gen is g:
            # Before anything can dispatch it (no await since submit): its batches carry this.
            entry.grammar = grammar
        return out

    # ------------------------------------------------------------------ grammars

    def _check(self, c: _Checking) -> None:
        """``c`` waits for its grammar's check in a task of its own; its place (id, bounds)
        is held meanwhile."""
        self.checking[(c.conn, c.client_id)] = c
        self.waiting.add(c.uid, 1, len(c.ids))
        c.task = asyncio.get_running_loop().create_task(self._checked(c), name="grammar-wait")
        c.task.add_done_callback(self._check_ended)

    async def _checked(self, c: _Checking) -> None:
        """Wait for ``c``'s grammar; then admit it, or refuse it (delivered here)."""
        assert c.g.structured is not None
        group = fair_group(c.conn, c.uid, c.conn.peer.pid if c.conn.peer is not None else None, c.g)
        try:
            try:
                # In a child process, within [grammar]'s limits: a hostile grammar costs only this request.
                grammar, why = await self.grammars.compile(c.g.structured, group)
            except GrammarUnavailable as exc:
                self._release(c)
                out = self.refuse(c.conn, "internal", f"structured output: {exc}", c.g.id, "structured")
            except asyncio.CancelledError:
                if not c.cancelled:
                    raise  # the client left, or the daemon stops: nothing to send
                self._release(c)
                out = self._cancelled(c)
            else:
                self._release(c)
                out = (self.refuse(c.conn, "bad_request", f"structured output: {why}", c.g.id, "structured")
                       if why is not None else self._admit_checked(c, grammar))
        except Exception:  # a bug: logged, and the request still gets its one answer
            log.exception("id=%s conn=%d admitting after its grammar's check failed", c.g.id, c.conn.cid)
            out = self.refuse(c.conn, "internal", "internal error admitting the request", c.g.id, "internal")
        finally:
            self._release(c)  # whatever happened, its place is let go
        if not c.conn.closed:
            self.deliver(out)

    def _release(self, c: _Checking) -> None:
        """``c`` no longer waits: its id and its part of the bounds are let go (once)."""
        if self.checking.get((c.conn, c.client_id)) is not c:
            return
        del self.checking[(c.conn, c.client_id)]
        self.waiting.add(c.uid, -1, -len(c.ids))

    def _admit_checked(self, c: _Checking, grammar: str | None) -> Effects:
        if c.conn.closed:
            return Effects()  # the client went away meanwhile: nobody to serve
        bad = self._check_state(c.conn, c.client_id)  # the world may have changed while it waited
        if bad is not None:
            return self.refuse(c.conn, *bad, c.g.id)
        return self._submit(c.conn, c.g, c.client_id, c.uid, c.ids, grammar)

    def _cancelled(self, c: _Checking) -> Effects:
        """Cancelled while its grammar was checked: accepted and ended at once (never
        dispatched: nothing awaits between the two), as if the cancel came right after."""
        rid = daemon_id(c.conn, c.client_id)
        out = self._admit_checked(c, None)
        if rid not in self.live:
            return out  # refused after all (draining, say)
        self.deliver(out)
        return self.core.cancel(rid, self.clock(), requester=c.conn)

    @staticmethod
    def _undelivered(out: Effects) -> None:
        raise RuntimeError("admission has no deliver: the shell sets it")

    def _check_ended(self, task: asyncio.Task[None]) -> None:
        """A wait ended: an error that escaped it (delivering its answer) is logged, never lost."""
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error("admitting a request after its grammar's check failed", exc_info=exc)

    async def _tokenize(self, g: P.Generate) -> list[int]:
        """Blocking work: in the thread pool, at most ``daemon.max_tokenizing`` at once."""
        loop = asyncio.get_running_loop()
        async with self.tokenizing:
            if g.messages is not None:
                msgs = [{"role": x.role, "content": x.content} for x in g.messages]
                return await loop.run_in_executor(self.pool, self.tok.encode_chat, msgs)
            assert g.prompt is not None
            return await loop.run_in_executor(self.pool, self.tok.encode, g.prompt)
