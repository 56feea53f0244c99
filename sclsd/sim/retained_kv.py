"""A simulated worker's retained KV: per-request entries on the device or in host memory.

After a slice a worker keeps each unfinished row's KV (its context but the
last sampled token) as the most recently used entry, on the device. Before a
batch starts, its rows' entries are checked out (an entry in host memory is
copied back first: its bytes over the host link), then the device keeps only
what fits beside the batch: least recently used entries move to host memory
(with a host link) or are evicted, and host memory over its budget evicts its
least recently used entries. Evicted requests are reported to the scheduler,
as a real worker reports them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["Checkout", "RetainedKV"]


@dataclass(slots=True)
class _Entry:
    tokens: int
    on_device: bool = True


@dataclass(slots=True)
class Checkout:
    """What a batch got from the store."""

    held: list[int]
    """Tokens of KV found per row (0: none)."""
    host_bytes: float = 0.0
    """Bytes that came back from host memory."""
    evicted: list[str] = field(default_factory=list)
    """Requests whose KV was dropped to make room for the batch."""


class RetainedKV:
    """LRU entries in two tiers: ``device_bytes`` shared with the running batch, ``host_bytes``."""

    def __init__(self, delta: int, device_bytes: float, host_bytes: float = 0.0) -> None:
        self.delta = delta
        self.device_bytes = device_bytes
        self.host_bytes = host_bytes
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self.evictions = 0

    def __contains__(self, rid: str) -> bool:
        return rid in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def tokens(self, rid: str) -> int:
        """Tokens held for ``rid`` (0: none)."""
        e = self._entries.get(rid)
        return e.tokens if e is not None else 0

    def bytes_held(self) -> float:
        return sum(e.tokens for e in self._entries.values()) * float(self.delta)

    def drop(self, rid: str) -> None:
        """Forget ``rid`` (it finished, or moved to another worker)."""
        self._entries.pop(rid, None)

    def put(self, items: Sequence[tuple[str, int]]) -> list[str]:
        """Keep ``(rid, tokens)`` of KV on the device, most recently used; returns evictions."""
        for rid, tokens in items:
            self._entries.pop(rid, None)
            if tokens > 0:
                self._entries[rid] = _Entry(tokens)
        return self._fit(0.0)

    def checkout(self, rids: Sequence[str], running_bytes: float) -> Checkout:
        """Take the entries of a starting batch's rows and make room for its ``running_bytes``."""
        held: list[int] = []
        host = 0.0
        for rid in rids:
            e = self._entries.pop(rid, None)
            if e is None:
                held.append(0)
                continue
            held.append(e.tokens)
            if not e.on_device:
                host += e.tokens * self.delta
        return Checkout(held, host, self._fit(running_bytes))

    def _fit(self, running_bytes: float) -> list[str]:
        """Device entries beyond the room beside the batch move to host (or go); host over budget goes."""
        room = max(0.0, self.device_bytes - running_bytes)
        host_room = self.host_bytes
        evicted: list[str] = []
        used_dev = used_host = 0.0
        for rid in reversed(self._entries):  # most recently used first
            e = self._entries[rid]
            b = e.tokens * self.delta
            if e.on_device and used_dev + b <= room:
                used_dev += b
                continue
            if used_host + b <= host_room:
                e.on_device = False
                used_host += b
                continue
            evicted.append(rid)
        for rid in evicted:
            del self._entries[rid]
        self.evictions += len(evicted)
        return evicted
