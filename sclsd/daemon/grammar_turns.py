"""Fair turns between groups for work that waits for a few slots (grammar checks).

:class:`Turns` is a line where each item belongs to the group that asked for it, and the
turns are nested as the daemon's line for grants is (:mod:`sclsd.core.grant_queue`): a
group is a path, for the daemon ``(uid, client process, connection or named group)``
(:func:`sclsd.daemon.serving.core.fair_group`), and at each level the children of a node
take turns, start-time fair queueing with an item as the unit: a child that becomes
active starts at the turn its parent last served, and each item taken moves its child one
turn on (ties go to the child that became active first). So two users get the same share
of the slots whatever their numbers of processes and connections, and a single item that
another group queues after a burst of 64 is taken next, not after the burst. Within a
group, first come, first served; with one group, first come, first served.

An item a second group also asks for (the same grammar) waits in that group's line too,
and is taken at whichever of its turns comes first (that group's turn is spent; the
other lines let it go without spending theirs), so no group waits behind another's turns
for work it shares.

Pure: no clock, no I/O.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Hashable
from typing import Generic, TypeVar

__all__ = ["Turns"]

T = TypeVar("T", bound=Hashable)

#: The name of a group's own node under its path (a node holds items or has children).
_LEAF = "\0"
#: Children of one node past which idle ones are forgotten.
_SWEEP = 1024


class _Node:
    __slots__ = ("parent", "children", "vtime", "tag", "seq", "count", "items")

    def __init__(self, parent: _Node | None) -> None:
        self.parent = parent
        self.children: dict[str, _Node] = {}
        self.vtime = 0.0
        """The turn of the child served last (where a child that becomes active starts)."""
        self.tag = -math.inf
        """Its next turn among its siblings."""
        self.seq = 0
        """When it became active."""
        self.count = 0
        """Items waiting under it."""
        self.items: deque[object] = deque()
        """A leaf's items, first come, first served."""


class Turns(Generic[T]):
    """Items in nested fair turns between their groups (see the module docstring)."""

    def __init__(self) -> None:
        self._root = _Node(None)
        self._seq = itertools.count(1)
        self._leaves: dict[T, list[_Node]] = {}
        """Each waiting item's lines (the first group's, then those that share it)."""

    def __len__(self) -> int:
        return len(self._leaves)

    def __contains__(self, item: T) -> bool:
        return item in self._leaves

    def join(self, item: T, group: tuple[str, ...]) -> None:
        """``item`` of ``group`` (a path) waits in its group's line (it must not wait already)."""
        assert item not in self._leaves, "already in line"
        self._leaves[item] = []
        self._enter(item, group)

    def share(self, item: T, group: tuple[str, ...]) -> None:
        """``group`` asks for ``item`` too (it waits): it waits in ``group``'s line as well."""
        leaf = self._leaf(group)
        if leaf not in self._leaves[item]:
            self._enter(item, group)

    def remove(self, item: T) -> bool:
        """``item`` leaves every line without a turn (nobody waits for it); whether it waited."""
        leaves = self._leaves.pop(item, None)
        for leaf in leaves or ():
            self._out(leaf, item)
        return leaves is not None

    def take(self) -> T | None:
        """The item whose turn is next leaves the lines (None when none waits)."""
        node = self._root
        if not node.count:
            return None
        while node.children:
            node = min((c for c in node.children.values() if c.count), key=lambda c: (c.tag, c.seq))
        item: T = node.items[0]  # type: ignore[assignment]
        served: _Node | None = node
        while served is not None and served.parent is not None:
            served.parent.vtime = served.tag
            served.tag += 1.0
            served = served.parent
        for leaf in self._leaves.pop(item):
            self._out(leaf, item)
        return item

    # ------------------------------------------------------------------ internals

    def _leaf(self, group: tuple[str, ...]) -> _Node:
        node = self._root
        for name in (*group, _LEAF):
            child = node.children.get(name)
            if child is None:
                if len(node.children) >= _SWEEP:
                    node.children = {k: c for k, c in node.children.items() if c.count}
                child = node.children[name] = _Node(node)
            node = child
        return node

    def _enter(self, item: T, group: tuple[str, ...]) -> None:
        leaf = self._leaf(group)
        leaf.items.append(item)
        self._leaves[item].append(leaf)
        node: _Node | None = leaf
        while node is not None and node.parent is not None:
            if not node.count:  # becomes active: starts at the turn its parent last served
                node.tag = max(node.tag, node.parent.vtime)
                node.seq = next(self._seq)
            node.count += 1
            node = node.parent
        self._root.count += 1

    def _out(self, leaf: _Node, item: T) -> None:
        leaf.items.remove(item)
        node: _Node | None = leaf
        while node is not None:
            node.count -= 1
            node = node.parent
