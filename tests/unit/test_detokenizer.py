from __future__ import annotations

from sclsd.tokenizer import ByteTokenizer, Detokenizer


def feed(d: Detokenizer, tok: ByteTokenizer, all_ids: list[int], chunks: list[int]) -> list[str]:
    out, i = [], 0
    for n in chunks:
        i += n
        out.append(d.apply(tok.decode(all_ids[:i]), final=i == len(all_ids)))
    return out


def test_incremental_text_concatenates_to_full_text_across_multibyte_splits() -> None:
    tok = ByteTokenizer()
    text = "héllo wörld ✓ done"
    ids = tok.encode(text)
    d = Detokenizer()
    parts = feed(d, tok, ids, [1, 2, 1, 3, 1, 5, len(ids) - 13])
    assert "".join(parts) == text == d.text
    assert all("\ufffd" not in p for p in parts)


def test_stop_string_spanning_two_slices_cuts_text() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("answer: 42\n\nmore text")
    d = Detokenizer(stop=["\n\n"])
    parts = feed(d, tok, ids, [10, 1, 5, len(ids) - 16])
    assert d.stopped and d.text == "answer: 42"
    assert "".join(parts) == "answer: 42"
