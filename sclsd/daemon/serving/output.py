"""One request's output: its tokens, text and log-probabilities, and what workers streamed.

Tokens reach a request two ways. While a slice runs, the worker streams them
(``tokens`` messages): each message's tokens become a :class:`Chunk` that
waits in :attr:`Output.inbound` while it is detokenized, then lands in
:attr:`Output.ids`. How many tokens the request generated is not counted here but in
its one record of progress, ``Request.num_generated`` (the running slice's streamed
ones: ``Request.slice_tokens``). When the slice ends, its ``result`` brings the tokens
that followed the streamed ones. A slice that ends without a result (its worker lost,
its batch failed) keeps what was streamed: :meth:`Output.settle` makes it part of the
output.

A request that ends at a stop string keeps only the tokens up to the one that
completed it (:meth:`Output.stop_cut`, :meth:`Output.trim_to_stop`): the count
is found when the stop appears, with a few decodes of a window of at most a
slice plus the stop string's length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ... import protocol as P
from ...core.request import FinishReason
from ...tokenizer import Detokenizer, Tokenizer

__all__ = ["Chunk", "Output", "kept_tokens"]


@dataclass(eq=False, slots=True)
class Chunk:
    """The tokens (and log-probabilities) of one ``tokens`` message for one request."""

    ids: list[int]
    logprobs: list[P.TokenLogprobs]


@dataclass(eq=False)
class Output:
    """What a request generated so far (see the module docstring)."""

    detok: Detokenizer
    tok: Tokenizer | None = None
    """The daemon's tokenizer: the tokens kept at a stop string."""
    ids: list[int] = field(default_factory=list)
    """Generated token ids, in order (streamed ones included once they landed)."""
    logprobs: list[P.TokenLogprobs] = field(default_factory=list)
    """Of ``ids``, in order, as far as workers sent them (requests with logprobs)."""
    sent_logprobs: int = 0
    """Entries of ``logprobs`` already sent in deltas."""
    stop_free: int = 0
    """Leading tokens of ``ids`` known not to complete a stop string."""
    kept: int | None = None
    """Tokens kept once a stop string ended the request (None: none did)."""
    inbound: list[Chunk] = field(default_factory=list)
    """Streamed chunks being detokenized, on their way to ``ids``."""
    unsettled: bool = False
    """The running slice streamed tokens and has not ended yet (by its result, or
    :meth:`settle`). How many is the request's progress, not the output's:
    ``Request.slice_tokens``."""
    streamed_reason: FinishReason | None = None
    """The worker said the row finished in a ``tokens`` message (kept in case no result comes)."""

    def context(self) -> list[int]:
        """The output including streamed tokens still being detokenized."""
        out = list(self.ids)
        for chunk in self.inbound:
            out += chunk.ids
        return out

    def window(self) -> tuple[list[int], list[int], tuple[int, int, int, int]]:
        """:meth:`Detokenizer.window <sclsd.tokenizer.Detokenizer.window>` of :meth:`context`,
        without copying the output before the window (its cost does not grow with it)."""
        d = self.detok
        p, ids = d.p, self.ids
        if p <= len(ids):  # the window starts among the landed tokens (always, but after a lag)
            tail = ids[p:]
            for chunk in self.inbound:
                tail += chunk.ids
            return tail, tail[:d.r - p], (p, d.r, d.t_r, p + len(tail))
        skip = p - len(ids)  # it starts among the inbound chunks
        tail = []
        n = len(ids)
        for chunk in self.inbound:
            n += len(chunk.ids)
            if skip >= len(chunk.ids):
                skip -= len(chunk.ids)
            else:
                tail += chunk.ids[skip:]
                skip = 0
        return tail, tail[:d.r - p], (p, d.r, d.t_r, n)

    # ------------------------------------------------------------------ streamed tokens

    def stream(self, ids: list[int], logprobs: list[P.TokenLogprobs],
               reason: FinishReason | None) -> Chunk:
        """``ids`` streamed in the running slice; returns the chunk to detokenize."""
        self.unsettled = True
        self.streamed_reason = reason
        chunk = Chunk(list(ids), logprobs[: len(ids)] if logprobs else [])
        self.inbound.append(chunk)
        return chunk

    def take(self, ids: list[int], logprobs: list[P.TokenLogprobs], reason: FinishReason | None) -> None:
        """``ids`` streamed in the running slice, for a request that does not stream: they
        join the output at once (its text is decoded with the slice's result)."""
        self.unsettled = True
        self.streamed_reason = reason
        self.ids.extend(ids)
        if logprobs:
            self.logprobs.extend(logprobs[: len(ids)])

    def land(self, chunk: Chunk) -> None:
        """``chunk`` was detokenized: its tokens join the output (unless its slice ended
        without a result meanwhile, which already put them there)."""
        if self.inbound and self.inbound[0] is chunk:
            self.inbound.pop(0)
            self.ids.extend(chunk.ids)
            self.logprobs.extend(chunk.logprobs)

    # ------------------------------------------------------------------ slice ends

    def apply_slice(self, out: P.RequestOutput) -> list[int]:
        """The slice's result ``out``: its tokens follow those it streamed, already in ``ids``
        (or on their way); returns them (now in ``ids`` too)."""
        tail = list(out.token_ids)
        self.ids.extend(tail)
        self.logprobs.extend(out.logprobs)
        self.unsettled, self.streamed_reason = False, None
        return tail

    def settle(self) -> FinishReason | None:
        """The running slice ended without a result: what it streamed stays in the output.
        Returns whether the worker said those tokens ended the row."""
        reason = self.streamed_reason
        self.unsettled, self.streamed_reason = False, None
        for chunk in self.inbound:
            self.ids.extend(chunk.ids)
            self.logprobs.extend(chunk.logprobs)
        self.inbound.clear()
        return reason

    # ------------------------------------------------------------------ stop strings

    def stop_cut(self, new: list[int]) -> list[int]:
        """Of the newest tokens ``new`` (the tail of ``ids``), those before or completing a
        stop string."""
        n = len(self.ids)
        if not self.detok.stopped:
            self.stop_free = n
            return new
        if self.kept is None:
            self.kept = kept_tokens(self.ids, self.detok.stop, self.stop_free, self.tok)
        return new[: max(0, self.kept - (n - len(new)))]

    def trim_to_stop(self) -> None:
        """The request ends: drop the tokens after the one that completed its stop string."""
        if self.detok.stopped and self.detok.stop:
            self.stop_cut([])
            assert self.kept is not None
            del self.ids[self.kept:]
            del self.logprobs[self.kept:]

    def unsent_logprobs(self) -> list[P.TokenLogprobs]:
        """Log-probabilities not sent yet (none past a stop string's end); marks them sent."""
        upto = len(self.logprobs) if self.kept is None else min(self.kept, len(self.logprobs))
        out = self.logprobs[self.sent_logprobs:upto]
        self.sent_logprobs = max(self.sent_logprobs, upto)
        return out


def kept_tokens(ids: list[int], stops: list[str], stop_free: int, tok: Tokenizer | None) -> int:
    """How many of ``ids`` to keep when the text of ``ids`` contains a stop string: up to and
    including the token that completed it (the first ``stop_free`` are known not to).

    Binary search over decodes of a window that starts a stop string's worth of tokens
    before ``stop_free`` (the stop cannot start earlier): cheap, and monotone in its end.
    """
    n = len(ids)
    if tok is None or n <= stop_free:
        return n
    # A character is at most 4 byte-level tokens; special tokens decode to nothing.
    start = max(0, stop_free - 4 * max(len(s) for s in stops) - 8)

    def hit(k: int) -> bool:
        text = tok.decode(ids[start:k])
        return any(s in text for s in stops)

    lo, hi = stop_free, n
    if not hit(hi):
        return n  # a tokenizer that rewrites earlier text: keep everything rather than guess
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if hit(mid):
            hi = mid
        else:
            lo = mid
    return hi
