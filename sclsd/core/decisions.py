"""What a scheduler decided: the values its entry points return.

A scheduler answers each call with what the call decided, and keeps nothing
for the driver to fetch later. In particular, KV that a worker keeps and the
scheduler stops counting on (its request moved to another worker, ended, or
its batch failed) comes back as :class:`Release` entries from the entry point
that gave it up: a round that moves requests away from their KV
(:class:`Round`), a result (:class:`Applied`), a cancel (:class:`Cancelled`),
timeouts (:class:`Expired`), a worker lost (:class:`Removed`), a worker
drained (``set_active`` returns :data:`Releases`). A driver applies every
release it is handed, once: it tells that worker to drop that KV. A release
names only workers still registered when the call returns.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .batch import Batch
    from .request import Request

__all__ = ["Applied", "Cancelled", "Expired", "Release", "Releases", "Removed", "Round", "releases_of"]


@dataclass(frozen=True, slots=True)
class Release:
    """Worker ``worker`` is to drop the KV it keeps for ``rids`` (oldest decision first)."""

    worker: str
    rids: tuple[str, ...]


Releases = tuple[Release, ...]
"""Releases by worker, one entry per worker, in the order the scheduler decided them."""


def releases_of(pairs: Iterable[tuple[str, str]]) -> Releases:
    """``(worker, rid)`` pairs grouped by worker, each group in its first pair's place."""
    by: dict[str, list[str]] = {}
    for wid, rid in pairs:
        by.setdefault(wid, []).append(rid)
    return tuple(Release(w, tuple(rids)) for w, rids in by.items())


@dataclass(frozen=True, slots=True)
class Round:
    """A scheduling round: the batches to send (each with its worker set), in order, and
    the KV to release; release it before sending the batches (a moved request's old worker
    drops its copy first)."""

    batches: tuple[Batch, ...] = ()
    releases: Releases = ()


@dataclass(frozen=True, slots=True)
class Applied:
    """A batch's outcome, applied: the requests it ended (finished, or failed for good), those
    back in the pool, and the KV to release."""

    ended: tuple[Request, ...] = ()
    requeued: tuple[Request, ...] = ()
    releases: Releases = ()


@dataclass(frozen=True, slots=True)
class Cancelled:
    """A live request ended outside a result (cancelled, timed out), and the KV to release."""

    request: Request
    releases: Releases = ()


@dataclass(frozen=True, slots=True)
class Expired:
    """The live requests whose deadline passed (ended ``timeout``), and the KV to release."""

    requests: tuple[Request, ...] = ()
    releases: Releases = ()


@dataclass(frozen=True, slots=True)
class Removed:
    """A worker gone: its batches' requests back in the pool (oldest batch first), those that
    ended instead (``FAILED``: too many workers died under them), and the KV to release
    (on other workers)."""

    requeued: tuple[Request, ...] = ()
    ended: tuple[Request, ...] = ()
    releases: Releases = ()
