"""``sclsd-bench chaos``: kill workers at random under a stream of requests; nothing may be
lost or duplicated, and every token must be right.

Starts a daemon with ``--workers`` workers, then for ``--minutes`` keeps ``--window``
requests in flight on each of ``--clients`` connections (random prompts and lengths, most
of them streamed, some ending at their natural EOS, a share cancelled by the client
after their first tokens) while a killer SIGKILLs a registered worker every
``--kill-every`` seconds on average, one with a batch in flight when there is one. The
supervisor restarts each; the daemon puts the dead worker's requests back in the pool.

Two kinds of workers (:class:`Workload`):

- ``fake`` (the default; ``decode_s`` per iteration, so slices take time and a kill lands
  in the middle of a batch): its tokens are a function of the prompt and the position
  (:func:`reference_tokens`), greedy requests only;
- a transformers engine (``hf``, ``hf-cb``, ``hf-static-cb``) on ``tiny-random`` (fp32, on
  the CPU), or ``llama`` (llama.cpp, the CPU's default engine) on the same weights as a GGUF,
  under ``scls-cb`` for the grant engines: greedy requests and, for a share, seeded sampling
  (a seeded row's draw of its token ``g`` depends on ``(seed, g)`` only), so both have one
  right answer, one uninterrupted pass (:func:`~sclsd.bench.chaos_checks.reference_for`,
  computed after the run, in batches): ``hf``'s for the transformers engines, ``llama``'s own
  for ``llama``, whose fp16 KV makes its tokens differ from ``hf``'s in places. Logits differ
  by about 1e-6 with the rows beside them, so a pick may go to a token next to the
  reference's: a request whose tokens first differ at such a pick
  (:data:`~sclsd.bench.chaos_checks.TIES`), right up to it, counts as a near tie, not as
  wrong; a wrong context (KV of another row, a token at the wrong position) picks tokens far
  from the reference's. A share of the requests (``--structured``) must follow a grammar
  (:data:`GRAMMARS`); a worker that serves one again after a kill replays its tokens so far
  through the grammar's matcher, and its tokens must still be the one pass's under the same
  grammar (a near tie is then measured among the tokens the grammar allows).

A request that lost slices to a kill and was served again must give exactly the tokens of
one uninterrupted pass. Checked per request: ``accepted``, then exactly one terminal event;
its tokens equal to the reference and to the ``done``'s count, or, for one the client
cancelled and that ended ``cancelled``, a prefix of it (a ``cancelled`` end the client never
asked for is wrong). At the end, once the daemon holds no request and no batch is out, a
ping round trip on every connection brings in anything still on the way: an event of a
request that already ended counts as a duplicate.

Reported: sent, accepted, done (of them ``cancelled``), refused, errors (by code), **lost**
(sent without a terminal event), **duplicated**, **wrong** (tokens that differ), kills (and of
those, mid-batch), worker restarts, the requests the dead workers held (put back in the pool),
requests per second and e2e latency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import protocol as P
from ..client import status
from ..defaults import ENGINE_FEATURES
from ..launch import launch
from .api_bench import ZERO_PROFILE
from .chaos_checks import (
    HF_MODEL,
    Finished,
    Tally,
    check_prompt,
    check_tokens,
    reference_for,
    reference_tokens,
)

#: Engines on ``tiny-random`` checked against one pass (:func:`~sclsd.bench.chaos_checks.reference_for`).
REAL_ENGINES = ("hf", "hf-cb", "hf-static-cb", "llama")
ENGINES = ("fake", *REAL_ENGINES)
#: What a request with a grammar (:attr:`Workload.structured`) follows: small enough to check in
#: milliseconds, each a different kind of llguidance grammar.
GRAMMARS = (
    P.Structured(kind="regex", value="[a-z]+( [a-z]+)*"),
    P.Structured(kind="json_schema", value='{"type": "object", "properties": {"n": {"type": "integer"}, '
                 '"s": {"type": "string", "maxLength": 16}}, "required": ["n", "s"], "additionalProperties": false}'),
    P.Structured(kind="choice", value='["yes", "no", "maybe not"]'),
)
#: What the prompts of :attr:`Workload.common` begin with: two of 40 tokens, longer than the
#: 16 tokens two of ``llama``'s requests must share before it keeps a prefix.
PREFIXES = (tuple(range(100, 140)), tuple(range(200, 240)))
#: The policy each engine is driven with unless told: the grant engines' is ``scls-cb``.
POLICY = {"fake": "scls", "hf": "scls", "hf-cb": "scls-cb", "hf-static-cb": "scls-cb", "llama": "scls-cb"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=5.0, help="how long requests are sent and workers killed")
    p.add_argument("--workers", type=int, default=3, help="workers the daemon spawns")
    p.add_argument("--engine", default="fake", choices=ENGINES,
                   help=f"the workers' engine: fake (tokens checked against its formula), a transformers "
                        f"engine on {HF_MODEL} or llama on its GGUF (tokens checked against one pass of hf, "
                        f"llama's own for llama)")
    p.add_argument("--policy", default=None, help="the scheduler's policy (default: scls-cb for hf-cb, "
                                                   "hf-static-cb and llama, else scls)")
    p.add_argument("--clients", type=int, default=4, help="client connections")
    p.add_argument("--window", type=int, default=4, help="requests in flight per connection")
    p.add_argument("--kill-every", type=float, default=2.0,
                   help="mean seconds between worker kills (0: none, a baseline)")
    p.add_argument("--cancels", type=float, default=0.1,
                   help="share of requests the client cancels (a streamed one after its first tokens)")
    p.add_argument("--seeded", type=float, default=0.3,
                   help="share of requests sampled with a seed (transformers engines; the fake engine is greedy)")
    p.add_argument("--prompt-logprobs", type=float, default=0.2,
                   help="share of requests that ask for their prompt's log-probabilities (engines that compute "
                        "them: fake, hf, hf-static-cb, llama), each checked to come exactly once, for every prompt "
                        "token")
    p.add_argument("--structured", type=float, default=0.1,
                   help="share of requests whose output must follow a grammar (a regex, a JSON schema or a "
                        "choice; engines that enforce them: not fake)")
    p.add_argument("--common", type=float, default=0.3,
                   help="share of requests whose prompt begins with one of two fixed prefixes of 40 tokens "
                        "(served from cached KV where the engine shares prefixes)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="an engine option of the workers ([workers.options]; not for fake), e.g. "
                        "share_prefixes=true; repeatable")
    p.add_argument("--decode-s", type=float, default=0.005, help="the fake engine's seconds per iteration")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--keep-dir", default=None, help="run the daemon in this directory and keep it (log)")


@dataclass(frozen=True)
class Workload:
    """What the workers run and what the clients send."""

    engine: str = "fake"
    policy: str | None = None
    """The scheduler's policy (None: :data:`POLICY`'s for the engine)."""
    cancels: float = 0.1
    """Share of requests the client cancels: a streamed one after a random number of its tokens
    (fewer than it asks for), another once it is accepted."""
    seeded: float = 0.0
    """Share of requests sampled (temperature 0.8, top-p 0.95) with a seed; the rest greedy.
    Transformers engines only: the fake engine's tokens do not depend on sampling."""
    prompt_logprobs: float = 0.0
    """Share of requests that ask for their prompt's log-probabilities (``prompt_logprobs`` 2),
    where the engine computes them (:attr:`scores`): each must get them exactly once."""
    options: tuple[tuple[str, Any], ...] = ()
    """Engine options of the workers (``[workers.options]``, checked by the daemon at load),
    e.g. ``("share_prefixes", True)`` for ``llama`` (:func:`option` reads ``KEY=VALUE``)."""
    common: float = 0.0
    """Share of requests whose prompt begins with one of :data:`PREFIXES` (as chats begin with
    a system prompt), so that engines that keep and share prefixes' KV (``hf-static-cb`` by
    default, ``llama`` with ``share_prefixes``) serve them from it, kills or not."""
    structured: float = 0.0
    """Share of requests whose output must follow one of :data:`GRAMMARS`, where the engine
    enforces them (:attr:`grammars`): a request served again after a kill resumes its grammar's
    state from the tokens it has, and must still give the one pass's tokens."""

    @property
    def grammars(self) -> bool:
        """Whether the engine enforces grammars (else no request has one)."""
        return self.engine in ENGINE_FEATURES["grammar"]

    @property
    def scores(self) -> bool:
        """Whether the engine computes the prompt's log-probabilities (else none are asked)."""
        return self.engine in ENGINE_FEATURES["prompt_logprobs"]

    @property
    def fake(self) -> bool:
        return self.engine == "fake"

    @property
    def policy_name(self) -> str:
        return self.policy or POLICY[self.engine]


@dataclass
class _Req:
    spec: P.Generate
    t0: float
    accepted: bool = False
    tokens: list[int] = field(default_factory=list)
    cancel_after: int = 0
    """Cancel once this many tokens came (streamed) or once accepted (not streamed); 0: never."""
    cancel_sent: bool = False
    prompt_lps: list[list[P.TokenLogprobs]] = field(default_factory=list)
    """Each delivery of the prompt's log-probabilities (a delta's or the done's)."""


class ChaosClient:
    """One connection that keeps ``window`` requests in flight and checks what comes back."""

    def __init__(self, name: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 tally: Tally, window: int, rng: random.Random, work: Workload | None = None) -> None:
        self.name = name
        self.reader = reader
        self.writer = writer
        self.tally = tally
        self.rng = rng
        self.work = work or Workload()
        self.slots = asyncio.Semaphore(window)
        self.inflight: dict[str, _Req] = {}
        self.ended: dict[str, str] = {}
        """Requests that ended: ``cancel raced`` for one whose cancel was sent and that did not
        end ``cancelled`` (its cancel's ``unknown_id`` may still come), else ``ended``."""
        self.pong = asyncio.Event()
        self._n = 0

    def _next(self) -> tuple[P.Generate, int]:
        """The next request, and when to cancel it (:attr:`_Req.cancel_after`)."""
        self._n += 1
        rng = self.rng
        seeded = not self.work.fake and rng.random() < self.work.seeded
        max_tokens = rng.randint(1, 64)
        scored = self.work.scores and rng.random() < self.work.prompt_logprobs
        structured = rng.choice(GRAMMARS) if self.work.grammars and rng.random() < self.work.structured else None
        spec = P.Generate(id=f"{self.name}-{self._n}", max_tokens=max_tokens,
                          temperature=0.8 if seeded else 0.0, top_p=0.95 if seeded else 1.0,
                          seed=rng.randrange(2**31) if seeded else None,
                          prompt_ids=[*(rng.choice(PREFIXES) if rng.random() < self.work.common else ()),
                                      *(rng.randrange(3, 256) for _ in range(rng.randint(1, 30)))],
                          # A grammar ends its output itself (only EOS may follow once it is complete).
                          ignore_eos=structured is None and rng.random() < 0.8, stream=rng.random() < 0.75,
                          prompt_logprobs=2 if scored else None, structured=structured)
        cancel = rng.random() < self.work.cancels
        return spec, (rng.randint(1, max(1, max_tokens - 1)) if cancel else 0)

    async def send_until(self, deadline: float) -> None:
        """Send requests, ``window`` at a time, until ``deadline`` (loop time)."""
        loop = asyncio.get_running_loop()
        while loop.time() < deadline:
            await self.slots.acquire()
            if loop.time() >= deadline:
                self.slots.release()
                return
            spec, cancel_after = self._next()
            assert spec.id is not None
            self.inflight[spec.id] = _Req(spec, loop.time(), cancel_after=cancel_after)
            self.tally.sent += 1
            self.writer.write(P.frame(spec))

    async def read(self) -> None:
        """Read and check events until the connection closes."""
        while True:
            try:
                header = await self.reader.readexactly(P.FRAME_HEADER.size)
            except asyncio.IncompleteReadError:
                return
            (size,) = P.FRAME_HEADER.unpack(header)
            self._event(P.server_decoder.decode(await self.reader.readexactly(size)))

    def _event(self, ev: Any) -> None:
        if isinstance(ev, P.Pong):
            self.pong.set()
            return
        rid = getattr(ev, "id", None)
        if rid in self.ended:
            if isinstance(ev, P.Error) and ev.code == "unknown_id" and self.ended[rid] == "cancel raced":
                # The answer to a cancel sent while the request's own end was on its way (the
                # daemon no longer knew it): one such answer per cancel, and only then.
                self.ended[rid] = "answered"
                self.tally.late_cancels += 1
                return
            self.tally.duplicated += 1
            self.tally.problem(f"{type(ev).__name__} for {rid} after its terminal event")
            return
        req = self.inflight.get(rid) if isinstance(rid, str) else None
        if req is None:
            self.tally.unexpected += 1
            self.tally.problem(f"event for no request of ours: {ev!r}"[:200])
            return
        if isinstance(ev, P.Accepted):
            req.accepted = True
            self.tally.accepted += 1
            self._maybe_cancel(req)
        elif isinstance(ev, P.Delta):
            req.tokens += ev.token_ids
            if ev.prompt_logprobs is not None:
                req.prompt_lps.append(ev.prompt_logprobs)
            self._maybe_cancel(req)
        elif isinstance(ev, (P.Done, P.Error)):
            self._end(req, ev)

    def _maybe_cancel(self, req: _Req) -> None:
        due = req.cancel_after and not req.cancel_sent and (
            len(req.tokens) >= req.cancel_after if req.spec.stream else req.accepted)
        if due:
            assert req.spec.id is not None
            req.cancel_sent = True
            self.writer.write(P.frame(P.Cancel(id=req.spec.id)))

    def _end(self, req: _Req, ev: P.Done | P.Error) -> None:
        spec = req.spec
        assert spec.id is not None and spec.prompt_ids is not None and spec.max_tokens is not None
        del self.inflight[spec.id]
        raced = req.cancel_sent and not (isinstance(ev, P.Done) and ev.finish_reason == "cancelled")
        self.ended[spec.id] = "cancel raced" if raced else "ended"
        self.slots.release()
        t = self.tally
        if isinstance(ev, P.Error):
            (t.errors if req.accepted else t.refused)[ev.code] += 1
            t.problem(f"{spec.id}: error {ev.code}: {ev.message}")
            return
        t.done += 1
        t.cancelled += ev.finish_reason == "cancelled"
        t.from_kv += bool(ev.usage.cached_tokens)
        if ev.prompt_logprobs is not None:
            req.prompt_lps.append(ev.prompt_logprobs)
        check_prompt(t, spec, req.prompt_lps, ev.finish_reason)
        t.latencies.append(asyncio.get_running_loop().time() - req.t0)
        got = req.tokens if spec.stream else (ev.token_ids or [])
        t.finished.append(Finished(spec, req.accepted, got, ev.usage.completion_tokens, ev.finish_reason,
                                   req.cancel_sent))

    async def finish(self, timeout: float) -> None:
        """Wait (bounded) until every request sent has ended."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while self.inflight and loop.time() < end:
            await asyncio.sleep(0.05)

    async def ping(self, timeout: float = 30.0) -> None:
        """A round trip: whatever the daemon sent before the pong has been read."""
        self.pong.clear()
        self.writer.write(P.frame(P.Ping(nonce=1)))
        await asyncio.wait_for(self.pong.wait(), timeout)


@dataclass
class Killer:
    """SIGKILLs a registered worker every ``every`` seconds on average (one with a batch in
    flight when there is one)."""

    status_sock: str
    every: float
    rng: random.Random
    kills: int = 0
    mid_batch: int = 0

    async def run(self, deadline: float) -> None:
        """Kill until ``deadline`` (loop time); ``every = 0``: no kills (a baseline)."""
        loop = asyncio.get_running_loop()
        if self.every <= 0:
            return
        while True:
            wake = loop.time() + self.every * self.rng.uniform(0.5, 1.5)
            await asyncio.sleep(max(0.0, min(wake, deadline) - loop.time()))
            if loop.time() >= deadline:
                return
            st = await asyncio.to_thread(status, self.status_sock, timeout=10)
            busy = [w for w in st.workers if w.batches_inflight > 0]
            pool = busy or st.workers
            if not pool:
                continue  # every worker is restarting
            victim = self.rng.choice(pool)
            try:
                os.kill(victim.pid, signal.SIGKILL)
            except ProcessLookupError:
                continue  # it died already; the daemon has not seen it yet
            self.kills += 1
            self.mid_batch += bool(busy)


async def _progress(tally: Tally, killer: Killer, t0: float, deadline: float, every_s: float) -> None:
    """A line on stderr every ``every_s`` seconds while requests are sent."""
    loop = asyncio.get_running_loop()
    while (now := loop.time()) < deadline:
        await asyncio.sleep(min(every_s, deadline - now))
        print(f"  {loop.time() - t0:5.0f}s: {tally.sent} sent, {tally.done} done ({tally.cancelled} cancelled), "
              f"{killer.kills} kills, {tally.duplicated} duplicated, {sum(tally.errors.values())} errors",
              file=sys.stderr, flush=True)


async def drive(sock: str, status_sock: str, *, seconds: float, clients: int, window: int,
                kill_every: float, seed: int, settle_s: float = 120.0,
                progress_s: float = 0.0, work: Workload | None = None) -> tuple[dict[str, Any], Tally]:
    """Requests on ``clients`` connections and kills for ``seconds``; then wait for every
    request (at most ``settle_s``), a settled daemon and a ping round trip per connection.
    With ``progress_s`` > 0, a progress line on stderr that often. Returns the result and the
    tally, whose tokens :func:`check_tokens` checks (``wrong`` is not counted yet)."""
    rng = random.Random(seed)
    tally = Tally()
    conns = []
    for i in range(clients):
        reader, writer = await asyncio.open_unix_connection(sock, limit=1 << 22)
        conns.append(ChaosClient(f"c{i}", reader, writer, tally, window, random.Random(rng.random()), work))
    readers = [asyncio.create_task(c.read(), name=f"read-{c.name}") for c in conns]
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    deadline = t0 + seconds
    killer = Killer(status_sock, kill_every, random.Random(rng.random()))
    shown = (_progress(tally, killer, t0, deadline, progress_s),) if progress_s > 0 else ()
    await asyncio.gather(killer.run(deadline), *(c.send_until(deadline) for c in conns), *shown)
    await asyncio.gather(*(c.finish(settle_s) for c in conns))
    wall = loop.time() - t0
    st = await asyncio.to_thread(_settled, status_sock, settle_s)
    for c in conns:
        await c.ping()
        c.writer.close()
    await asyncio.gather(*readers)  # a reader's failure (a bad frame) is raised here
    lat = sorted(tally.latencies)
    return {
        "seconds": round(seconds, 1), "workers": len(st.workers), "clients": clients, "window": window,
        "sent": tally.sent, "accepted": tally.accepted, "done": tally.done, "cancelled": tally.cancelled,
        "refused": dict(tally.refused), "errors": dict(tally.errors),
        "lost": sum(len(c.inflight) for c in conns), "duplicated": tally.duplicated,
        "late_cancels": tally.late_cancels,
        "unexpected": tally.unexpected,
        "kills": killer.kills, "kills_mid_batch": killer.mid_batch,
        "worker_restarts": st.counters.get("worker_restarts", 0),
        "requests_per_s": round(tally.done / wall, 1) if wall > 0 else 0.0,
        "e2e_p50_s": round(lat[len(lat) // 2], 3) if lat else None,
        "e2e_p99_s": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))], 3) if lat else None,
    }, tally


def _settled(status_sock: str, timeout: float) -> P.StatusSnapshot:
    """The daemon's status once it holds no request and no worker has a batch out (after
    that no event of any request can come)."""
    end = time.monotonic() + timeout
    while True:
        st = status(status_sock, timeout=10)
        if st.live_requests == 0 and not any(w.batches_inflight for w in st.workers):
            return st
        if time.monotonic() > end:
            raise RuntimeError(f"the daemon did not settle within {timeout:.0f}s: "
                               f"{st.live_requests} live requests")
        time.sleep(0.1)


def option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` as an engine option: the value as a JSON value (``true``, ``8``, ``0.5``,
    ``"text"``, as TOML writes them too), else as the text itself."""
    key, value = (part.strip() for part in text.split("=", 1))
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def sections(workers: int, decode_s: float, profile: Path, log_level: str = "warning",
             work: Workload | None = None) -> dict[str, Any]:
    """The daemon's config: workers restarted at once and never given up on (each kill is
    deliberate, not a crash loop), and no failure limit per request (a request may lose any
    number of slices to kills, none of them its fault, and must still be served, so its tokens
    can be checked). Fake workers get a zero-time profile and fast heartbeats; transformers
    workers the daemon's own defaults (a CPU worker busy beside others is slow, not dead)."""
    work = work or Workload()
    sched = {"policy": work.policy_name, "slice_len": 8, "gamma_s": 0.02, "max_failures": 1_000_000,
             "max_worker_losses": 0}
    pool = {"spawn": workers, "engine": work.engine, "threads": 1, "restart_backoff_s": 0.2,
            "quick_failure_s": 0.0}
    if not work.fake:
        if work.options:
            pool["options"] = dict(work.options)
        return {"daemon": {"log_level": log_level}, "model": {"name": HF_MODEL}, "scheduler": sched,
                "workers": pool}
    return {
        "daemon": {"log_level": log_level, "heartbeat_interval_s": 0.25, "heartbeat_timeout_s": 5.0},
        "model": {"name": "fake"},
        "scheduler": {**sched, "profile": str(profile)},
        "workers": {**pool, "options": {"decode_s": decode_s}},
    }


def run_chaos(*, seconds: float, workers: int = 3, clients: int = 4, window: int = 4, kill_every: float = 2.0,
              decode_s: float = 0.005, seed: int = 1, dir: str | None = None,
              log_level: str = "warning", progress_s: float = 0.0, work: Workload | None = None) -> dict[str, Any]:
    """Start a daemon, :func:`drive` it, stop it, check the tokens; the result, with the
    daemon's exit code."""
    work = work or Workload()
    with tempfile.TemporaryDirectory(prefix="sclsd-chaos-") as tmp:
        profile = Path(tmp) / "zero-profile.json"
        profile.write_text(json.dumps(ZERO_PROFILE))
        d = launch(sections(workers, decode_s, profile, log_level, work), dir=dir, wait_workers=workers,
                   timeout=120.0 if work.fake else 300.0)
        try:
            result, tally = asyncio.run(drive(d.sock, d.status_sock, seconds=seconds, clients=clients,
                                              window=window, kill_every=kill_every, seed=seed,
                                              progress_s=progress_s, work=work))
            # The daemon logs each dead worker's requests as it puts them back in the pool.
            result["requests_hit_by_kills"] = sum(
                int(n) for n in re.findall(r"worker=\S+ lost with (\d+) requests", d.log.read_text()))
        except BaseException:
            print(d.log_text(), file=sys.stderr)
            raise
        finally:
            code = d.stop()
    result["daemon_exit"] = code
    specs = [f.spec for f in tally.finished]
    if work.fake:
        refs = [reference_tokens(list(s.prompt_ids or ()), s.max_tokens or 1, s.ignore_eos) for s in specs]
        check_tokens(tally, refs)
    else:
        ref = reference_for(work.engine)
        if progress_s > 0:
            print(f"  checking {len(specs)} requests against {ref.engine_name}'s one pass ...", file=sys.stderr,
                  flush=True)
        try:
            refs = ref.tokens(specs, progress=progress_s > 0)
            check_tokens(tally, refs,
                         lambda f, i: ref.margin(f.spec, [*(f.spec.prompt_ids or ()), *f.tokens[:i]], i, f.tokens[i]))
        finally:
            ref.close()
    if dir is not None and tally.wrong_ones:
        (Path(dir) / "wrong.json").write_text(json.dumps(tally.wrong_ones, indent=1))
    result["wrong"] = tally.wrong
    result["prompt_logprobs"] = tally.prompt_checked
    result["prompt_wrong"] = tally.prompt_wrong
    result["structured"] = sum(f.spec.structured is not None for f in tally.finished)
    result["prompts_from_kv"] = tally.from_kv
    result["near_ties"] = tally.near_ties
    result["near_tie_max"] = {k: float(f"{v:.2g}") for k, v in sorted(tally.tie_max.items())}
    result["problems"] = tally.examples
    result["ties"] = tally.ties[:5]
    return result


def ok(result: dict[str, Any]) -> bool:
    """Nothing lost, nothing duplicated, every token right, every request served."""
    return (result["lost"] == 0 and result["duplicated"] == 0 and result["wrong"] == 0
            and result.get("prompt_wrong", 0) == 0 and result["unexpected"] == 0 and not result["errors"] and result["daemon_exit"] == 0)


def run(args: argparse.Namespace) -> int:
    bad = [f"--{k.replace('_', '-')} must be {why}" for k, ok_, why in (
        ("minutes", args.minutes > 0, "> 0"), ("workers", 1 <= args.workers <= 64, "in 1..64"),
        ("clients", args.clients >= 1, ">= 1"), ("window", args.window >= 1, ">= 1"),
        ("kill_every", args.kill_every >= 0, ">= 0"), ("decode_s", args.decode_s >= 0, ">= 0"),
        ("cancels", 0 <= args.cancels <= 1, "in 0..1"), ("seeded", 0 <= args.seeded <= 1, "in 0..1"),
        ("prompt_logprobs", 0 <= args.prompt_logprobs <= 1, "in 0..1"),
        ("structured", 0 <= args.structured <= 1, "in 0..1"), ("common", 0 <= args.common <= 1, "in 0..1"))
        if not ok_]
    bad += [f"--option {o!r} must be KEY=VALUE" for o in args.option if "=" not in o or not o.split("=", 1)[0]]
    if args.option and args.engine == "fake":
        bad.append("--option is for the real engines (the fake workers' options are the bench's own)")
    if bad:
        print(f"sclsd-bench chaos: {'; '.join(bad)}", file=sys.stderr)
        return 2
    work = Workload(engine=args.engine, policy=args.policy, cancels=args.cancels, seeded=args.seeded,
                    prompt_logprobs=args.prompt_logprobs, structured=args.structured, common=args.common,
                    options=tuple(option(o) for o in args.option))
    kills = f"a kill every ~{args.kill_every:g}s" if args.kill_every > 0 else "no kills"
    opts = "".join(f" {k}={v}" for k, v in work.options)
    what = "fake workers" if work.fake else f"{args.engine} workers on {HF_MODEL}{opts}"
    print(f"chaos: {args.workers} {what} ({work.policy_name}), {args.clients} clients x {args.window} requests, "
          f"{kills}, {args.cancels:.0%} cancelled, for {args.minutes:g} min ...", file=sys.stderr)
    result = run_chaos(seconds=args.minutes * 60, workers=args.workers, clients=args.clients,
                       window=args.window, kill_every=args.kill_every, decode_s=args.decode_s,
                       seed=args.seed, dir=args.keep_dir, progress_s=15.0, work=work)
    if args.json:
        print(json.dumps(result))
    else:
        print(", ".join(f"{k}={v}" for k, v in result.items()))
    return 0 if ok(result) else 1
