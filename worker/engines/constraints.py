"""What a row may emit at each step: the per-row generation constraints of every engine.

A batch row (:class:`~sclsd.protocol.BatchRequest`) constrains its tokens by four rules,
defined here once (:class:`RowConstraints`) and applied by every engine through one of
the forms below, so that a rule changed here changes ``hf``, ``hf-cb`` and ``fake`` alike:

* **stop tokens** (:func:`stop_ids`): EOS unless ``ignore_eos``, then the row's
  ``stop_token_ids``. Emitting one ends the row (:meth:`RowConstraints.ends`).
* **min_tokens**: while the row, counted over the whole request (position ``g`` of the
  next token, its ``generated`` included), has fewer than ``min_tokens`` tokens, its stop
  tokens inside the vocabulary are held back (:meth:`RowConstraints.early`).
* **logit_bias**: added to the row's logits; ids outside the vocabulary are ignored.
* **grammar**: only the tokens the row's llguidance matcher allows
  (:mod:`worker.engines.grammar`). While ``min_tokens`` holds, the stop tokens are taken
  out of the grammar's mask too, unless nothing else would be left: the grammar wins,
  the output must follow it (:func:`grammar_row`).

The forms:

* a batch of rows as dense ``[rows, vocab]`` tensors, for static batches
  (:class:`DenseConstraints`, used by :class:`~worker.engines.sampling.BatchSampler`);
* one row as host tensors the continuous engine scatters per step, batched over the
  step's rows there (:meth:`RowConstraints.bias_entries`, :meth:`RowConstraints.stop_bits`,
  :func:`grammar_row`, :func:`bitmask_addend`; :mod:`worker.engines.cb_constraints`);
* one token at a time without a model, for the ``fake`` engine
  (:meth:`RowConstraints.choose`, :func:`first_allowed`). It has no logits: of a bias only
  the extremes act (:data:`FORCE` forces a token, :data:`BAN` bans it), as they dominate
  any model's logits.

Bitmasks are llguidance's: int32 words, token ``t`` is bit ``t & 31`` of word ``t >> 5``
(little-endian: byte ``t >> 3``, bit ``t & 7``); a set bit allows the token.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any

from sclsd.protocol import BatchRequest

__all__ = ["BAN", "FORCE", "DenseConstraints", "RowConstraints", "bitmask_addend", "byte_table", "constrained",
           "constraints_key", "first_allowed", "grammar_row", "stop_ids", "words"]

#: The list form's reading of ``logit_bias``: at or above this a token is forced...
FORCE = 100.0
#: ...at or below this it is banned (in logits, ±100 outweighs any model's preference).
BAN = -100.0


def stop_ids(r: BatchRequest, eos: Iterable[int]) -> tuple[int, ...]:
    """The tokens that end row ``r``: EOS (unless ``ignore_eos``), then its ``stop_token_ids``."""
    return tuple(dict.fromkeys([*([] if r.ignore_eos else eos), *r.stop_token_ids]))


def constrained(r: BatchRequest) -> bool:
    """Whether row ``r`` asks for any rule beyond ending at its stop tokens."""
    return bool(r.grammar or r.logit_bias or r.min_tokens > r.generated)


def constraints_key(r: BatchRequest) -> tuple[Any, ...]:
    """What a resumed request must share with the row resuming it for its rules to hold."""
    return (r.min_tokens, tuple(sorted(r.logit_bias.items())), r.grammar)


def words(vocab: int) -> int:
    """int32 words of a bitmask over ``vocab`` tokens."""
    return (vocab + 31) // 32


class RowConstraints:
    """One row's rules (module docstring), from its :class:`BatchRequest`."""

    __slots__ = ("offset", "min_tokens", "stops", "held", "bias", "grammar", "_ends", "_bias_map")

    def __init__(self, offset: int, min_tokens: int, stops: tuple[int, ...], held: tuple[int, ...],
                 bias: tuple[tuple[int, float], ...], grammar: str | None) -> None:
        self.offset = offset
        """Tokens the request generated before this row (its ``generated``)."""
        self.min_tokens = min_tokens
        self.stops = stops
        """The tokens that end the row (:func:`stop_ids`)."""
        self.held = held
        """The stop tokens inside the vocabulary, held back while ``min_tokens`` is not
        reached; empty when the row reached it before this row, or has none."""
        self.bias = bias
        """``logit_bias`` inside the vocabulary: (token, bias), by token."""
        self.grammar = grammar
        self._ends = frozenset(stops)
        self._bias_map = dict(bias)

    @classmethod
    def of(cls, r: BatchRequest, stops: Sequence[int], vocab: int) -> RowConstraints:
        """Row ``r``'s rules; ``stops``: the tokens that end it (:func:`stop_ids`)."""
        held = tuple(t for t in stops if 0 <= t < vocab) if r.min_tokens > r.generated else ()
        bias = tuple(sorted((t, float(b)) for t, b in r.logit_bias.items() if 0 <= t < vocab))
        return cls(r.generated, r.min_tokens, tuple(stops), held, bias, r.grammar)

    @classmethod
    def for_row(cls, r: BatchRequest, eos: Iterable[int], vocab: int) -> RowConstraints:
        """Row ``r``'s rules, its stop tokens those of :func:`stop_ids` with ``eos``."""
        return cls.of(r, stop_ids(r, eos), vocab)

    def early(self, g: int) -> bool:
        """Whether the stop tokens are held back for the request's token ``g`` (0-based,
        counted over the whole request)."""
        return g < self.min_tokens and bool(self.held)

    def ends(self, token: int) -> bool:
        """Whether ``token`` ends the row."""
        return token in self._ends

    # ------------------------------------------------------------------ list form (no model)

    def choose(self, token: int, g: int, lo: int, hi: int) -> int:
        """The token a model-less engine emits at position ``g`` where it would emit ``token``
        (of the ordinary ids ``[lo, hi)``): a forced token (the smallest), else the first
        id from ``token`` on (cyclically) not banned; then, while the stop tokens are held
        back, the id after a stop token instead. The grammar is the caller's (it wins over
        these: :func:`first_allowed`)."""
        if self._bias_map:
            token = self._biased(token, lo, hi)
        if g < self.min_tokens and token in self.held:
            token = lo + (token + 1 - lo) % (hi - lo)
        return token

    def _biased(self, token: int, lo: int, hi: int) -> int:
        bias = self._bias_map
        forced = [t for t, b in self.bias if b >= FORCE and lo <= t < hi]
        if forced:
            return forced[0]
        span = hi - lo
        for k in range(span):
            cand = lo + (token - lo + k) % span
            if bias.get(cand, 0.0) > BAN:
                return cand
        return token

    # ------------------------------------------------------------------ tensor form (host tensors)

    def bias_entries(self, early: bool = False) -> tuple[Any, Any] | None:
        """(token ids long, additions fp32) to scatter-add into the row's logits: its biases,
        with ``early`` its held stop tokens at -inf after them; None when there is nothing."""
        import torch

        pairs = [*self.bias, *((t, float("-inf")) for t in self.held)] if early else list(self.bias)
        if not pairs:
            return None
        return (torch.tensor([t for t, _ in pairs], dtype=torch.long),
                torch.tensor([b for _, b in pairs], dtype=torch.float32))

    def stop_bits(self, vocab: int) -> Any:
        """int32 ``[words]`` bitmask on the host allowing every token but the held stop
        tokens, or None when none are held."""
        import torch

        if not self.held:
            return None
        bits = torch.full((words(vocab),), -1, dtype=torch.int32)
        as_bytes = bits.view(torch.uint8)
        for t in self.held:
            as_bytes[t >> 3] &= ~(1 << (t & 7)) & 0xFF
        return bits


def first_allowed(bits: int, token: int, lo: int, hi: int) -> int | None:
    """List form of a grammar's mask: ``token`` if the bitmask ``bits`` (an int, bit ``t``
    for token ``t``) allows it, else the next id of ``[lo, hi)`` (cyclically) it allows,
    else None."""
    if bits >> token & 1:
        return token
    span = hi - lo
    for k in range(1, span):
        cand = lo + (token - lo + k) % span
        if bits >> cand & 1:
            return cand
    return None


def grammar_row(out: Any, matcher: Any, stop_bits: Any, early: bool) -> None:
    """Row ``out`` (int32 ``[words]``, contiguous, on the host) of a step's bitmask: the
    tokens allowed next, ``matcher``'s (when it has one) less the held stop tokens while
    ``early`` unless that leaves none (the grammar wins); without a matcher, ``stop_bits``."""
    if matcher is None:
        out.copy_(stop_bits)
        return
    matcher.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * out.element_size())
    if early and stop_bits is not None:
        kept = out & stop_bits
        if bool(kept.any()):
            out.copy_(kept)


@functools.cache
def byte_table(device: Any) -> Any:
    """``[256, 8]`` fp32 on ``device``: each byte's 8 bits, low first, as 0 (set) or -inf
    (made once per device; an engine that captures graphs makes it before capturing)."""
    import torch

    allowed = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
    return torch.where(allowed.bool(), 0.0, float("-inf")).to(device)


def bitmask_addend(bits: Any, vocab: int, table: Any = None) -> Any:
    """``[rows, vocab]`` fp32 on ``bits``' device: 0 where an int32 ``[rows, words]`` bitmask
    allows the token, -inf elsewhere. Each byte is looked up in a table (:func:`byte_table`):
    no host sync, and several times faster on a CPU than unpacking bits into a boolean mask."""
    import torch

    if table is None:
        table = byte_table(bits.device)
    b = bits.view(torch.uint8).flatten().long()
    return table.index_select(0, b).view(bits.size(0), -1)[:, :vocab]


class DenseConstraints:
    """The rules of a static batch's rows as dense ``[rows, vocab]`` tensors on the device,
    applied to a step's logits with a fixed number of tensor operations (grammar rows add
    their host bitmask, one copy per step).

    ``matchers``: row index -> its grammar's matcher (:class:`~worker.engines.grammar.BatchGrammar`),
    for the rows that have one; they must be fed each step's tokens by the caller.
    """

    def __init__(self, rows: Sequence[RowConstraints], vocab: int, device: Any,
                 matchers: dict[int, Any] | None = None) -> None:
        import torch

        n = len(rows)
        self.vocab = vocab
        self.device = device
        self.matchers = dict(matchers or {})
        f32: dict[str, Any] = dict(dtype=torch.float32, device=device)
        self.bias: Any = None
        if any(c.bias for c in rows):
            self.bias = torch.zeros((n, vocab), **f32)
            for i, c in enumerate(rows):
                if c.bias:
                    self.bias[i, torch.tensor([t for t, _ in c.bias], device=device)] = torch.tensor(
                        [b for _, b in c.bias], **f32)
        # min_tokens: steps left with the stop tokens held, per row (counted from this batch's first).
        self.min_left = [max(0, c.min_tokens - c.offset) if c.held else 0 for c in rows]
        self.until = max(self.min_left, default=0)
        self.stop_mask: Any = None
        plain = [i for i in range(n) if self.min_left[i] and i not in self.matchers]
        if plain:  # grammar rows fold their held stops into their bitmask (grammar_row)
            self.stop_mask = torch.zeros((n, vocab), dtype=torch.bool, device=device)
            for i in plain:
                self.stop_mask[i, torch.tensor(rows[i].held, device=device)] = True
            self.min_left_t = torch.tensor(self.min_left, dtype=torch.long, device=device)
        self.grammar_rows: Any = None
        self._order = sorted(self.matchers)
        if self._order:
            self.grammar_rows = torch.tensor(self._order, dtype=torch.long, device=device)
            self._stop_bits = [rows[i].stop_bits(vocab) for i in self._order]
            pin = torch.device(device).type == "cuda"  # read each step before the next fill
            self._bits = torch.empty((len(self._order), words(vocab)), dtype=torch.int32, pin_memory=pin)

    def apply(self, x: Any, step: int) -> Any:
        """``[rows, vocab]`` fp32 logits of the batch's token ``step`` (0: the first of this
        batch) with every row's rules applied; a new tensor where anything applies."""
        if self.bias is not None:
            x = x + self.bias
        if self.stop_mask is not None and step < self.until:
            early = (self.min_left_t > step).unsqueeze(1)
            x = x.masked_fill(self.stop_mask & early, float("-inf"))
        if self.grammar_rows is not None:
            for j, i in enumerate(self._order):
                grammar_row(self._bits[j], self.matchers[i], self._stop_bits[j], step < self.min_left[i])
            bits = self._bits.to(x.device, non_blocking=True)
            x = x.index_add(0, self.grammar_rows, bitmask_addend(bits, self.vocab))
        return x
