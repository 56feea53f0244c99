"""How ``hf-cb`` sets up transformers' manager on CUDA, checked on the CPU from the settings it
hands transformers: the memory share (at most transformers' own), the KV padding of captured
steps, and the step shapes captured at warm-up."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("torch")

from worker.engines.cb_setup import (  # noqa: E402
    DEFAULT_KV_PADDING_TOKENS,
    graph_padding,
    kv_buckets,
    query_buckets,
    warm_graphs,
)
from worker.engines.hf_cb import manager_options  # noqa: E402


class CudaType:
    type = "cuda"


def transformers_share(processors: bool) -> float:
    from transformers import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.initialization import (
        resolve_max_memory_percent,
    )

    cfg = ContinuousBatchingConfig()
    resolve_max_memory_percent(cfg, has_logit_processors=processors, device=CudaType())  # type: ignore[arg-type]
    assert cfg.max_memory_percent is not None
    return float(cfg.max_memory_percent)


def test_graph_memory_share_is_at_most_transformers_own_with_logits_processors():
    """The engine's manager always has logits processors on the captured path (its per-request
    rules), for which transformers takes 0.8: the engine's share may not be more."""
    share = manager_options("cuda", 256, None, "auto", None, None)["max_memory_percent"]
    assert share <= transformers_share(True) < transformers_share(False)
    assert manager_options("cuda", 256, None, True, 0.6, None)["max_memory_percent"] == 0.6  # by hand wins


def test_captured_steps_pad_kv_reads_to_the_interval_not_16k():
    pad = graph_padding("cuda", True, None)
    assert pad == {"kv_padding_interval_size": DEFAULT_KV_PADDING_TOKENS} and DEFAULT_KV_PADDING_TOKENS < 16384
    assert graph_padding("cuda", True, 1024) == {"kv_padding_interval_size": 1024}
    assert graph_padding("cuda", False, None) == graph_padding("cpu", False, 1024) == {}
    with pytest.raises(ValueError, match="kv_padding_tokens"):
        graph_padding("cuda", True, 0)
    from transformers import ContinuousBatchingConfig

    cfg = ContinuousBatchingConfig(**(manager_options("cuda", 256, None, "auto", None, None) | pad))
    assert cfg.kv_padding_interval_size == DEFAULT_KV_PADDING_TOKENS and cfg.use_cuda_graph


def test_buckets_warmed():
    assert query_buckets(64, 8192) == [64, 128, 192, 256, 320, 384, 448, 512, 1024, 2048, 4096, 8192]
    assert query_buckets(64, 300) == [64, 128, 192, 256, 300]
    assert kv_buckets(2048, 10**6) == [2048, 4096, 6144, 8192]
    assert kv_buckets(2048, 3000) == [2048]


def fake_manager(varlen: bool = True, fail: int = 0) -> tuple[Any, list[tuple[int, int]], list[int]]:
    """A manager whose runner records each capture, and fails the first ``fail`` of them (or
    any with grad on) as transformers does: a warning and a duration of 0."""
    import torch

    calls: list[tuple[int, int]] = []
    resets: list[int] = []

    def run_one_warmup(model: Any, num_q_tokens: int, max_kv_read: int) -> float:
        assert model == "model"
        calls.append((num_q_tokens, max_kv_read))
        return 0.0 if torch.is_grad_enabled() or len(calls) <= fail else 0.01

    runner = SimpleNamespace(use_cuda_graph_varlen=varlen, run_one_warmup=run_one_warmup)
    cache = SimpleNamespace(max_batch_tokens=256, max_tokens_read=5000, reset=lambda: resets.append(1))
    mgr = SimpleNamespace(model="model", batch_processor=SimpleNamespace(model_runner=runner, cache=cache),
                          continuous_batching_config=SimpleNamespace(q_padding_interval_size=64,
                                                                     kv_padding_interval_size=2048))
    return mgr, calls, resets


def test_warm_up_captures_every_common_query_and_kv_bucket():
    mgr, calls, resets = fake_manager()
    steps: list[str] = []
    assert warm_graphs(mgr, steps.append) == len(calls) == 4 * 2
    assert calls == [(q, kv) for q in (64, 128, 192, 256) for kv in (2048, 4096)]
    assert resets == [1] and steps and "8/8" in steps[-1]
    mgr, calls, resets = fake_manager(varlen=False)
    assert warm_graphs(mgr) == 0 and calls == [] and resets == []


def test_warm_up_runs_without_grad_and_counts_the_shapes_that_failed(caplog):
    """With grad on every capture failed on a GPU (the weights are leaves that require grad),
    and the engine still said it had warmed them all."""
    import torch

    assert torch.is_grad_enabled()
    mgr, calls, resets = fake_manager(fail=3)
    with caplog.at_level("WARNING"):
        assert warm_graphs(mgr) == 8 - 3 and len(calls) == 8 and resets == [1]
    assert "3 of 8 step shapes failed" in caplog.text
