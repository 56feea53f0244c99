"""The per-row constraints every engine applies (worker/engines/constraints.py): each rule, and
its forms (dense tensors for static batches, sparse host tensors for continuous batching, one
token at a time for the model-less engine) agreeing with each other."""

from __future__ import annotations

import ctypes
import random
from typing import Any

import pytest

from sclsd import protocol as P
from worker.engines.constraints import (
    BAN,
    FORCE,
    DenseConstraints,
    RowConstraints,
    bitmask_addend,
    constrained,
    constraints_key,
    first_allowed,
    grammar_row,
    stop_ids,
    words,
)

torch = pytest.importorskip("torch")

EOS = 2
VOCAB = 40
LO = 3  # the model-less engine's first ordinary id


def req(generated: int = 0, **kw: Any) -> P.BatchRequest:
    ctx = [5, 6, 7] + [8] * generated
    return P.BatchRequest(rid="r", token_ids=ctx, max_new_tokens=16, generated=generated, **kw)


def bits_of(allowed: set[int], vocab: int = VOCAB) -> Any:
    """int32 ``[words]`` bitmask allowing exactly ``allowed``."""
    out = torch.zeros(words(vocab), dtype=torch.int32)
    as_bytes = out.view(torch.uint8)
    for t in allowed:
        as_bytes[t >> 3] |= 1 << (t & 7)
    return out


def allowed_of(bits: Any, vocab: int = VOCAB) -> set[int]:
    return {t for t in range(vocab) if int(bits.view(torch.uint8)[t >> 3]) >> (t & 7) & 1}


class StubMatcher:
    """A grammar matcher that allows a fixed set of tokens (llguidance's mask call only)."""

    def __init__(self, allowed: set[int]) -> None:
        self.mask = bits_of(allowed)

    def unsafe_compute_mask_ptr(self, ptr: int, size: int) -> None:
        ctypes.memmove(ptr, self.mask.data_ptr(), size)


# ---------------------------------------------------------------------- the rules


def test_stop_ids_are_eos_unless_ignored_then_the_rows_own_once_each() -> None:
    assert stop_ids(req(stop_token_ids=[9, 2, 9]), [2, 0]) == (2, 0, 9)
    assert stop_ids(req(stop_token_ids=[9], ignore_eos=True), [2]) == (9,)
    c = RowConstraints.for_row(req(stop_token_ids=[9]), [EOS], VOCAB)
    assert c.ends(EOS) and c.ends(9) and not c.ends(10)


def test_min_tokens_holds_the_stops_in_the_vocabulary_until_the_request_has_that_many() -> None:
    c = RowConstraints.for_row(req(generated=1, min_tokens=3, stop_token_ids=[9, 10**6]), [EOS], VOCAB)
    assert c.held == (EOS, 9) and c.stops == (EOS, 9, 10**6)
    assert [c.early(g) for g in range(1, 5)] == [True, True, False, False]  # tokens 2 and 3 held
    # Reached before this row, or nothing to hold: no rule at all.
    assert RowConstraints.for_row(req(generated=3, min_tokens=3), [EOS], VOCAB).held == ()
    assert not RowConstraints.for_row(req(min_tokens=3, ignore_eos=True), [EOS], VOCAB).early(0)


def test_logit_bias_keeps_the_vocabulary_sorted_by_token() -> None:
    c = RowConstraints.for_row(req(logit_bias={30: 1.0, 4: -2.5, VOCAB: 9.0, -1: 3.0}), [EOS], VOCAB)
    assert c.bias == ((4, -2.5), (30, 1.0))


def test_what_a_resumed_request_must_share() -> None:
    assert not constrained(req()) and constrained(req(min_tokens=1)) and constrained(req(logit_bias={4: 1.0}))
    assert not constrained(req(generated=2, min_tokens=2))
    assert constraints_key(req(logit_bias={5: 1.0, 4: 2.0})) == constraints_key(req(logit_bias={4: 2.0, 5: 1.0}))
    assert constraints_key(req(min_tokens=2)) != constraints_key(req(min_tokens=3))


# ---------------------------------------------------------------------- the list form


def test_the_list_form_forces_bans_and_holds_the_stops() -> None:
    c = RowConstraints.for_row(req(logit_bias={20: FORCE, 12: FORCE}), [EOS], VOCAB)
    assert c.choose(7, 0, LO, VOCAB) == 12  # the smallest forced token
    c = RowConstraints.for_row(req(logit_bias={7: BAN, 8: BAN, 9: -5.0}), [EOS], VOCAB)
    assert c.choose(7, 0, LO, VOCAB) == 9 and c.choose(5, 0, LO, VOCAB) == 5  # small biases do not act
    c = RowConstraints.for_row(req(min_tokens=2, stop_token_ids=[VOCAB - 1]), [EOS], VOCAB)
    assert c.choose(VOCAB - 1, 1, LO, VOCAB) == LO  # the id after it, cyclically
    assert c.choose(VOCAB - 1, 2, LO, VOCAB) == VOCAB - 1


def test_first_allowed_scans_cyclically_from_the_proposal() -> None:
    bits = (1 << 5) | (1 << 30)
    assert first_allowed(bits, 5, LO, VOCAB) == 5
    assert first_allowed(bits, 6, LO, VOCAB) == 30
    assert first_allowed(bits, 31, LO, VOCAB) == 5
    assert first_allowed(1 << EOS, 6, LO, VOCAB) is None  # nothing ordinary allowed


def _ramp(proposal: int) -> Any:
    """Logits of a model that prefers ``proposal``, then the ids after it (cyclically over the
    ordinary ids), each less; special ids least. All within (0, 40): a ±100 bias dominates."""
    x = torch.zeros(VOCAB)
    span = VOCAB - LO
    for k in range(span):
        x[LO + (proposal - LO + k) % span] = float(span - k)
    return x


def test_the_list_form_picks_what_the_tensor_form_argmax_picks() -> None:
    """For a model whose preference after its proposal goes up the ids, the model-less pick is
    the dense tensor form's greedy pick (at most one forced token, no stop next to a held one
    or a banned one, no held stop forced: where the list form's one-step shift is defined to agree)."""
    rng = random.Random(5)
    checked = 0
    for _ in range(400):
        stops = rng.sample(range(LO, VOCAB), rng.randrange(0, 3))
        bias = {t: BAN for t in rng.sample(range(LO, VOCAB), rng.randrange(0, 4))}
        if rng.random() < 0.3:
            bias[rng.randrange(LO, VOCAB)] = FORCE
        r = req(generated=rng.randrange(0, 3), min_tokens=rng.randrange(0, 6), stop_token_ids=stops,
                logit_bias=bias)
        c = RowConstraints.for_row(r, [EOS], VOCAB)
        held = {t for t in c.held if t >= LO}
        nxt = {LO + (t + 1 - LO) % (VOCAB - LO) for t in held}
        if nxt & (held | {t for t, b in bias.items() if b <= BAN}) or held & {t for t, b in bias.items() if b >= FORCE}:
            continue
        dense = DenseConstraints([c], VOCAB, "cpu")
        for step in range(4):
            g = r.generated + step
            proposal = rng.randrange(LO, VOCAB)
            picked = int(dense.apply(_ramp(proposal).unsqueeze(0), step).argmax())
            assert picked == c.choose(proposal, g, LO, VOCAB), (r, g, proposal)
            checked += 1
    assert checked > 500


# ---------------------------------------------------------------------- the tensor forms


def test_the_bitmask_addend_is_the_bitmask_unpacked() -> None:
    rng = random.Random(0)
    rows = [set(rng.sample(range(VOCAB), rng.randrange(0, VOCAB))) for _ in range(5)]
    bits = torch.stack([bits_of(a) for a in rows])
    add = bitmask_addend(bits, VOCAB)
    assert add.shape == (5, VOCAB)
    for i, a in enumerate(rows):
        assert {t for t in range(VOCAB) if add[i, t] == 0.0} == a
        assert all(add[i, t] == float("-inf") for t in range(VOCAB) if t not in a)


def test_stop_bits_allow_all_but_the_held_stops() -> None:
    c = RowConstraints.for_row(req(min_tokens=2, stop_token_ids=[33]), [EOS], VOCAB)
    assert allowed_of(c.stop_bits(VOCAB)) == set(range(VOCAB)) - {EOS, 33}
    assert RowConstraints.for_row(req(), [EOS], VOCAB).stop_bits(VOCAB) is None


def _sparse(c: RowConstraints, x: Any, g: int) -> Any:
    """Row logits ``x`` under the continuous engine's per-row form: biases (and held stops)
    scatter-added."""
    e = c.bias_entries(early=c.early(g))
    if e is None:
        return x
    return x.clone().index_put_((e[0],), e[1], accumulate=True)


def test_the_dense_and_the_sparse_tensor_forms_agree() -> None:
    rng = random.Random(3)
    for _ in range(50):
        rows = []
        for _ in range(rng.randrange(1, 5)):
            bias = {rng.randrange(-2, VOCAB + 2): rng.uniform(-5, 5) for _ in range(rng.randrange(0, 4))}
            rows.append(req(generated=rng.randrange(0, 3), min_tokens=rng.randrange(0, 6),
                            stop_token_ids=rng.sample(range(VOCAB), rng.randrange(0, 3)),
                            ignore_eos=rng.random() < 0.3, logit_bias=bias))
        cs = [RowConstraints.for_row(r, [EOS], VOCAB) for r in rows]
        dense = DenseConstraints(cs, VOCAB, "cpu")
        for step in range(6):
            x = torch.randn(len(rows), VOCAB)
            got = dense.apply(x, step)
            for i, (r, c) in enumerate(zip(rows, cs, strict=True)):
                assert torch.equal(got[i], _sparse(c, x[i], r.generated + step))
                held = {t for t in range(VOCAB) if got[i, t] == float("-inf")}
                assert held == (set(c.held) if c.early(r.generated + step) else set())


# ---------------------------------------------------------------------- grammars


def test_a_grammar_loses_the_held_stops_unless_only_they_are_left() -> None:
    c = RowConstraints.for_row(req(min_tokens=3, stop_token_ids=[9]), [EOS], VOCAB)
    stop = c.stop_bits(VOCAB)
    out = torch.empty(words(VOCAB), dtype=torch.int32)
    grammar_row(out, StubMatcher({EOS, 9, 11}), stop, early=True)
    assert allowed_of(out) == {11}
    grammar_row(out, StubMatcher({EOS, 9, 11}), stop, early=False)
    assert allowed_of(out) == {EOS, 9, 11}
    grammar_row(out, StubMatcher({EOS}), stop, early=True)  # the grammar wins
    assert allowed_of(out) == {EOS}
    grammar_row(out, None, stop, early=True)  # no grammar: the held stops alone
    assert allowed_of(out) == set(range(VOCAB)) - {EOS, 9}


def test_the_dense_form_masks_grammar_rows_by_the_same_rule() -> None:
    rows = [req(min_tokens=2), req(min_tokens=2), req(logit_bias={4: 1.5})]
    cs = [RowConstraints.for_row(r, [EOS], VOCAB) for r in rows]
    dense = DenseConstraints(cs, VOCAB, "cpu", {0: StubMatcher({EOS, 5}), 2: StubMatcher({4, 6})})
    x = torch.randn(3, VOCAB)
    first = dense.apply(x, 0)
    finite = [{t for t in range(VOCAB) if first[i, t] > float("-inf")} for i in range(3)]
    assert finite == [{5}, set(range(VOCAB)) - {EOS}, {4, 6}]
    assert first[2, 4] == x[2, 4] + 1.5 and torch.equal(first[1, 5:], x[1, 5:])
    dense.matchers[0] = StubMatcher({EOS})  # only the stop is left: the grammar wins
    assert {t for t in range(VOCAB) if dense.apply(x, 1)[0, t] > float("-inf")} == {EOS}
    assert {t for t in range(VOCAB) if dense.apply(x, 2)[1, t] > float("-inf")} == set(range(VOCAB))


def test_the_static_sampler_lets_a_grammar_win_over_min_tokens() -> None:
    """hf's sampler applies the dense form: a grammar row that may only stop stops, even
    before ``min_tokens`` (as hf-cb does); a plain row's stops stay held."""
    from types import SimpleNamespace

    from worker.engines.sampling import BatchSampler

    rows = [req(min_tokens=3, temperature=0.0), req(min_tokens=3, temperature=0.0)]
    grammar = SimpleNamespace(matchers={0: StubMatcher({EOS})})
    s = BatchSampler(rows, [1, 1], VOCAB, "cpu", steps=2, eos=[EOS], grammar=grammar)
    logits = torch.zeros(2, VOCAB)
    logits[:, EOS] = 5.0
    tokens, _ = s.sample(logits).start().result(s)
    assert tokens[0] == EOS and tokens[1] != EOS
