"""The request table: every accepted request, by id, until its terminal event.

Ids are the daemon's own (:attr:`Entry.rid`, what the scheduler and the workers
know a request by): a client's id is only unique among that client's live
requests, so no client can take or collide with another's ids; its events carry
the client's id (:attr:`Entry.client_id`), and the table finds a request by
(client, client id) as well.

An :class:`Entry` owns the request's scheduler view (its
:class:`~sclsd.core.request.Request`), what its client asked for, and its
:class:`~sclsd.daemon.serving.output.Output`; nothing about a request is
kept anywhere else in the daemon (the scheduler's pool and batches hold the
same ``Request`` objects). The table also keeps the sums admission bounds
(prompt tokens queued, per uid) and each client's requests.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

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
    token_gaps: list[tuple[float, int]] = field(default_factory=list)
    """Each arrival after the first: (seconds since the previous one, tokens it brought),
    for the inter-token latency histogram."""
    grammar: str | None = None
    """llguidance's grammar text for its ``structured`` output, compiled at admission (in a
    grammar process: :mod:`sclsd.daemon.grammar`); its batch rows carry it."""
    prompt_logprobs: list[P.TokenLogprobs] | None = None
    """With ``prompt_logprobs``: the first a worker sent, with their tokens' texts (None: none
    yet; its batch rows ask for them until a worker sent some)."""
    prompt_logprobs_taken: bool = False
    """A worker sent them (they are being named, or are in :attr:`prompt_logprobs`)."""
    prompt_logprobs_sent: bool = False
    """They went to the client in a ``delta``."""

    def takes_prompt_logprobs(self, lps: list[P.TokenLogprobs]) -> bool:
        """Whether a worker's row that carried ``lps`` brings the first (to be named and kept)."""
        if lps and not self.prompt_logprobs_taken and self.gen.prompt_logprobs is not None:
            self.prompt_logprobs_taken = True
            return True
        return False

    def tokens_at(self, now: float, n: int = 1) -> None:
        """``n`` new tokens for this request reached the daemon at ``now``."""
        if self.last_token_at is not None:
            gap = now - self.last_token_at
            if self.max_gap_s is None or gap > self.max_gap_s:
                self.max_gap_s = gap
            self.token_gaps.append((gap, n))
        self.last_token_at = now

    @property
    def rid(self) -> str:
        """The daemon's id for it (unique among live requests, whoever sent them)."""
        return self.req.rid

    @property
    def client_id(self) -> str:
        """The id its client knows it by (unique among that client's live requests): every
        event to the client carries it."""
        return self.gen.id if self.gen.id is not None else self.req.rid

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
        #: Each client's live requests: its id for each -> the daemon's.
        self._by_client: dict[Client, dict[str, str]] = {}

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
        """The live requests ``client`` submitted, by the daemon's ids (a copy)."""
        return set(self._by_client.get(client, {}).values())

    def owns(self, client: Client, rid: str) -> bool:
        """Whether ``rid`` (the daemon's id) is a live request ``client`` submitted."""
        e = self._entries.get(rid)
        return e is not None and e.client == client

    def find(self, client: Client, client_id: str) -> str | None:
        """The daemon's id of ``client``'s live request that it calls ``client_id``."""
        return self._by_client.get(client, {}).get(client_id)

    def with_client_id(self, client_id: str) -> list[str]:
        """The daemon's ids of every live request whose client calls it ``client_id``
        (any client's: for an admin, who may not know the daemon's id)."""
        return [rid for rid, e in self._entries.items() if e.client_id == client_id]

    def add(self, e: Entry) -> None:
        mine = self._by_client.setdefault(e.client, {})
        # Admission refuses a client id its client has live; never two of one.
        assert e.client_id not in mine, f"{e.client_id!r} is live for this client"
        self._entries[e.rid] = e
        mine[e.client_id] = e.rid
        self._count(e, +1)

    def remove(self, e: Entry) -> bool:
        """Take ``e`` out; False if it was not live."""
        if self._entries.get(e.rid) is not e:
            return False
        del self._entries[e.rid]
        mine = self._by_client.get(e.client)
        if mine is not None:
            mine.pop(e.client_id, None)
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
