"""The real default model: SmolLM2-135M-Instruct from the packaged GGUF, through ``hf``."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("gguf")

from sclsd import models  # noqa: E402
from sclsd.protocol import BatchMsg, BatchRequest  # noqa: E402

pytestmark = pytest.mark.slow

NEW = 8


@pytest.fixture(scope="module")
def engine():
    from worker.engines import create_engine

    return create_engine("hf", "default", threads=1)


@pytest.fixture(scope="module")
def tokenizer():
    return models.load_tokenizer("default")


def chat_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    if not isinstance(ids, list):  # a BatchEncoding in some transformers versions
        ids = ids["input_ids"]
    return list(ids)


def test_tokenizer_is_cached_and_shared(tokenizer):
    assert len(tokenizer) == models.SMOLLM2_VOCAB
    assert models.load_tokenizer("smollm2-135m-instruct") is tokenizer
    assert models.load_tokenizer("tiny-random") is tokenizer  # tiny-random shares it
    assert tokenizer.eos_token_id in models.eos_token_ids("default")


def test_torch_free_gguf_tokenizer_equals_transformers(tokenizer):
    """The daemon reads the GGUF tokenizer without torch: it must equal transformers' own."""
    from transformers import AutoTokenizer

    ms = models.resolve("default")
    ref = AutoTokenizer.from_pretrained(str(ms.path), gguf_file=ms.gguf_file, local_files_only=True)
    assert tokenizer.backend_tokenizer.to_str() == ref.backend_tokenizer.to_str()
    assert (tokenizer.all_special_ids, tokenizer.chat_template, tokenizer.eos_token_id) == (
        ref.all_special_ids, ref.chat_template, ref.eos_token_id)
    for text in ["Hello, world!", "héllo wörld 日本語 🤖\n\n\ttabs", "<|im_start|>user\nhi<|im_end|>", ""]:
        assert tokenizer.encode(text) == ref.encode(text)
        assert chat_ids(tokenizer, text) == chat_ids(ref, text)
    ids = list(range(0, models.SMOLLM2_VOCAB, 997))
    assert tokenizer.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)


def test_greedy_chat_reply(engine, tokenizer):
    info = engine.info()
    assert info.kv_bytes_per_token == 46_080 and info.eos_token_ids == [2]
    ids = chat_ids(tokenizer, "What is the capital of France?")
    req = BatchRequest(rid="q", token_ids=ids, max_new_tokens=NEW, temperature=0.0)
    outs, stats = engine.serve(BatchMsg(batch_id=0, slice_len=NEW, requests=[req]))
    tokens = outs[0].token_ids
    assert 1 <= len(tokens) <= NEW and stats.iterations == len(tokens)
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    assert text.strip(), tokens


def test_sliced_equals_one_pass_on_real_model(engine, tokenizer):
    prompts = [
        chat_ids(tokenizer, "Name a color."),
        chat_ids(tokenizer, "Write a haiku about the sea, please."),
    ]

    def rows(gens):
        return [
            BatchRequest(
                rid=str(i),
                token_ids=p + g,
                max_new_tokens=NEW - len(g),
                temperature=0.0,
                ignore_eos=True,
                generated=len(g),
            )
            for i, (p, g) in enumerate(zip(prompts, gens, strict=True))
        ]

    one, _ = engine.serve(BatchMsg(batch_id=1, slice_len=NEW, requests=rows([[], []])))
    gens: list[list[int]] = [[], []]
    while len(gens[0]) < NEW:
        outs, _ = engine.serve(BatchMsg(batch_id=2, slice_len=3, requests=rows(gens)))
        for g, o in zip(gens, outs, strict=True):
            g += o.token_ids
    assert gens == [o.token_ids for o in one]
