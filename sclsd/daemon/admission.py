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
once; a connection's frames are handled one after another, so one client cannot
queue more than one prompt there. An admitted request goes to the serving core
(:meth:`~sclsd.daemon.serving.core.ServingCore.submit`); admission returns the
core's effects, or the refusal, for the shell to deliver.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

import msgspec

from .. import protocol as P
from ..config import Config
from ..defaults import ENGINE_FEATURES
from ..engine_options import OPTIONS
from ..tokenizer import Tokenizer, max_prompt_chars
from .grammar import GrammarChecks, GrammarUnavailable
from .metrics import Metrics
from .serving.core import ServingCore
from .serving.effects import Effects
from .sockets import Conn

log = logging.getLogger("sclsd")


def daemon_id(conn: Conn, client_id: str) -> str:
    """The daemon's id for the request ``conn`` calls ``client_id``: unique among live
    requests, as a client's ids are unique among its own (the connection number has no
    ``:``, so no two pairs give one string)."""
    return f"{conn.cid}:{client_id}"


def has_chat_template(tok: Tokenizer) -> bool:
    """Whether chat messages can be rendered as the model expects: a transformers tokenizer
    with a chat template, or a tokenizer with a format of its own (the ``fake`` model's)."""
    inner: Any = getattr(tok, "tok", None)
    return inner is None or bool(getattr(inner, "chat_template", None))


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
        self.admitting = 0
        #: Grammars are compiled in child processes, never here (:mod:`.grammar`).
        self.grammars = GrammarChecks(cfg.grammar, metrics.grammar_refused)

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
        """Admit ``g`` (the core's effects: ``accepted`` and the rest) or refuse it."""
        self.admitting += 1
        try:
            return await self._admit(conn, g)
        finally:
            self.admitting -= 1

    def _overloaded(self, uid: int | None, prompt_tokens: int) -> tuple[str, str] | None:
        """(the bound passed, why) when admitting would pass one."""
        d = self.cfg.daemon
        live = self.live
        # ``admitting`` includes the request being checked.
        if len(live) + self.admitting > d.max_queued_requests:
            return "max_queued_requests", (f"{len(live)} requests queued (+{self.admitting - 1} being "
                                           f"admitted), the limit is {d.max_queued_requests}; retry later")
        if live.queued_tokens + prompt_tokens > d.max_queued_tokens:
            return "max_queued_tokens", (f"{live.queued_tokens} prompt tokens queued, +{prompt_tokens} "
                                         f"exceeds the limit of {d.max_queued_tokens}; retry later")
        if d.uid_share < 1.0:
            reqs, toks = live.by_uid.get(uid, (0, 0))
            cap_r = max(1, int(d.uid_share * d.max_queued_requests))
            cap_t = max(1, int(d.uid_share * d.max_queued_tokens))
            if reqs + 1 > cap_r or toks + prompt_tokens > cap_t:
                return "uid_share", (f"uid {uid} holds {reqs} requests / {toks} prompt tokens; one uid "
                                     f"may hold {cap_r} / {cap_t} (daemon.uid_share); retry later")
        return None

    def _sampling_refusal(self, g: P.Generate) -> str | None:
        """Why the workers cannot sample ``g`` (temperature > 0), if they cannot: what the
        registered workers said they can do (``Register.caps``), else, before any has
        registered, what the configured engine will say."""
        caps = self.core.members.caps()
        if caps:
            sampling = all(c.sampling for c in caps)
            seeded = all(c.seeded for c in caps)
        else:
            w = self.cfg.workers
            continuous = self.cfg.engine == "hf-cb"
            sampling = not continuous or bool(w.options.get("sampling", OPTIONS["sampling"].default))
            seeded = True  # every engine seeds per request (hf-cb too: worker/engines/cb_select.py)
        if not sampling:
            return ("temperature > 0: these workers serve greedy decoding only (hf-cb started with "
                    "[workers.options] sampling = false)")
        if g.seed is not None and not seeded:
            return "seed: these workers cannot seed a request (their engine says so in its caps)"
        return None

    def _feature_refusal(self, g: P.Generate) -> tuple[str, str] | None:
        """(the field, why) when ``g``'s ``min_tokens``, ``logit_bias`` or ``structured`` cannot
        be served: a bad value, or workers that do not apply it (their ``caps``; before any has
        registered, the configured engine's)."""
        caps = self.core.members.caps()
        engine = self.cfg.engine

        def can(flag: str) -> bool:
            if caps:
                return all(getattr(c, flag) for c in caps)
            return engine in ENGINE_FEATURES.get(flag, ())

        if g.min_tokens:
            if g.max_tokens is not None and g.min_tokens > g.max_tokens:
                return "min_tokens", f"min_tokens: {g.min_tokens} is more than max_tokens ({g.max_tokens})"
            if not can("min_tokens"):
                return "min_tokens", f"min_tokens: these workers ({engine}) do not apply it"
        if g.logit_bias:
            vocab = self.tok.vocab_size
            bad = [t for t in g.logit_bias if t >= vocab]
            if bad:
                return "logit_bias", f"logit_bias: token id {bad[0]} is not below the vocabulary size {vocab}"
            if not can("logit_bias"):
                return "logit_bias", f"logit_bias: these workers ({engine}) do not apply it"
        if g.structured is not None:
            if not can("grammar"):
                return "structured", f"structured output: these workers ({engine}) do not enforce grammars"
        return None

    def _check_state(self, conn: Conn, client_id: str) -> tuple[P.ErrorCode, str] | None:
        if self.is_draining():
            return "draining", "the daemon is shutting down"
        why = self.not_serving()
        if why is not None:
            return "no_workers", why
        if self.live.find(conn, client_id) is not None:
            return "duplicate_id", f"request id {client_id!r} is already live on this connection"
        return None

    async def _admit(self, conn: Conn, g: P.Generate) -> Effects:
        m = self.cfg.model
        client_id = g.id or uuid.uuid4().hex[:16]
        uid = conn.peer.uid if conn.peer is not None else None
        if len(self.live) + self.admitting > self.cfg.daemon.max_queued_requests:
            # Refuse before any tokenizing work.
            bound, message = self._overloaded(uid, 0) or ("max_queued_requests", "overloaded")
            return self.refuse(conn, "overloaded", message, g.id, bound)
        forms = sum(x is not None for x in (g.prompt, g.prompt_ids, g.messages))
        if forms != 1:
            return self.refuse(conn, "bad_request", "give exactly one of prompt, prompt_ids, messages",
                               g.id, "prompt_forms")
        if g.max_tokens is not None and g.max_tokens > m.max_gen and not g.cap_max_tokens:
            return self.refuse(conn, "bad_request", f"max_tokens: {g.max_tokens} is more than this "
                               f"daemon's limit of {m.max_gen} tokens (model.max_gen)", g.id, "max_tokens")
        if g.temperature > 0 and (why := self._sampling_refusal(g)) is not None:
            # Refused here rather than by every worker it would be sent to.
            return self.refuse(conn, "bad_request", why, g.id, "sampling")
        if (feature := self._feature_refusal(g)) is not None:
            return self.refuse(conn, "bad_request", feature[1], g.id, feature[0])
        grammar: str | None = None
        if g.structured is not None:
            # In a child process, within [grammar]'s limits: a hostile grammar costs only this request.
            try:
                grammar, why = await self.grammars.compile(g.structured)
            except GrammarUnavailable as exc:
                return self.refuse(conn, "internal", f"structured output: {exc}", g.id, "structured")
            if why is not None:
                return self.refuse(conn, "bad_request", f"structured output: {why}", g.id, "structured")
            if conn.closed:
                return Effects()
        if g.messages is not None and not has_chat_template(self.tok):
            return self.refuse(conn, "bad_request", "messages: the model's tokenizer has no chat "
                               "template; send a prompt instead", g.id, "chat_template")
        bad = self._check_state(conn, client_id)
        if bad is not None:
            return self.refuse(conn, *bad, g.id)
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
        if g.id is None:  # the id it hears in every event of the request (refusals say None)
            g = msgspec.structs.replace(g, id=client_id)
        rid = daemon_id(conn, client_id)
        out = self.core.submit(conn, uid, g, rid, list(ids), self.clock(),
                               pid=conn.peer.pid if conn.peer is not None else None)
        entry = self.live.get(rid)
        if entry is not None and entry.gen is g:
            # Before anything can dispatch it (no await since submit): its batches carry this.
            entry.grammar = grammar
        return out

    async def _tokenize(self, g: P.Generate) -> list[int]:
        """Blocking work: in the thread pool, at most ``daemon.max_tokenizing`` at once."""
        loop = asyncio.get_running_loop()
        async with self.tokenizing:
            if g.messages is not None:
                msgs = [{"role": x.role, "content": x.content} for x in g.messages]
                return await loop.run_in_executor(self.pool, self.tok.encode_chat, msgs)
            assert g.prompt is not None
            return await loop.run_in_executor(self.pool, self.tok.encode, g.prompt)
