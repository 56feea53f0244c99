"""A reference for the grant policy: every placement a plain scan of every worker.

:class:`ScanGrantPolicy` decides by the rules of :mod:`sclsd.core.grants`
written as directly as they read: each round re-sorts the returning requests
and tries each, each placement compares every worker. The incremental
:class:`~sclsd.core.grants.GrantPolicy` must decide exactly as it does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from sclsd.core.estimator import Estimator
from sclsd.core.grants import GrantRules


@dataclass(frozen=True, slots=True)
class Grant:
    """Request ``rid`` may generate up to ``tokens`` more tokens on ``worker``."""

    rid: str
    worker: str
    context: int
    """Tokens of context when the grant starts (prompt plus tokens generated so far)."""
    tokens: int
    prefill: int
    """Tokens the worker must prefill first: 0 when it holds the request's KV."""
    cost: float
    """The estimate added to the worker's load."""
    page: int = 1
    """The worker's KV page in tokens: a grant reserves whole pages."""

    @property
    def reserve(self) -> int:
        """KV tokens reserved for this grant: context plus granted tokens, in whole pages."""
        return _pages(self.context + self.tokens, self.page)


def _tokens(rules: GrantRules, frac: float, S: int) -> int:  # noqa: N803
    """⌈frac · S⌉, at least rules.floor, at most S."""
    return min(S, max(rules.floor, -int(-frac * S // 1)))


def _pages(tokens: int, page: int) -> int:
    """``tokens`` rounded up to whole pages of ``page`` tokens."""
    return -(-tokens // page) * page


@dataclass(frozen=True, slots=True)
class Placement:
    """Why a returning request went where it went (for tests and traces)."""

    rid: str
    holder: str
    worker: str
    gap: float
    """load(holder) − load(worker) when decided (0 when it stayed)."""
    reprefill_cost: float
    fits_holder: bool


@dataclass(slots=True)
class _Pending:
    rid: str
    context: int
    remaining: int
    holder: str | None
    """The worker holding its KV, if any."""


@dataclass(slots=True)
class _Worker:
    reserved: int = 0
    load: float = 0.0
    grants: dict[str, Grant] = field(default_factory=dict)
    parked: dict[str, int] = field(default_factory=dict)
    """Returning requests waiting here for room, by the KV tokens they keep reserved."""


class ScanGrantPolicy:
    """The grant policy as a scan of every worker per placement, run after every call."""

    def __init__(
        self, est: Estimator, slice_len: int, token_budget: float, workers: Iterable[str] = (),
        *, rules: GrantRules | None = None,
    ) -> None:
        self.rules = rules if rules is not None else GrantRules()
        self.rho = 1.0
        self._due: set[str] = set()  # holders whose parked requests the next round looks at
        self._all_due = True
        self._seen: tuple[object, ...] = ()
        if slice_len < 1:
            raise ValueError("slice_len must be >= 1")
        self.est = est
        self.S = slice_len
        self.budget = int(token_budget)
        self._workers: dict[str, _Worker] = {}
        self._returning: list[_Pending] = []
        self._waiting: deque[_Pending] = deque()
        self._evict: list[tuple[str, str]] = []
        self._after: str | None = None
        self._inactive: set[str] = set()
        self.page = 1
        """KV page size in tokens (engines allocate whole pages): reservations round up to it."""
        self.migrations = 0
        self.drops = 0
        self.placements: list[Placement] = []
        self.record_placements = False
        for w in workers:
            self.add_worker(w)

    # ------------------------------------------------------------------ fleet

    def _touch(self, wid: str | None) -> None:
        """Parked requests on ``wid`` are due for a look; all of them if it is left idle."""
        w = self._workers.get(wid) if wid is not None else None
        if w is None:
            return
        if not w.grants and not w.parked:
            self._all_due = True
        else:
            self._due.add(wid)  # type: ignore[arg-type]

    def add_worker(self, wid: str) -> None:
        self._all_due = True
        self._workers.setdefault(wid, _Worker())
        self._inactive.discard(wid)

    def set_active(self, wid: str, active: bool) -> None:
        """Take ``wid`` out of rotation (drain) or back in. Out of rotation it gets no new
        grant; requests waiting on its KV queue again (that KV is evicted), and grants
        running there keep running."""
        if wid in self._workers:
            self._all_due = True
        if active:
            self._inactive.discard(wid)
            return
        self._inactive.add(wid)
        w = self._workers.get(wid)
        if w is None:
            return
        # In the order the returning requests go (the largest next grant first, ties in
        # the order they came), as the policy keeps them.
        mine = [p for p in self._returning if p.holder == wid]
        for p in sorted(mine, key=lambda p: -self.decode_cost(p.context, min(self.S, p.remaining))):
            self._drop_holder(p)

    def remove_worker(self, wid: str) -> list[str]:
        """Forget ``wid``; returns the ids of the requests it held grants for (their KV is lost)."""
        w = self._workers.pop(wid, None)
        self._inactive.discard(wid)
        if w is None:
            return []
        self._all_due = True
        lost = list(w.grants)  # the driver re-submits them with arrive()
        keep = [p for p in self._returning if p.holder != wid]
        moved = [p for p in self._returning if p.holder == wid]
        self._returning = keep
        for p in reversed(moved):
            p.holder = None
            self._waiting.appendleft(p)
        return lost

    @property
    def workers(self) -> list[str]:
        return sorted(self._workers)

    def load(self, wid: str) -> float:
        """Estimated seconds to finish ``wid``'s granted slices (0 when it has none)."""
        w = self._workers[wid]
        return w.load + self._busy_cost() if w.grants else 0.0

    def reserved(self, wid: str) -> int:
        return self._workers[wid].reserved

    def grants_on(self, wid: str) -> dict[str, Grant]:
        return dict(self._workers[wid].grants)

    @property
    def queued(self) -> int:
        return len(self._waiting) + len(self._returning)

    # ------------------------------------------------------------------ costs

    def decode_cost(self, context: int, tokens: int) -> float:
        e = self.est
        return e.d1 * (context * tokens + tokens * (tokens + 1) / 2.0) + e.d2 * tokens

    def prefill_cost(self, tokens: int) -> float:
        return self.est.t_prefill(1, tokens) if tokens > 0 else 0.0

    def _busy_cost(self) -> float:
        return self.est.d4 * self.S

    # ------------------------------------------------------------------ events

    def arrive(self, rid: str, context: int, remaining: int, *, first: bool = False) -> None:
        """A new request: ``context`` prompt tokens, at most ``remaining`` to generate.

        ``first``: queue it ahead of the waiting ones (a request whose worker was lost).
        """
        if remaining > 0:
            p = _Pending(rid, context, remaining, None)
            if first:
                self._waiting.appendleft(p)
            else:
                self._waiting.append(p)

    def end(self, rid: str, context: int, remaining: int, *, kept: bool = True) -> Grant:
        """``rid``'s grant ended with ``context`` tokens and ``remaining`` left (0: finished).

        Its reservation is freed but for the KV an unfinished request keeps on the worker
        (``kept``: the worker said it keeps it; otherwise the request queues again to
        re-prefill wherever it goes, ahead of new ones).
        """
        found = self._ungrant(rid)
        if found is None:
            raise KeyError(f"no grant for {rid!r}")
        wid, g = found
        w = self._workers[wid]
        self.rho += ((1.0 if remaining > 0 else 0.0) - self.rho) / self.rules.window
        if remaining <= 0:
            self._touch(wid)
            return g
        if kept and wid not in self._inactive:  # its KV stays, reserved, until placed
            w.parked[rid] = _pages(context, self.page)
            w.reserved += w.parked[rid]
            self._returning.append(_Pending(rid, context, remaining, wid))
        else:
            if kept:
                self._evict.append((wid, rid))
            self._waiting.appendleft(_Pending(rid, context, remaining, None))
        self._touch(wid)
        return g

    def _ungrant(self, rid: str) -> tuple[str, Grant] | None:
        """Take ``rid``'s grant off its worker: its reservation and load freed."""
        for wid, w in self._workers.items():
            g = w.grants.pop(rid, None)
            if g is not None:
                w.reserved -= g.reserve
                w.load = w.load - g.cost if w.grants else 0.0  # no drift: idle means no load
                return wid, g
        return None

    def forget(self, rid: str) -> bool:
        """``rid`` ended outside a grant's end (cancelled, timed out, failed): drop what the
        policy holds for it (a grant, a parked KV, a queue place); False if nothing."""
        found = self._ungrant(rid)
        if found is not None:
            self._evict.append((found[0], rid))  # the engine may keep it after the grant
            self._touch(found[0])
            return True
        for p in self._returning:
            if p.rid == rid:
                self._returning.remove(p)
                self._drop_holder(p, requeue=False)
                return True
        for p in self._waiting:
            if p.rid == rid:
                self._waiting.remove(p)
                return True
        return False

    def _drop_holder(self, p: _Pending, *, requeue: bool = True) -> None:
        """Evict ``p``'s parked KV; with ``requeue`` it waits again, first, with no holder."""
        if p in self._returning:
            self._returning.remove(p)
        holder = p.holder
        self._unpark(p)
        self._touch(holder)
        if holder is not None:
            self._evict.append((holder, p.rid))
        p.holder = None
        if requeue:
            self._waiting.appendleft(p)

    def take_evictions(self) -> list[tuple[str, str]]:
        """(worker, rid) pairs whose retained KV the policy no longer counts on."""
        out, self._evict = self._evict, []
        return out

    # ------------------------------------------------------------------ decisions

    def schedule(self) -> list[Grant]:
        """Grant what fits: returning requests first (largest first), then new ones FCFS.

        A returning request that does not fit on the worker holding its KV, and
        that no less loaded worker with room takes, is *parked* there: its KV
        stays reserved and it goes first when that worker's grants end. A worker
        with parked requests takes no other new grant. A worker left with no
        grant and parked requests that cannot fit drops the largest one's KV
        (it queues again, to re-prefill wherever it goes) until one fits.
        """
        seen = (self.budget, self.page, self.est, self.S, self.rules)
        if seen != self._seen:  # a setting changed: every parked request is due
            self._seen, self._all_due = seen, True
        due, self._due = self._due, set()
        every, self._all_due = self._all_due, False
        out: list[Grant] = []
        back = sorted(self._returning, key=lambda p: -self.decode_cost(p.context, min(self.S, p.remaining)))
        self._returning = []
        for p in back:
            if not every and p.holder not in due:
                self._returning.append(p)  # nothing changed where it waits
                continue
            g = self._place(p)
            if g is None:  # parked: it waits where its KV is (reserved there since its end)
                self._returning.append(p)
            else:
                out.append(g)
        self._unblock(out)
        while self._waiting:
            g = self._place(self._waiting[0])
            if g is None:
                break  # head-of-line: FCFS
            self._waiting.popleft()
            out.append(g)
        return out

    def _unpark(self, p: _Pending) -> None:
        w = self._workers.get(p.holder) if p.holder is not None else None
        if w is not None and p.rid in w.parked:
            w.reserved -= w.parked.pop(p.rid)

    def _unblock(self, out: list[Grant]) -> None:
        """Idle workers whose parked requests cannot fit drop KV until one does."""
        for wid, w in self._workers.items():
            while w.parked and not w.grants:
                mine = [p for p in self._returning if p.holder == wid]
                if not mine:
                    break
                granted = False
                for p in mine:
                    g = self._place(p)
                    if g is not None:
                        self._returning.remove(p)
                        out.append(g)
                        granted = True
                if granted or not w.parked:
                    continue
                self.drops += 1
                self._drop_holder(max(mine, key=lambda p: p.context))

    def _fits(self, w: _Worker, need: int, rid: str) -> bool:
        return w.reserved - w.parked.get(rid, 0) + need <= self.budget

    def _place(self, p: _Pending) -> Grant | None:
        """Grant ``p`` on the worker where it finishes first (None: wait, parked where it is)."""
        # A context near the budget gets a shorter grant rather than none.
        tokens = min(self.S, p.remaining, max(1, self.budget - p.context))
        rules = self.rules
        if rules.short and len(self._waiting) > (1 if self._waiting and self._waiting[0] is p else 0):
            tokens = min(tokens, _tokens(rules, rules.short, self.S))  # others wait: a short grant
        need = _pages(p.context + tokens, self.page)
        # A worker that does not hold p's KV takes it only with room for the headroom too.
        headroom = 0
        if rules.headroom and self.rho > 0.0:
            cap = int(rules.headroom_cap * self.budget)
            headroom = cap if self.rho >= 1.0 else min(
                cap, int(rules.headroom * tokens * self.rho / (1.0 - self.rho)))
        names = sorted(self._workers)
        if not names:
            return None
        decode = self.decode_cost(p.context, tokens)
        pre = self.prefill_cost(p.context)
        start = self._rotation(names)
        best: tuple[float, int, str] | None = None
        for k, wid in enumerate(names):
            w = self._workers[wid]
            held = wid == p.holder
            if wid in self._inactive:
                continue
            # The holder always competes (it either has room or will, when its grants end);
            # another worker only with room and nothing parked.
            room = need + headroom if w.grants else need  # an idle worker needs no headroom
            if not held and (w.parked or not self._fits(w, room, p.rid)):
                continue
            finish = self._finish(w) + (0.0 if held else pre)
            holder_on = p.holder is not None and p.holder in self._workers and p.holder not in self._inactive
            if not held and holder_on and rules.stall:
                finish += pre * rules.stall * len(w.grants)  # the stall of every row there
            # The holder wins ties; other ties rotate so idle workers share lone requests.
            rank = -1 if held else (k - start) % len(names)
            if best is None or (finish, rank) < best[:2]:
                best = (finish, rank, wid)
        if best is None:
            return None
        wid = best[2]
        w = self._workers[wid]
        held = wid == p.holder
        if held and not self._fits(w, need, p.rid):
            if not rules.least:
                return None
            room = self.budget - (w.reserved - w.parked.get(p.rid, 0))
            fit = room // self.page * self.page - p.context
            if fit < _tokens(rules, rules.least, self.S):
                return None
            tokens = min(tokens, fit)  # what fits, rather than parking
            decode = self.decode_cost(p.context, tokens)
        if self.record_placements and p.holder is not None:
            hw = self._workers[p.holder]
            self.placements.append(
                Placement(
                    p.rid,
                    p.holder,
                    wid,
                    0.0 if held else self._finish(hw) - self._finish(w),
                    pre,
                    self._fits(hw, need, p.rid),
                )
            )
        self._unpark(p)
        prefill = 0 if held else p.context
        cost = decode + (0.0 if held else pre)
        g = Grant(p.rid, wid, p.context, tokens, prefill, cost, self.page)
        if p.holder is not None and not held:
            self.migrations += 1
            self._evict.append((p.holder, p.rid))
        w.grants[p.rid] = g
        w.reserved += g.reserve
        w.load += cost
        self._touch(p.holder)
        if not held:
            self._after = wid
        return g

    def _finish(self, w: _Worker) -> float:
        """When ``w`` would finish a slice given now: its grants' work plus S iterations' fixed cost."""
        return w.load + self._busy_cost()

    def _rotation(self, names: list[str]) -> int:
        if self._after is None:
            return 0
        for k, n in enumerate(names):
            if n > self._after:
                return k
        return 0
