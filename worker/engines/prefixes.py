"""When a finished row's KV is worth keeping for other requests: the rule both engines that share
prompt prefixes use (``llama``'s :class:`~worker.engines.llama_kv.KVSlots`, ``hf-static-cb``'s
:class:`~worker.engines.kvstore.KVStore` through :mod:`worker.engines.arena_set`).

A prefix nobody else begins with is pure cost (cells or memory held for nobody, and on
``hf-static-cb`` a copy out of the arena), so a row's KV is cached only when another of the
recent rows began with the same :data:`MIN_PREFIX` tokens: a shared system prompt, a prompt
sent again, ``n`` choices of a prompt, an evaluation's context before each continuation. Where
no two requests begin alike (a replay of distinct prompts) nothing is cached.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["MIN_PREFIX", "RECENT_HEADS", "RecentHeads"]

#: The fewest tokens a cached prefix holds, and a row takes from one: shorter ones are not
#: worth the copy.
MIN_PREFIX = 16
#: How many recent rows' heads (first :data:`MIN_PREFIX` tokens) are remembered.
RECENT_HEADS = 64


class RecentHeads:
    """The heads of the rows started lately (at most ``size``), with how many began so."""

    def __init__(self, size: int = RECENT_HEADS) -> None:
        self.size = size
        self._heads: OrderedDict[tuple[int, ...], int] = OrderedDict()

    def seen(self, tokens: Sequence[int]) -> None:
        """A row with context ``tokens`` started (its head becomes the most recent)."""
        if len(tokens) <= MIN_PREFIX:
            return
        head = tuple(tokens[:MIN_PREFIX])
        self._heads[head] = self._heads.pop(head, 0) + 1
        while len(self._heads) > self.size:
            self._heads.popitem(last=False)

    def shared(self, tokens: Sequence[int]) -> bool:
        """Whether at least two recent rows began with ``tokens``' head (so a cached prefix of
        ``tokens`` is likely to serve another)."""
        return len(tokens) >= MIN_PREFIX and self._heads.get(tuple(tokens[:MIN_PREFIX]), 0) >= 2
