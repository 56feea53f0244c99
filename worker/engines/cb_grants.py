"""Slice grants inside transformers' continuous batching: a scheduler that pauses requests.

The ``hf-cb`` engine serves the daemon's ``scls-cb`` grants: a request may generate a
given number of tokens, then stops *with its KV kept* until the daemon grants it more
(or releases it). transformers has no such state, so :class:`GrantScheduler` (a
:class:`~transformers.generation.continuous_batching.scheduler.FIFOScheduler`) adds one:

* every request has an :class:`Allowance`, the context length (prompt + generated
  tokens) at which it must stop. A decoding request that reached it leaves
  ``active_requests`` for :attr:`GrantScheduler.paused` with its cache blocks still
  allocated (``keep``), or has them freed (not ``keep``: its grant ended the request).
  Paused requests are never scheduled; a larger allowance moves them back, and their
  next step feeds the last sampled token: no prefill.
* the engine thread never touches the scheduler: it talks to :class:`GrantControl`
  (one lock), and the scheduler applies what changed at the start of every loop
  iteration, on the generation thread (:meth:`GrantScheduler.clear_cancelled_requests`
  is the first scheduler call of each iteration). Raising an allowance before the
  request reached the old one is harmless: it just keeps going.
* preemptions are counted, never silent: transformers re-queues a request it offloads
  or soft-resets (``OffloadingManager.offload_requests``) through
  :meth:`~GrantScheduler.add_waiting_request`, so a second arrival of a request id is
  one preemption. Before transformers gets there, kept KV gives way: paused requests
  are evicted (oldest first; the engine reports them) when the running ones need room.
* the peak of KV tokens held (running and paused contexts) is tracked at every step.

Written against transformers 5.23 (its scheduler internals are not a stable API).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from transformers.generation.continuous_batching.requests import RequestState, RequestStatus
from transformers.generation.continuous_batching.scheduler import SCHEDULER_MAPPING, FIFOScheduler

log = logging.getLogger(__name__)

__all__ = ["Allowance", "GrantControl", "GrantScheduler", "register", "unregister"]


@dataclass(frozen=True, slots=True)
class Allowance:
    """Where a request stops: at ``total`` context tokens (prompt + generated)."""

    total: int
    keep: bool
    """Pause there keeping the KV (True) or free it (False: the request is over for us)."""


def context_len(state: RequestState) -> int:
    """Prompt + generated tokens. Unlike ``generated_len()`` this survives a soft reset,
    which moves the generated tokens into ``initial_tokens``."""
    return len(state.initial_tokens) + len(state.generated_tokens)


class GrantControl:
    """What the engine thread and the generation thread share; every field under :attr:`lock`.

    The engine sets allowances and asks for drops; the scheduler reports evictions,
    the KV it holds for paused requests, the preemption count and the KV peak.
    """

    def __init__(self) -> None:
        self.lock = threading.Condition()
        """Notified whenever the generation thread applied changes (once per loop turn)."""
        self.allow: dict[str, Allowance] = {}
        self.drops: set[str] = set()
        self.evicted: set[str] = set()
        """Paused requests the scheduler evicted, until the engine has taken note."""
        self.held: dict[str, int] = {}
        """Paused request id -> tokens of KV its blocks hold (``position_offset``)."""
        self.preemptions = 0
        self.kv_peak = 0
        self.warmed_shapes: int | None = None
        """Step shapes the manager's warm-up captured (:func:`~worker.engines.cb_setup.warm_graphs`;
        None: no warm-up, as on the CPU). Set once, before the generation thread starts."""
        self.wake: Callable[[], None] = lambda: None
        """Wakes the generation loop when it idles (set to the manager's event)."""
        self.forget: Callable[[str], None] = lambda tid: None
        """Hears every request dropped or evicted (the engine forgets its per-request rules)."""

    def admit(self, tid: str, allowance: Allowance) -> None:
        """Before ``add_request(tid)``: where the new request stops."""
        with self.lock:
            self.allow[tid] = allowance

    def resume(self, tid: str, allowance: Allowance) -> bool:
        """Let a paused (or pausing) request go on to ``allowance``; False if it was evicted."""
        with self.lock:
            if tid in self.evicted:
                self.evicted.discard(tid)
                return False
            self.allow[tid] = allowance
        self.wake()
        return True

    def drop(self, tid: str) -> None:
        """Forget ``tid`` and free its blocks, wherever it is (idempotent)."""
        with self.lock:
            self.allow.pop(tid, None)
            self.evicted.discard(tid)
            self.drops.add(tid)
        self.forget(tid)
        self.wake()

    def take_evicted(self, tids: Iterable[str]) -> set[str]:
        """Those of ``tids`` the scheduler evicted (forgotten here once returned)."""
        with self.lock:
            gone = self.evicted.intersection(tids)
            self.evicted -= gone
            return gone


class GrantScheduler(FIFOScheduler):
    """FIFO scheduling that pauses requests at their allowance (see the module docstring)."""

    def __init__(self, cache: Any, safety_margin: float | None, max_requests_per_batch: int,
                 *, control: GrantControl) -> None:
        self.control = control
        super().__init__(cache, safety_margin, max_requests_per_batch)

    def reset(self) -> None:
        super().reset()
        self.paused: dict[str, RequestState] = {}
        """Paused requests in pause order (the oldest is evicted first)."""
        self._admitted: set[str] = set()
        with self.control.lock:
            self.control.held.clear()

    # ------------------------------------------------------------------ transformers hooks

    def add_waiting_request(self, state: RequestState) -> None:
        """New requests come here once; a request id seen before was preempted and re-queued."""
        if state.request_id in self._admitted:
            with self.control.lock:
                self.control.preemptions += 1
            log.warning("transformers preempted %s (KV cache full)", state.request_id)
        self._admitted.add(state.request_id)
        super().add_waiting_request(state)

    def clear_cancelled_requests(self) -> list[RequestState]:
        """First scheduler call of every iteration: apply the engine's changes, then cancel."""
        self._sync()
        return super().clear_cancelled_requests()

    def schedule_batch(self, token_budget: int, cache_budget: int) -> tuple[Any, bool, int, int]:
        out = super().schedule_batch(token_budget, cache_budget)
        # None: nothing fits. transformers would preempt a running request, or fail the
        # whole loop when none runs: kept KV is dropped first (re-scheduling after a
        # None is safe: nothing was allocated, and prefix sharing is off).
        while out[0] is None and self._evict_one():
            out = super().schedule_batch(token_budget, cache_budget)
        if out[0] and self.starved_requests and self._room_for_starved():
            self.starved_requests = []  # nothing for transformers to offload now
        self._track_peak(out[0] or [])
        return out

    # ------------------------------------------------------------------ internals

    def _sync(self) -> None:
        """Drops, pauses and resumes, on the generation thread between two steps."""
        c = self.control
        with c.lock:
            drops, c.drops = c.drops, set()
            for tid in drops:
                self._admitted.discard(tid)
                if self.paused.pop(tid, None) is not None:
                    self.cache.free_blocks(tid)
                    c.held.pop(tid, None)
                else:  # running, waiting, or already gone: transformers' own cancellation
                    self.set_request_cancellation(tid)
            for tid, state in list(self.active_requests.items()):
                a = c.allow.get(tid)
                decoding = state.status == RequestStatus.DECODING
                if a is None or not decoding or context_len(state) < a.total:
                    continue
                del self.active_requests[tid]
                self.block_new_requests = False  # room was made: admissions may resume
                if a.keep:
                    self.paused[tid] = state
                    c.held[tid] = state.position_offset
                else:
                    self.cache.free_blocks(tid)
            for tid, state in list(self.paused.items()):
                a = c.allow.get(tid)
                if a is not None and context_len(state) < a.total:
                    del self.paused[tid]
                    c.held.pop(tid, None)
                    self.active_requests[tid] = state
            c.lock.notify_all()

    def _evict_one(self) -> bool:
        """Free the oldest paused request that no resume is waiting for; False if none."""
        c = self.control
        with c.lock:  # atomic against GrantControl.resume: evicted or resumed, never both
            for tid, state in self.paused.items():
                a = c.allow.get(tid)
                if a is not None and context_len(state) < a.total:
                    continue  # resumed since _sync: it runs next iteration
                del self.paused[tid]
                self.cache.free_blocks(tid)
                c.allow.pop(tid, None)
                c.held.pop(tid, None)
                c.evicted.add(tid)
                c.forget(tid)
                self._admitted.discard(tid)
                log.warning("evicted the kept KV of %s (%d tokens) to make room", tid,
                            state.position_offset)
                c.lock.notify_all()
                return True
        return False

    def _room_for_starved(self) -> bool:
        """Evict paused requests until every starved running one can grow; True if they can."""
        allocators = self.cache.cache_allocators
        needed = [{name: a.needs_new_blocks(s.request_id, s.current_len(), n)
                   for name, a in allocators.items()} for s, n in self.starved_requests]
        while self.cache.count_storable_requests(needed) < len(needed):
            if not self._evict_one():
                return False
        return True

    def _track_peak(self, scheduled: list[Any]) -> None:
        """KV tokens held once this step ran: scheduled requests add their query tokens."""
        query = {fs.state.request_id: fs.query_length for fs in scheduled}
        held = sum(s.position_offset + query.get(tid, 0) for tid, s in self.active_requests.items())
        held += sum(s.position_offset for s in self.paused.values())
        c = self.control
        if held > c.kv_peak:
            with c.lock:
                c.kv_peak = max(c.kv_peak, held)


def register(control: GrantControl) -> str:
    """Register a scheduler bound to ``control`` with transformers; returns its ``scheduler_type``.

    transformers builds the scheduler itself (on its generation thread, from
    ``SCHEDULER_MAPPING[scheduler_type]``), so each engine registers its own name.
    """
    name = f"sclsd-grants-{id(control):x}"
    SCHEDULER_MAPPING[name] = functools.partial(GrantScheduler, control=control)  # type: ignore[assignment]
    return name


def unregister(name: str) -> None:
    SCHEDULER_MAPPING.pop(name, None)
