from __future__ import annotations

from sclsd.tokenizer import ByteTokenizer, Detokenizer, HFTokenizer, decode_many, load


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


def test_the_byte_tokenizer_decodes_ids_past_a_byte_as_their_low_byte() -> None:
    tok = ByteTokenizer()
    assert tok.decode([104, 105]) == "hi"
    assert tok.decode([104 + 256, 105 + 512]) == "hi"  # a fake vocabulary larger than 256
    assert tok.decode([0xE2, 0x9C]) == "\ufffd"  # an unfinished character


def test_decode_many_gives_what_decoding_each_gives() -> None:
    """The streamed windows of a message go to the tokenizer in one batch call: the same
    texts as one call each, special tokens kept or skipped per sequence."""
    tok = load("smollm2-135m-instruct")
    assert isinstance(tok, HFTokenizer)
    seqs = [tok.encode(t) for t in ("Hello there", " wörld ✓", "", "a\n\nb")]
    im_end = tok.tok.convert_tokens_to_ids("<|im_end|>")
    seqs.append(seqs[0] + [im_end] + seqs[1])
    for keep in ([False] * 5, [True] * 5, [True, False, True, False, True]):
        want = [tok.decode(s, skip_special_tokens=not k) for s, k in zip(seqs, keep, strict=True)]
        assert decode_many(tok, seqs, keep) == want
    assert "<|im_end|>" in decode_many(tok, seqs, [True] * 5)[4]
    assert "<|im_end|>" not in decode_many(tok, seqs, [False] * 5)[4]
    byte = ByteTokenizer()
    assert decode_many(byte, [[104, 105], [0xC3, 0xA9]], [False, True]) == ["hi", "é"]
