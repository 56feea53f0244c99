"""``GET /tokenizer_info`` (vLLM's): the tokenizer's configuration, what lm-evaluation-harness's
remote tokenizer reads (its special tokens, its chat template), behind the API key."""

from __future__ import annotations

import json

from sclsd.tokenizer import load

from .conftest import Front, serve_front


def test_the_tokenizers_configuration_as_vllm_gives_it() -> None:
    tok = load("tiny-random")

    async def body(f: Front) -> None:
        r = await f.http.get("/tokenizer_info")
        assert r.status_code == 200, r.text
        info = r.json()
        hf = tok.tok
        assert info["tokenizer_class"] == type(hf).__name__ and info["vocab_size"] == tok.vocab_size
        assert info["eos_token"] == hf.eos_token and info["bos_token"] == hf.bos_token
        assert info["chat_template"] == hf.chat_template
        assert not [k for k in info if k.endswith("_file") or k == "name_or_path"]  # no paths of this box
        json.dumps(info)  # plain JSON all through (added tokens as their text)
        # As lm-evaluation-harness finds the EOS id: the token's text through /tokenize.
        ids = (await f.http.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False})).json()
        assert ids["tokens"] == [hf.eos_token_id]
        assert (await f.http.head("/tokenizer_info")).status_code == 200

    serve_front(body, settings={"tokenizer": tok})


def test_it_needs_the_api_key_and_serves_the_byte_tokenizer_too(front) -> None:
    async def body(f: Front) -> None:
        assert (await f.http.get("/tokenizer_info")).status_code == 401
        r = await f.http.get("/tokenizer_info", headers={"Authorization": "Bearer sekrit"})
        assert r.status_code == 200 and r.json()["tokenizer_class"] == "ByteTokenizer"

    front(body, settings={"api_key": "sekrit"})
