"""A fake grammar checker for :class:`~sclsd.daemon.grammar.GrammarChecks`: no processes,
each grammar's behaviour named by its text, each try recorded, and time passing only when
a check says so.

A grammar's ``value`` picks what its check does:

* ``ok:...`` answers at once (its text: ``compiled ...``);
* ``bad:...`` is refused at once (cause ``invalid``);
* ``hold:...`` answers only once the test calls :meth:`FakeChecker.release` on it (as a
  check that takes a while; the time waited is not counted);
* ``boom:...`` fails as a bug would (the checker raises);
* ``slow:...`` never answers (a hostile grammar): a wait of under a second (``quick_s``)
  is spent in full at once; a longer one (up to ``timeout_s``) once the test calls
  :meth:`FakeChecker.release` on it, and then the check is past its time, with
  :attr:`FakeChecker.lasting` saying whether its timeout would come again.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from sclsd import protocol as P
from sclsd.daemon.grammar_cache import Checked


def grammar(value: str) -> P.Structured:
    return P.Structured(kind="regex", value=value)


def schema(value: str) -> P.Structured:
    """A JSON-schema ``structured`` whose check behaves as ``value`` says (its description)."""
    return P.Structured(kind="json_schema", value=json.dumps({"type": "string", "description": value}))


class FakeTry:
    def __init__(self, owner: FakeChecker, s: P.Structured) -> None:
        self.owner = owner
        self.value = s.value
        if s.kind == "json_schema":
            self.value = json.loads(s.value)["description"]
        self.stopped = False

    async def wait(self, seconds: float) -> Checked | None:
        v = self.value
        try:
            if v.startswith("hold:"):
                await self.owner.gate(v).wait()
                return Checked(self.owner.text(v))
            if v.startswith("slow:"):
                if seconds >= 1.0:  # past quick_s: until the test says its time is up
                    await self.owner.gate(v).wait()
                await asyncio.sleep(0)
                return None  # it took all it was given
        except asyncio.CancelledError:
            await self.stop()
            raise
        if v.startswith("bad:"):
            return Checked(None, f"regex: {v} is not a grammar", "invalid")
        return Checked(self.owner.text(v))

    async def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self.owner.stopped.append(self.value)
            self.owner.changed.set()

    async def timed_out(self) -> Checked:
        await self.stop()
        self.owner.timed_out.append(self.value)
        return Checked(None, "the grammar did not compile within grammar.timeout_s = 5 s", "timeout",
                       self.owner.lasting)


class FakeChecker:
    """Records the grammars whose check started, in order, and those stopped."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.stopped: list[str] = []
        self.timed_out: list[str] = []
        self.lasting = True
        self.closed = False
        self._gates: dict[str, asyncio.Event] = {}
        self.changed = asyncio.Event()
        """Set at each check started or stopped."""
        self.text: Callable[[str], str] = lambda v: f"compiled {v}"
        """The grammar text a check answers (a worker that enforces grammars needs a real one)."""

    def gate(self, value: str) -> asyncio.Event:
        return self._gates.setdefault(value, asyncio.Event())

    def release(self, value: str) -> None:
        self.gate(value).set()

    def attempt(self, s: P.Structured) -> FakeTry:
        t = FakeTry(self, s)
        if t.value.startswith("boom:"):
            raise RuntimeError(f"a bug checking {t.value}")
        self.started.append(t.value)
        self.changed.set()
        return t

    def close(self) -> None:
        self.closed = True
