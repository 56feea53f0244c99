"""Which worker likely holds a cached prefix of a new request's prompt: the daemon's hint to the
grant policy (``Request.prefix_worker``; :meth:`~sclsd.core.grant_place.GrantPlacement._place`
weighs the prefill it would save there against the workers' loads).

Workers whose engine shares prefixes between requests (``caps.shared_prefixes``: ``llama``'s and
``hf-static-cb``'s ``share_prefixes``) keep what a finished request leaves, each its own. The
daemon remembers, for the contexts of the requests that finished on each such worker, a hash
of every whole :data:`BLOCK` of tokens from the start (each hash chained to the one before, so
one names the whole prefix up to it), the most recent worker for each, least recently noted
dropped first past :data:`MAX_BLOCKS`. A new prompt's hint is the worker of its longest prefix
so named: a chat's next turn goes back to the worker that served the turn before, where that
worker's load allows, and a shared system prompt to one that served it lately.

It is a likelihood, not a record: a worker may not have cached a context (its heads rule, its
memory) or may have dropped it since; a wrong hint costs a request at most the placement's
balance, never its correctness. Pure: token ids in, a worker's name out, no clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["BLOCK", "MAX_BLOCKS", "PrefixRoutes"]

#: Tokens per hashed block: a prefix counts in whole blocks (the engines share no prefix
#: shorter than 16 tokens).
BLOCK = 16
#: The most block hashes remembered (each about 150 bytes): 4M tokens of contexts.
MAX_BLOCKS = 1 << 18
#: A context's first tokens hashed at most (a longer prompt's hint is its first 16k tokens',
#: which name its conversation as well; the worker matches the whole): hashing runs on the
#: event loop, 0.4 ms for that many on the 2-core development machine (0.09 ms for 4k).
MAX_TOKENS = 1 << 14


def _chain(tokens: Sequence[int]) -> list[int]:
    """The chained hash of each whole block of ``tokens`` from the start (at most MAX_TOKENS)."""
    out: list[int] = []
    h = 0
    n = min(len(tokens), MAX_TOKENS) // BLOCK * BLOCK
    for i in range(0, n, BLOCK):
        h = hash((h, *tokens[i:i + BLOCK]))
        out.append(h)
    return out


class PrefixRoutes:
    """Block hashes of finished contexts -> the worker that last served one (module docstring)."""

    def __init__(self, max_blocks: int = MAX_BLOCKS) -> None:
        self.max_blocks = max_blocks
        self.workers: dict[str, int] = {}
        """The members whose engine shares prefixes (``caps.shared_prefixes``), each with the
        generation its blocks are noted under: a worker that leaves or registers again starts
        a new one, so what it held before goes stale at once, without a scan of every block
        on the event loop (48 ms at :data:`MAX_BLOCKS`); stale blocks age out as others are
        noted."""
        self._where: OrderedDict[int, tuple[str, int]] = OrderedDict()
        self._generation = 0
        self.hints = 0
        """Requests given a hint since the daemon started."""

    def __len__(self) -> int:
        """Blocks remembered for the members that share now (a scan: for tests)."""
        return sum(1 for w, g in self._where.values() if self.workers.get(w) == g)

    def join(self, worker: str, shares: bool) -> None:
        """``worker`` joined; ``shares``: its engine shares prefixes (else nothing is noted for it)."""
        self.forget(worker)
        if shares:
            self._generation += 1
            self.workers[worker] = self._generation

    def note(self, worker: str, context: Sequence[int]) -> None:
        """A request whose context is ``context`` finished on ``worker``, which may keep it
        (nothing, for a worker that shares no prefix)."""
        gen = self.workers.get(worker)
        if gen is None:
            return
        where = self._where
        for h in _chain(context):
            where[h] = (worker, gen)
            where.move_to_end(h)
        while len(where) > self.max_blocks:
            where.popitem(last=False)

    def hint(self, prompt: Sequence[int]) -> tuple[str, int] | None:
        """The worker of the longest noted prefix of ``prompt`` (whole blocks, not the whole
        prompt: its last token is always computed) and that prefix's tokens; None when no
        block is known."""
        if not self._where:
            return None
        workers = self.workers
        best: tuple[str, int] | None = None
        for k, h in enumerate(_chain(prompt[:-1]), 1):
            entry = self._where.get(h)
            if entry is None:
                break  # a longer prefix was noted only with this one
            if workers.get(entry[0]) == entry[1]:
                best = (entry[0], k * BLOCK)
        if best is not None:
            self.hints += 1
        return best

    def forget(self, worker: str) -> None:
        """``worker`` is gone: what it held went with it (its blocks are stale from now on)."""
        self.workers.pop(worker, None)
