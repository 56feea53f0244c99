"""The request table: every accepted request, by id, until its terminal event.

An :class:`Entry` owns the request's scheduler view (its
:class:`~sclsd.core.request.Request`), what its client asked for, and its
:class:`~sclsd.daemon.serving.output.Output`; nothing about a request is
kept anywhere else in the daemon (the scheduler's pool and batches hold the
same ``Request`` objects). The table also keeps the sums admission bounds
(prompt tokens queued, per uid) and each client's requests.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from ... import protocol as P
from ...core.request import Request
from .effects import Client
from .output import Output

__all__ = ["Entry", "RequestTable"]


@dataclass(eq=False)
class Entry:
    """One live request."""

    req: Request
    client: Client
    """Who submitted it: its events go there."""
    uid: int | None
    """The client's uid (SO_PEERCRED), for the per-uid admission share."""
    gen: P.Generate
    prompt_ids: list[int]
    out: Output
    cached_tokens: int = 0
    """Most prompt tokens one slice took from KV a worker kept (``usage.cached_tokens``)."""
    sent_at: float | None = None
    """When its latest batch was sent to a worker."""
    started_at: float | None = None
    """When a worker started its first slice: that batch's dispatch plus the time it waited
    in the worker's local queue (its result says), so the queue time counts that wait too."""
    last_token_at: float | None = None
    """When the daemon last got new tokens for it (streamed, or in a result)."""
    max_gap_s: float | None = None
    """Longest wait between two such arrivals, first token to last (None: fewer than two):
    what a streaming client sees between two deltas, a slice boundary's stall included."""

    def tokens_at(self, now: float) -> None:
        """New tokens for this request reached the daemon at ``now``."""
        if self.last_token_at is not None:
            gap = now - self.last_token_at
            if self.max_gap_s is None or gap > self.max_gap_s:
                self.max_gap_s = gap
        self.last_token_at = now

    @property
    def rid(self) -> str:
        return self.req.rid

    @property
    def streams(self) -> bool:
        """Whether its client hears tokens as they come (else all of them in ``done``)."""
        return self.gen.stream

    @property
    def wants_logprobs(self) -> bool:
        return self.gen.logprobs or self.gen.top_logprobs > 0


class RequestTable:
    """Live requests by id, with the sums admission reads (see the module docstring)."""

    def __init__(self) -> None:
        self._entries: dict[str, Entry] = {}
        #: Prompt tokens of live requests (``daemon.max_queued_tokens``).
        self.queued_tokens = 0
        #: Live requests and their prompt tokens per client uid (``daemon.uid_share``).
        self.by_uid: dict[int | None, tuple[int, int]] = {}
        self._by_client: dict[Client, set[str]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, rid: object) -> bool:
        return rid in self._entries

    def __iter__(self) -> Iterator[Entry]:
        return iter(list(self._entries.values()))

    def get(self, rid: str) -> Entry | None:
        return self._entries.get(rid)

    def holds(self, e: Entry) -> bool:
        """Whether ``e`` is still live (and not an ended request's namesake)."""
        return self._entries.get(e.rid) is e

    def ids(self) -> list[str]:
        return list(self._entries)

    def of_client(self, client: Client) -> set[str]:
        """The live requests ``client`` submitted (a copy)."""
        return set(self._by_client.get(client, ()))

    def owns(self, client: Client, rid: str) -> bool:
        """Whether ``rid`` is a live request ``client`` submitted."""
        return rid in self._by_client.get(client, ())

    def add(self, e: Entry) -> None:
        self._entries[e.rid] = e
        self._by_client.setdefault(e.client, set()).add(e.rid)
        self._count(e, +1)

    def remove(self, e: Entry) -> bool:
        """Take ``e`` out; False if it was not live."""
        if self._entries.get(e.rid) is not e:
            return False
        del self._entries[e.rid]
        mine = self._by_client.get(e.client)
        if mine is not None:
            mine.discard(e.rid)
            if not mine:
                del self._by_client[e.client]
        self._count(e, -1)
        return True

    def _count(self, e: Entry, sign: int) -> None:
        n = len(e.prompt_ids)
        self.queued_tokens += sign * n
        reqs, toks = self.by_uid.get(e.uid, (0, 0))
        reqs, toks = reqs + sign, toks + sign * n
        if reqs:
            self.by_uid[e.uid] = (reqs, toks)
        else:
            self.by_uid.pop(e.uid, None)
