"""The events a client hears about its request, built from the request's entry.

``delta`` carries new tokens and text (trimmed at a stop string) and, when
asked for, their log-probabilities with each token's text (the first delta after the
prefill also the prompt's, ``prompt_logprobs``); ``done`` the
usage and timings, and for a request that does not stream the whole output.
Building an event changes nothing but the output's stop-string and
sent-logprobs marks; sending it is the caller's business.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ... import protocol as P
from ...core.request import FinishReason
from ...tokenizer import Tokenizer
from .table import Entry

__all__ = ["ClientEvents", "PromptNamesJob", "named"]


def named(tok: Tokenizer, texts: dict[int, str], lps: list[P.TokenLogprobs]) -> list[P.TokenLogprobs]:
    """``lps`` with each token's text filled in (``texts``: id -> text, the cache it grows)."""
    decode = tok.decode

    def one(x: P.Logprob) -> P.Logprob:
        t = texts.get(x.id)
        if t is None:
            t = texts[x.id] = decode([x.id])
        return P.Logprob(x.id, x.logprob, t)

    return [P.TokenLogprobs(one(e.chosen), [one(a) for a in e.top]) for e in lps]


@dataclass(eq=False, slots=True)
class PromptNamesJob:
    """A request's prompt log-probabilities to name (:func:`named`), off the loop (a
    :class:`~.effects.DecodeJob`): one entry per prompt token, each with its alternatives, is
    too much work for the loop on a long prompt (150 ms for 4,096 tokens with 20 alternatives,
    the cache cold). Queued before the job of the tokens they came with, so that their delta
    carries them."""

    entry: Entry
    lps: list[P.TokenLogprobs]
    texts: dict[int, str]

    def size(self) -> int:
        return sum(1 + len(e.top) for e in self.lps)

    def run(self, tok: Any) -> list[P.TokenLogprobs]:
        return named(tok, self.texts, self.lps)


class ClientEvents:
    """Builds ``delta``, ``done`` and ``error`` events (see the module docstring)."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        #: Token id -> text, for logprobs (bounded by the vocabulary).
        self._texts: dict[int, str] = {}

    def delta(self, e: Entry, ids: list[int], text: str) -> P.Delta | None:
        """New tokens ``ids`` (the tail of the output) and their text, as a ``delta`` for a
        streaming request (None: nothing to send, or the request does not stream). Notes
        where a stop string ended the request either way."""
        out = e.out
        if out.detok.stop:
            ids = out.stop_cut(ids)
        if not e.streams:
            return None
        lps = None
        if e.wants_logprobs:
            lps = self._named(out.unsent_logprobs()) or None
        plps = None
        if e.prompt_logprobs is not None and not e.prompt_logprobs_sent:
            plps = e.prompt_logprobs
            e.prompt_logprobs_sent = True
        if ids or text or lps or plps:
            return P.Delta(id=e.client_id, token_ids=ids, text=text, logprobs=lps, prompt_logprobs=plps)
        return None

    def done(self, e: Entry, reason: FinishReason, now: float) -> P.Done:
        """The terminal ``done``; the output is trimmed where a stop string ended it."""
        out = e.out
        out.trim_to_stop()
        r = e.req
        streams = e.streams
        return P.Done(
            id=e.client_id,
            finish_reason=reason,
            usage=P.Usage(prompt_tokens=len(e.prompt_ids), completion_tokens=len(out.ids),
                          cached_tokens=e.cached_tokens),
            timings=self.timings(e, now),
            text=None if streams else out.detok.text,
            token_ids=None if streams else list(out.ids),
            worker=r.worker,
            logprobs=self._named(out.logprobs) if e.wants_logprobs and not streams else None,
            # A request that does not stream, or one whose prompt's came after its last delta.
            prompt_logprobs=e.prompt_logprobs if not e.prompt_logprobs_sent else None,
        )

    @staticmethod
    def timings(e: Entry, now: float) -> P.Timings:
        r = e.req
        # Queued until a worker started its first slice (not merely until its batch went
        # into the worker's queue); one no worker started waited all its life.
        start = e.started_at if e.started_at is not None else r.first_token
        return P.Timings(
            queued_s=(start if start is not None else now) - r.arrival,
            ttft_s=None if r.first_token is None else r.first_token - r.arrival,
            e2e_s=now - r.arrival,
            slices=r.slices,
            max_gap_s=e.max_gap_s,
        )

    def _named(self, lps: list[P.TokenLogprobs]) -> list[P.TokenLogprobs]:
        """``lps`` with each token's text filled in (cached per id: a vocabulary's worth)."""
        return named(self.tok, self._texts, lps)

    def prompt_names(self, e: Entry, lps: list[P.TokenLogprobs]) -> PromptNamesJob:
        """The job that names ``e``'s prompt log-probabilities off the loop (the same cache)."""
        return PromptNamesJob(e, lps, self._texts)
