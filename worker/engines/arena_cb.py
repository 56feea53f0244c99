"""The host side of ``hf-static-cb``: grants in flight, their rows, and the daemon's releases.

A grant is a batch of the daemon's (:class:`~sclsd.protocol.BatchMsg`): its rows join the
engine's running set when the arena has room for them and leave it one by one, each at
its stop token, its ``max_new_tokens`` or its slice (``min(max_new_tokens, slice_len)``
tokens in this grant); the grant ends once all its rows have. Nothing here touches the
device: :mod:`worker.engines.hf_static_cb` moves the rows' KV and runs the steps.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import msgspec

from sclsd.protocol import BatchRequest, RequestOutput
from worker.engines.grant import Grant
from worker.engines.hf import RowState
from worker.engines.hf_model import PromptScore

__all__ = ["Releases", "Row"]


class Row:
    """One row of a grant: waiting for room, then running in an arena slot, then ended.

    Its KV occupies the first :attr:`fed` columns of its slot: every context token but the
    last (prefilled, or copied in from kept KV) and one more per decode step."""

    __slots__ = ("grant", "state", "cap", "keep", "used", "sent", "slot", "matcher", "released", "waited", "score",
                 "_ctx")

    def __init__(self, grant: Grant, req: BatchRequest, eos: list[int], prompt_scores: bool = False) -> None:
        self.grant = grant
        self.state = RowState(req, eos)
        """Tokens, log-probabilities, finish reason and seed (``hf``'s, the same rules)."""
        self.score: PromptScore | None = self.state.prompt_score(prompt_scores)
        """Its prompt's log-probabilities, filled by its prefill when it asks for them in its
        request's first grant (``prompt_scores``: the engine's model can compute them); such
        a row prefills its whole context, never taking kept KV (None: it does not ask)."""
        self.cap = min(req.max_new_tokens, grant.batch.slice_len)
        """Tokens it may generate in this grant."""
        self.keep = grant.batch.kv_reuse and self.cap < req.max_new_tokens
        """Its KV is kept when its slice ends first (the daemon may grant it more)."""
        self.used = 0
        """Context tokens whose KV came from what was kept for the request (no prefill)."""
        self.sent = 0
        """Tokens already in a :class:`~worker.engines.base.NewTokens` event."""
        self.slot = -1
        self.matcher: Any = None
        """Its grammar's llguidance matcher (None: no grammar)."""
        self.released = False
        """The daemon released the request while this row was in the engine: nothing is kept."""
        self.waited = False
        """It waited for arena room while other rows ran."""
        self._ctx: list[int] | None = None
        """Its context and this grant's tokens so far, grown as they come (:meth:`now`)."""

    @property
    def req(self) -> BatchRequest:
        return self.state.req

    @property
    def rid(self) -> str:
        return self.state.req.rid

    @property
    def length(self) -> int:
        """L: its context (prompt and the tokens of earlier grants)."""
        return len(self.state.req.token_ids)

    @property
    def need(self) -> int:
        """Columns its slot must have: its context and its grant (``L + cap``): the last
        column a step may write is ``L - 1 + cap`` (one step past its slice, read behind)."""
        return self.length + self.cap

    @property
    def fed(self) -> int:
        """Columns of KV it holds once its tokens so far are read: also the column, and the
        position, of its next decode step."""
        return self.length - 1 + len(self.state.out)

    @property
    def ended(self) -> bool:
        """Stopped, at its ``max_new_tokens``, or at the end of its slice."""
        return self.state.done or len(self.state.out) >= self.cap

    def next_input(self) -> int:
        """The token its next decode step feeds."""
        out = self.state.out
        return out[-1] if out else self.state.req.token_ids[-1]

    def now(self) -> BatchRequest:
        """The row as the sampler sees it before its next token: the tokens of this grant so far
        appended to its context and counted as generated (penalties, ``min_tokens``, the
        position of its seeded draws: :class:`~worker.engines.sampling.BatchSampler`)."""
        r, out = self.state.req, self.state.out
        if not out:
            return r
        if self._ctx is None:
            self._ctx = list(r.token_ids)
        self._ctx += out[len(self._ctx) - len(r.token_ids):]  # the new tokens only: rows change often
        return msgspec.structs.replace(r, token_ids=self._ctx, generated=r.generated + len(out))

    def kept_tokens(self) -> list[int]:
        """The tokens whose KV it holds at the end of its slice (the last sampled one was never fed)."""
        return [*self.state.req.token_ids, *self.state.out[:-1]]

    def keeps(self) -> bool:
        """Whether its KV is kept when it ends now: its slice ended first, and it was not released."""
        return self.keep and not self.released and self.state.reason is None and bool(self.state.out)

    def fresh(self) -> RequestOutput | None:
        """Its tokens since the last call, as a streamed part (None: nothing new); the first
        part carries its prompt's log-probabilities too."""
        s = self.state
        if len(s.out) <= self.sent:
            return None
        part = RequestOutput(rid=s.req.rid, token_ids=s.out[self.sent:], finish_reason=s.reason,  # type: ignore[arg-type]
                             logprobs=s.logprobs[self.sent:], prompt_logprobs=s.plps if self.sent == 0 else [])
        self.sent = len(s.out)
        return part

    def output(self, kept: int) -> RequestOutput:
        """Its output at its end (``kept``: KV tokens kept for it)."""
        s = self.state
        return RequestOutput(rid=s.req.rid, token_ids=s.out, finish_reason=s.reason,  # type: ignore[arg-type]
                             kv_tokens=kept, reused_tokens=self.used, logprobs=s.logprobs, prompt_logprobs=s.plps)

    def prefill_tokens(self) -> int:
        """Context tokens it computed when it joined: none when it resumed its kept KV whole
        (the last token is fed by its first decode step), else every token the kept KV did
        not cover."""
        return 0 if self.used and self.used == self.length - 1 else self.length - self.used


class Releases:
    """Requests the daemon released, from the receive thread, until the serve thread takes
    them at its next turn (one lock; the engine's kept KV is dropped at once, in its store)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rids: set[str] = set()
        self._all = False

    def add(self, rids: Iterable[str] | None) -> None:
        with self._lock:
            if rids is None:
                self._all = True
            else:
                self._rids.update(rids)

    def peek(self) -> tuple[set[str], bool]:
        """(the rids released and not taken yet, whether everything was), left for :meth:`take`."""
        with self._lock:
            return set(self._rids), self._all

    def take(self) -> tuple[set[str], bool]:
        """(the rids released since the last call, whether everything was)."""
        with self._lock:
            out, every = self._rids, self._all
            self._rids, self._all = set(), False
        return out, every
