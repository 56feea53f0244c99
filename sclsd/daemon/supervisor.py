"""Local worker processes: spawn, restart with backoff, give up on a crash loop.

Spawned workers run the installed ``worker`` package (never a ``worker/``
directory that happens to lie in the daemon's working directory: the first
``sys.path`` entry is dropped and the process starts in the daemon's private
run directory), get the worker secret through a file only the daemon's user can
read, and die with the daemon (``--parent-pid``: the kernel's parent-death
signal). A worker that exits within ``workers.quick_failure_s`` of its start
``workers.max_quick_failures`` times in a row is not restarted again: the
daemon says why in its status and, with no worker left, refuses new requests
with ``no_workers``.

A spawned worker is *loading* from its spawn until it registers: the status
shows it with its age and its latest loading step, which the worker keeps in
``<run dir>/<id>.progress`` (``sclsd-worker --progress-file``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Container
from dataclasses import dataclass
from typing import Literal

from ..config import Config
from ..core.policy import GRANT_POLICIES
from ..defaults import AUTO_ENGINE, AUTO_FALLBACK, offline_env
from ..engine_options import TORCH

log = logging.getLogger("sclsd.workers")

# ``python -c`` puts the working directory first on sys.path; drop it so a stray
# ``worker/`` there cannot shadow the installed package.
_BOOTSTRAP = "import sys; del sys.path[0]; from worker.main import main; sys.exit(main(sys.argv[1:]))"


def _absolute(value: str) -> str:
    """A relative path that exists, made absolute (workers run in another directory)."""
    return os.path.abspath(value) if value and not os.path.isabs(value) and os.path.exists(value) else value


@dataclass(frozen=True)
class Loading:
    """A local worker process that runs and has not registered (yet)."""

    id: str
    pid: int
    age_s: float
    """Seconds since it was spawned."""
    step: str
    """Its latest loading step ("" before it logged one)."""
    state: Literal["loading", "restarting", "given_up"] = "loading"
    """``restarting``: its process ended, a new one starts after the back-off; ``given_up``:
    not restarted any more (``pid`` is the process that ended)."""


class Supervisor:
    """Runs ``workers.spawn`` local workers (see the module docstring)."""

    def __init__(self, cfg: Config, run_dir: str, secret_file: str | None,
                 spawn_args: Callable[[str], list[str]], on_exit: Callable[[str, str], None],
                 on_give_up: Callable[[str], None]) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.secret_file = secret_file
        self.spawn_args = spawn_args
        self.on_exit = on_exit
        self.on_give_up = on_give_up
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        #: ``time.monotonic()`` of each worker's latest spawn.
        self.spawned_at: dict[str, float] = {}
        #: Workers not restarted any more, with the reason.
        self.gave_up: dict[str, str] = {}
        self.restarts = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False

    def start(self) -> None:
        for i in range(self.cfg.workers.spawn):
            self._tasks.append(asyncio.create_task(self._supervise(f"w{i}", i), name=f"supervise-w{i}"))

    def command(self, wid: str, index: int) -> list[str]:
        w, d = self.cfg.workers, self.cfg.daemon
        device = f"cuda:{index}" if w.device == "cuda" else w.device
        cmd = [
            sys.executable, "-c", _BOOTSTRAP,
            "--connect", d.worker_endpoint,
            "--id", wid,
            "--engine", self.cfg.engine,
            *(["--engine-fallback", AUTO_FALLBACK[self.cfg.engine]]
              if w.engine == AUTO_ENGINE and self.cfg.engine in AUTO_FALLBACK else []),
            "--model", _absolute(self.cfg.model.name),
            "--device", device,
            "--threads", str(w.threads),
            "--mem-budget", str(w.mem_budget_bytes),
            "--heartbeat", str(d.heartbeat_interval_s),
            "--daemon-timeout", str(w.daemon_timeout_s),
            "--parent-pid", str(os.getpid()),
            "--progress-file", self.progress_file(wid),
        ]
        if self.cfg.engine in TORCH:  # fake has no weights, llama runs the GGUF's as they are
            cmd += ["--dtype", self.cfg.model.dtype]
        elif self.cfg.engine == "fake" and self.cfg.scheduler.policy in GRANT_POLICIES and "batching" not in w.options:
            cmd += ["--batching", "continuous"]  # it stands in for hf-cb: it takes grants
        if self.cfg.model.cache_dir:
            cmd += ["--cache-dir", _absolute(self.cfg.model.cache_dir)]
        if self.secret_file is not None:
            cmd += ["--secret-file", self.secret_file]
        cmd += self.spawn_args(wid)
        # [workers.options] key = value becomes the worker flag --key value (e.g. decode_s -> --decode-s).
        for key, value in sorted(w.options.items()):
            cmd += [f"--{key.replace('_', '-')}", _absolute(str(value))]
        return cmd

    def progress_file(self, wid: str) -> str:
        return os.path.join(self.run_dir, f"{wid}.progress")

    def loading(self, registered: Container[str]) -> list[Loading]:
        """Local workers not in ``registered``: loading, waiting to restart after their
        process ended, or given up, by id.

        Reads each one's progress file: a few bytes, and only while workers load.
        """
        now = time.monotonic()
        out = []
        for wid, proc in sorted(self.procs.items()):
            if wid in registered:
                continue
            if proc.returncode is not None:
                age = round(now - self.spawned_at.get(wid, now), 1)
                if wid in self.gave_up:
                    out.append(Loading(wid, proc.pid, age, self.gave_up[wid][:200], "given_up"))
                elif not self._stopping:
                    out.append(Loading(wid, proc.pid, age, f"exited rc={proc.returncode}", "restarting"))
                continue
            try:
                with open(self.progress_file(wid), encoding="utf-8", errors="replace") as f:
                    step = f.read(256).strip()
            except OSError:
                step = ""
            out.append(Loading(wid, proc.pid, round(now - self.spawned_at.get(wid, now), 1), step))
        return out

    @property
    def serving(self) -> bool:
        """False once every local worker was given up (and some were configured)."""
        return not (self.cfg.workers.spawn and len(self.gave_up) == self.cfg.workers.spawn)

    async def _supervise(self, wid: str, index: int) -> None:
        """Run one local worker; restart it when it exits unless the daemon is stopping."""
        w = self.cfg.workers
        env = offline_env()
        env["PYTHONUNBUFFERED"] = "1"
        quick = 0
        loop = asyncio.get_running_loop()
        while not self._stopping:
            started = loop.time()
            # A restarted worker must not show the previous process's last step.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.progress_file(wid))
            proc = await asyncio.create_subprocess_exec(*self.command(wid, index), env=env,
                                                        cwd=self.run_dir, start_new_session=True)
            self.procs[wid] = proc
            self.spawned_at[wid] = time.monotonic()
            log.info("worker=%s spawned pid=%d", wid, proc.pid)
            rc = await proc.wait()
            if self._stopping:
                break
            self.on_exit(wid, f"process exited rc={rc}")
            quick = quick + 1 if loop.time() - started < w.quick_failure_s else 0
            if quick >= w.max_quick_failures:
                why = (f"local worker {wid} exited {quick} times in a row within "
                       f"{w.quick_failure_s:.0f}s of its start (last rc={rc}); not restarting it: "
                       "see the daemon's log for the worker's error")
                log.error("%s", why)
                self.gave_up[wid] = why
                self.on_give_up(why)
                return
            backoff = min(w.restart_backoff_max_s, w.restart_backoff_s * (2 ** max(0, quick - 1)))
            self.restarts += 1
            log.warning("worker=%s pid=%d exited rc=%s; restarting in %.1fs", wid, proc.pid, rc, backoff)
            await asyncio.sleep(backoff)

    def kill(self, wid: str, sig: int = signal.SIGKILL) -> None:
        """Signal a local worker process (a hung one is killed, then restarted)."""
        proc = self.procs.get(wid)
        if proc is not None and proc.returncode is None:
            proc.send_signal(sig)

    def check(self) -> None:
        for t in self._tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise RuntimeError(f"background task {t.get_name()} failed") from t.exception()

    def terminate(self, members: Container[str]) -> None:
        """SIGTERM the local processes that are no ``members`` (the daemon is stopping): a worker
        still loading was told nothing over the socket, and one registering now is turned away;
        the signal makes it exit as soon as its engine has loaded, without registering. No
        restart follows."""
        self._stopping = True
        for wid, proc in self.procs.items():
            if wid not in members and proc.returncode is None:
                log.info("worker=%s pid=%d has not registered: SIGTERM (it exits once loaded)", wid, proc.pid)
                proc.send_signal(signal.SIGTERM)

    async def stop(self, timeout: float = 30.0) -> None:
        """Wait for the local processes (already asked to shut down), kill stragglers."""
        self._stopping = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        for wid, proc in list(self.procs.items()):
            try:
                await asyncio.wait_for(proc.wait(), max(0.1, deadline - loop.time()))
            except asyncio.TimeoutError:
                log.warning("worker=%s did not exit in time; killing", wid)
                proc.kill()
                await proc.wait()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
