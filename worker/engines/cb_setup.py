"""How ``hf-cb`` sets up transformers' continuous batching manager: the paged cache's size,
the memory share and graph padding on CUDA, the generation settings, the warm-up of the
captured step shapes before the worker registers, and the manager's start."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

#: CPU defaults: small pages (the daemon counts tokens, transformers allocates pages), and a
#: cache of the memory budget capped here (SDPA keeps a [batch tokens, cache tokens] mask).
CPU_PAGE_SIZE = 16
CPU_MAX_CACHE_TOKENS = 65536
#: Elsewhere: transformers' default page; transformers sizes the cache itself.
GPU_PAGE_SIZE = 256
#: Share of the free memory transformers' sizing may take with CUDA graphs on: at most
#: transformers' own figure for a manager with logits processors (0.8; 0.9 without them),
#: which the engine's always has on the captured path (its per-request rules,
#: :mod:`worker.engines.cb_constraints`). The rest holds the graphs' memory pool, the sampler
#: over up to ``max_requests_per_batch`` logit rows and the CUDA context.
GPU_GRAPHS_MEMORY_SHARE = 0.8
#: KV padding of transformers' captured steps on CUDA: every KV read is padded to a multiple
#: of this many tokens (transformers' default, 16,384, makes a 1k-token decode attend over
#: 16k columns). Finer intervals mean more graph shapes, captured at warm-up
#: (:func:`warm_graphs`) up to :data:`WARM_KV_TOKENS`.
DEFAULT_KV_PADDING_TOKENS = 2048
#: KV reads warmed at start-up: the contexts live batches commonly hold (longer ones are
#: captured the first time they are served).
WARM_KV_TOKENS = 8192
#: Query buckets warmed at every multiple of the query padding up to this many tokens (decode
#: batches of up to that many rows, chunks beside them), then at powers of two.
WARM_DENSE_QUERY_TOKENS = 512


def transformers_memory_share(processors: bool = True) -> float:
    """The share of free memory transformers' paged cache takes on CUDA when not told:
    its own figure, read from its resolver (0.8 with logits processors, 0.9 without)."""
    from transformers import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.initialization import (
        resolve_max_memory_percent,
    )

    class _Cuda:  # only the device's type is read
        type = "cuda"

    cfg = ContinuousBatchingConfig()
    resolve_max_memory_percent(cfg, has_logit_processors=processors, device=_Cuda())  # type: ignore[arg-type]
    return float(cfg.max_memory_percent or 0.0)



def cache_size(device: str, kv_limit: int, delta: int, page_size: int | None,
               num_blocks: int | None) -> tuple[int, int | None]:
    """(page tokens, pages) of the paged cache. On the CPU sized here, from the memory budget
    (transformers would take 60 % of the machine's RAM). On CUDA the pages are None unless
    given: transformers sizes the cache from the free memory with its own footprint formula
    (KV, activations, the SDPA mask), which never asks for what it then refuses, and the
    engine reports what it built (:func:`cache_tokens`)."""
    if device == "cpu":
        page = page_size or CPU_PAGE_SIZE
        tokens = min(kv_limit // max(1, delta), CPU_MAX_CACHE_TOKENS)
        return page, num_blocks if num_blocks is not None else max(1, -(-tokens // page))
    return page_size or GPU_PAGE_SIZE, num_blocks


def cache_tokens(mgr: Any) -> int:
    """Tokens of KV the manager's paged cache holds (its whole-model blocks × page)."""
    cache = mgr.batch_processor.cache
    return int(cache.num_blocks) * int(mgr.continuous_batching_config.page_size)


def manager_options(device: str, page_size: int, num_blocks: int | None, cuda_graphs: Any,
                    memory_share: float | None, max_batch_tokens: int | None) -> dict[str, Any]:
    """The cache and graph settings of ``ContinuousBatchingConfig``. On CUDA transformers'
    own graphs are on unless ``cuda_graphs`` is false (forced: without flash attention it
    would not choose them, though they cut a 7B decode step 3.6× on an H100), and with
    them the cache takes :data:`GPU_GRAPHS_MEMORY_SHARE` of the free memory, or
    transformers' own figure where that is less, unless ``memory_share`` says otherwise.
    The padding of captured steps is :func:`graph_padding`'s."""
    from worker.engines.static_cache import as_switch

    opts: dict[str, Any] = {"page_size": page_size, "num_blocks": num_blocks}
    if max_batch_tokens is not None:
        if int(max_batch_tokens) < 1:
            raise ValueError(f"max_batch_tokens: expected a positive integer, got {max_batch_tokens!r}")
        opts["max_batch_tokens"] = int(max_batch_tokens)
    graphs = as_switch("cuda_graphs", cuda_graphs, device == "cuda")
    if graphs and device != "cuda":
        raise ValueError("cuda_graphs: CUDA graphs need a CUDA device")
    if memory_share is not None and not 0.0 < float(memory_share) <= 1.0:
        raise ValueError(f"memory_share: expected a number in (0, 1], got {memory_share!r}")
    if device == "cuda":
        opts["use_cuda_graph"] = graphs
        share = memory_share if memory_share is not None else (
            min(GPU_GRAPHS_MEMORY_SHARE, transformers_memory_share()) if graphs else None)
        if share is not None:
            opts["max_memory_percent"] = float(share)
    return opts


def generation_config(sampling: bool, pad_id: int, eos: list[int]) -> Any:
    """The manager's settings. With ``sampling``: placeholder temperature, top-k and top-p
    that make transformers build those warpers; each request passes its own
    (``worker.engines.hf_cb.sampling_kwargs``). Without: greedy decoding, no warpers (cheaper: the warpers
    sort the whole vocabulary at every step)."""
    from transformers import GenerationConfig

    extra: dict[str, Any] = dict(temperature=0.5, top_k=50, top_p=0.9) if sampling else {}
    return GenerationConfig(do_sample=sampling, max_new_tokens=1024, pad_token_id=pad_id,
                            eos_token_id=eos[0] if eos else -1, **extra)


def graph_padding(device: str, graphs: bool, kv_padding_tokens: int | None) -> dict[str, Any]:
    """The padding settings of ``ContinuousBatchingConfig`` for captured steps: on CUDA with
    graphs, KV reads padded to multiples of ``kv_padding_tokens`` (default
    :data:`DEFAULT_KV_PADDING_TOKENS`) instead of transformers' 16,384; nothing otherwise.
    transformers takes it as ``kv_padding_interval_size``, a field of its public config."""
    if kv_padding_tokens is not None and int(kv_padding_tokens) < 1:
        raise ValueError(f"kv_padding_tokens: expected a positive integer, got {kv_padding_tokens!r}")
    if device != "cuda" or not graphs:
        return {}
    return {"kv_padding_interval_size": int(kv_padding_tokens or DEFAULT_KV_PADDING_TOKENS)}


def query_buckets(interval: int, max_batch_tokens: int) -> list[int]:
    """Padded query sizes to warm: every multiple of ``interval`` up to
    :data:`WARM_DENSE_QUERY_TOKENS`, then powers of two, up to ``max_batch_tokens``."""
    interval = max(1, int(interval))
    top = max(interval, int(max_batch_tokens))
    out = list(range(interval, min(top, WARM_DENSE_QUERY_TOKENS) + 1, interval))
    q = 2 * (out[-1] if out else interval)
    while q <= top:
        out.append(q)
        q *= 2
    return sorted(set(out) | {top})


def kv_buckets(interval: int, max_tokens_read: int) -> list[int]:
    """Padded KV reads to warm: the multiples of ``interval`` up to :data:`WARM_KV_TOKENS`
    and the cache's longest read."""
    interval = max(1, int(interval))
    top = min(WARM_KV_TOKENS, max(interval, int(max_tokens_read)))
    return list(range(interval, top + 1, interval)) or [interval]


def warm_graphs(mgr: Any, progress: Callable[[str], None] | None = None) -> int:
    """Capture transformers' varlen step at the common (query, KV read) buckets after its own
    warm-up (which captures only the largest), so that they are not captured while serving
    (a spike in the first-token and inter-token times). Uses the manager's model runner (no
    public hook for this in transformers); returns the shapes warmed, 0 when graphs are off
    or the runner is not the one this was written for.

    Runs under ``torch.no_grad()`` as transformers' own warm-up does: with grad on, every
    capture fails on the weights (leaves that require grad). transformers logs such a failure
    and returns a duration of 0; the shapes that failed are counted and logged here."""
    import torch

    proc = getattr(mgr, "batch_processor", None)
    runner = getattr(proc, "model_runner", None)
    if runner is None or not getattr(runner, "use_cuda_graph_varlen", False) \
            or not hasattr(runner, "run_one_warmup"):
        return 0
    cfg, cache = mgr.continuous_batching_config, mgr.batch_processor.cache
    shapes = [(q, kv) for q in query_buckets(cfg.q_padding_interval_size, cache.max_batch_tokens)
              for kv in kv_buckets(cfg.kv_padding_interval_size, cache.max_tokens_read)]
    warmed = 0
    with torch.no_grad():
        for i, (q, kv) in enumerate(shapes, 1):
            warmed += runner.run_one_warmup(model=mgr.model, num_q_tokens=q, max_kv_read=kv) > 0
            if progress is not None and (i == len(shapes) or i % 8 == 0):
                progress(f"warming: captured {warmed}/{len(shapes)} step shapes (query {q}, KV {kv})")
    cache.reset()  # as transformers' own warm-up: the fake requests' blocks back to the pool
    if warmed < len(shapes):
        log.warning("hf-cb warm-up: %d of %d step shapes failed to capture (transformers' warning "
                    "above says why); they will be captured while serving", len(shapes) - warmed, len(shapes))
    return warmed


def start_manager(model: Any, gen_config: Any, cache_opts: dict[str, Any], sampling: bool, device: Any,
                  progress: Callable[[str], None] | None = None) -> tuple[Any, Any, str, Any]:
    """Create and start ``model``'s continuous batching manager under a grant scheduler of its
    own (:mod:`worker.engines.cb_grants`) and the engine's per-request rules
    (:mod:`worker.engines.cb_constraints`); on CUDA its cache is built and its step shapes
    captured first. Returns (manager, its :class:`~worker.engines.cb_grants.GrantControl`, the
    scheduler's registered name, its :class:`~worker.engines.cb_constraints.RequestRules`)."""
    import threading

    from transformers import ContinuousBatchingConfig

    from worker.engines.cb_constraints import RequestRules
    from worker.engines.cb_grants import GrantControl, register

    control = GrantControl()
    name = register(control)
    cfg = ContinuousBatchingConfig(
        scheduler_type=name,
        use_async_batching=False,  # pauses assume a step's update precedes the next schedule
        safety_margin=0.0,  # admission is the daemon's call (its reservations)
        allow_block_sharing=False,
        per_request_processors=sampling,  # each request's temperature, top-k, top-p
        **cache_opts,
    )
    mgr = model.init_continuous_batching(generation_config=gen_config, continuous_batching_config=cfg)
    control.wake = mgr._wake_up_loop.set
    rules = RequestRules.for_manager(mgr, int(model.config.vocab_size), device)
    control.forget = rules.forget
    if device.type == "cuda":
        import torch

        with torch.cuda.device(device):
            mgr.warmup()  # builds the cache (sized by transformers) and captures its largest graphs
            # and the common shapes, not met first while serving
            control.warmed_shapes = warm_graphs(mgr, progress)
    # mgr.start() without its non-daemon thread: kept KV keeps the manager alive between
    # batches, and a process that forgot close() must still be able to exit.
    mgr.background_thread_status.clear()
    prior = mgr.batch_processor
    mgr._generation_thread = threading.Thread(target=mgr._run_generation_loop,
                                              name="hf-cb-generation", daemon=True)
    mgr._generation_thread.start()
    wait_for_processor(mgr, prior, 300.0 if prior is None else 30.0)
    return mgr, control, name, rules


def wait_for_processor(mgr: Any, prior: Any, timeout_s: float = 300.0) -> None:
    """Return once the manager's thread has built its batch processor (another than ``prior``,
    the warm-up's on CUDA), or has died (its error reaches the first request). Building it
    reseeds torch's global RNG from that thread (transformers' ``set_tp_seed``); left to run
    on its own, the reseed lands in the middle of whatever this process does next: a model
    drawn from a fixed seed got other weights. There is no event to wait on, so it is polled.
    After a warm-up (``prior``) a transformers that keeps the warm-up's processor builds none:
    then the wait ends at ``timeout_s`` without an error."""
    import time

    end = time.monotonic() + timeout_s
    while mgr.batch_processor is None or mgr.batch_processor is prior:
        if not mgr._generation_thread.is_alive():
            return
        if time.monotonic() > end:
            if prior is not None:
                return
            raise RuntimeError(f"hf-cb: transformers' generation thread built no batch processor in {timeout_s:.0f}s")
        time.sleep(0.005)
