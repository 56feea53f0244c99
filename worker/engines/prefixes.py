"""Prefixes shared between requests: the shortest worth sharing (both engines that share,
``llama``'s :class:`~worker.engines.llama_kv.KVSlots` and ``hf-static-cb``'s
:class:`~worker.engines.kvstore.KVStore`), and ``llama``'s rule for when a finished row's KV
is worth keeping.

On ``llama`` a prefix nobody else begins with is pure cost: its cells are held for nobody,
and every decode step attends over the cells up to the highest in use. So a row's KV is
cached only when another of the recent rows began with the same :data:`MIN_PREFIX` tokens
(:class:`RecentHeads`): a shared system prompt, a prompt sent again, ``n`` choices of a
prompt, an evaluation's context before each continuation. Where no two requests begin alike
(a replay of distinct prompts) nothing is cached. (``hf-static-cb`` keeps every finished row:
:mod:`worker.engines.arena_share` says why.)
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
