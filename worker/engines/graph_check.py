"""The check of the static path's captured decode steps, before a worker registers.

Each captured step is replayed and its body run eagerly on the same ``(n, c)`` bucket, the
same arena and the same inputs, and their logits are compared within a tolerance: a step
whose replay is wrong loses its graph and its bucket, the others stay, and the engine's
caps list what is kept (docs/design.md §10).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from worker.engines.static_cache import StaticRunner

log = logging.getLogger("worker")

#: How far a replayed decode step's logits may be from the eager step's on the same inputs,
#: as a share of the largest logit: reduction order differs between kernels (fp16 logits of a
#: random 7B differ by ~1e-2), a graph that reads or writes the wrong memory is off by the
#: logits' own scale.
GRAPH_LOGIT_TOLERANCE = 0.02


def verify(runner: StaticRunner, vocab: int,
           tolerance: float = GRAPH_LOGIT_TOLERANCE) -> dict[tuple[int, int], float]:
    """Replay each captured step and run its body eagerly on the same inputs (same rows,
    columns, arena and counters); a step whose logits differ by more than ``tolerance`` of
    the largest logit (or are not finite) is dropped with its bucket. Returns each checked
    bucket's difference as that share."""
    import torch

    gen = torch.Generator().manual_seed(0)
    errors: dict[tuple[int, int], float] = {}
    with torch.inference_mode():
        for key in runner.captured():
            step = runner.steps[key]
            n, c = key
            past = c // 2
            ids = torch.randint(1, max(2, vocab), (n, 1), generator=gen).to(runner.device)
            step.probe(ids, past)
            eager = step.body().float().clone()
            step.probe(ids, past)
            got = step.run().float()
            scale = float(eager.abs().max().clamp(min=1e-6))
            err = float((got - eager).abs().max()) / scale
            errors[key] = err if err == err else float("inf")  # NaN: not finite, fails
            if not errors[key] <= tolerance:
                del runner.steps[key]
        runner.reset_counters(0)
        runner.mask_flat.zero_()
    return errors


def check_graphs(engine: Any, progress: Callable[[str], None] | None = None,
                 tolerance: float = GRAPH_LOGIT_TOLERANCE) -> bool:
    """Check every captured decode step against its own body run eagerly on the same ``(n, c)``
    and inputs (:func:`verify`): a step whose logits are further than
    ``tolerance`` (a share of the largest logit) loses its graph, the others stay. Then serve
    one small batch with what is kept, which warms the prefill's first shapes (an exception
    there is the caller's to handle). Returns whether any graph is kept.

    Logits, not greedy tokens, and the same shape, not another: a random-weight model in fp16
    has near-tied logits, where a reduction-order difference between two shapes flips a token
    without anything being wrong."""
    import random

    from sclsd.protocol import BatchMsg, BatchRequest

    runner: StaticRunner = engine.static
    vocab = int(getattr(engine, "vocab_size", 0) or engine.config.vocab_size)
    if progress is not None:
        progress("warming: checking the decode graphs against the eager step")
    errors = verify(runner, vocab, tolerance)
    bad = {k: e for k, e in errors.items() if not e <= tolerance}
    if bad:
        log.warning("warming: %d of %d captured decode steps gave other logits than their eager step "
                    "(batch, cache: error as a share of the largest logit %s; tolerance %g); those "
                    "buckets are dropped, %d graphs kept", len(bad), len(errors),
                    {k: round(e, 4) for k, e in sorted(bad.items())}, tolerance, len(runner.captured()))
    if not runner.captured():
        return False
    rng = random.Random(0)
    rows = min(4, max(runner.batch_buckets, default=1))
    reqs = [BatchRequest(rid=f"warm-up-{i}", token_ids=[rng.randrange(1, vocab) for _ in range(5 + 7 * i)],
                         max_new_tokens=12, temperature=0.0, ignore_eos=True) for i in range(rows)]
    engine.serve(BatchMsg(batch_id=0, slice_len=12, requests=reqs, kv_reuse=False))
    return True


def warm_graphs(engine: Any, progress: Callable[[str], None] | None = None,
                on_drop: Callable[[], None] | None = None) -> None:
    """A static engine's warm-up before it registers: capture its decode graphs (CUDA), check
    them (:func:`check_graphs`) and serve a small batch; if serving with the graphs fails,
    drop them all (``on_drop`` then resets what the engine built on them): the eager step
    still serves, and the log says why."""
    runner: StaticRunner = engine.static
    t0 = time.perf_counter()
    runner.warm_up(progress)
    if runner.captured():
        try:
            check_graphs(engine, progress)  # drops the steps whose replay is wrong
        except Exception as exc:  # noqa: BLE001 - the eager step still serves; say why
            log.warning("warming: serving with the captured decode steps failed (%s: %s); "
                        "dropping them, decode runs eagerly", type(exc).__name__, exc)
            runner.drop_graphs()
            if on_drop is not None:
                on_drop()
    log.info("warm-up done in %.1f s: %d decode graphs captured", time.perf_counter() - t0,
             len(runner.captured()))
