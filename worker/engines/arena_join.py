"""Which waiting rows of ``hf-static-cb`` join the running ones at a regroup, and which paused
rows give up their slots for them (:class:`Joining`, the part of
:class:`~worker.engines.arena_set.ArenaRows` that decides; it moves nothing).

Order: rows whose request's KV covers their whole context but the last token come first
(returning rows: resumed in place from a paused slot, or copied in from the kept-KV store),
in arrival order; then the others, first come first served. A returning row costs no
prefill, so it neither waits for nor takes a prefill turn; the others share one turn's
``prefill_chunk_tokens`` (at least one row per turn; without chunks, on the CPU, a turn
prefills the rows of one grant, so that a burst of arrivals is not one long stall). A row joins while one geometry holds
the running rows, it and the paused rows that stay (:meth:`~worker.engines.arena_rows.RowRunner.geometry`);
where it fits only without some paused rows, the oldest of them spill to the store (those no
waiting row is about to resume first). The first row that does not fit even with every
paused row spilled blocks the rows behind it until rows leave; one that could not fit even
alone ends with the reason.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from worker.engines.arena_cb import Row
from worker.engines.arena_rows import Geometry, RowRunner
from worker.engines.arena_slots import Paused
from worker.engines.kvstore import KVStore, Retained, common_prefix

__all__ = ["Choice", "Join", "Joining"]


@dataclass(eq=False)
class Join:
    """A waiting row that joins: resumed in place (``paused``), with KV copied in from the
    store (``entry``: its request's kept KV, or a cached prefix), or fresh; ``row.used``
    context tokens come from either."""

    row: Row
    paused: Paused | None = None
    entry: Retained | None = None
    shared: bool = False
    """``entry`` is a cached prefix of another request's (copied, left in the store)."""

    @property
    def prefill(self) -> int:
        """Context tokens to prefill: all but the last, less those whose KV it brings."""
        return self.row.length - 1 - self.row.used


@dataclass(eq=False)
class Choice:
    """A regroup's decision: who joins, the geometry they run in and the paused rows that
    stay (those that made room spilled while it was made)."""

    joins: list[Join] = field(default_factory=list)
    geometry: Geometry | None = None
    held: list[Paused] = field(default_factory=list)


class Joining:
    """The joining half of :class:`~worker.engines.arena_set.ArenaRows` (module docstring)."""

    runner: RowRunner
    kv: KVStore | None
    waiting: deque[Row]
    geometry: Geometry | None
    paused: dict[str, Paused]
    """Rows paused in place, oldest first."""
    waited_rows: int
    shared_prefix: Callable[..., tuple[Retained | None, int]]
    _too_large: Callable[[Row], None]
    _drop: Callable[[str], None]
    _spill: Callable[[list[Paused]], None]

    def returning(self, row: Row) -> bool:
        """Whether ``row``'s whole context but its last token has KV here (no prefill)."""
        return self._usable(row) == row.length - 1 > 0

    def _usable(self, row: Row) -> int:
        """Context tokens of ``row`` whose KV is here, paused in place, in the store or (with
        :attr:`share`) in a cached prefix (none for a row that scores its prompt: its prefill
        computes every position)."""
        if not row.grant.batch.kv_reuse or row.released or row.score is not None:
            return 0
        ctx = list(row.req.token_ids)
        p = self.paused.get(row.rid)
        if p is not None:
            return common_prefix(p.tokens, ctx, len(ctx) - 1)
        if self.kv is None:
            return 0
        return self.kv.usable(row.rid, ctx) or self.shared_prefix(ctx)[1]

    def head_fits(self, live: list[Row]) -> bool:
        """Whether the first waiting row (in join order) fits beside ``live``, with every
        paused row but its own spilled if need be (in a bucket, where ``live`` step in one)."""
        if not self.waiting:
            return False
        head = next((r for r in self.waiting if self.returning(r)), self.waiting[0])
        need = max([head.need, *(r.need for r in live)])
        loose = not live or self.geometry is None or not self.geometry.bucket
        return self.runner.geometry(len(live) + 1, need, len(live) + 1, loose) is not None

    def choose(self, live: list[Row]) -> Choice:
        """Who of the waiting rows joins ``live`` now, and with what (module docstring)."""
        for row in self.waiting:  # a paused request whose next row cannot use its KV lets it go
            p = self.paused.get(row.rid)
            if p is not None and self._usable(row) == 0:
                self._drop(row.rid)
        budget = self.runner.prefill_chunk_tokens or float("inf")
        unchunked = not self.runner.prefill_chunk_tokens  # then a turn prefills one grant's rows
        out = Choice(held=list(self.paused.values()))
        claimed = {r.rid for r in self.waiting}
        k, need, spent = len(live), max((r.need for r in live), default=0), 0
        first = [r for r in self.waiting if self.returning(r)]
        ahead = {id(r) for r in first}
        order = first + [r for r in self.waiting if id(r) not in ahead]
        fresh: set[int] = set()  # grants whose rows prefill in this turn
        for row in order:
            used = self._usable(row)
            cost = row.length - 1 - used
            if cost > 0 and (spent >= budget or (unchunked and fresh and id(row.grant) not in fresh)):
                break
            own = self.paused.get(row.rid) if used else None
            held = [p for p in out.held if p is not own]
            # Rows that step in a bucket (a captured graph, on CUDA) take no row that would make
            # them step outside one (eagerly): it waits for room in a bucket instead.
            now = self._geometry(k, need, held) if k else None
            loose = now is None or not now.bucket
            if self.runner.geometry(k + 1, max(need, row.need), k + 1, loose) is None:
                if k == 0:  # not even alone
                    self.waiting.remove(row)
                    if own is not None:
                        self._drop(row.rid)
                        out.held = held
                    self._too_large(row)
                    continue
                self._mark_waited()
                break
            # The oldest paused rows spill until it fits, those no waiting row claims first
            # (a claimed one spilled now is copied back in when its row joins).
            victims = sorted(held, key=lambda p: p.rid in claimed)
            while self._geometry(k + 1, max(need, row.need), held, loose) is None:
                v = victims.pop(0)
                held.remove(v)
                self._spill([v])
            self.waiting.remove(row)
            claimed.discard(row.rid)
            out.held = held
            out.joins.append(self._join(row, own))
            k, need, spent = k + 1, max(need, row.need), spent + out.joins[-1].prefill
            if out.joins[-1].prefill > 0:
                fresh.add(id(row.grant))
        # The running rows, those joining and the paused rows that stay (fewer than or as
        # many as each join was fitted with: a row too large alone let its own go).
        out.held = list(self.paused.values())
        out.geometry = self._geometry(k, need, out.held) if k else None
        return out

    def _geometry(self, rows: int, need: int, held: list[Paused], loose: bool = True) -> Geometry | None:
        reserve = max((p.reserve for p in held), default=0)
        return self.runner.geometry(rows, max(need, reserve), rows + len(held), loose)

    def _join(self, row: Row, own: Paused | None) -> Join:
        """``row`` joining: its paused KV resumed, or the store's checked out."""
        if own is not None:
            row.used = self._usable(row)
            del self.paused[row.rid]
            return Join(row, paused=own)
        if self.kv is None:
            return Join(row)
        ctx = list(row.req.token_ids)
        entry, used = self.kv.take(row.rid, ctx)
        if not row.grant.batch.kv_reuse or row.released or row.score is not None:
            return Join(row)
        shared = entry is None
        if shared:  # nothing of its own: another request's prefix (:mod:`worker.engines.arena_share`)
            entry, used = self.shared_prefix(ctx, take=True)
        if entry is None:
            return Join(row)
        row.used = used
        return Join(row, entry=entry, shared=shared)

    def _mark_waited(self) -> None:
        for row in self.waiting:  # the head blocks every row behind it
            if not row.waited:
                row.waited = True
                self.waited_rows += 1
