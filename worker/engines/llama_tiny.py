"""``tiny-random`` as a GGUF, for the ``llama`` engine: the weights ``hf`` serves for that
name (:func:`sclsd.models.load_model`, fp32) written with the ``gguf`` package, so the two
engines run the same tiny model and tests of the ``llama`` engine need no download and
load in milliseconds.

The tokenizer's metadata (which llama.cpp needs to load a model, though the engine never
tokenizes) is copied from the built-in SmolLM2 GGUF, whose tokenizer ``tiny-random``
shares. The file is built once and cached under the model cache
(``<cache root>/tiny/v<FORMAT>-transformers-<version>/tiny-random.gguf``,
:mod:`sclsd.modelcache`): the random initialisation is transformers', so its version is
part of the path.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from sclsd import modelcache, models

__all__ = ["tiny_gguf", "write_tiny_gguf"]

log = logging.getLogger("sclsd.models")

#: Bumped when what the file holds changes.
FORMAT = 1
NAME = "tiny-random.gguf"
#: The tokenizer's metadata copied from the SmolLM2 GGUF.
_TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
                   "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
                   "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id",
                   "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token",
                   "tokenizer.ggml.add_space_prefix")


def tiny_gguf(cache_dir: str | None = None) -> Path:
    """The path of ``tiny-random``'s GGUF, built on first use (under the entry's lock)."""
    from importlib.metadata import version

    root = modelcache.cache_root(cache_dir)
    dest = root / "tiny" / f"v{FORMAT}-transformers-{version('transformers')}"
    if not dest.is_dir():
        with modelcache.build_lock(dest):
            if not dest.is_dir():
                log.info("building the GGUF of tiny-random (once) in %s", dest)
                modelcache.publish(dest, lambda d: write_tiny_gguf(d / NAME))
    return dest / NAME


def _permute(w: Any, heads: int) -> Any:
    """A q or k projection's rows from transformers' rotary layout (halves) to llama.cpp's
    (interleaved pairs), as llama.cpp's own converter permutes them."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path) -> None:
    """Write ``tiny-random`` (weights fp32) to ``path``."""
    import gguf
    import torch

    cfg = models.TINY_RANDOM_CONFIG
    model = models.load_model("tiny-random", dtype=torch.float32)
    weights = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-random")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(cfg["hidden_size"] // heads)
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    src = gguf.GGUFReader(str(models.smollm2_gguf_path()))
    for key in _TOKENIZER_KEYS:
        field = src.fields.get(key)
        if field is None:
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            w.add_array(key, field.contents())
        else:
            w.add_key_value(key, field.contents(), kind)
    w.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"])
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", weights[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", _permute(weights[p + "self_attn.q_proj.weight"], heads))
        w.add_tensor(f"blk.{i}.attn_k.weight", _permute(weights[p + "self_attn.k_proj.weight"], kv_heads))
        w.add_tensor(f"blk.{i}.attn_v.weight", weights[p + "self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", weights[p + "self_attn.o_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", weights[p + "post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate.weight", weights[p + "mlp.gate_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_up.weight", weights[p + "mlp.up_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_down.weight", weights[p + "mlp.down_proj.weight"])
    w.add_tensor("output_norm.weight", weights["model.norm.weight"])
    # Tied embeddings: no output.weight, llama.cpp reads token_embd.weight.
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
