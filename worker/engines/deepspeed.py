"""``deepspeed``: the ``hf`` engine's slice loop over a model wrapped by ``deepspeed.init_inference``.

Everything that makes a slice (left padding, at most ``slice_len`` iterations,
early stop, per-row sampling, stop tokens, stats) is :class:`~worker.engines.hf.HFEngine`'s:
this engine only changes what the loop calls. The model is loaded as ``hf``
loads it, then handed to ``deepspeed.init_inference`` with

- an explicit ``dtype`` (the engine's; DeepSpeed would otherwise cast to fp16),
- ``tensor_parallel`` size 1 (one worker per GPU, as everywhere in sclsd),
- ``keep_module_on_host``: the model already sits on the worker's device, and
  DeepSpeed would otherwise move it to *its* current device (``cuda:0``, or a
  GPU when the worker was asked for the CPU),
- no kernel injection (see below).

Two repairs keep the wrapped model computing what ``hf`` computes:

- a model loaded from a GGUF file is flagged quantized by transformers even
  though its weights were dequantised to plain tensors, and DeepSpeed's dtype
  cast (``.float()``) refuses such a model; the flag is cleared when every
  parameter is a floating-point tensor, and the model is refused otherwise;
- DeepSpeed's cast (``.bfloat16()``, ``.half()``) also casts the buffers that
  transformers keeps in fp32 (the rotary ``inv_freq``: in bf16 its rounding
  shifts every rotary phase; SmolLM2's logits over 200 tokens moved by up to 0.94,
  and by 0 once the buffers are put back); they are put back.

Without kernel injection DeepSpeed runs the transformers modules as they are:
on one device it adds no speed, and the engine exists to run the paper's DS
worker and to carry its memory rule table (``[scheduler] memory = "rules"``).
Kernel injection (``kernel_inject = true``) is refused: it is CUDA-only, and
on CUDA its injected Llama layers cannot run this loop correctly
(:data:`KERNEL_INJECT_REFUSAL` says why).

``deepspeed`` is imported here only, when this engine is built: the daemon and
the other engines never import it.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from sclsd import models
from worker.engines.base import EngineInfo
from worker.engines.hf import HFEngine

log = logging.getLogger(__name__)

#: The version the tests and docs/operations.md were verified with (pyproject's ``deepspeed`` extra).
VERIFIED_VERSION = "0.19.8"

#: Why ``kernel_inject = true`` is refused on CUDA (on the CPU the kernels do not exist).
KERNEL_INJECT_REFUSAL = (
    "DeepSpeed kernel injection is not supported by this engine: the injected Llama layers "
    "(DeepSpeedTransformerInference) return a tuple where transformers' LlamaModel expects a "
    "tensor, keep their K/V in DeepSpeed's own process-wide workspace instead of the cache the "
    "slice loop passes, and their CUDA attention kernel applies rotary positions from that "
    "workspace's token count, ignoring the per-row position ids that left padding needs; "
    "serve with kernel_inject = false"
)


class DeepSpeedUnavailableError(ValueError):
    """deepspeed is missing or cannot be imported; the message is one line saying how to fix it.

    A ``ValueError``, like every other start-up refusal, so that ``sclsd-worker``
    reports it as one ``cannot start engine`` line and exits 2.
    """


def import_deepspeed(device_type: str) -> Any:
    """Import and return the ``deepspeed`` package, or raise :class:`DeepSpeedUnavailableError`.

    For a CPU worker DeepSpeed is told to use its CPU accelerator (it would
    otherwise probe for a GPU and warn when it finds none).
    """
    if device_type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except ImportError as exc:
        raise DeepSpeedUnavailableError(
            f"the deepspeed engine needs the deepspeed package ({exc}): "
            f"pip install 'sclsd[deepspeed]' (verified with deepspeed=={VERIFIED_VERSION})"
        ) from None
    except Exception as exc:  # noqa: BLE001 - a broken install fails in many ways; say which
        raise DeepSpeedUnavailableError(
            f"deepspeed is installed but does not import: {type(exc).__name__}: {exc}"
        ) from None
    return deepspeed


def check_kernel_inject(kernel_inject: bool, device_type: str) -> None:
    """Refuse kernel injection with the reason (CPU: no kernels; CUDA: see the refusal)."""
    if not kernel_inject:
        return
    if device_type != "cuda":
        raise ValueError(
            "kernel_inject = true needs CUDA: DeepSpeed's injected kernels do not run on "
            f"{device_type!r} (serve with kernel_inject = false)"
        )
    raise ValueError(KERNEL_INJECT_REFUSAL)


def as_bool(name: str, value: Any) -> bool:
    """An on/off option given as a bool or as text (``--opt`` passes ``"false"`` as a string)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off", "none", ""):
        return False
    raise ValueError(f"{name} must be true or false, got {value!r}")


def clear_dequantised_marker(model: Any) -> None:
    """Drop transformers' "quantized" flag from a model whose weights are plain floats.

    transformers marks a model loaded from a GGUF as quantized even when it
    dequantised every weight; DeepSpeed's dtype cast then fails with ``.float() is
    not supported for quantized model``. A model with any non-float parameter or
    buffer (weights really left packed) is refused instead: casting it would be wrong.
    """
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None and not getattr(model, "is_quantized", False):
        return
    packed = [
        name
        for name, t in [*model.named_parameters(), *model.named_buffers()]
        if not t.is_floating_point()
    ]
    if packed:
        raise ValueError(
            f"the deepspeed engine needs dequantised weights, but {len(packed)} tensors "
            f"stay quantized (e.g. {packed[0]})"
        )
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    else:
        model.is_quantized = False


def wrap_model(deepspeed: Any, model: Any, device: Any, dtype: Any) -> Any:
    """``deepspeed.init_inference`` on ``model`` (already on ``device`` in ``dtype``).

    Returns the DeepSpeed ``InferenceEngine``; calling it calls the model. Raises
    ``ValueError`` if the wrapped model did not end up on ``device`` in ``dtype``.
    """
    import torch

    clear_dequantised_marker(model)
    kept = models.float_buffers(model, dtype)
    if device.type == "cuda" and device.index is not None:
        # DeepSpeed allocates on its current device; make that the worker's.
        torch.cuda.set_device(device)
    wrapped = deepspeed.init_inference(
        model,
        dtype=dtype,
        tensor_parallel={"tp_size": 1},
        replace_with_kernel_inject=False,
        keep_module_on_host=True,
    )
    models.restore_buffers(wrapped.module, kept)
    check_placement(wrapped.module, device, dtype, kept)
    return wrapped


def check_placement(module: Any, device: Any, dtype: Any, kept: dict[str, Any]) -> None:
    """Every parameter on ``device`` in ``dtype``; every buffer on ``device``, the kept ones
    in their own dtype. A mismatch is a ``ValueError``: serving it would be silently wrong."""
    for name, p in module.named_parameters():
        if not on_device(p, device) or p.dtype != dtype:
            raise ValueError(
                f"deepspeed left parameter {name} on {p.device} in {p.dtype}; "
                f"expected {device} in {dtype}"
            )
    for name, b in module.named_buffers():
        if not on_device(b, device):
            raise ValueError(f"deepspeed left buffer {name} on {b.device}; expected {device}")
        if name in kept and b.dtype != kept[name].dtype:
            raise ValueError(f"buffer {name} is {b.dtype}; expected {kept[name].dtype}")


def on_device(t: Any, device: Any) -> bool:
    """Whether tensor ``t`` is on ``device`` (``cuda`` without an index: any GPU)."""
    return bool(t.device.type == device.type and (device.index is None or t.device.index == device.index))


class DeepSpeedEngine(HFEngine):
    """The ``hf`` slice loop over a ``deepspeed.init_inference`` model (see the module docstring)."""

    name = "deepspeed"
    #: The paper's DS worker keeps the eager loop unless ``static_cache = true``.
    static_default = False

    def __init__(
        self,
        model: str = models.DEFAULT_MODEL,
        device: str = "cpu",
        dtype: Any = None,
        kernel_inject: bool = False,
        **kwargs: Any,
    ) -> None:
        import torch

        dev = torch.device(device)
        # Refuse before the model loads (seconds to minutes): the options, then the package.
        check_kernel_inject(as_bool("kernel_inject", kernel_inject), dev.type)
        deepspeed = import_deepspeed(dev.type)
        # Set before the hf constructor, which already asks info() for M_ava.
        self.deepspeed_version = str(deepspeed.__version__)
        super().__init__(model=model, device=device, dtype=dtype, **kwargs)
        t0 = time.perf_counter()
        self.model = wrap_model(deepspeed, self.model, self.device, self.dtype)
        self.load_s += time.perf_counter() - t0
        log.info("deepspeed %s: init_inference(dtype=%s, tp_size=1, kernel_inject=False) on %s",
                 self.deepspeed_version, self.dtype, self.device)  # fmt: skip

    def info(self) -> EngineInfo:
        """``hf``'s facts, plus the DeepSpeed version and the kernel-injection setting."""
        info = super().info()
        info.extra.update(deepspeed=self.deepspeed_version, kernel_inject=False)
        return info
