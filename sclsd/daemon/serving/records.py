"""Which worker holds the record of which live request: the daemon's side of row deltas.

A worker keeps the record of every request it was sent whole (prompt, parameters,
grammar, and the context it holds: what it was sent, then what it generated;
:mod:`worker.rows`). While the daemon knows that worker holds the request with ``n``
tokens of its context, a new row of it there is a
:class:`~sclsd.protocol.ContinueRow`: its budget and the tokens past ``n`` (usually
none). :class:`Records` is that knowledge, and the records to forget:

- a row sent (whole or not) makes the worker hold the request's context as sent;
- a result's row grows it by the row's tokens, or ends it when the row finished
  there (the worker drops a finished row's record itself);
- a request that moves to another worker, or ends in the daemon (a stop string, a
  cancel, a timeout) is forgotten where it was held: the call that forgets it returns that
  worker, and the caller puts the id in its :class:`~.effects.Effects` (``forget``), from
  where it rides on the next batch to that worker (``BatchMsg.forget``) or goes in one
  :class:`~sclsd.protocol.Forget` once the entry point's other messages went out;
- a failed batch makes its rows' records untrusted (the next row there is whole);
- a ``release`` drops the record with the KV; a worker lost or registered anew holds
  nothing.
"""

from __future__ import annotations

__all__ = ["Records"]

#: ``held`` value of a record the worker has, but whose context the daemon cannot vouch for.
STALE = -1


class Records:
    """The records workers hold, by worker and request (see the module docstring)."""

    def __init__(self) -> None:
        self.held: dict[str, dict[str, int]] = {}
        """Worker id -> request id -> context tokens the worker holds for it (``STALE``)."""
        self.where: dict[str, str] = {}
        """Request id -> the worker holding its record."""

    def known(self, wid: str, rid: str) -> int | None:
        """The context tokens ``wid`` holds for ``rid`` that a continued row may build on
        (None: send the row whole)."""
        n = self.held.get(wid, {}).get(rid)
        return None if n is None or n == STALE else n

    def sent(self, wid: str, rid: str, n: int) -> str | None:
        """A row of ``rid`` went to ``wid`` with ``n`` context tokens; a record elsewhere is
        forgotten: returns that worker (None: none), which must be told."""
        old = self.where.get(rid)
        if old is not None and old != wid:
            self._forget(old, rid)
        else:
            old = None
        self.where[rid] = wid
        self.held.setdefault(wid, {})[rid] = n
        return old

    def grew(self, wid: str, rid: str, n: int) -> None:
        """``wid``'s row of ``rid`` generated tokens, which the daemon kept: it holds ``n``."""
        if self.where.get(rid) == wid:
            self.held[wid][rid] = n

    def stale(self, wid: str, rid: str) -> None:
        """``wid`` holds a record of ``rid`` the daemon cannot vouch for (its batch failed,
        or what it streamed and its result disagree): the next row there is whole."""
        if self.where.get(rid) == wid:
            self.held[wid][rid] = STALE

    def dropped(self, wid: str, rid: str) -> None:
        """``wid`` dropped ``rid``'s record itself (the row finished there, or a release)."""
        if self.where.get(rid) == wid:
            del self.where[rid]
            del self.held[wid][rid]

    def ended(self, rid: str) -> str | None:
        """``rid`` ended in the daemon: its record is forgotten wherever it is held; returns
        that worker (None: none), which must be told."""
        wid = self.where.get(rid)
        if wid is not None:
            self._forget(wid, rid)
        return wid

    def worker_gone(self, wid: str) -> None:
        """``wid`` was lost or registered anew: it holds no record."""
        for rid in self.held.pop(wid, {}):
            del self.where[rid]

    def _forget(self, wid: str, rid: str) -> None:
        del self.where[rid]
        del self.held[wid][rid]
