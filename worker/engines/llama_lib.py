"""The C API of llama.cpp, as much of it as the ``llama`` engine uses: the one module that
knows the library (docs/design.md §6, "llama").

The library is the ik_llama.cpp build that the PyPI wheel ``ik-llama-cpp-python`` ships
(``libllama.so`` with its ``ggml``, prebuilt for manylinux x86-64): the wheel's
``ik_llama_cpp._ctypes_api`` loads it (``$IK_LLAMA_CPP_LIB_PATH`` names another file) and
declares its parameter structs, whose layouts are the fork's; the functions the wheel does
not declare (a sequence's KV removed, saved and restored, the model's facts) are declared
here on the same library. Another build of ``libllama`` (upstream llama.cpp, another
binding) replaces this module alone: the engine reads nothing else of the library.

What the engine needs of it:

* a model loaded from a GGUF file (memory-mapped: the weights as shipped, quantised);
* one context whose KV cache holds ``n_ctx`` token cells shared by up to ``n_seq``
  sequences, each a request's KV (positions 0, 1, ... of its tokens);
* :class:`Batch`: any tokens of any sequences decoded in one ``llama_decode`` call, with
  the logits of the tokens that ask for them (one row each, in the batch's order);
* a sequence's KV dropped (from a position on, or whole), saved to host memory and loaded
  back into any free sequence of the context (``llama_state_seq_*``).

Flash attention stays off: the fork's CPU flash-attention path aborts the process
(``GGML_ASSERT(S > 0)``) on batches of several sequences.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from typing import Any

import numpy as np

__all__ = ["Batch", "Context", "LlamaError", "Model", "greedy_loop", "library", "version"]

log = logging.getLogger("worker.llama")

#: ``ggml_type`` of the KV cache the engine allocates (GGML_TYPE_F16): 2 bytes per value.
KV_TYPE_F16 = 1
KV_VALUE_BYTES = 2

_c_int32, _c_uint32, _c_size, _vp = ctypes.c_int32, ctypes.c_uint32, ctypes.c_size_t, ctypes.c_void_p
_u8p = ctypes.POINTER(ctypes.c_uint8)
_LOG_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)


class _KVView(ctypes.Structure):
    """``struct llama_kv_cache_view``: where the cache's cells are used (for :meth:`Context.compact`)."""

    _fields_ = [("n_cells", _c_int32), ("n_seq_max", _c_int32), ("token_count", _c_int32),
                ("used_cells", _c_int32), ("max_contiguous", _c_int32), ("max_contiguous_idx", _c_int32),
                ("cells", _vp), ("cells_sequences", _vp)]


#: The functions declared here, beyond the wheel's: name -> (argument types, result type).
_EXTRA: dict[str, tuple[list[Any], Any]] = {
    "llama_log_set": ([_LOG_CALLBACK, _vp], None),
    "llama_n_vocab": ([_vp], _c_int32),
    "llama_n_layer": ([_vp], _c_int32),
    "llama_n_ctx_train": ([_vp], _c_int32),
    "llama_token_eos": ([_vp], _c_int32),
    "llama_model_size": ([_vp], ctypes.c_uint64),
    "llama_model_meta_val_str": ([_vp, ctypes.c_char_p, ctypes.c_char_p, _c_size], _c_int32),
    "llama_n_ctx": ([_vp], _c_uint32),
    "llama_get_logits": ([_vp], ctypes.POINTER(ctypes.c_float)),
    "llama_kv_cache_seq_rm": ([_vp, _c_int32, _c_int32, _c_int32], ctypes.c_bool),
    "llama_kv_cache_seq_cp": ([_vp, _c_int32, _c_int32, _c_int32, _c_int32], None),
    "llama_kv_cache_defrag": ([_vp], None),
    "llama_kv_cache_update": ([_vp], _c_int32),
    "llama_get_kv_cache_used_cells": ([_vp], _c_int32),
    "llama_state_seq_get_size": ([_vp, _c_int32, _c_uint32], _c_size),
    "llama_state_seq_get_data": ([_vp, _u8p, _c_size, _c_int32, _c_uint32], _c_size),
    "llama_state_seq_set_data": ([_vp, _u8p, _c_size, _c_int32, _c_uint32], _c_size),
    "llama_kv_cache_view_init": ([_vp, _c_int32], _KVView),
    "llama_kv_cache_view_update": ([_vp, ctypes.POINTER(_KVView)], None),
    "llama_kv_cache_view_free": ([ctypes.POINTER(_KVView)], None),
}

#: llama.cpp's log levels (ggml_log_level) as Python's; its info lines (every tensor and
#: setting of a load) are debug here.
_LEVELS = {1: logging.DEBUG, 2: logging.DEBUG, 3: logging.WARNING, 4: logging.ERROR}


class LlamaError(RuntimeError):
    """The library refused something (a model it cannot load, a context it cannot make)."""


def _forward_log(level: int, text: bytes | None, _user: Any) -> None:
    if text:
        line = text.decode(errors="replace").rstrip()
        # The fork sizes its buffers against a GPU's free memory and warns, on a CPU, that
        # "device 0" has none: not a fault here.
        lvl = logging.DEBUG if line.startswith("Free memory") else _LEVELS.get(level, logging.DEBUG)
        log.log(lvl, "%s", line)


#: Held for the life of the process: the library keeps a pointer to it.
_log_callback = _LOG_CALLBACK(_forward_log)


@functools.cache
def library() -> Any:
    """The wheel's ``_ctypes_api`` module with the functions of :data:`_EXTRA` declared on its
    library, its log routed to the ``worker.llama`` logger and its backend started (once)."""
    from ik_llama_cpp import _ctypes_api as api

    lib = api._lib
    for name, (args, res) in _EXTRA.items():
        f = getattr(lib, name)
        f.argtypes, f.restype = args, res
    lib.llama_log_set(_log_callback, None)
    api.llama_backend_init()
    return api


def version() -> str:
    """The binding's version (the library's build is the wheel's)."""
    import importlib.metadata

    return "ik-llama-cpp-python " + importlib.metadata.version("ik-llama-cpp-python")


class Model:
    """A GGUF model loaded by the library (memory-mapped) and the facts the engine reads."""

    def __init__(self, path: str) -> None:
        api = library()
        self.api, self.lib = api, api._lib
        params = api.llama_model_default_params()
        params.n_gpu_layers = 0
        params.fit = False
        ptr = api.llama_model_load_from_file(path.encode(), params)
        if not ptr:
            raise LlamaError(f"llama.cpp cannot load the model {path} (not a GGUF it reads?)")
        self.ptr: int | None = ptr
        lib = self.lib
        self.path = path
        self.n_vocab = int(lib.llama_n_vocab(ptr))
        self.n_layer = int(lib.llama_n_layer(ptr))
        self.n_ctx_train = int(lib.llama_n_ctx_train(ptr))
        self.eos = int(lib.llama_token_eos(ptr))
        self.size_bytes = int(lib.llama_model_size(ptr))
        self.arch = self.meta("general.architecture") or "llama"
        self.n_head = int(self.meta(f"{self.arch}.attention.head_count") or 0)
        self.n_head_kv = int(self.meta(f"{self.arch}.attention.head_count_kv") or self.n_head)
        n_embd = int(api.llama_model_n_embd(ptr))
        default_dim = n_embd // self.n_head if self.n_head else 0
        self.k_dim = int(self.meta(f"{self.arch}.attention.key_length") or default_dim)
        self.v_dim = int(self.meta(f"{self.arch}.attention.value_length") or default_dim)
        if not (self.n_layer and self.n_head_kv and self.k_dim and self.v_dim):
            raise LlamaError(f"{path}: cannot read the attention shape of architecture {self.arch!r}")

    def meta(self, key: str) -> str | None:
        """A metadata value of the GGUF as text (None: not there)."""
        buf = ctypes.create_string_buffer(512)
        n = self.lib.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        return buf.value.decode(errors="replace") if n >= 0 else None

    @property
    def kv_bytes_per_token(self) -> int:
        """Δ of the engine's fp16 KV cache: ``layers · kv_heads · (k_dim + v_dim) · 2`` bytes."""
        return self.n_layer * self.n_head_kv * (self.k_dim + self.v_dim) * KV_VALUE_BYTES

    def close(self) -> None:
        if self.ptr:
            self.api.llama_free_model(self.ptr)
            self.ptr = None


class Context:
    """One context of ``model``: ``n_ctx`` KV cells for up to ``n_seq`` sequences, at most
    ``n_batch`` tokens per :meth:`decode` (one physical batch: a decode that finds no room
    stores nothing), ``threads`` CPU threads.

    No decode runs while the cache has holes: a token the library places in a free cell
    below used ones (left by a sequence removed) gets wrong logits from this build (its
    later tokens are right again; its stored KV is right), so every removal marks the cache
    and the next :meth:`decode` first defragments it (:meth:`compact`).
    """

    def __init__(self, model: Model, n_ctx: int, n_seq: int, n_batch: int, threads: int) -> None:
        api = model.api
        self.api, self.lib, self.model = api, model.lib, model
        params = api.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = params.n_ubatch = n_batch
        params.n_seq_max = n_seq
        params.n_threads = params.n_threads_batch = threads
        params.flash_attn = False
        params.type_k = params.type_v = KV_TYPE_F16
        params.defrag_thold = -1.0  # defragmented when a decode finds no room (Context.defrag)
        ptr = api.llama_init_from_model(model.ptr, params)
        if not ptr:
            raise LlamaError(f"llama.cpp cannot make a context of {n_ctx} cells for {n_seq} sequences")
        self.ptr: int | None = ptr
        self.n_ctx = int(self.lib.llama_n_ctx(ptr))
        self.n_seq, self.n_batch, self.threads = n_seq, n_batch, threads
        self.vocab = model.n_vocab
        self._view = self.lib.llama_kv_cache_view_init(ptr, 1)
        self.holes = False
        """A sequence's KV was removed since the last :meth:`compact`."""
        self.compactions = 0

    def decode(self, batch: Batch) -> int:
        """Run ``batch``: 0 done, 1 no room for it in the KV cache (nothing stored), < 0 an error."""
        if self.holes:
            self.compact()
        return int(self.api.llama_decode(self.ptr, batch.struct))

    def compact(self) -> None:
        """Defragment until the used cells are the first ones (the library moves a bounded
        number of cell runs per pass)."""
        for _ in range(64):
            v = self._view
            self.lib.llama_kv_cache_view_update(self.ptr, ctypes.byref(v))
            if v.used_cells == 0 or (v.max_contiguous_idx == v.used_cells
                                     and v.max_contiguous == v.n_cells - v.used_cells):
                break
            self.defrag()
            self.compactions += 1
        self.holes = False

    def logits(self, n_out: int) -> np.ndarray:
        """``[n_out, vocab]`` fp32 logits of the last decode's tokens that asked for them, in the
        batch's order: a view of the library's buffer, valid until the next decode."""
        ptr = self.lib.llama_get_logits(self.ptr)
        return np.ctypeslib.as_array(ptr, shape=(n_out, self.vocab))

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> bool:
        """Drop sequence ``seq``'s KV at positions ``[p0, p1)`` (-1: open); whole when both -1."""
        self.holes = True
        return bool(self.lib.llama_kv_cache_seq_rm(self.ptr, seq, p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Sequence ``dst`` shares ``src``'s KV at positions ``[p0, p1)`` (-1: open): the cells
        gain ``dst``, nothing is computed or copied."""
        self.lib.llama_kv_cache_seq_cp(self.ptr, src, dst, p0, p1)

    def save(self, seq: int) -> bytes:
        """Sequence ``seq``'s KV as bytes (host memory)."""
        n = int(self.lib.llama_state_seq_get_size(self.ptr, seq, 0))
        buf = (ctypes.c_uint8 * n)()
        got = int(self.lib.llama_state_seq_get_data(self.ptr, buf, n, seq, 0))
        return bytes(memoryview(buf)[:got])

    def load(self, data: bytes, seq: int) -> bool:
        """Put KV saved by :meth:`save` into the empty sequence ``seq``; False when it does not
        fit (nothing loaded)."""
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        return int(self.lib.llama_state_seq_set_data(self.ptr, buf, len(data), seq, 0)) > 0

    def used_cells(self) -> int:
        """KV cells holding some sequence's token."""
        return int(self.lib.llama_get_kv_cache_used_cells(self.ptr))

    def defrag(self) -> None:
        """Move the used cells together now (a decode needs its tokens' cells contiguous)."""
        self.lib.llama_kv_cache_defrag(self.ptr)
        self.lib.llama_kv_cache_update(self.ptr)

    def clear(self) -> None:
        """Drop every sequence's KV."""
        self.api.llama_kv_cache_clear(self.ptr)
        self.holes = False

    def close(self) -> None:
        if self.ptr:
            self.lib.llama_kv_cache_view_free(ctypes.byref(self._view))
            self.api.llama_free(self.ptr)
            self.ptr = None


class Batch:
    """Tokens for one :meth:`Context.decode`: up to ``capacity`` tokens of any sequences, in
    arrays the library reads in place (one sequence per token)."""

    def __init__(self, api: Any, capacity: int) -> None:
        self.capacity = capacity
        self.token = np.zeros(capacity, np.int32)
        self.pos = np.zeros(capacity, np.int32)
        self.n_seq = np.ones(capacity, np.int32)
        self.seq = np.zeros(capacity, np.int32)
        self.want = np.zeros(capacity, np.int8)
        i32p = ctypes.POINTER(ctypes.c_int32)
        base = self.seq.ctypes.data
        self._seq_ptrs = (i32p * capacity)(*[ctypes.cast(base + 4 * i, i32p) for i in range(capacity)])
        self.struct = api.llama_batch()
        s = self.struct
        s.token = self.token.ctypes.data_as(i32p)
        s.pos = self.pos.ctypes.data_as(i32p)
        s.n_seq_id = self.n_seq.ctypes.data_as(i32p)
        s.seq_id = ctypes.cast(self._seq_ptrs, ctypes.POINTER(i32p))
        s.logits = self.want.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self.n = 0
        self.n_out = 0

    def clear(self) -> None:
        self.n = self.n_out = 0
        self.struct.n_tokens = 0

    def room(self) -> int:
        return self.capacity - self.n

    def add(self, tokens: list[int], seq: int, pos: int, logits: bool, every: bool = False) -> int:
        """Add ``tokens`` of sequence ``seq`` at positions from ``pos``; with ``logits`` the last
        one's logits are computed. Returns that row's index among the decode's logits (-1: none).
        ``every``: every token's logits are computed (a prompt scored), and the index returned
        is the first token's."""
        k, n = len(tokens), self.n
        if k == 0 or n + k > self.capacity:
            raise ValueError(f"{k} tokens do not fit a batch of {self.capacity} holding {n}")
        self.token[n:n + k] = tokens
        self.pos[n:n + k] = np.arange(pos, pos + k, dtype=np.int32)
        self.seq[n:n + k] = seq
        self.want[n:n + k] = 0
        self.n = n + k
        self.struct.n_tokens = self.n
        if every:
            self.want[n:n + k] = 1
            self.n_out += k
            return self.n_out - k
        if not logits:
            return -1
        self.want[n + k - 1] = 1
        self.n_out += 1
        return self.n_out - 1


def prefill_seq(ctx: Context, batch: Batch, ids: list[int], seq: int) -> None:
    """Decode ``ids`` into sequence ``seq`` from position 0, in decodes of at most
    ``batch.capacity`` tokens; the last token's logits are then ``ctx.logits(1)[0]``."""
    for pos in range(0, len(ids), batch.capacity):
        part = ids[pos:pos + batch.capacity]
        batch.clear()
        batch.add(part, seq, pos, pos + len(part) == len(ids))
        if ctx.decode(batch) != 0:
            raise LlamaError("the prompt does not fit the context")


def greedy_loop(ctx: Context, prompt: list[int], n: int, seq: int = 0) -> tuple[list[int], float, float]:
    """The library's own greedy decoding of one sequence, without sclsd: the prompt in decodes
    of at most ``ctx.n_batch`` tokens, then one token per decode, each the argmax of its logits.
    Returns the tokens, the prefill's seconds and the decode steps' seconds (``sclsd-bench``)."""
    import time

    batch = Batch(ctx.api, ctx.n_batch)
    ctx.seq_rm(seq)
    t0 = time.perf_counter()
    prefill_seq(ctx, batch, prompt, seq)
    out = [int(ctx.logits(1)[0].argmax())]
    t1 = time.perf_counter()
    for i in range(n - 1):
        batch.clear()
        batch.add(out[-1:], seq, len(prompt) + i, True)
        if ctx.decode(batch) != 0:
            raise LlamaError("the context is full")
        out.append(int(ctx.logits(1)[0].argmax()))
    t2 = time.perf_counter()
    ctx.seq_rm(seq)
    return out, t1 - t0, t2 - t1
