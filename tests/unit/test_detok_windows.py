"""Incremental detokenizing by windows: the text comes out as the whole output decodes, at
a cost per call that does not grow with the output (each call decodes a few tokens)."""

from __future__ import annotations

import random

import pytest

from sclsd.tokenizer import Detokenizer, load

TEXT = ("Le café coûtait 3,50 € — très cher! 東京は大きい都市です。 Emoji 👍🏽 and ✓ done.\n"
        "  Indented   spaces, tabs\tand a URL https://example.org/a?b=c.\n") * 6


@pytest.fixture(scope="module", params=["smollm2-135m-instruct", "tiny-random"])
def tok(request):  # noqa: ANN001, ANN201 - a fixture
    return load(request.param)


def _feed(d: Detokenizer, tok, ids: list[int], sizes: list[int]) -> tuple[list[str], int]:  # noqa: ANN001
    """Feed ``ids`` in chunks of ``sizes`` as the daemon does; the texts and the longest window."""
    out, i, longest = [], 0, 0
    for n in sizes:
        i = min(len(ids), i + n)
        win, pre, snap = d.window(ids[:i])
        longest = max(longest, len(win))
        out.append(d.apply_window(snap, tok.decode(win), tok.decode(pre), final=i == len(ids)))
        if i == len(ids):
            break
    return out, longest


def test_windows_give_the_whole_outputs_text(tok) -> None:  # noqa: ANN001
    ids = tok.encode(TEXT)
    rng = random.Random(3)
    for _ in range(5):
        sizes = [rng.choice((1, 1, 2, 3, 7)) for _ in range(len(ids))]
        d = Detokenizer()
        parts, longest = _feed(d, tok, ids, sizes)
        assert "".join(parts) == d.text == tok.decode(ids)
        assert all("\ufffd" not in p for p in parts)
        assert longest <= 32  # a window is a few chunks, never the output so far


def test_a_long_output_costs_the_same_per_call(tok) -> None:  # noqa: ANN001
    ids = tok.encode(TEXT * 5)  # thousands of tokens
    d = Detokenizer()
    parts, longest = _feed(d, tok, ids, [2] * len(ids))
    assert "".join(parts) == tok.decode(ids)
    assert len(ids) > 2000 and longest <= 32


def test_stop_strings_across_windows(tok) -> None:  # noqa: ANN001
    ids = tok.encode("answer: 42 is it.\n\nmore text after the stop")
    for size in (1, 2, 5):
        d = Detokenizer(stop=["\n\n"])
        parts, _ = _feed(d, tok, ids, [size] * len(ids))
        assert d.stopped and d.text == "answer: 42 is it." == "".join(parts)


def test_windows_in_flight_together_come_out_once(tok) -> None:  # noqa: ANN001
    # Two windows made before either is applied (two messages on their way to the pool).
    ids = tok.encode("first part, then the second part, then a third.")
    d = Detokenizer()
    a = d.window(ids[:5])
    b = d.window(ids[:11])
    c = d.window(ids)
    texts = [d.apply_window(s, tok.decode(w), tok.decode(p), final=s is c[2]) for w, p, s in (a, b, c)]
    assert "".join(texts) == tok.decode(ids) == d.text


def test_keep_stop_ends_the_text_after_the_stop_string_even_split_over_calls() -> None:
    for keep, want in ((False, "Hello wor"), (True, "Hello world")):
        d = Detokenizer(stop=["ld", "o w"][:1], keep_stop=keep)
        out = d.apply("Hello wor") + d.apply("Hello worl") + d.apply("Hello world and more")
        assert d.stopped and out == want == d.text
    # The earliest stop string wins, and only its own text is kept.
    d = Detokenizer(stop=["more", "and"], keep_stop=True)
    assert d.apply("Hello world and more", final=True) == "Hello world and"


def test_an_outputs_window_is_the_detokenizers_window_of_its_context() -> None:
    """``Output.window`` builds the window without copying the output, chunks still being
    detokenized included, wherever the window starts."""
    from sclsd.daemon.serving.output import Chunk, Output

    rng = random.Random(5)
    for _ in range(200):
        out = Output(Detokenizer())
        out.ids = [rng.randrange(1000) for _ in range(rng.randrange(0, 12))]
        out.inbound = [Chunk([rng.randrange(1000) for _ in range(rng.randrange(1, 5))], [])
                       for _ in range(rng.randrange(0, 4))]
        n = len(out.context())
        out.detok.r = rng.randrange(0, n + 1)
        out.detok.p = rng.randrange(0, out.detok.r + 1)
        assert out.window() == out.detok.window(out.context())
