"""Structured-output grammars compiled and checked outside the daemon's process.

A request's ``structured`` becomes llguidance's grammar text in a child process
(:func:`sclsd.structured.child_main`), never in the daemon: llguidance is native code
that a hostile grammar can crash (a ``$ref`` chain a thousand deep, a Lark grammar of
thousands of chained rules overflow its stack) or drive to allocate without bound (an
``allOf`` of patterns), and one request must not end the daemon and everyone's work in
flight. So:

* ``grammar.processes`` children, started on first use with ``python -c`` (nothing of
  the daemon's memory or threads is forked), each capped at ``grammar.memory_bytes``
  of address space beyond its size at start (``RLIMIT_AS``), each checking one grammar
  at a time with llguidance's limits (``[grammar]``);
* each check has ``grammar.timeout_s``: a child past it is killed, one that crashed
  (stack, memory) is reaped, and either way the next check starts a fresh one; the
  request is refused (``bad_request``) with a message naming the limit;
* every refusal is counted by its cause (:data:`CAUSES`; the daemon's metric
  ``sclsd:grammar_refusals_total{cause}``);
* the daemon keeps the grammar text the child returns with the request
  (``Entry.grammar``): batches carry it, nothing in the daemon compiles it again.

Waiting for a child runs in a small thread pool of its own, so the event loop never
blocks and tokenizing is not held up by grammars.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection

import msgspec

from .. import protocol as P
from ..grammar_config import GrammarConfig
from ..structured import CHILD_MAX_REPLY

log = logging.getLogger("sclsd")

__all__ = ["CAUSES", "GrammarChecks", "GrammarUnavailable"]

#: Why a grammar is refused: past ``timeout_s``; past ``memory_bytes`` (its child ran out of
#: address space); its child crashed otherwise (llguidance's stack); not a grammar
#: llguidance accepts; past one of llguidance's limits.
CAUSES = ("timeout", "memory", "crash", "invalid", "limit")

#: ``python -c`` puts the working directory first on sys.path: dropped, as for workers.
_BOOTSTRAP = ("import sys, json; del sys.path[0]; from sclsd.structured import child_main; "
              "child_main(int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]))")
#: How long a new child may take to start (import llguidance) before it counts as broken.
START_S = 60.0
_REPLY = msgspec.msgpack.Decoder(tuple[str, str])
_ENC = msgspec.msgpack.Encoder()


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


class GrammarChecks:
    """Compiles requests' grammars in child processes (see the module docstring)."""

    def __init__(self, cfg: GrammarConfig, on_refused: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        self.idle: list[_Child] = []
        self.slots = asyncio.Semaphore(cfg.processes)
        self.threads = ThreadPoolExecutor(cfg.processes, thread_name_prefix="sclsd-grammar")
        self.refused: dict[str, int] = dict.fromkeys(CAUSES, 0)
        """Grammars refused, by cause (:data:`CAUSES`)."""
        self.on_refused = on_refused
        """Called on the event loop with the cause of each refusal (the daemon's metrics)."""

    async def compile(self, s: P.Structured) -> tuple[str | None, str | None]:
        """(grammar text, None) for ``s``, or (None, why it is refused); GrammarUnavailable
        when no child can be started."""
        async with self.slots:
            child = self.idle.pop() if self.idle else self._start()
            loop = asyncio.get_running_loop()
            try:
                ok, text, why, cause = await loop.run_in_executor(self.threads, self._round_trip, child, s)
            except asyncio.CancelledError:
                child.proc.kill()  # mid-job: its answer is for nobody, its state unknown
                raise
            if ok:
                self.idle.append(child)
            if cause is not None:
                self.refused[cause] += 1
                if self.on_refused is not None:
                    self.on_refused(cause)
            return text, why

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

    def _round_trip(self, child: _Child, s: P.Structured) -> tuple[bool, str | None, str | None, str | None]:
        """In a thread: ``s`` to ``child`` and its answer back, within the time limit;
        (child still usable, text, why refused, the cause of the refusal)."""
        try:
            if not child.ready:
                if not child.conn.poll(START_S):
                    raise EOFError
                child.conn.recv_bytes(1024)
                child.ready = True
        except (EOFError, OSError):
            rc = child.kill()
            raise GrammarUnavailable(f"a grammar process did not start (exit status {rc})") from None
        limit = self.cfg.timeout_s
        try:
            child.conn.send_bytes(_ENC.encode((s.kind, s.value)))
            if not child.conn.poll(limit):
                child.kill()
                return False, None, f"the grammar did not compile within grammar.timeout_s = {limit:g} s", "timeout"
            status, body = _REPLY.decode(child.conn.recv_bytes(CHILD_MAX_REPLY))
        except (EOFError, OSError, msgspec.DecodeError):
            return (False, None, *self._crashed(child.kill()))
        if status == "ok":
            return True, body, None, None
        return True, None, body, status if status in ("invalid", "limit", "memory") else "invalid"

    def _crashed(self, rc: int | None) -> tuple[str, str]:
        """Why a child that ended mid-check ended, as the client hears it, and the cause."""
        name = _signal_name(rc)
        log.warning("a grammar process ended while checking a request's grammar (%s)", name)
        if rc == -signal.SIGSEGV:
            return f"the grammar could not be compiled: its check crashed ({name}: nested too deeply?)", "crash"
        return (f"the grammar did not compile within grammar.memory_bytes = {self.cfg.memory_bytes} "
                f"(its check ended with {name})", "memory")


def _signal_name(rc: int | None) -> str:
    if rc is not None and rc < 0:
        try:
            return signal.Signals(-rc).name
        except ValueError:
            pass
    return f"exit status {rc}"
