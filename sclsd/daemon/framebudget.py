"""The daemon's budget for half-sent frames, over all connections and per peer uid.

A frame's body is taken off the socket as it arrives, and what has arrived of a frame
that is not complete yet stays in memory until the rest comes (or
``daemon.frame_timeout_s`` ends the connection). Each connection may hold up to
``max_frame_bytes`` that way, so without a bound N slow connections grow the daemon by
N times ``max_frame_bytes``. Every connection of the client and the status sockets
charges what it holds of its current frame to one :class:`FrameBudget`; a frame that
arrives whole in one read is never charged, so ordinary traffic never touches it.

Who is closed when a charge does not fit:

- over the uid's budget (``daemon.max_partial_frame_bytes_per_uid``): the connection
  that brought the new bytes. Its own uid's frames put it there.
- over the global budget (``daemon.max_partial_frame_bytes``, only reachable with
  several uids): connections of the uid holding the most are closed, largest first,
  until the new bytes fit. A uid holding little, a bystander, keeps its connections;
  the charging connection is itself closed if it is the one chosen.

Everything runs on the event loop: no locks.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)

#: The uid charged for a peer without credentials (SO_PEERCRED unavailable).
NO_UID = -1


class FrameBudget(Generic[K]):
    """Bytes held in incomplete frames, per holder (a connection), per uid and in all.

    ``evict(holder, why)`` closes another holder chosen to make room under the global
    budget; its charge is already released when it is called.
    """

    def __init__(self, total: int, per_uid: int, evict: Callable[[K, str], None] | None = None) -> None:
        if not 0 < per_uid <= total:
            raise ValueError(f"need 0 < per_uid ({per_uid}) <= total ({total})")
        self.total = total
        self.per_uid = per_uid
        self.evict = evict
        self.held = 0
        """Bytes held now, over every holder."""
        self.closed = 0
        """Connections closed because a charge did not fit, since start."""
        self._by_uid: dict[int, int] = {}
        self._holders: dict[int, dict[K, int]] = {}
        self._uid_of: dict[K, int] = {}

    def holding(self, holder: K) -> int:
        """Bytes ``holder`` holds now."""
        uid = self._uid_of.get(holder)
        return 0 if uid is None else self._holders[uid][holder]

    def uid_holding(self, uid: int) -> int:
        """Bytes the holders of ``uid`` hold now."""
        return self._by_uid.get(uid, 0)

    def charge(self, holder: K, uid: int, n: int) -> str | None:
        """``holder`` (of ``uid``) now holds ``n`` more bytes. None when they fit; else why
        not, and the holder's whole charge is released (the caller closes it)."""
        if self._by_uid.get(uid, 0) + n > self.per_uid:
            self._refuse(holder)
            return (f"frames in progress of uid {uid} would hold more than "
                    f"{self.per_uid} bytes (daemon.max_partial_frame_bytes_per_uid)")
        why = (f"frames in progress of all clients would hold more than {self.total} bytes "
               "(daemon.max_partial_frame_bytes); connections of the uid holding the most are closed")
        while self.held + n > self.total and self._by_uid:
            heaviest = max(self._by_uid, key=self._by_uid.__getitem__)
            holders = self._holders[heaviest]
            victim = max(holders, key=holders.__getitem__)
            if victim == holder:
                self._refuse(holder)
                return why
            self.release(victim)
            self.closed += 1
            if self.evict is not None:
                self.evict(victim, why)
        self._uid_of[holder] = uid
        holders = self._holders.setdefault(uid, {})
        holders[holder] = holders.get(holder, 0) + n
        self._by_uid[uid] = self._by_uid.get(uid, 0) + n
        self.held += n
        return None

    def release(self, holder: K) -> None:
        """``holder``'s frame is complete or gone: it holds nothing any more."""
        uid = self._uid_of.pop(holder, None)
        if uid is None:
            return
        holders = self._holders[uid]
        n = holders.pop(holder)
        self.held -= n
        left = self._by_uid[uid] - n
        if holders:
            self._by_uid[uid] = left
        else:
            del self._holders[uid]
            del self._by_uid[uid]

    def _refuse(self, holder: K) -> None:
        self.release(holder)
        self.closed += 1
