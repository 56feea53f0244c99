"""Structured output: rows whose tokens must follow a grammar (a JSON schema, any JSON
object, a regular expression, a Lark grammar), enforced as a token mask in the sampler.

A batch row carries its grammar as llguidance's grammar text (``BatchRequest.grammar``,
made by the daemon from the request's ``response_format``). The engine builds one
llguidance matcher per such row and replays the tokens the row generated in earlier
slices (the ``generated`` tail of its context), so the grammar's state travels with the
request as token ids, like everything else, and a request that moves to another worker
resumes there exactly. Before each draw the matcher says which tokens may come next (a
bitmask over the vocabulary, applied to the row's logits on the device); after it, the
chosen token is consumed. EOS is allowed only where the grammar may end; once the
grammar is complete only EOS is.

llguidance (Rust, no other dependency) compiles a schema in milliseconds and computes a
mask in microseconds per row; the host must know a row's last token before it can mask
the next one, so batches with grammar rows read each step's tokens before queuing the
next step.

A row's matcher is built within the limits its row carries (``BatchRequest.grammar_limits``,
the daemon's ``[grammar]``). A grammar that cannot be built (invalid, past a limit, or one
that makes llguidance panic) raises :class:`GrammarError` naming the row: the engine fails
that row alone (``RequestOutput.error``) and serves the rest of its batch.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

import msgspec

from sclsd.protocol import BatchRequest, RequestOutput

log = logging.getLogger(__name__)

__all__ = ["BatchGrammar", "GrammarError", "batch_grammar", "byte_grammar_tokenizer", "grammar_for",
           "grammar_tokenizer", "row_error", "row_matcher", "supported"]


class GrammarError(ValueError):
    """Row ``rid``'s grammar matcher could not be built; the request fails, not the batch."""

    def __init__(self, rid: str, message: str) -> None:
        super().__init__(message)
        self.rid = rid


def row_error(exc: GrammarError) -> RequestOutput:
    """The output that ends the row ``exc`` names with its error (no tokens)."""
    return RequestOutput(rid=exc.rid, token_ids=[], error=str(exc))


@functools.cache
def supported() -> bool:
    """Whether llguidance is installed (the ``worker`` extra installs it). Not
    ``llguidance.torch``: nothing here uses it (the masks are applied by
    :mod:`.constraints`), and its ``torch.compile`` at import pulls in torch's inductor,
    10 s of a worker's start on an idle CPU and a minute on a busy one."""
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def grammar_tokenizer(spec: Any, vocab: int, eos: tuple[int, ...]) -> Any:
    """llguidance's view of the tokenizer of model ``spec`` (built once per process, on the
    first grammar row: about a second)."""
    import llguidance.hf

    from sclsd import models

    return llguidance.hf.from_tokenizer(models.load_tokenizer(spec), n_vocab=vocab, eos_token=list(eos) or None)


def batch_grammar(reqs: Sequence[BatchRequest], spec: Any, vocab: int, eos: Sequence[int],
                  device: Any) -> BatchGrammar | None:
    """The batch's grammars, or None when no row has one."""
    if not any(r.grammar for r in reqs):
        return None
    return BatchGrammar(reqs, grammar_for(spec, vocab, eos), vocab, device)


def grammar_for(spec: Any, vocab: int, eos: Sequence[int]) -> Any:
    """llguidance's tokenizer for model ``spec`` (:func:`grammar_tokenizer`); a ValueError
    that says why when llguidance is not installed."""
    if not supported():
        raise ValueError("structured output needs llguidance (pip install 'sclsd[worker]')")
    return grammar_tokenizer(spec, vocab, tuple(eos))


def row_matcher(r: BatchRequest, tokenizer: Any) -> Any:
    """A matcher for ``r``'s grammar in the state after the tokens ``r`` generated in earlier
    slices (the ``generated`` tail of its context, replayed), built within ``r``'s limits;
    :class:`GrammarError` if the grammar is not valid, passes a limit, makes llguidance fail
    in any way (a Rust panic included), or those tokens do not follow it."""
    import llguidance

    assert r.grammar is not None
    try:
        lim = r.grammar_limits
        limits = None if lim is None else llguidance.LLParserLimits(**msgspec.structs.asdict(lim))
        m = llguidance.LLMatcher(tokenizer, r.grammar, limits=limits)
        error = m.get_error() if m.is_error() else None
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - pyo3's PanicException is a BaseException
        error = f"{type(exc).__name__}: {exc}"
    if error is not None:
        raise GrammarError(r.rid, f"request {r.rid!r}: its grammar could not be built: {_first_line(error)}")
    tail = r.token_ids[len(r.token_ids) - r.generated:] if r.generated else []
    if tail and not m.consume_tokens(tail):
        raise GrammarError(r.rid, f"request {r.rid!r}: its earlier tokens do not follow its grammar "
                                  f"({_first_line(m.get_error())})")
    return m


def _first_line(text: str) -> str:
    """An llguidance error's first line (a panic's backtrace follows it), at most 500 characters."""
    return (text.strip().splitlines() or ["unknown error"])[0][:500]


class _ByteVocab:
    """The ``fake`` model's vocabulary for llguidance: id ``i`` is the byte ``i % 256``, ids
    below ``first`` are special (EOS among them)."""

    def __init__(self, vocab: int, eos: int, first: int) -> None:
        self.eos_token_id = eos
        self.bos_token_id = None
        self.tokens = [b"<|special %d|>" % i if i < first else bytes([i % 256]) for i in range(vocab)]
        self.special_token_ids = list(range(first))

    def __call__(self, s: bytes | str) -> list[int]:
        return list(s if isinstance(s, bytes) else s.encode())


@functools.cache
def byte_grammar_tokenizer(vocab: int, eos: int, first: int) -> Any:
    """llguidance's tokenizer for the ``fake`` model's byte vocabulary (:class:`_ByteVocab`)."""
    import llguidance

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocab(vocab, eos, first)), n_vocab=vocab)


class BatchGrammar:
    """The matchers of a batch's grammar rows (module docstring); their masks are applied by
    :class:`worker.engines.constraints.DenseConstraints`."""

    def __init__(self, reqs: Sequence[BatchRequest], tokenizer: Any, vocab: int, device: Any) -> None:
        self.rows = [i for i, r in enumerate(reqs) if r.grammar]
        self.matchers: dict[int, Any] = {i: row_matcher(reqs[i], tokenizer) for i in self.rows}
        self.device = device

    @classmethod
    def of(cls, matchers: dict[int, Any], device: Any) -> BatchGrammar:
        """The grammars of a batch whose rows' matchers exist already (row index -> matcher):
        a continuous engine keeps each row's matcher while the rows around it change."""
        self = cls.__new__(cls)
        self.rows = sorted(matchers)
        self.matchers = dict(matchers)
        self.device = device
        return self

    def advance(self, tokens: Sequence[int], done: Sequence[bool]) -> None:
        """Consume each unfinished grammar row's new token."""
        for i, m in self.matchers.items():
            if not done[i] and not m.is_stopped():
                if not m.consume_token(tokens[i]):
                    log.warning("row %d: token %d refused by its grammar (%s)", i, tokens[i], m.get_error())
