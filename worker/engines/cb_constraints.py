"""Per-request ``min_tokens``, ``logit_bias`` and grammars inside transformers' continuous batching.

transformers 5.23 applies the logits processors of its ``GenerationConfig`` to every
request alike; only its per-request warpers (temperature, top-k, top-p) read settings
of their own, through the ``ContinuousBatchingLogitsProcessor`` hooks: before each
forward pass ``prepare_tensor_args`` hears the step's requests (their
``RequestState``: id, generated tokens) in the order of the logits rows, and
``__call__`` then processes those rows' logits. :class:`RequestRules` is such a
processor, installed first in the manager's list (before the warpers), for every
request the engine registered rules for (:meth:`RequestRules.add`, keyed by
transformers' request id). The rules are those of :mod:`worker.engines.constraints`
(one definition for every engine: :class:`~worker.engines.constraints.RowConstraints`),
applied here in their sparse tensor form, batched over the step's rows:

* ``logit_bias``: scatter-added to the row's logits;
* ``min_tokens``: the row's stop tokens held back while the request, counted over its
  whole life (the row's ``generated`` plus what this transformers request generated),
  has fewer tokens;
* a grammar: an llguidance matcher per request (:func:`worker.engines.grammar.row_matcher`,
  which replays the row's ``generated`` tail), fed the request's new tokens before each
  step, whose bitmask (:func:`~worker.engines.constraints.grammar_row`) masks the row.
  While a request stays paused on the worker between grants its matcher stays with it;
  a request served fresh (moved, released, evicted) gets a new one replayed from its tokens.

The host knows each step's previous tokens before preparing the next one: the engine
runs the manager without async batching.

**Cost.** Eagerly (the CPU; CUDA without graphs) a step whose rows have no rules does
nothing here, and when no row at all has rules the manager's processor list is
switched off for the step (greedy decoding then runs no processor). Rows with rules
cost one scatter-add over those rows (their biases, and their stop tokens at -inf
while ``min_tokens`` is not reached), rebuilt only when the batch's rows change; grammar
rows add their bitmask, computed on the host at every step (microseconds per row) and
turned into a ``[rows, vocab]`` 0/-inf addend by a byte lookup. Under CUDA graphs (or
``torch.compile``) what the processor does is frozen at capture, so there it works
from static buffers applied at every step (a ``[rows, 1024]`` scatter and a bitmask
over ``[rows, vocab]``, neutral for rows without rules), which the host rewrites only
where rows changed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from transformers.generation.continuous_batching.cb_logits_processors import (
    ContinuousBatchingLogitsProcessor,
)

from sclsd.protocol import BatchRequest
from sclsd.protocol.common import MAX_TOKEN_LIST
from worker.engines.cb_select import (
    Picker,
    RowPick,
    generated_count,
    generated_since,
    pick_key,
    wants_pick,
)
from worker.engines.constraints import (
    RowConstraints,
    bitmask_addend,
    byte_table,
    constrained,
    constraints_key,
    grammar_row,
    words,
)
from worker.engines.grammar import grammar_for, row_matcher

log = logging.getLogger(__name__)

__all__ = ["RequestRules", "RowRules", "generated_count", "generated_since", "has_rules", "rules_key"]

#: ``logit_bias`` entries one row may carry on the captured path (the protocol's own limit).
CAPTURED_BIAS_ENTRIES = MAX_TOKEN_LIST


def has_rules(r: BatchRequest) -> bool:
    """Whether row ``r`` asks for anything of this module (or for picks of its own:
    :mod:`worker.engines.cb_select`)."""
    return constrained(r) or wants_pick(r)


def rules_key(r: BatchRequest) -> tuple[Any, ...]:
    """What a resumed request must share with the row resuming it for its rules to hold."""
    return (*constraints_key(r), pick_key(r))


@dataclass(eq=False)
class RowRules:
    """What one transformers request obeys at every draw (identity, not value, tells two apart)."""

    key: tuple[Any, ...]
    rules: RowConstraints
    """The row's rules; its ``offset``: tokens the request generated before this
    transformers request's own (its row's ``generated``)."""
    stop_bits: Any
    """int32 ``[words]`` on the host: every token allowed but the stop tokens; None when
    ``min_tokens`` is already reached or there are no stop tokens."""
    bias: tuple[Any, Any] | None
    """(token ids, biases) on the host, or None."""
    early_bias: tuple[Any, Any] | None
    """``bias`` with the stop tokens at -inf (while ``min_tokens`` is not reached), or None."""
    matcher: Any = None
    consumed: int = 0
    """Tokens of this transformers request's own output the matcher has consumed."""
    pick: RowPick | None = None
    """How the engine picks the request's tokens itself (seed, log-probabilities), or None."""

    @classmethod
    def build(cls, r: BatchRequest, stops: tuple[int, ...], vocab: int, tokenizer: Any,
              max_bias: int | None = None) -> RowRules | None:
        """``r``'s rules, or None when it has none. ValueError: a grammar that is not valid
        (or that its earlier tokens do not follow), or more ``logit_bias`` entries than
        ``max_bias``. ``tokenizer``: llguidance's (needed only for a grammar row)."""
        c = RowConstraints.of(r, stops, vocab)
        if max_bias is not None and len(c.bias) > max_bias:
            raise ValueError(f"request {r.rid!r}: {len(c.bias)} logit_bias entries, "
                             f"this engine applies at most {max_bias}")
        bias = c.bias_entries()
        stop_bits = c.stop_bits(vocab)
        early_bias = c.bias_entries(early=True) if stop_bits is not None else None
        matcher = row_matcher(r, tokenizer) if r.grammar else None
        pick = RowPick.build(r)
        if bias is None and stop_bits is None and matcher is None and pick is None:
            return None
        return cls(rules_key(r), c, stop_bits, bias, early_bias, matcher, pick=pick)

    def early(self, state: Any) -> bool:
        """Whether the stop tokens are still masked for ``state``'s next token."""
        return self.rules.early(self.rules.offset + generated_count(state))

    def catch_up(self, state: Any) -> None:
        """Feed the matcher what ``state`` generated since the last call."""
        n = generated_count(state)
        if n <= self.consumed:
            return
        new = generated_since(state, self.consumed)
        self.consumed = n
        m = self.matcher
        for tok in new:
            if m.is_stopped():
                break
            if not m.consume_token(tok):
                log.warning("request %s: token %d refused by its grammar (%s)", state.request_id, tok,
                            m.get_error())
                break

    def fill(self, out: Any, i: int, early: bool) -> None:
        """Row ``i`` of the int32 host bitmask ``out``: the tokens allowed next."""
        grammar_row(out[i], self.matcher, self.stop_bits, early)


class RequestRules(ContinuousBatchingLogitsProcessor):
    """The engine's per-request rules as a continuous-batching logits processor (module docstring).

    ``add``/``forget`` come from the engine's threads, everything else from the generation
    thread; a request's rules are added before transformers can schedule it and forgotten
    after it left (single dict operations: atomic under the GIL).
    """

    supported_kwargs: dict[str, type] = {}
    ignored_kwargs: tuple[str, ...] = ()

    def __init__(self, vocab: int, device: Any, captured: bool = False, rows: int = 0) -> None:
        self.rules: dict[str, RowRules] = {}
        self.vocab = vocab
        self.words = words(vocab)
        self.device = torch.device(device)
        self.captured = captured
        """Static buffers applied at every step (CUDA graphs, compile): see the module docstring."""
        self.procs: Any = None
        """The manager's processor list (:meth:`install`)."""
        self.others = False
        """Whether that list holds other processors (transformers' warpers)."""
        self.picker = Picker(self.device, vocab)
        """The rows whose tokens the engine picks itself (:mod:`worker.engines.cb_select`)."""
        self._none = torch.empty(0, dtype=torch.int32)
        self._byte_table = byte_table(self.device)  # made now: not while a graph is captured
        # Eager path: this step's plans (None: nothing to do) and what they were built from.
        self._bias_plan: tuple[Any, Any, Any] | None = None
        self._bias_from: list[tuple[int, RowRules, bool]] = []
        self._mask_plan: tuple[Any, Any] | None = None
        self._mask_from: list[tuple[int, RowRules, bool]] = []
        # Captured path: static buffers and which rules each row of them holds.
        self._held_bias: dict[int, RowRules] = {}
        self._held_mask: set[int] = set()
        if captured:
            if rows < 1:
                raise ValueError("captured rules need the most rows of a step")
            pin = self.device.type == "cuda"
            self.rows = rows
            self._host_idx = torch.zeros((rows, CAPTURED_BIAS_ENTRIES), dtype=torch.long, pin_memory=pin)
            self._host_val = torch.zeros((rows, CAPTURED_BIAS_ENTRIES), dtype=torch.float32, pin_memory=pin)
            self._host_bits = torch.full((rows, self.words), -1, dtype=torch.int32, pin_memory=pin)
            self._idx = self._host_idx.to(self.device)
            self._val = self._host_val.to(self.device)
            self._bits = self._host_bits.to(self.device)

    # ------------------------------------------------------------------ the engine's side

    @classmethod
    def for_manager(cls, mgr: Any, vocab: int, device: Any) -> RequestRules:
        """Rules installed in a new manager, before its batch processor exists (that sizes the
        processors' arguments); on the captured path when its config captures or compiles."""
        cfg = mgr.continuous_batching_config
        captured = (any(cfg.cuda_graph_booleans) or cfg.varlen_compile_config is not None
                    or cfg.decode_compile_config is not None)
        rules = cls(vocab, device, captured=captured, rows=int(cfg.max_requests_per_batch or 0))
        rules.install(mgr.logit_processor)
        rules.picker.attach(mgr)
        return rules

    def for_row(self, r: BatchRequest, stops: tuple[int, ...], spec: Any,
                eos: Any) -> RowRules | None:
        """Row ``r``'s rules for model ``spec`` (None: it has none); ValueError: a grammar that
        is not valid (or llguidance missing), too many biases for the captured path."""
        if not has_rules(r):
            return None
        tokenizer = grammar_for(spec, self.vocab, eos) if r.grammar else None
        return RowRules.build(r, stops, self.vocab, tokenizer,
                              max_bias=CAPTURED_BIAS_ENTRIES if self.captured else None)

    def same(self, tid: str, r: BatchRequest) -> bool:
        """Whether request ``tid`` has the rules row ``r`` asks for (none for both counts)."""
        held = self.rules.get(tid)
        return not has_rules(r) if held is None else held.key == rules_key(r)

    def install(self, procs: Any) -> None:
        """Put this processor first in ``procs`` (a manager's ``ContinuousBatchingLogitsProcessorList``,
        before its batch processor exists: that sizes the processors' argument rows)."""
        self.procs = procs
        self.others = len(procs.logits_processor) > 0
        procs.logits_processor.insert(0, self)
        procs.tensors_required += 1
        procs.do_processing = self.others or self.captured

    def add(self, tid: str, rules: RowRules) -> None:
        self.rules[tid] = rules

    def get(self, tid: str) -> RowRules | None:
        return self.rules.get(tid)

    def forget(self, tid: str) -> None:
        self.rules.pop(tid, None)

    # ------------------------------------------------------------------ transformers' hooks

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.zero_()

    def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> torch.Tensor:
        """The step's host work: which rows have rules, their matchers fed, their masks."""
        rules = self.rules
        bias_rows: list[tuple[int, RowRules, bool]] = []
        mask_rows: list[tuple[int, RowRules, bool]] = []
        pick_rows: list[tuple[int, RowPick, Any]] = []
        captured = self.captured
        if rules:
            for i, fs in enumerate(requests_with_new_token):
                rr = rules.get(fs.state.request_id)
                if rr is None:
                    continue
                if rr.pick is not None:
                    pick_rows.append((i, rr.pick, fs.state))
                early = rr.early(fs.state)
                if rr.matcher is not None:
                    rr.catch_up(fs.state)
                    mask_rows.append((i, rr, early))
                    if rr.bias is not None:
                        bias_rows.append((i, rr, False))
                elif captured:  # a row's stops go to the bitmask there (the scatter holds biases only)
                    if rr.bias is not None:
                        bias_rows.append((i, rr, False))
                    if early:
                        mask_rows.append((i, rr, True))
                elif rr.bias is not None or early:  # eagerly the stops are -inf entries of the scatter
                    bias_rows.append((i, rr, early))
        self.picker.stage(pick_rows, captured)
        if captured:
            self._stage_captured(bias_rows, mask_rows)
        else:
            self._stage_eager(bias_rows, mask_rows)
        return self._none  # no per-row argument: the processor's argument row keeps its default

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        picker = self.picker
        if picker.active:
            picker.before(scores)  # log-probabilities of the model's own logits, then penalties
        if self.captured:
            n = scores.size(0)
            scores.scatter_add_(1, self._idx[:n], self._val[:n])
            scores.add_(self._addend(self._bits[:n]))
        else:
            if self._bias_plan is not None:
                rows, idx, val = self._bias_plan
                scores.index_put_((rows, idx), val, accumulate=True)
            if self._mask_plan is not None:
                rows, bits = self._mask_plan
                scores.index_add_(0, rows, self._addend(bits))
        return picker.after(scores) if picker.active else scores

    # ------------------------------------------------------------------ internals

    def _addend(self, bits: torch.Tensor) -> torch.Tensor:
        """``[rows, vocab]``: 0 where an int32 ``[rows, words]`` bitmask allows the token, -inf elsewhere."""
        return bitmask_addend(bits, self.vocab, self._byte_table)

    def _stage_eager(self, bias_rows: list[tuple[int, RowRules, bool]],
                     mask_rows: list[tuple[int, RowRules, bool]]) -> None:
        dev = self.device
        if bias_rows != self._bias_from:  # the rows changed: rebuild (identity comparisons)
            self._bias_from = bias_rows
            self._bias_plan = None
            if bias_rows:
                entries = [rr.early_bias if early else rr.bias for _, rr, early in bias_rows]
                k = max(len(e[0]) for e in entries if e is not None)
                idx = torch.zeros((len(bias_rows), k), dtype=torch.long)
                val = torch.zeros((len(bias_rows), k), dtype=torch.float32)
                for j, e in enumerate(entries):
                    assert e is not None
                    idx[j, : len(e[0])] = e[0]
                    val[j, : len(e[1])] = e[1]
                rows = torch.tensor([i for i, _, _ in bias_rows], dtype=torch.long).unsqueeze(1).expand(-1, k)
                self._bias_plan = (rows.to(dev), idx.to(dev), val.to(dev))
        grammar = any(rr.matcher is not None for _, rr, _ in mask_rows)
        if grammar or mask_rows != self._mask_from:
            self._mask_from = mask_rows
            self._mask_plan = None
            if mask_rows:
                bits = torch.empty((len(mask_rows), self.words), dtype=torch.int32)
                for j, (_, rr, early) in enumerate(mask_rows):
                    rr.fill(bits, j, early)
                rows = torch.tensor([i for i, _, _ in mask_rows], dtype=torch.long)
                self._mask_plan = (rows.to(dev), bits.to(dev))
        if self.procs is not None:
            self.procs.do_processing = (self.others or self._bias_plan is not None
                                        or self._mask_plan is not None or self.picker.active)

    def _stage_captured(self, bias_rows: list[tuple[int, RowRules, bool]],
                        mask_rows: list[tuple[int, RowRules, bool]]) -> None:
        if not bias_rows and not mask_rows and not self._held_bias and not self._held_mask:
            return
        want = {i: rr for i, rr, _ in bias_rows}
        changed: list[int] = []
        for i in [i for i, rr in self._held_bias.items() if want.get(i) is not rr]:
            self._host_idx[i].zero_()
            self._host_val[i].zero_()
            del self._held_bias[i]
            changed.append(i)
        for i, rr in want.items():
            if self._held_bias.get(i) is not rr:
                assert rr.bias is not None
                t, b = rr.bias
                self._host_idx[i].zero_()
                self._host_val[i].zero_()
                self._host_idx[i, : len(t)] = t
                self._host_val[i, : len(b)] = b
                self._held_bias[i] = rr
                changed.append(i)
        if changed:
            lo, hi = min(changed), max(changed) + 1
            self._idx[lo:hi].copy_(self._host_idx[lo:hi])
            self._val[lo:hi].copy_(self._host_val[lo:hi])
        now = {i for i, _, _ in mask_rows}
        touched = list(now)
        for i in self._held_mask - now:
            self._host_bits[i].fill_(-1)
            touched.append(i)
        for i, rr, early in mask_rows:
            rr.fill(self._host_bits, i, early)
        self._held_mask = now
        if touched:
            lo, hi = min(touched), max(touched) + 1
            self._bits[lo:hi].copy_(self._host_bits[lo:hi])
