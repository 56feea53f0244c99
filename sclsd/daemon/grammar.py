"""Structured-output grammars checked in turn, once each, outside the daemon's process.

Admission hands a request's ``structured`` to :meth:`GrammarChecks.compile` after every
cheap check passed (the bounds, the client's uid share): the grammar is compiled and
checked in a child process (:mod:`.grammar_children`, ``grammar.processes`` at once), and
the daemon keeps the text the child returns with the request (``Entry.grammar``):
batches carry it, nothing in the daemon compiles it again. What one client's grammars
cost the others is bounded:

* **Once per content.** Results are kept by the grammar's content (:mod:`.grammar_cache`:
  the compiled text, or the refusal and its cause), and requests that ask for a grammar
  being checked (an HTTP request's ``n`` choices, clients sending the same schema) wait
  for that one check.
* **Fair turns.** Checks wait for a child in fair turns between the groups asking for
  them, nested as the line for grants is (:mod:`.grammar_turns`; a request's group is
  its user, its process, then its connection and ``user`` or its ``generate.group``):
  one group's burst of grammars takes turns with another group's single one, and one
  user's many processes and connections with another user's one.
* **Quick ones first.** A first try still running after ``grammar.quick_s`` goes on only
  while no other first try waits and another slot is left for first tries (with two or
  more children); else its child is killed and the grammar waits for a second try, from
  the start and up to ``grammar.timeout_s``, which starts only when no first try waits,
  and never in the last free slot. So grammars that take seconds (hostile ones take all of
  ``timeout_s``) do not hold up the ones that take milliseconds, whoever sends them.
* **Stopped when nobody waits.** When every request waiting for a check is gone
  (cancelled, its client disconnected: the waiting coroutine is cancelled), the check
  leaves the line, or its child is killed mid-check.

Every refusal is counted by its cause (:data:`CAUSES`; ``sclsd:grammar_refusals_total``),
once per request it refuses; :attr:`GrammarChecks.counts` says how each request's grammar
was answered (``sclsd:grammar_checks_total``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from .. import protocol as P
from ..grammar_config import GrammarConfig
from .grammar_cache import Checked, GrammarCache, key_of
from .grammar_children import CAUSES, Children, GrammarUnavailable
from .grammar_turns import Turns

log = logging.getLogger("sclsd")

__all__ = ["CAUSES", "OUTCOMES", "GrammarChecks", "GrammarUnavailable"]

#: How a request's grammar was answered or let go (:attr:`GrammarChecks.counts`):
#: ``checked`` a check ran for it; ``cached`` from the cache; ``shared`` it waited for a
#: check another request had asked for; ``retried`` its first try took past ``quick_s``
#: and was stopped for a second one (counted per check); ``stopped`` nobody waited for its
#: check any more, which left the line or was killed (per check).
OUTCOMES = ("checked", "cached", "shared", "retried", "stopped")


class Try(Protocol):
    """One check of one grammar (:class:`~.grammar_children.Attempt`)."""

    async def wait(self, seconds: float) -> Checked | None:
        """Its answer, if it comes within ``seconds`` more; cancelled: stopped."""

    async def stop(self) -> None:
        """Stop it (its answer is for nobody)."""

    async def timed_out(self) -> Checked:
        """Stop it: it took ``grammar.timeout_s``; the refusal that says so."""


class Checker(Protocol):
    """What :class:`GrammarChecks` runs checks in (:class:`~.grammar_children.Children`;
    tests give a fake)."""

    def attempt(self, s: P.Structured) -> Try:
        """A check of ``s`` (GrammarUnavailable when it cannot start)."""

    def close(self) -> None:
        """Stop what is left."""


@dataclass(eq=False)
class _Job:
    """One grammar's check and the requests waiting for it."""

    key: bytes
    s: P.Structured
    group: tuple[str, ...]
    result: asyncio.Future[Checked]
    waiters: int = 0
    second: bool = False
    """Its first try took past ``quick_s``: it waits for (or runs) its second."""
    slow: bool = False
    """It holds one of the slots for checks past ``quick_s``."""
    task: asyncio.Task[Checked | None] | None = None
    """While it runs."""


class GrammarChecks:
    """Checks requests' grammars (see the module docstring)."""

    def __init__(self, cfg: GrammarConfig, on_refused: Callable[[str], None] | None = None,
                 checker: Checker | None = None,
                 on_outcome: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        self.children = checker if checker is not None else Children(cfg)
        self.cache = GrammarCache(cfg.cache_entries, cfg.cache_bytes)
        self.first: Turns[_Job] = Turns()
        """Checks waiting for their first try."""
        self.again: Turns[_Job] = Turns()
        """Checks waiting for their second try (their first took past ``quick_s``)."""
        self.jobs: dict[bytes, _Job] = {}
        """Checks waiting or running, by key."""
        self.running: set[_Job] = set()
        self.slow = 0
        """Running checks past ``quick_s`` (first tries that went on, second tries)."""
        self.max_slow = max(1, cfg.processes - 1)
        """At most this many: with two children or more, one is always left for first tries."""
        self.refused: dict[str, int] = dict.fromkeys(CAUSES, 0)
        """Requests whose grammar was refused, by cause (:data:`CAUSES`)."""
        self.counts: dict[str, int] = dict.fromkeys(OUTCOMES, 0)
        """How grammars were answered (:data:`OUTCOMES`)."""
        self.on_refused = on_refused
        """Called on the event loop with the cause of each refusal (the daemon's metrics)."""
        self.on_outcome = on_outcome
        """Called on the event loop with each count of :data:`OUTCOMES` (the daemon's metrics)."""

    @property
    def idle(self) -> list[object]:
        """Children waiting for a check (none for a fake checker)."""
        return getattr(self.children, "idle", [])

    async def compile(self, s: P.Structured, group: tuple[str, ...] = ()) -> tuple[str | None, str | None]:
        """(grammar text, None) for ``s``, or (None, why it is refused), in ``group``'s turn;
        GrammarUnavailable when no child can be started. Cancelling it lets go of the check
        (stopped when nobody else waits for it)."""
        key = key_of(s)
        hit = self.cache.get(key)
        if hit is not None:
            self._count("cached")
            return self._answer(hit)
        job = self.jobs.get(key)
        if job is None:
            job = self.jobs[key] = _Job(key, s, group, asyncio.get_running_loop().create_future())
            self.first.join(job, group)
            self._count("checked")
            self._pump()
        else:
            self._count("shared")
            line = self.first if job in self.first else self.again if job in self.again else None
            if line is not None:
                line.share(job, group)
        job.waiters += 1
        try:
            checked = await asyncio.shield(job.result)
        finally:
            job.waiters -= 1
            if job.waiters == 0 and not job.result.done():
                self._let_go(job)
        return self._answer(checked)

    def close(self) -> None:
        """Stop every check and end the idle children (the daemon's exit ends the others:
        they die with it)."""
        for job in list(self.jobs.values()):
            self._let_go(job)
        self.children.close()

    # ------------------------------------------------------------------ the line and the slots

    def _pump(self) -> None:
        """Start what the free slots may take: first tries in turn; else, while another slot
        stays free for first tries, a second try."""
        while len(self.running) < self.cfg.processes:
            job = self.first.take()
            if job is None and self.slow < self.max_slow:
                job = self.again.take()
                if job is not None:
                    job.slow = True
                    self.slow += 1
            if job is None:
                return
            self.running.add(job)
            job.task = task = asyncio.get_running_loop().create_task(self._run(job), name="grammar-check")
            task.add_done_callback(functools.partial(self._ran, job))

    async def _run(self, job: _Job) -> Checked | None:
        """One try of ``job``: its answer, or None when its first try is stopped for a second."""
        cfg = self.cfg
        att = self.children.attempt(job.s)
        if job.second:
            out = await att.wait(cfg.timeout_s)
        else:
            quick = min(cfg.quick_s, cfg.timeout_s)
            out = await att.wait(quick)
            if out is None and quick < cfg.timeout_s:
                if self.slow >= self.max_slow or self.first:
                    # Other first tries wait, or every slot for slow checks is taken: this one
                    # goes after them.
                    await att.stop()
                    return None
                job.slow = True
                self.slow += 1
                out = await att.wait(cfg.timeout_s - quick)
        return out if out is not None else await att.timed_out()

    def _ran(self, job: _Job, task: asyncio.Task[Checked | None]) -> None:
        """A try ended: its answer to the waiting requests (and the cache), or its second try
        in line; the next checks start."""
        self.running.discard(job)
        job.task = None
        if job.slow:
            job.slow = False
            self.slow -= 1
        if not task.cancelled() and not job.result.done():
            exc = task.exception()
            if exc is not None:
                del self.jobs[job.key]
                job.result.set_exception(exc)  # GrammarUnavailable, or a bug: for the waiting requests
            elif (checked := task.result()) is None:
                job.second = True
                self._count("retried")
                self.again.join(job, job.group)
            else:
                del self.jobs[job.key]
                self.cache.put(job.key, checked)
                job.result.set_result(checked)
        self._pump()

    def _let_go(self, job: _Job) -> None:
        """Nobody waits for ``job`` any more: out of line, or its child killed mid-check."""
        self.jobs.pop(job.key, None)
        self.first.remove(job)
        self.again.remove(job)
        if job.task is not None:
            job.task.cancel()  # the attempt kills its child; the slot is free once it is reaped
        job.result.cancel()
        self._count("stopped")

    def _answer(self, checked: Checked) -> tuple[str | None, str | None]:
        if checked.cause is not None:
            self.refused[checked.cause] += 1
            if self.on_refused is not None:
                self.on_refused(checked.cause)
        return checked.text, checked.why

    def _count(self, outcome: str) -> None:
        self.counts[outcome] += 1
        if self.on_outcome is not None:
            self.on_outcome(outcome)
