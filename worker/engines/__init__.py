"""Engine registry: name -> ``module:Class``, imported only when asked for.

``import worker.engines`` must stay light (no torch): the daemon and the tests
of the worker process import it without a model.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from worker.engines.base import Engine, EngineInfo

#: Known engines, in the order of ``sclsd.defaults.ENGINES`` (the config and the command
#: lines read that tuple; tests/unit/test_config.py checks the two agree).
ENGINES: dict[str, str] = {
    "hf": "worker.engines.hf:HFEngine",
    "hf-cb": "worker.engines.hf_cb:HFCBEngine",
    "hf-static-cb": "worker.engines.hf_static_cb:HFStaticCBEngine",
    "llama": "worker.engines.llama:LlamaEngine",
    "deepspeed": "worker.engines.deepspeed:DeepSpeedEngine",
    "fake": "worker.engines.fake:FakeEngine",
}

__all__ = ["ENGINES", "Engine", "EngineInfo", "create_engine", "engine_class"]


def engine_class(name: str) -> type[Engine]:
    """The engine class registered under ``name``; ``ValueError`` listing choices if unknown."""
    try:
        target = ENGINES[name]
    except KeyError:
        raise ValueError(
            f"unknown engine {name!r}; choose one of: {', '.join(sorted(ENGINES))}"
        ) from None
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def create_engine(name: str, model: str | None = None, device: str = "cpu", **opts: Any) -> Engine:
    """Build engine ``name`` for ``model`` on ``device``; ``opts`` go to its constructor.

    ``model=None`` keeps the engine's own default (SmolLM2 for ``hf``).
    """
    # Engines share no constructor signature: each takes its own options.
    cls: Callable[..., Engine] = engine_class(name)
    if model is not None:
        opts["model"] = model
    return cls(device=device, **opts)
