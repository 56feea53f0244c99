"""The child processes that compile structured-output grammars, never the daemon itself.

A request's ``structured`` becomes llguidance's grammar text in a child process
(:func:`sclsd.structured.child_main`), never in the daemon: llguidance is native code
that a hostile grammar can crash (a ``$ref`` chain a thousand deep, a Lark grammar of
thousands of chained rules overflow its stack) or drive to allocate without bound (an
``allOf`` of patterns), and one request must not end the daemon and everyone's work in
flight. So:

* children are started with ``python -c`` (nothing of the daemon's memory or threads is
  forked), up to ``processes`` spares ahead of need, each capped at ``grammar.memory_bytes`` of address space beyond
  its size at start (``RLIMIT_AS``), each checking one grammar at a time with
  llguidance's limits (``[grammar]``);
* an :class:`Attempt` is one check in one child, waited for in steps (the caller decides
  between steps whether it goes on: :mod:`.grammar`); one past its time is killed
  (:meth:`Attempt.timed_out`), one nobody waits for any more is killed
  (:meth:`Attempt.stop`), one that crashed (stack, memory) is reaped, and the next
  check gets a fresh child;
* each answer says whether another try would give the same (:attr:`Checked.lasting`):
  llguidance's answers, a crash on its stack and a memory cap do; a timeout does only when
  the child spent at least :data:`LASTING_CPU` of the time computing (on a machine whose
  cores are busy it may have had little of it), read from ``/proc/<pid>/stat``.

Waiting for a child runs in a small thread pool of its own, so the event loop never
blocks and tokenizing is not held up by grammars.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection

import msgspec

from .. import protocol as P
from ..grammar_config import GrammarConfig
from ..structured import CHILD_MAX_REPLY
from .grammar_cache import Checked

log = logging.getLogger("sclsd")

__all__ = ["CAUSES", "LASTING_CPU", "Attempt", "Children", "GrammarUnavailable"]

#: Why a grammar is refused: past ``timeout_s``; past ``memory_bytes`` (its child ran out of
#: address space); its child crashed otherwise (llguidance's stack); not a grammar
#: llguidance accepts; past one of llguidance's limits.
CAUSES = ("timeout", "memory", "crash", "invalid", "limit")
#: A check past its time is refused for good (kept in the cache) only when its child was
#: computing at least this share of the time: then the grammar itself is what takes long,
#: and it would take as long again.
LASTING_CPU = 0.8

#: ``python -c`` puts the working directory first on sys.path: dropped, as for workers.
_BOOTSTRAP = ("import sys, json; del sys.path[0]; from sclsd.structured import child_main; "
              "child_main(int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]))")
#: How long a new child may take to start (import llguidance) before it counts as broken.
START_S = 60.0
_REPLY = msgspec.msgpack.Decoder(tuple[str, str])
_ENC = msgspec.msgpack.Encoder()
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
#: Signals that end a child the same way on another try (its stack; an allocation past
#: its RLIMIT_AS that the native code aborts on); any other death (SIGKILL from the
#: kernel's OOM killer, say) may be the machine's doing.
_LASTING_SIGNALS = (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS)


class GrammarUnavailable(RuntimeError):
    """No grammar child could be started (the daemon's fault, not the request's)."""


@dataclass(eq=False)
class _Child:
    proc: subprocess.Popen[bytes]
    conn: Connection
    ready: bool = False

    def kill(self) -> int | None:
        """End the process (SIGKILL unless it ended already); its exit status."""
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            rc = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - a SIGKILLed process ends
            rc = None
        self.conn.close()
        return rc

    def cpu_s(self) -> float | None:
        """Seconds of CPU the process has used so far (None where it cannot be read)."""
        try:
            with open(f"/proc/{self.proc.pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            return None
        fields = stat.rpartition(b")")[2].split()  # after the command name, which may hold spaces
        try:
            return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime (fields 14, 15)
        except (IndexError, ValueError):
            return None


class Attempt:
    """One grammar check in one child (see the module docstring). Created on the loop's
    thread (a child dies with the thread that started it); waited for with :meth:`wait`."""

    def __init__(self, children: Children, child: _Child, s: P.Structured) -> None:
        self.children = children
        self.child = child
        self.s = s
        self.waited = 0.0
        """Seconds waited for the answer so far."""
        self.stopped = False
        self._sent = False
        self._cpu0: float | None = None
        self._thread: asyncio.Future[Checked | None] | None = None

    async def wait(self, seconds: float) -> Checked | None:
        """The answer, if it comes within ``seconds`` more (None: not yet; the child keeps
        checking). Cancelled: the child is killed (its answer is for nobody)."""
        loop = asyncio.get_running_loop()
        self._thread = fut = loop.run_in_executor(self.children.threads, self._wait, seconds)
        try:
            out = await asyncio.shield(fut)
        except asyncio.CancelledError:
            await self.stop()
            raise
        finally:
            self.waited += seconds
        if out is not None and out.cause in (None, "invalid", "limit") and not self.stopped:
            self.children.keep(self.child)  # it answered: ready for the next check
        return out

    async def stop(self) -> None:
        """Kill the child mid-check (nobody wants its answer) and wait until the thread that
        waited for it let go (so threads never outnumber ``grammar.processes``)."""
        self.stopped = True
        self.child.proc.kill()
        if self._thread is not None and not self._thread.done():
            await asyncio.wait([self._thread])
        await asyncio.shield(asyncio.to_thread(self.child.kill))  # reaped off the loop, whatever happens

    async def timed_out(self) -> Checked:
        """The check took all its time: the child is killed, the grammar refused naming the
        limit; lasting when the child was computing (:data:`LASTING_CPU`) all along."""
        cpu1 = self.child.cpu_s()
        await self.stop()
        cpu = None if cpu1 is None or self._cpu0 is None else cpu1 - self._cpu0
        lasting = cpu is not None and cpu >= LASTING_CPU * self.waited
        limit = self.children.cfg.timeout_s
        log.info("a grammar check ran out of time after %.1f s (%s of CPU%s)", self.waited,
                 "unknown" if cpu is None else f"{cpu:.1f} s", "" if lasting else ": not kept, the machine was busy")
        return Checked(None, f"the grammar did not compile within grammar.timeout_s = {limit:g} s", "timeout",
                       lasting)

    def _wait(self, seconds: float) -> Checked | None:
        """In a thread: (send the job and) wait up to ``seconds`` for the answer."""
        child = self.child
        if not self._sent:
            try:
                if not child.ready:
                    if not child.conn.poll(START_S):
                        raise EOFError
                    child.conn.recv_bytes(1024)
                    child.ready = True
            except (EOFError, OSError):
                rc = child.kill()
                raise GrammarUnavailable(f"a grammar process did not start (exit status {rc})") from None
            self._cpu0 = child.cpu_s()
            self._sent = True
            try:
                child.conn.send_bytes(_ENC.encode((self.s.kind, self.s.value)))
            except OSError:
                return self._ended()
        try:
            if not child.conn.poll(seconds):
                return None
            status, body = _REPLY.decode(child.conn.recv_bytes(CHILD_MAX_REPLY))
        except (EOFError, OSError, msgspec.DecodeError):
            return self._ended()
        if status == "ok":
            return Checked(body)
        if status == "memory":  # its allocator failed: not a child to trust with the next check
            child.kill()
            return Checked(None, body, "memory")
        return Checked(None, body, status if status == "limit" else "invalid")

    def _ended(self) -> Checked | None:
        """The child ended mid-check: why, as the client hears it, and the cause (None when
        it was stopped: nobody hears it)."""
        rc = self.child.kill()
        if self.stopped:
            return None
        name = _signal_name(rc)
        lasting = rc is not None and rc < 0 and -rc in _LASTING_SIGNALS
        log.warning("a grammar process ended while checking a request's grammar (%s)", name)
        if rc == -signal.SIGSEGV:
            return Checked(None, f"the grammar could not be compiled: its check crashed ({name}: nested too "
                           "deeply?)", "crash", lasting)
        return Checked(None, f"the grammar did not compile within grammar.memory_bytes = "
                       f"{self.children.cfg.memory_bytes} (its check ended with {name})", "memory", lasting)


class Children:
    """The grammar children: idle ones kept for the next check, new ones started as needed."""

    def __init__(self, cfg: GrammarConfig) -> None:
        self.cfg = cfg
        self.idle: list[_Child] = []
        """Children that answered their last check and wait for the next."""
        self.threads = ThreadPoolExecutor(cfg.processes, thread_name_prefix="sclsd-grammar")

    def attempt(self, s: P.Structured) -> Attempt:
        """A check of ``s`` in an idle child, or a new one (GrammarUnavailable if it cannot
        be started)."""
        child = None
        while self.idle and child is None:
            child = self.idle.pop()
            if child.proc.poll() is not None:
                child.kill()  # ended while idle (killed from outside): reaped, not blamed on this grammar
                child = None
        if child is None:
            child = self._start()
        if len(self.idle) < self.cfg.processes:
            # Spares, starting while this check runs: the next checks do not wait for a child
            # to start (a check stopped or past its time takes its child with it).
            self.idle.append(self._start())
        return Attempt(self, child, s)

    def keep(self, child: _Child) -> None:
        """``child`` answered its check: kept for the next one, unless enough are kept already."""
        if len(self.idle) < self.cfg.processes:
            self.idle.append(child)
        else:
            child.kill()

    def close(self) -> None:
        """End every idle child (the daemon's exit ends the others: they die with it)."""
        for child in self.idle:
            child.kill()
        self.idle.clear()
        self.threads.shutdown(wait=False, cancel_futures=True)

    def _start(self) -> _Child:
        """A new child (on the loop's thread: a child dies with the thread that started it)."""
        ours, theirs = socket.socketpair()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", _BOOTSTRAP, str(theirs.fileno()), str(self.cfg.memory_bytes),
                 json.dumps(self.cfg.limits())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        except OSError as exc:
            ours.close()
            raise GrammarUnavailable(f"cannot start a grammar process: {exc}") from exc
        finally:
            theirs.close()
        return _Child(proc, Connection(ours.detach()))


def _signal_name(rc: int | None) -> str:
    if rc is not None and rc < 0:
        try:
            return signal.Signals(-rc).name
        except ValueError:
            pass
    return f"exit status {rc}"
