"""The rows of ``hf-static-cb``'s arena: which wait, which run in which slot, which are paused
in place, in what geometry, and how they join and leave between decode steps
(:mod:`worker.engines.hf_static_cb` runs the steps; :mod:`worker.engines.arena_rows` moves the
KV; :mod:`worker.engines.arena_join` decides who joins; :mod:`worker.engines.arena_slots` where
each row goes).

**Ending.** A row's end is settled as soon as its last token is read (:meth:`ArenaRows.settle`):
its output goes to its grant at once. A row whose slice ended first and whose request keeps
its KV is **paused in place** (:class:`~worker.engines.arena_slots.Paused`): its KV stays in
its slot, its columns reserved, and the request counts as kept (``kv_tokens``). Until the
next regroup the ended row stays in the step as a ghost (its tokens dropped, its writes
past its KV in its own slot): dropping it would change the step's rows, which needs the
host to know every row's tokens, so a row's end alone does not drain the pipeline.

**Regrouping** (:meth:`ArenaRows.regroup`) happens between steps when the running rows'
geometry would change (a bucket of rows or the columns per slot), when a waiting row can
join, or with grammar rows: the ghosts leave, rows join (a request paused here resumes in
its own slot: no copy and no prefill; one whose KV is in the store has it copied in; the
rest is prefilled), running rows are compacted into slots ``[0, k)`` and paused rows kept
after them, out of the step's range. A paused row spills to the kept-KV store (its KV cut
out, :class:`~worker.engines.kvstore.KVStore`) only when a joining row needs its room, the
oldest first, or leaves the arena when its request is released or its next row cannot use
it; a spill the store cannot keep is reported as evicted (:meth:`ArenaRows.take_evicted`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from sclsd.protocol import RequestOutput
from worker.engines.arena_cb import Releases, Row
from worker.engines.arena_join import Choice, Join, Joining
from worker.engines.arena_rows import Geometry, RowRunner
from worker.engines.arena_share import PrefixSharing
from worker.engines.arena_slots import Paused, order_moves, place
from worker.engines.kvstore import KVStore, Retained

log = logging.getLogger("worker")

__all__ = ["PADDING", "ArenaRows", "StepTally"]

#: Why a step reads columns that are not its rows' own, in the account's order: a bucket's
#: dummy rows; ghosts, rows that ended but stay in the step until the next regroup; the cache
#: bucket above the widest running row's need (and paused rows' KV, which the slots hold too);
#: the widest row's need over each other row's (every slot is as wide as the widest); and each
#: row's own slice not written yet (its need, context and grant, over its KV so far).
PADDING = ("dummy rows", "ended rows", "above the widest row", "the widest row over the others",
           "slices not yet written")

#: ``done(row, output)``: a row left the engine with its output.
Done = Callable[[Row, RequestOutput], None]


@dataclass
class StepTally:
    """What the decode steps ran since the engine started (benchmarks, the log at close)."""

    steps: int = 0
    rows: int = 0
    """Running rows, over every step."""
    cols_read: int = 0
    """KV columns the steps' attention read: each step's bucket rows × its columns per slot."""
    cols_own: int = 0
    """Those the running rows held (each row's own, to its current token): the share of the
    steps' KV reads that was not padding."""
    prefill_s: float = 0.0
    """Seconds the prefill turns took (on CUDA up to the device's end of each)."""
    turns_s: float = 0.0
    """Seconds of the engine's turns that had work: the steps, their prefills and regroups, and
    on CUDA the waits for the device (each turn reads a step's tokens)."""
    loose: int = 0
    """Steps in a shape that is no bucket while batches run in bucket shapes: on CUDA with graphs,
    eager steps (several times a captured one's cost for a 7B model)."""
    pad: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PADDING, 0))
    """The columns read that were not the rows' own, by why (:data:`PADDING`): what each way
    of reading fewer would save (finer buckets, slots of several widths, a kernel that reads
    only each row's own columns)."""
    shapes: Counter[tuple[int, int]] = field(default_factory=Counter)
    """Steps by shape ``(n, c)``: which buckets a workload steps in, and so which a grid needs."""

    def add(self, rows: int, n: int, c: int, own: int, loose: bool, *, slots: int, widest: int,
            needs: int) -> None:
        """One step of ``rows`` running rows in ``n`` slots of ``c`` columns, holding ``own``;
        ``loose``: its shape is no bucket (:attr:`loose`). ``slots``: the step's rows with the
        ghosts of rows that ended; ``widest`` and ``needs``: the running rows' largest and
        summed :attr:`~worker.engines.arena_cb.Row.need`, which split the padding (:attr:`pad`)."""
        self.steps += 1
        self.loose += loose
        self.rows += rows
        self.cols_read += n * c
        self.cols_own += own
        self.shapes[(n, c)] += 1
        for why, cols in zip(PADDING, ((n - slots) * c, (slots - rows) * c, rows * (c - widest), rows * widest - needs,
                                       needs - own), strict=True):
            self.pad[why] += cols

    def padding(self) -> str:
        """The padding read per step by why, for the account at close."""
        per = max(1, self.steps)
        return ", ".join(f"{why} {cols / per:.0f}" for why, cols in self.pad.items())

    def busiest(self, most: int = 8) -> str:
        """The ``most`` shapes the most steps ran in, ``n×c steps``, for the account at close."""
        return ", ".join(f"{n}×{c} {k}" for (n, c), k in self.shapes.most_common(most))


class ArenaRows(Joining, PrefixSharing):
    """Waiting, running and paused rows and their geometry (module docstring). The serve
    thread only, but :meth:`release` and :meth:`held`, which any thread may call."""

    def __init__(self, runner: RowRunner, kv: KVStore | None, device: Any, done: Done, share: bool = False) -> None:
        self.runner = runner
        self.kv = kv
        self.device = device
        self.done = done
        self.waiting: deque[Row] = deque()
        self.slots: list[Row] = []
        """The rows of the step, by slot (slots ``[0, len)``): running ones and, until the next
        regroup, ghosts of rows that ended."""
        self.paused: dict[str, Paused] = {}
        self.geometry: Geometry | None = None
        """The step's geometry (None: no row runs)."""
        self.c = 0
        """Columns per slot of the rows held now, running or paused (0: none held)."""
        self.dirty = True
        """The running rows changed since the step's inputs and the sampler were set."""
        self.releases = Releases()
        self.evicted: list[str] = []
        """Requests reported kept whose KV was lost since the last :meth:`take_evicted`."""
        self.waited_rows = 0
        """Rows that waited for arena room while others ran (since the engine started)."""
        self.counts = {"resumed": 0, "loaded": 0, "shared": 0, "cached": 0, "spilled": 0, "moved": 0, "prefills": 0,
                       "relayouts": 0, "regroups": 0, "spill_oom": 0, "oom_turns": 0}
        """Since the engine started: rows resumed in place, rows whose KV was copied in from the store,
        rows that started from a cached prefix, finished rows cached as prefixes (:mod:`.arena_share`),
        paused rows spilled to the store, rows copied from one slot to another, turns that prefilled
        newcomers, changes of the columns per slot (each moves every row held), regroups (each rebuilds
        the sampler and, on CUDA, drains the pipeline for a step), spills whose copies found no device
        memory (their rows' KV dropped)."""
        self.tally = StepTally()
        self.init_sharing(share)
        self._version = 0
        self._due = (-1, False)

    # ------------------------------------------------------------------ state

    def live(self) -> list[Row]:
        """The running rows (the step's rows but the ghosts)."""
        return [r for r in self.slots if not r.ended]

    def busy(self) -> bool:
        return bool(self.waiting) or any(not r.ended for r in self.slots)

    def every_row(self) -> list[Row]:
        return [*self.waiting, *self.slots]

    def add(self, rows: Iterable[Row]) -> None:
        """Rows of a new grant wait for their turn."""
        self.waiting.extend(rows)
        self._touch()

    def held(self) -> dict[str, int]:
        """rid -> KV tokens paused in place (less the releases not applied yet). Any thread."""
        rids, every = self.releases.peek()
        if every:
            return {}
        return {rid: len(p.tokens) for rid, p in list(self.paused.items()) if rid not in rids}

    def account(self) -> str:
        """What the rows and the steps went through since the engine started, for the log at
        close (and ``sclsd-bench gpu-check``, which reads it there)."""
        c, t, per = self.counts, self.tally, max(1, self.tally.steps)
        return (f"rows resumed in place {c['resumed']}, copied in from the store {c['loaded']}, paused rows "
                f"spilled {c['spilled']}, rows moved between slots {c['moved']}, rows that waited for room "
                f"{self.waited_rows}; {self.sharing_account()}{t.steps} decode steps of {t.rows / per:.1f} rows on average, "
                f"{c['prefills']} prefill turns; {t.cols_read / per:.0f} KV columns read per step, "
                f"{100 * t.cols_own / max(1, t.cols_read):.0f} % of them the rows' own; {c['relayouts']} relayouts, "
                f"{t.prefill_s:.1f} s of prefill, {t.turns_s:.1f} s in turns: "
                f"{1000 * max(0.0, t.turns_s - t.prefill_s) / per:.1f} ms a step besides prefill; "
                f"{t.loose} steps outside the buckets, {c['regroups']} regroups"
                + (f", {c['spill_oom']} spills dropped for want of device memory" if c["spill_oom"] else "")
                + self.oom_account() + f"; padding read per step: {t.padding()}; steps by shape: {t.busiest()}")

    def take_evicted(self) -> list[str]:
        out, self.evicted = self.evicted, []
        return out

    def reset(self) -> None:
        """Forget every row (a failed turn); the arena starts empty and paused requests are
        reported evicted."""
        for rid in self.paused:
            if self.kv is not None:
                self.kv.done([rid])
            self.evicted.append(rid)
        self.slots, self.waiting, self.paused = [], deque(), {}
        self.geometry, self.c = None, 0
        self.dirty = True
        self._touch()

    def _touch(self) -> None:
        self._version += 1

    # ------------------------------------------------------------------ ends, cancels, releases

    def settle(self, rows: Iterable[Row]) -> None:
        """Rows read as ended: outputs to their grants; a row whose KV is kept pauses in its
        slot; each stays in the step as a ghost until the next regroup."""
        for row in rows:
            kept = 0
            if self.kv is not None and row.keeps():
                self.paused.pop(row.rid, None)  # re-inserted: the newest pause is the last
                self.paused[row.rid] = p = Paused(row.rid, row.slot, row.kept_tokens())
                kept = len(p.tokens)
            elif self.kv is not None:
                self.kv.done([row.rid])
            self.done(row, row.output(kept))
        self._touch()

    def cancel(self, marks: set[tuple[int, str]]) -> None:
        """End the rows named (batch id, request id) before they get another token,
        ``cancelled`` and keeping nothing: a waiting one (and what is kept for its request)
        at once, a running one too (a token of a step already queued is dropped)."""
        def hit(row: Row) -> bool:
            return (row.grant.batch_id, row.rid) in marks

        for row in [r for r in self.waiting if hit(r)]:
            self.waiting.remove(row)
            row.state.reason = "cancelled"
            self._drop(row.rid)
            if self.kv is not None:
                self.kv.release([row.rid])
            self.done(row, row.output(0))
        ended = [r for r in self.slots if hit(r) and not r.ended]
        for row in ended:
            row.state.reason = "cancelled"
        self.settle(ended)

    def release(self, rids: Iterable[str] | None) -> None:
        """Any thread: drop kept KV in the store at once; paused rows and rows of these
        requests keep nothing (the serve thread's next turn)."""
        rids = None if rids is None else list(rids)
        if self.kv is not None:
            self.kv.release(rids)
        self.releases.add(rids)

    def apply_releases(self) -> None:
        """The serve thread's side of :meth:`release`: waiting and running rows of the requests
        released keep nothing when they end, paused ones leave their slots."""
        rids, every = self.releases.take()
        if rids or every:
            for row in self.every_row():
                if every or row.rid in rids:
                    row.released = True
            for rid in list(self.paused) if every else [r for r in rids if r in self.paused]:
                self._drop(rid)

    def _drop(self, rid: str) -> None:
        """Forget ``rid``'s paused KV (its slot is free from the next regroup)."""
        if self.paused.pop(rid, None) is not None:
            if self.kv is not None:
                self.kv.done([rid])
            self._touch()

    # ------------------------------------------------------------------ regrouping

    def regroup_due(self, strict: bool = False) -> bool:
        """Whether the step's rows must change before the next step: the running rows'
        geometry changed, a waiting row fits, or (``strict``: grammar rows) a row ended."""
        if strict and any(r.ended for r in self.slots):
            return True
        if self._due[0] == self._version:
            return self._due[1]
        live = self.live()
        if live:
            g = self._geometry(len(live), max(r.need for r in live), list(self.paused.values()))
            cur = self.geometry
            due = g is None or cur is None or (g.c, g.plan.n) != (cur.c, cur.plan.n)
        else:
            due = bool(self.slots)
        # With nothing running, a waiting row joins or, fitting not even alone, ends.
        due = due or (bool(self.waiting) and not live) or self.head_fits(live)
        self._due = (self._version, due)
        return due

    def regroup(self) -> None:
        """Ghosts leave, waiting rows join (:meth:`~worker.engines.arena_join.Joining.choose`),
        and the rows take their slots in the new geometry (module docstring)."""
        self.cache_prefixes()
        live = self.live()
        choice = self.choose(live)
        self._layout(live, choice)
        self.counts["regroups"] += 1
        self._touch()

    def _layout(self, live: list[Row], choice: Choice) -> None:
        """Move the rows holding KV to their slots in ``choice``'s geometry, then copy in and
        prefill the joining rows."""
        joins = choice.joins
        self.dirty = True
        if not live and not joins:
            self.slots, self.geometry = [], None
            if not self.paused:
                self.c = 0
            return  # the paused rows stay where they are
        g = choice.geometry
        if g is None:
            raise RuntimeError("the running rows no longer fit the arena")
        quiet = [(r, r.slot, r.fed) for r in live]
        quiet += [(j.row, j.paused.slot if j.paused else -1, j.row.used if j.paused else 0)
                  for j in joins if j.prefill <= 0]
        loud = [(j.row, j.paused.slot if j.paused else -1, j.row.used if j.paused else 0)
                for j in joins if j.prefill > 0]
        held = choice.held
        cap = self.runner.arena.tokens // g.c
        pl = place([(s, n) for _, s, n in quiet], [(s, n) for _, s, n in loud],
                   [(p.slot, len(p.tokens)) for p in held], cap)
        old, new = self.c or g.c, g.c
        self.counts["relayouts"] += old != new
        now = [(s, n) for _, s, n in quiet + loud] + [(p.slot, len(p.tokens)) for p in held]
        if new < old:  # shrinking: the rows first take the new columns where they are
            self.runner.relayout(_lens(now), old, new)
            old = new
        self.runner.permute(order_moves(pl.moves), old)
        self.counts["moved"] += len(pl.moves)
        for (row, _, _), slot in zip(quiet + loud, pl.running, strict=True):
            row.slot = slot
        for p, slot in zip(held, pl.paused, strict=True):
            p.slot = slot
        if new > old:
            after = [(r.slot, n) for r, _, n in quiet + loud] + [(p.slot, len(p.tokens)) for p in held]
            self.runner.relayout(_lens(after), old, new)
        self.slots = sorted((r for r, _, _ in quiet + loud), key=lambda r: r.slot)
        self.geometry, self.c = g, new
        self._bring(joins, len(quiet))

    def _bring(self, joins: list[Join], lo: int) -> None:
        """The joining rows' KV: kept KV copied in from the store, the rest prefilled (rows
        ``[lo, k)``); each grant is charged its rows' share of the prefill's time."""
        c = self.c
        for j in joins:
            g = j.row.grant
            g.prefill_tokens += j.row.prefill_tokens()
            g.reused_tokens += j.row.used
            if j.paused is not None:
                self.counts["resumed"] += 1
            elif j.entry is not None:
                self.runner.load(j.row.slot, c, j.entry.kv, j.row.used)
                self.counts["shared" if j.shared else "loaded"] += 1
        loud = sorted((j for j in joins if j.prefill > 0), key=lambda j: j.row.slot)
        if not loud:
            return
        t0 = time.perf_counter()
        self.counts["prefills"] += 1
        parts = [(j.row.req.token_ids[j.row.used:j.row.length - 1], j.row.used) for j in loud]
        self.runner.prefill(lo, c, parts, [j.row.score for j in loud])
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)  # the prefill's time is its grants'
        spent = time.perf_counter() - t0
        self.tally.prefill_s += spent
        total = sum(len(p) for p, _ in parts) or 1
        for j, (p, _) in zip(loud, parts, strict=True):
            j.row.grant.prefill_s += spent * len(p) / total

    def _spill(self, entries: list[Paused]) -> None:
        """Cut paused rows' KV out to the store (their slots are free from now on); one the
        store does not keep is reported evicted (unless released meanwhile)."""
        if not entries:
            return
        import torch

        assert self.kv is not None
        span = max(p.slot for p in entries) + 1
        self.room_for([len(p.tokens) for p in entries])  # cached prefixes give way to the copies
        try:
            cuts: list[tuple[list[Any], int]] | None = self.runner.cut(
                [p.slot for p in entries], [len(p.tokens) for p in entries], span, self.c)
        except torch.OutOfMemoryError as exc:
            # The copies need device memory beside the arena (the store's share, and a row's
            # KV more while the store makes room); without it the rows' KV goes as the
            # store's evictions go, and the joining row still gets their slots. Its requests
            # prefill again at their next grant: slower, nothing lost.
            log.warning("hf-static-cb: no device memory to spill %d paused rows (%s): their KV is "
                        "dropped, reported evicted", len(entries), str(exc).splitlines()[0] if str(exc) else "OOM")
            cuts = None
            self.counts["spill_oom"] += 1
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        pending, every = self.releases.peek()
        for i, p in enumerate(entries):
            kept = cuts is not None and self.kv.put(p.rid, Retained(p.tokens, cuts[i][1], cuts[i][0]))
            self.kv.done([p.rid])
            del self.paused[p.rid]
            if not kept and not every and p.rid not in pending:
                self.evicted.append(p.rid)
            self.counts["spilled"] += 1
        self._touch()

    def _too_large(self, row: Row) -> None:
        msg = (f"request {row.rid!r} needs {row.need} KV columns (context {row.length} + slice {row.cap}); "
               f"the arena holds {self.runner.arena.tokens} token slots")
        log.warning("hf-static-cb: %s", msg)
        if self.kv is not None:
            self.kv.release([row.rid])
        self.done(row, RequestOutput(rid=row.rid, token_ids=[], error=msg))


def _lens(rows: list[tuple[int, int]]) -> list[int]:
    """Per slot from 0 to the last one named, the KV columns its row holds (0: none)."""
    rows = [(s, n) for s, n in rows if s >= 0]
    out = [0] * (max((s for s, _ in rows), default=-1) + 1)
    for s, n in rows:
        out[s] = n
    return out
