"""The rows of ``hf-static-cb``'s arena: which wait, which run in which slot, in what geometry,
and how they join and leave between decode steps (:mod:`worker.engines.hf_static_cb` runs
the steps; :mod:`worker.engines.arena_rows` moves the KV).

Joining, first come first served: a waiting row joins while one geometry of the arena holds
the running rows and it (:meth:`~worker.engines.arena_rows.RowRunner.geometry`); the head
that does not fit blocks the rows behind it until rows leave (a row's grant bounds how long
that is), and a head that could not fit even alone ends with the reason. A joining row takes
what the store kept for its request, copied into its slot, and the rest of its context but
the last token is prefilled there; one turn prefills at most one ``prefill_chunk_tokens``
chunk's worth of newcomers (at least one row). Leaving: an unfinished row's KV is cut out to
the store, its output goes to its grant, and the last running rows move into the slots freed.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from sclsd.protocol import RequestOutput
from worker.engines.arena_cb import Releases, Row
from worker.engines.arena_rows import Geometry, RowRunner
from worker.engines.kvstore import KVStore, Retained

log = logging.getLogger("worker")

__all__ = ["ArenaRows"]

#: ``done(row, output)``: a row left the engine with its output.
Done = Callable[[Row, RequestOutput], None]


class ArenaRows:
    """Waiting and running rows and their geometry (module docstring). The serve thread only,
    but :meth:`release`, which any thread may call."""

    def __init__(self, runner: RowRunner, kv: KVStore | None, device: Any, done: Done) -> None:
        self.runner = runner
        self.kv = kv
        self.device = device
        self.done = done
        self.waiting: deque[Row] = deque()
        self.slots: list[Row] = []
        """The running rows, by slot (slots ``[0, len)``)."""
        self.ended: list[Row] = []
        """Rows read as ended whose slots still hold their KV (they leave at the next turn)."""
        self.geometry: Geometry | None = None
        self.dirty = True
        """The running rows changed since the step's inputs and the sampler were set."""
        self.releases = Releases()
        self.waited_rows = 0
        """Rows that waited for arena room while others ran (since the engine started)."""

    def busy(self) -> bool:
        return bool(self.slots or self.waiting or self.ended)

    def joinable(self) -> bool:
        """Whether the head of the waiting rows fits beside the running ones now."""
        if not self.waiting:
            return False
        need = max([self.waiting[0].need, *(r.need for r in self.slots)])
        return self.runner.geometry(len(self.slots) + 1, need) is not None

    def every_row(self) -> list[Row]:
        return [*self.waiting, *self.slots, *self.ended]

    def reset(self) -> None:
        """Forget every row (a failed turn); the arena starts empty."""
        self.slots, self.ended, self.waiting = [], [], deque()
        self.geometry = None
        self.dirty = True

    # ------------------------------------------------------------------ cancels and releases

    def cancel(self, marks: set[tuple[int, str]]) -> None:
        """End the rows named (batch id, request id) before they get another token, ``cancelled``
        and keeping nothing: a waiting row at once, a running one at the next turn (it is read as
        ended: a token of a step already queued is dropped)."""
        def hit(row: Row) -> bool:
            return (row.grant.batch_id, row.rid) in marks

        for row in [r for r in self.waiting if hit(r)]:
            self.waiting.remove(row)
            row.state.reason = "cancelled"
            self.done(row, row.output(0))
        for row in self.slots:
            if hit(row) and not row.ended:
                row.state.reason = "cancelled"
                self.ended.append(row)

    def release(self, rids: Iterable[str] | None) -> None:
        """Any thread: drop kept KV at once; rows of these requests keep nothing (next turn)."""
        rids = None if rids is None else list(rids)
        if self.kv is not None:
            self.kv.release(rids)
        self.releases.add(rids)

    def apply_releases(self) -> None:
        """The serve thread's side of :meth:`release`: waiting, running and ended rows of the
        requests released keep nothing when they end."""
        rids, every = self.releases.take()
        if rids or every:
            for row in self.every_row():
                if every or row.rid in rids:
                    row.released = True

    # ------------------------------------------------------------------ leaving

    def retire(self) -> None:
        """Rows read as ended leave: kept KV cut out, outputs to their grants, the last rows
        moved into the free slots."""
        if not self.ended:
            return
        ended, self.ended = self.ended, []
        kept = self._keep(ended)
        for row in ended:
            if self.kv is not None:
                self.kv.done([row.rid])
            self.done(row, row.output(kept.get(id(row), 0)))
        gone = {id(r) for r in ended}
        self._compact([r for r in self.slots if id(r) not in gone])
        self.dirty = True

    def _keep(self, ended: list[Row]) -> dict[int, int]:
        """Cut the KV of the rows that keep it into the store: id(row) -> tokens kept."""
        rows = [r for r in ended if r.keeps()] if self.kv is not None else []
        if not rows or self.geometry is None:
            return {}
        assert self.kv is not None
        tokens = [r.kept_tokens() for r in rows]
        cuts = self.runner.cut([r.slot for r in rows], [len(t) for t in tokens], len(self.slots), self.geometry.c)
        out: dict[int, int] = {}
        for r, toks, (kv, nbytes) in zip(rows, tokens, cuts, strict=True):
            if self.kv.put(r.rid, Retained(toks, nbytes, kv)):
                out[id(r)] = len(toks)
        return out

    def _compact(self, alive: list[Row]) -> None:
        """Slots ``[0, len(alive))`` for the rows left (those above move into the holes), in the
        geometry they need now."""
        k = len(alive)
        holes = sorted(set(range(k)) - {r.slot for r in alive})
        movers = [r for r in alive if r.slot >= k]
        c = self.geometry.c if self.geometry is not None else 0
        for row, hole in zip(movers, holes, strict=True):
            self.runner.move(row.slot, hole, row.fed, c)
            row.slot = hole
        self.slots = sorted(alive, key=lambda r: r.slot)
        if not self.slots:
            self.geometry = None
        else:
            self._regeometry(self.runner.geometry(k, max(r.need for r in self.slots)))

    def _regeometry(self, geo: Geometry | None) -> None:
        """Run the rows in ``geo`` (moving them when its columns differ)."""
        if geo is None:
            raise RuntimeError("the running rows no longer fit the arena")
        old = self.geometry
        if old is not None and old.c != geo.c and self.slots:
            self.runner.relayout([r.fed for r in self.slots], old.c, geo.c)
        self.geometry = geo

    # ------------------------------------------------------------------ joining

    def admit(self) -> None:
        """Waiting rows join while they fit (module docstring)."""
        budget = self.runner.prefill_chunk_tokens or float("inf")
        k = len(self.slots)
        need = max((r.need for r in self.slots), default=0)
        joined: list[tuple[Row, Retained | None]] = []
        geo: Geometry | None = None
        spent = 0
        while self.waiting and spent < budget:
            head = self.waiting[0]
            g = self.runner.geometry(k + len(joined) + 1, max(need, head.need))
            if g is None:
                if k + len(joined) == 0:
                    self.waiting.popleft()
                    self._too_large(head)
                    continue
                for row in self.waiting:  # the head blocks every row behind it
                    if not row.waited:
                        row.waited = True
                        self.waited_rows += 1
                break
            self.waiting.popleft()
            entry = self._take_kv(head)
            head.grant.prefill_tokens += head.prefill_tokens()
            head.grant.reused_tokens += head.used
            spent += head.length - 1 - head.used
            need = max(need, head.need)
            geo = g
            joined.append((head, entry))
        if geo is not None:
            self._regeometry(geo)
            self._join(joined)

    def _take_kv(self, row: Row) -> Retained | None:
        """What the store kept for ``row``'s request, checked out (``row.used``: the tokens of
        it the row uses)."""
        if self.kv is None:
            return None
        entry, used = self.kv.take(row.rid, list(row.req.token_ids))
        if entry is None or not row.grant.batch.kv_reuse or row.released:
            return None
        row.used = used
        return entry

    def _join(self, joined: list[tuple[Row, Retained | None]]) -> None:
        """Place ``joined`` after the running rows: kept KV copied in, the rest prefilled."""
        geo = self.geometry
        assert geo is not None
        lo = len(self.slots)
        # Rows with tokens to prefill first: the prefill runs over their slots only.
        joined.sort(key=lambda j: j[0].used >= j[0].length - 1)
        for i, (row, entry) in enumerate(joined):
            row.slot = lo + i
            if entry is not None:
                self.runner.load(row.slot, geo.c, entry.kv, row.used)
            self.slots.append(row)
        t0 = time.perf_counter()
        parts = [(row.req.token_ids[row.used:row.length - 1], row.used) for row, _ in joined]
        self.runner.prefill(lo, geo.c, [p for p in parts if p[0]])
        if self.device.type == "cuda" and any(p for p, _ in parts):
            import torch

            torch.cuda.synchronize(self.device)  # the prefill's time is its grants'
        spent = time.perf_counter() - t0
        total = sum(len(p) for p, _ in parts) or 1
        for (row, _), (p, _) in zip(joined, parts, strict=True):
            row.grant.prefill_s += spent * len(p) / total
        self.dirty = True

    def _too_large(self, row: Row) -> None:
        msg = (f"request {row.rid!r} needs {row.need} KV columns (context {row.length} + slice {row.cap}); "
               f"the arena holds {self.runner.arena.tokens} token slots")
        log.warning("hf-static-cb: %s", msg)
        if self.kv is not None:
            self.kv.release([row.rid])
        self.done(row, RequestOutput(rid=row.rid, token_ids=[], error=msg))
