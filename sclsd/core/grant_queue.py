"""Requests waiting for a grant, in fair turns between groups.

:class:`GrantQueue` keeps every request the grant policy has not granted yet:

* the **front**: requests that lost their worker or their kept KV while being served; they
  go first, in order (they had their turn already);
* per **group**, the requests back from a grant whose KV a worker keeps (*held* there; the
  largest next grant first, then in the order they came back), then the group's requests
  that hold nothing, first come, first served.

Groups take turns, and the turns are nested: a request's group is a path, for the daemon
``(uid, client process, connection or named group)``, and at each level the children of a
node take turns (start-time fair queueing with a grant as the unit: a child that becomes
active starts at the turn its parent last served, and each grant moves its child one turn
on). So two users get the same share of grants whatever their numbers of processes, two
processes of one user the same share whatever their numbers of connections, and a request
sent after a burst of another process's 256 requests, spread over 64 connections, is next
in turn, not behind them. A returning request takes its group's turn like any other: the
next free place goes to the next group in turn, not to whoever was served last. With one
group it is first come, first served, returning requests first.

The policy asks for the next group in turn (:meth:`GrantQueue.next_group`) and tries that
group's requests in its own order; a grant charges the group's turn (:meth:`take`).

Pure: no clock, no I/O.
"""

from __future__ import annotations

import itertools
import math
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

__all__ = ["Group", "GrantQueue", "Pending"]


@dataclass(slots=True, eq=False)
class Pending:
    """A request waiting for its next grant."""

    rid: str
    context: int
    remaining: int
    holder: str | None
    """The worker holding its KV, if any."""
    prefix: tuple[str, int] | None = None
    """A new request's hint: a worker likely to hold a cached prefix of its prompt, and that
    prefix's tokens (what it saves there: :meth:`~sclsd.core.grant_place.GrantPlacement._place`)."""
    key: float = 0.0
    """Its place among its group's returning requests (ascending: the largest next grant first)."""


class _Node:
    """A level of the turns: a user, a process, or a group (a leaf, holding requests)."""

    __slots__ = ("parent", "name", "children", "vtime", "tag", "seq", "count", "back", "keys", "waiting")

    def __init__(self, parent: _Node | None, name: str) -> None:
        self.parent = parent
        self.name = name
        self.children: dict[str, _Node] = {}
        self.vtime = 0.0
        """The turn of the child served last (where a child that becomes active starts)."""
        self.tag = -math.inf
        """Its next turn among its siblings."""
        self.seq = 0
        """When it became active (ties of turns go to the earlier)."""
        self.count = 0
        """Requests waiting under it (the front's excepted)."""
        self.back: list[Pending] = []
        """A leaf's returning requests, ascending ``key``; equal keys in the order they came."""
        self.keys: list[float] = []
        self.waiting: deque[Pending] = deque()
        """A leaf's requests that hold no KV, first come, first served."""


#: What :meth:`GrantQueue.next_group` hands out: a group (leaf) and its requests.
Group = _Node
#: The name of a group's own node under its path.
_LEAF = "\0"
#: Children of one node past which idle ones are swept (:meth:`GrantQueue._sweep`).
_SWEEP = 1024


class GrantQueue:
    """The front, and every group's returning and waiting requests (see the module docstring)."""

    def __init__(self) -> None:
        self.front: deque[Pending] = deque()
        self._root = _Node(None, "")
        self._seq = itertools.count(1)
        self._group_of: dict[str, tuple[str, ...]] = {}
        """rid -> its group's path, from its arrival until it leaves the policy (its node may
        come and go: a group with nothing to remember is not kept)."""
        self._where: dict[str, Pending] = {}
        """rid -> its entry, while it waits (front, held or waiting)."""
        self.n_waiting = 0
        """Requests that hold no KV waiting (front included)."""

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, rid: object) -> bool:
        return rid in self._where

    # ------------------------------------------------------------------ arrivals

    def join(self, p: Pending, group: tuple[str, ...]) -> None:
        """A newcomer of ``group`` (a path: see the module docstring) waits in its group's line."""
        self._group_of[p.rid] = group
        leaf = self._leaf(group)
        leaf.waiting.append(p)
        self._enter(leaf, p)

    def push_front(self, p: Pending) -> None:
        """``p`` lost its worker or its KV: it goes first, ahead of those already there (a
        driver that puts several back in order pushes them last to first)."""
        self.front.appendleft(p)
        self._where[p.rid] = p
        self.n_waiting += 1

    def push_back(self, p: Pending, key: float) -> None:
        """``p`` came back from a grant with its KV held by ``p.holder``: its group's returning
        requests, after those of an equal or smaller key."""
        leaf = self._leaf(self._group_of.setdefault(p.rid, ()))
        p.key = key
        k = bisect_right(leaf.keys, key)
        leaf.back.insert(k, p)
        leaf.keys.insert(k, key)
        self._enter(leaf, p)

    # ------------------------------------------------------------------ leaving

    def take(self, p: Pending) -> None:
        """``p`` was granted: it leaves the line and its group's turn moves on."""
        path = self._group_of.get(p.rid)
        if path is not None:
            self._served(self._leaf(path))
        self._remove(p)

    def remove(self, p: Pending) -> None:
        """``p`` leaves the line without a grant (its KV dropped, it was forgotten)."""
        self._remove(p)

    def leave(self, rid: str) -> None:
        """``rid`` left the policy (finished, forgotten): its group is no longer its."""
        p = self._where.get(rid)
        if p is not None:
            self._remove(p)
        self._group_of.pop(rid, None)

    def find(self, rid: str) -> Pending | None:
        """``rid``'s entry while it waits."""
        return self._where.get(rid)

    # ------------------------------------------------------------------ reading

    def held_by(self, wid: str) -> list[Pending]:
        """The returning requests held by ``wid``, group by group, each group's in order."""
        return [p for leaf in self._leaves(self._root) for p in leaf.back if p.holder == wid]

    def back(self) -> Iterator[Pending]:
        """Every returning request (group by group)."""
        for leaf in self._leaves(self._root):
            yield from leaf.back

    def rekey(self, key: Callable[[Pending], float]) -> None:
        """New keys for the returning requests; each group's order is sorted again, stably."""
        for leaf in self._leaves(self._root):
            for p in leaf.back:
                p.key = key(p)
            leaf.back.sort(key=lambda p: p.key)
            leaf.keys = [p.key for p in leaf.back]

    def next_group(self, done: set[int]) -> Group | None:
        """The group whose turn it is, among those with requests waiting, but the groups (and
        levels) whose ids are in ``done`` (the caller marks what it has been through); None
        when every one is."""
        return self._pick(self._root, done)

    # ------------------------------------------------------------------ internals

    def _leaf(self, path: tuple[str, ...]) -> _Node:
        """The group of ``path``: a node of its own below the path's last level, so a node
        holds requests or has children, never both (paths may differ in depth)."""
        node = self._root
        for name in (*path, _LEAF):
            child = node.children.get(name)
            if child is None:
                child = node.children[name] = _Node(node, name)
            node = child
        return node

    def _enter(self, leaf: _Node, p: Pending) -> None:
        self._where[p.rid] = p
        if p.holder is None:
            self.n_waiting += 1
        node: _Node | None = leaf
        while node is not None and node.parent is not None:
            node.count += 1
            parent = node.parent
            if node.count == 1:  # it becomes active: at its parent's turn, not before its own
                node.tag = max(node.tag, parent.vtime)
                node.seq = next(self._seq)
                if len(parent.children) > _SWEEP:
                    self._sweep(parent)
            node = parent

    def _remove(self, p: Pending) -> None:
        if self._where.pop(p.rid, None) is None:
            return
        if p.holder is None:
            self.n_waiting -= 1
        if self.front and p in self.front:
            self.front.remove(p)
            return
        path = self._group_of.get(p.rid)
        if path is None:
            return
        leaf = self._leaf(path)
        if p.holder is None:
            leaf.waiting.remove(p)
        else:
            for k, q in enumerate(leaf.back):
                if q is p:
                    del leaf.back[k]
                    del leaf.keys[k]
                    break
        node: _Node | None = leaf
        while node is not None and node.parent is not None:
            node.count -= 1
            parent = node.parent
            if node.count == 0 and node.tag <= parent.vtime and not node.children:
                del parent.children[node.name]  # as good as new: nothing to remember
            node = parent

    @staticmethod
    def _sweep(node: _Node) -> None:
        """Forget ``node``'s idle children that have nothing to remember (their turn has come
        round again): groups come and go with connections."""
        for name, child in list(node.children.items()):
            if not child.count and child.tag <= node.vtime:
                del node.children[name]

    def _served(self, leaf: _Node) -> None:
        """A grant for ``leaf``: at every level, its branch takes its turn."""
        node: _Node | None = leaf
        while node is not None and node.parent is not None:
            parent = node.parent
            start = max(node.tag, parent.vtime)
            parent.vtime = start
            node.tag = start + 1.0
            node = parent

    def _pick(self, node: _Node, done: set[int]) -> _Node | None:
        if not node.children:  # a leaf
            return node if node.count and id(node) not in done else None
        if id(node) in done:
            return None
        active = [c for c in node.children.values() if c.count and id(c) not in done]
        for child in sorted(active, key=lambda c: (c.tag, c.seq)):
            got = self._pick(child, done)
            if got is not None:
                return got
        done.add(id(node))
        return None

    def _leaves(self, node: _Node) -> Iterator[_Node]:
        if not node.children:
            if node.parent is not None:
                yield node
            return
        for child in list(node.children.values()):
            yield from self._leaves(child)
