"""The tokenizer inside sclsd-http: fill-in-the-middle prompts for ``suffix``."""

from __future__ import annotations

import copy
from typing import Any

import httpx2
import pytest

from sclsd.http.tokens import FIM_TOKENS, View

from .test_tool_calls import run


@pytest.fixture(scope="module", params=range(len(FIM_TOKENS)))
def fim_tokenizer(request: pytest.FixtureRequest) -> Any:
    from sclsd.tokenizer import load

    t = copy.copy(load("tiny-random"))
    t.tok = copy.deepcopy(t.tok)
    t.tok.add_special_tokens({"additional_special_tokens": list(FIM_TOKENS[request.param])})
    t.vocab_size = len(t.tok)
    return t


def test_fim_prompt_layout(fim_tokenizer) -> None:
    view = View(fim_tokenizer)
    p, s, m = (fim_tokenizer.tok.convert_tokens_to_ids(x) for x in
               next(names for names in FIM_TOKENS if names[0] in fim_tokenizer.tok.get_added_vocab()))
    ids = view.fim("def add(a, b):\n    ", "\n    return c")
    assert ids[0] == p and ids[-1] == m and ids.count(s) == 1
    cut = ids.index(s)
    assert fim_tokenizer.decode(ids[1:cut]) == "def add(a, b):\n    "
    assert fim_tokenizer.decode(ids[cut + 1:-1]) == "\n    return c"


def test_suffix_through_the_daemon(fim_tokenizer) -> None:
    async def body(http: httpx2.AsyncClient, server: Any) -> None:
        prefix, suffix = "def add(a, b):\n    ", "\n    return c"
        r = await http.post("/v1/completions", json={"prompt": prefix, "suffix": suffix, "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(View(fim_tokenizer).fim(prefix, suffix))

    run(fim_tokenizer, body)
