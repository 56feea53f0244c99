"""Where the rows of ``hf-static-cb``'s arena sit after a regroup, and the order of the slot
copies that put them there (pure: no torch; :mod:`worker.engines.arena_rows` does the copies).

The arena's slots hold three kinds of rows (:mod:`worker.engines.arena_set`):

- **running** rows in slots ``[0, k)``, the range a decode step covers (with the bucket's
  dummy rows after them: ``[k, n)``);
- among those, rows that join with tokens to prefill in the last ``m`` of them,
  ``[k - m, k)``, one contiguous block the prefill runs over;
- **paused** rows (a grant ended, their KV kept in place until the next grant or until
  the room is needed) anywhere in ``[k, cap)``, ``cap`` the slots the arena has at the
  geometry's columns: out of the steps' way, but for the bucket's dummies, which write only
  their slot's last column, a column a paused row's KV never reaches (:attr:`Paused.reserve`).

:func:`place` keeps every row that is already in its range where it is and moves the
others into the lowest free slots of theirs, so a pause, a resume or a row leaving costs at
most a copy or two of single rows. :func:`order_moves` orders those copies so that none
overwrites a row not copied yet, breaking cycles (two rows trading places) with one
saved row at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["Move", "Op", "Paused", "Placement", "order_moves", "place"]


@dataclass(eq=False)
class Paused:
    """A request whose grant ended with its KV kept in place, in arena slot :attr:`slot`."""

    rid: str
    slot: int
    tokens: list[int]
    """The context its KV covers: column ``i`` of its slot holds the KV of ``tokens[i]``."""

    @property
    def reserve(self) -> int:
        """Columns its slot keeps: its KV and one more, so that a dummy row's write to the
        slot's last column never lands on its KV."""
        return len(self.tokens) + 1


class Move(NamedTuple):
    """Copy the first ``length`` columns of slot ``src`` to slot ``dst``."""

    src: int
    dst: int
    length: int


class Op(NamedTuple):
    """One step of a reordered permutation: ``move`` (``src`` to ``dst``), ``save`` (``src``'s
    first ``length`` columns to the one spare buffer) or ``restore`` (the spare to ``dst``)."""

    kind: str
    src: int
    dst: int
    length: int


@dataclass(frozen=True)
class Placement:
    """Each row's slot after a regroup: running rows (in the order given), paused rows (in
    the order given), and the copies that put the rows holding KV there."""

    running: list[int]
    paused: list[int]
    moves: list[Move]


def place(running: Sequence[tuple[int, int]], prefill: Sequence[tuple[int, int]],
          paused: Sequence[tuple[int, int]], cap: int) -> Placement:
    """Slots for ``running`` rows (no tokens to prefill), ``prefill`` rows (to prefill) and
    ``paused`` rows, each ``(current slot or -1, KV columns it holds)``: the first two in
    ``[0, k)``, the prefill rows last and in their order, the paused in ``[k, cap)`` (module
    docstring). A row already in its range keeps its slot; the others take the lowest free
    slots of their range."""
    k = len(running) + len(prefill)
    lo = len(running)  # the prefill block: [lo, k)
    if k + len(paused) > cap:
        raise ValueError(f"{k + len(paused)} rows in {cap} slots")
    run_at = _fill([s for s, _ in running], 0, lo)
    pre_at = list(range(lo, k))
    par_at = _fill([s for s, _ in paused], k, cap)
    moves = [Move(s, d, n) for (s, n), d in zip([*running, *prefill, *paused], [*run_at, *pre_at, *par_at],
                                                strict=True)
             if s >= 0 and s != d and n > 0]
    return Placement(run_at + pre_at, par_at, moves)


def _fill(slots: Sequence[int], lo: int, hi: int) -> list[int]:
    """Slots in ``[lo, hi)`` for rows now at ``slots`` (-1: none): a row already there stays,
    the others take the lowest free ones, in their order."""
    stay = {s for s in slots if lo <= s < hi}
    free = (s for s in range(lo, hi) if s not in stay)
    return [s if lo <= s < hi else next(free) for s in slots]


def order_moves(moves: Sequence[Move]) -> list[Op]:
    """``moves`` (distinct sources, distinct destinations) as copies in an order where each
    copy's destination is no longer needed as a source: a cycle is broken by saving one
    row to a spare buffer and restoring it last (at most one saved row at any time)."""
    pending: dict[int, tuple[int, int]] = {m.dst: (m.src, m.length) for m in moves if m.src != m.dst}
    ops: list[Op] = []
    while pending:
        sources = {s for s, _ in pending.values() if s >= 0}
        ready = [d for d in pending if d not in sources]
        if ready:
            for d in ready:
                s, n = pending.pop(d)
                ops.append(Op("restore", -1, d, n) if s < 0 else Op("move", s, d, n))
            continue
        # Only cycles are left: every destination still holds a row some copy reads.
        d = next(iter(pending))
        reader = next(x for x, (s, _) in pending.items() if s == d)
        n = pending[reader][1]
        ops.append(Op("save", d, -1, n))
        pending[reader] = (-1, n)
    return ops
