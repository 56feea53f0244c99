"""``fake``: deterministic tokens and simulated serving time, no model.

Token ``g`` of a request (counted over the whole request) is a hash of its
prompt, ``g`` and, for sampled rows, the seed: a function of the context, so a
request gives the same tokens whether it is served in slices or in one pass.
Each request "naturally" ends with EOS after ``1 + H(prompt) % max_natural``
tokens (the prompt being ``token_ids`` minus the ``generated`` tail), unless
``ignore_eos``. The engine sleeps ``prefill_s_per_token · N · L`` for the
prefill and ``decode_s`` per iteration, and reports the KV memory the batch
would take, ``(L + iterations) · N · Δ``, as its peak memory. Rows that ask for
log-probabilities get made-up, stable ones; penalties and min-p do not change its tokens.
Its rows obey the constraints every engine does (:mod:`worker.engines.constraints`, in
their list form: :meth:`~worker.engines.constraints.RowConstraints.choose`): ``min_tokens``
holds the stop tokens back and delays the natural end to ``min_tokens`` tokens (its EOS
counted: one token before the torch engines would allow EOS); of ``logit_bias`` only the extremes act (+100 forces a token,
-100 bans it). With ``grammar`` (an engine option; it needs llguidance) it enforces
rows' grammars as the torch engines do: each token is the first the row's matcher allows
from the one it would have taken (token ``i`` stands for the byte ``i % 256``, as the
fake model's tokenizer reads it), and a row whose grammar cannot be built fails alone
(:mod:`worker.engines.grammar`).

Like ``hf`` it yields each iteration's tokens as they come, one poll each (after that
iteration's sleep, so time to first token is measurable) and, with ``kv_reuse``
(on by default), models KV kept across slices: unfinished rows' context sizes
are retained (:class:`~worker.engines.kvstore.KVStore`, LRU within the memory
budget) and a batch whose rows are held sleeps only for the prefill of what is
new, ``prefill_s_per_token · N · max(new tokens)``.

That is static batching (``batching = "static"``, the default): one batch at a time.
With ``batching = "continuous"`` (how the daemon spawns it under ``scls-cb``) it
serves as ``hf-cb`` does: batches join and leave one running set of at most
``max_rows`` rows, a step of ``decode_s`` gives every running row its next token
(:mod:`worker.engines.fake_cb`). Tokens are the same either way (:class:`FakeRow`).
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections.abc import Iterable
from typing import Any

from sclsd.protocol import (
    BatchMsg,
    BatchRequest,
    BatchStats,
    EngineCaps,
    RequestOutput,
    TokenLogprobs,
)
from worker.engines.base import EngineInfo, Event, SliceEngine, Steps, TokenCursor
from worker.engines.constraints import RowConstraints, first_allowed
from worker.engines.fake_cb import ContinuousRows
from worker.engines.grammar import byte_grammar_tokenizer, row_matcher
from worker.engines.grammar import supported as grammar_supported
from worker.engines.kvstore import KVReuse, KVStore, Retained
from worker.engines.sampling import mix_seed, random_seed, synthetic_logprobs

DEFAULT_BUDGET = 4 * 1024**3
#: Δ of SmolLM2-135M in fp32, so fake and hf workers look alike to the scheduler.
DEFAULT_KV_BYTES = 46_080
EOS_ID = 2
#: Ids below this are special tokens in the SmolLM2 vocabulary; ordinary output avoids them.
FIRST_ORDINARY_ID = 3
_MASK64 = (1 << 64) - 1


def _hash_ids(ids: list[int]) -> int:
    """Stable 64-bit hash of a token-id sequence."""
    digest = hashlib.blake2b(struct.pack(f"<{len(ids)}q", *ids), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class FakeRow:
    """One row's tokens as the fake engine makes them, one :meth:`step` at a time.

    Token ``g`` (counted over the whole request) is a function of the prompt, ``g``, the
    seed of a sampled row and the row's rules, never of the batch or the slice, so every
    way of serving a request (static batches, slices, continuous rows) gives the same tokens.
    """

    __slots__ = ("eng", "req", "rules", "natural", "state", "matcher", "out", "lps", "plps", "reason")

    def __init__(self, eng: FakeEngine, r: BatchRequest, matcher: Any = None) -> None:
        self.eng = eng
        self.req = r
        self.rules = RowConstraints.for_row(r, (EOS_ID,), eng.vocab)
        # The prompt is the context minus the tokens of earlier slices.
        h = _hash_ids(r.token_ids[: len(r.token_ids) - r.generated])
        # min_tokens delays the natural end (and keeps stop tokens out) until that many tokens.
        self.natural = max(1 + h % eng.max_natural, r.min_tokens)
        # Sampled rows fold their seed in (unseeded ones a fresh one): outputs differ from greedy.
        self.state = mix_seed(h, r.seed if r.seed is not None else random_seed()) if r.temperature > 0 else h
        self.matcher = matcher
        self.out: list[int] = []
        self.lps: list[Any] = []
        self.plps: list[TokenLogprobs] = []
        """The prompt's log-probabilities (made up, stable), in the request's first slice."""
        if r.prompt_logprobs is not None and r.generated == 0:
            p = r.token_ids
            self.plps = [synthetic_logprobs(p[i], r.prompt_logprobs, mix_seed(h ^ 0x9E0, i), FIRST_ORDINARY_ID,
                                            eng.vocab) for i in range(1, len(p))]
        self.reason: str | None = None
        """``stop`` or ``length`` once the row finished, ``cancelled`` once the daemon ended it
        (None: it may go on)."""

    def step(self) -> int:
        """Generate the row's next token (its reason set when it ends the row); returns it."""
        eng, r = self.eng, self.req
        g = r.generated + len(self.out)  # absolute index of this token
        if g == self.natural - 1 and not r.ignore_eos:
            tok = EOS_ID
        else:
            tok = FIRST_ORDINARY_ID + mix_seed(self.state, g) % (eng.vocab - FIRST_ORDINARY_ID)
            tok = self.rules.choose(tok, g, FIRST_ORDINARY_ID, eng.vocab)
        if self.matcher is not None:  # the grammar wins over the rest
            tok = eng._allowed(self.matcher, tok)
            self.matcher.consume_token(tok)
        self.out.append(tok)
        if r.logprobs or r.top_logprobs:  # made up, but stable: see synthetic_logprobs
            self.lps.append(synthetic_logprobs(tok, r.top_logprobs, mix_seed(self.state ^ 0x5EED, g),
                                               FIRST_ORDINARY_ID, eng.vocab))
        if self.rules.ends(tok):
            self.reason = "stop"
        elif len(self.out) >= r.max_new_tokens:
            self.reason = "length"
        return tok


class FakeEngine(SliceEngine):
    """A stand-in engine for tests and load tests (see the module docstring)."""

    name = "fake"

    def __init__(
        self,
        model: str = "fake",
        device: str = "cpu",
        decode_s: float = 0.0,
        prefill_s_per_token: float = 0.0,
        vocab: int = 1000,
        mem_budget: int | None = None,
        kv_bytes_per_token: int = DEFAULT_KV_BYTES,
        max_natural: int = 64,
        threads: int | None = None,
        kv_reuse: bool = True,
        kv_retain_bytes: int | None = None,
        batching: str = "static",
        grammar: bool = False,
        max_rows: int = 64,
        share_prefixes: bool = False,
    ) -> None:
        if vocab <= FIRST_ORDINARY_ID:
            raise ValueError(f"vocab must exceed {FIRST_ORDINARY_ID}, got {vocab}")
        self.model = model
        self.device = device
        self.decode_s = float(decode_s)
        self.prefill_s_per_token = float(prefill_s_per_token)
        self.vocab = int(vocab)
        self.mem_budget = int(mem_budget) if mem_budget else DEFAULT_BUDGET
        self.kv_bytes = int(kv_bytes_per_token)
        self.max_natural = int(max_natural)
        if batching not in ("static", "continuous"):
            raise ValueError(f"batching must be 'static' or 'continuous', got {batching!r}")
        #: What it tells the daemon, and how it serves: ``continuous`` takes slice grants
        #: (scls-cb) and runs their rows together (:mod:`worker.engines.fake_cb`).
        self.batching = batching
        if int(max_rows) < 1:
            raise ValueError(f"max_rows must be at least 1, got {max_rows}")
        self.max_rows = int(max_rows)
        """Continuous batching: the most rows running at once (others wait for a place)."""
        self.kv_peak_tokens = 0
        """Continuous batching: the most KV tokens held at once (running and kept), since it started."""
        self.share_prefixes = bool(share_prefixes)
        """Only said to the daemon (``caps.shared_prefixes``, for its routing's tests): its rows
        cost what they cost whatever came before, so there is nothing to share."""
        self.grammar = bool(grammar)
        if self.grammar and not grammar_supported():
            raise ValueError("grammar = true needs llguidance (pip install 'sclsd[worker]')")
        del threads  # accepted for CLI symmetry with the torch engines
        budget = self.mem_budget if kv_retain_bytes is None else int(kv_retain_bytes)
        self.kv = KVReuse(KVStore(budget), self.kv_bytes, self.mem_budget) if kv_reuse else None
        self.continuous = ContinuousRows(self) if batching == "continuous" else None
        """Continuous batching's running set of rows (None: static batching)."""

    def info(self) -> EngineInfo:
        """Configured Δ and budget; EOS is id 2 (SmolLM2's ``<|im_end|>``)."""
        return EngineInfo(
            engine=self.name,
            model=self.model,
            device=self.device,
            kv_bytes_per_token=self.kv_bytes,
            mem_available=self.mem_budget,
            eos_token_ids=[EOS_ID],
            vocab_size=self.vocab,
            caps=EngineCaps(batching=self.batching, grammar=self.grammar, prompt_logprobs=True,  # type: ignore[arg-type]
                            max_rows=self.max_rows if self.batching == "continuous" else 0,
                            shared_prefixes=self.share_prefixes),
        )

    def profile(self) -> dict[str, Any]:
        """The fake engine's cost is known exactly: prefill ``p1·N·L`` and ``d4`` per iteration
        (every generated token counts as one iteration), so the daemon's estimates match."""
        from sclsd.core.estimator import Estimator
        from sclsd.core.profiles import Profile

        est = Estimator(p1=self.prefill_s_per_token, p2=0.0, p3=0.0, p4=0.0,
                        d1=0.0, d2=0.0, d3=0.0, d4=self.decode_s)
        return Profile(name="fake", engine=self.name, model=self.model, device=self.device, estimator=est,
                       kv_bytes_per_token=self.kv_bytes, mem_available=float(self.mem_budget),
                       source="derived", notes="exact cost of the fake engine's sleeps").to_dict()

    def natural_length(self, prompt: list[int]) -> int:
        """Tokens after which a request with this prompt emits EOS (EOS included)."""
        return 1 + _hash_ids(prompt) % self.max_natural

    def steps(self, batch: BatchMsg) -> Steps:
        """Generate deterministic tokens for at most ``slice_len`` iterations, one per step."""
        reqs = batch.requests
        if not reqs:
            return [], BatchStats()
        self.check_batch(batch, self.vocab)
        for r in reqs:
            if r.generated > len(r.token_ids):
                raise ValueError(f"request {r.rid!r}: generated exceeds its context")

        n = len(reqs)
        # Before any KV is taken: a GrammarError fails that row alone (SliceEngine.poll).
        matchers = self._matchers(reqs)
        used = self.kv.take(batch)[1] if self.kv is not None else [0] * n
        try:
            return (yield from self._steps(batch, used, matchers))
        finally:
            if self.kv is not None:
                self.kv.store.done(r.rid for r in reqs)

    # Continuous batching hands the four to the running set of rows (fake_cb.ContinuousRows).

    def has_room(self) -> bool:
        """Static: while no batch runs; continuous: while fewer than ``max_rows`` rows run or wait."""
        return self.continuous.has_room() if self.continuous is not None else super().has_room()

    def busy(self) -> bool:
        """Whether a batch taken has not ended."""
        return self.continuous.busy() if self.continuous is not None else super().busy()

    def submit(self, batch: BatchMsg) -> None:
        """Static: start ``batch``; continuous: queue its rows to join the running set."""
        if self.continuous is not None:
            return self.continuous.submit(batch)
        return super().submit(batch)

    def poll(self, timeout: float) -> list[Event]:
        """One iteration: of the running batch, or of every running row."""
        return self.continuous.poll(timeout) if self.continuous is not None else super().poll(timeout)

    def row(self, r: BatchRequest) -> FakeRow:
        """Row ``r``'s token source, its grammar's matcher built (GrammarError if it cannot be)."""
        return FakeRow(self, r, self._matcher(r))

    def _matchers(self, reqs: list[BatchRequest]) -> dict[int, Any]:
        """Row index -> its grammar's matcher, for the rows with a grammar (none unless the
        engine enforces grammars); GrammarError for a row whose grammar cannot be built."""
        return {i: self._matcher(r) for i, r in enumerate(reqs) if self.grammar and r.grammar}

    def _matcher(self, r: BatchRequest) -> Any:
        """Row ``r``'s grammar matcher (None: no grammar, or the engine enforces none)."""
        if not (self.grammar and r.grammar):
            return None
        return row_matcher(r, byte_grammar_tokenizer(self.vocab, EOS_ID, FIRST_ORDINARY_ID))

    def _allowed(self, m: Any, tok: int) -> int:
        """``tok`` if the matcher ``m`` allows it, else the next ordinary id it allows, else EOS."""
        if m.is_stopped():
            return EOS_ID
        pick = first_allowed(int.from_bytes(m.compute_bitmask(), "little"), tok, FIRST_ORDINARY_ID, self.vocab)
        return EOS_ID if pick is None else pick

    def _steps(self, batch: BatchMsg, used: list[int], matchers: dict[int, Any]) -> Steps:
        reqs = batch.requests
        n = len(reqs)
        width = max(len(r.token_ids) for r in reqs)
        fresh = [len(r.token_ids) - u for r, u in zip(reqs, used, strict=True)]
        prefill_s = self.prefill_s_per_token * n * max(fresh)
        t0 = time.perf_counter()
        if prefill_s > 0:
            time.sleep(prefill_s)
        t1 = time.perf_counter()

        rows = [FakeRow(self, r, matchers.get(i)) for i, r in enumerate(reqs)]
        cursor = TokenCursor([r.rid for r in reqs])
        iterations = invalid = 0
        while iterations < batch.slice_len and any(row.reason is None for row in rows):
            if iterations:  # the first token comes from the prefill
                invalid += sum(row.reason is not None for row in rows)
            iterations += 1
            if self.decode_s > 0:
                time.sleep(self.decode_s)
            for row in rows:
                if row.reason is None:
                    row.step()
            yield cursor.new([row.out for row in rows], [row.reason for row in rows], [row.lps for row in rows],
                             [row.plps for row in rows])
            self.end_cancelled(rows)
        t2 = time.perf_counter()
        outs = [row.out for row in rows]
        reasons = [row.reason for row in rows]
        kept = self._keep(reqs, outs, reasons) if batch.kv_reuse else [0] * n

        outputs = [
            RequestOutput(rid=r.rid, token_ids=outs[i], finish_reason=reasons[i],  # type: ignore[arg-type]
                          logprobs=rows[i].lps, prompt_logprobs=rows[i].plps, kv_tokens=kept[i],
                          reused_tokens=used[i])
            for i, r in enumerate(reqs)
        ]
        stats = BatchStats(
            prefill_s=t1 - t0,
            decode_s=t2 - t1,
            iterations=iterations,
            pad_tokens=sum(width - len(r.token_ids) for r in reqs),
            invalid_tokens=invalid,
            peak_memory=(width + iterations) * n * self.kv_bytes,
            batch_size=n,
            input_len=width,
            prefill_tokens=sum(fresh),
            reused_tokens=sum(used),
        )
        return outputs, stats

    # ------------------------------------------------------------------ retained KV (modelled)

    def _keep(self, reqs: list[Any], outs: list[list[int]], reasons: list[str | None]) -> list[int]:
        """Retain the (modelled) KV of unfinished rows; returns the tokens kept per row."""
        kept = [0] * len(reqs)
        if self.kv is None:
            return kept
        for i, r in enumerate(reqs):
            if reasons[i] is None and outs[i]:
                tokens = list(r.token_ids) + outs[i][:-1]
                if self.kv.store.put(r.rid, Retained(tokens, len(tokens) * self.kv_bytes)):
                    kept[i] = len(tokens)
        return kept

    def release(self, rids: Iterable[str] | None = None) -> None:
        """Drop retained KV (the daemon's ``release``; None: all of it)."""
        if self.kv is not None:
            self.kv.store.release(rids)

    def take_evicted(self) -> list[str]:
        """Requests whose retained KV was evicted since the last call."""
        return self.kv.store.take_evicted() if self.kv is not None else []
