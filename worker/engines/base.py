"""The Engine interface every worker engine implements (hf, hf-cb, deepspeed, fake)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from sclsd.protocol import BatchMsg, BatchStats, RequestOutput


@dataclass
class EngineInfo:
    """Facts a worker reports to the daemon at register."""

    engine: str
    model: str
    device: str
    kv_bytes_per_token: int
    """Δ: bytes of KV cache per token (2 · layers · kv_heads · head_dim · dtype bytes)."""
    mem_available: int
    """M_ava: bytes available for KV cache after weights and engine overhead."""
    eos_token_ids: list[int] = field(default_factory=list)
    vocab_size: int = 0
    """Token ids the model accepts (0: unknown); the daemon checks its tokenizer against it,
    so engines report what ``len(tokenizer)`` gives for their model."""
    extra: dict[str, Any] = field(default_factory=dict)


class Engine(ABC):
    """Serves one batch at a time, for at most ``batch.slice_len`` decoding iterations.

    ``serve`` is called from the worker's serve thread only; engines need not
    be thread-safe.
    """

    name: str = "base"

    @abstractmethod
    def info(self) -> EngineInfo:
        """Describe the loaded model and the memory it leaves for KV cache."""

    @abstractmethod
    def serve(self, batch: BatchMsg) -> tuple[list[RequestOutput], BatchStats]:
        """Run the batch; return one output per request (same order) and stats.

        Each row stops at EOS (unless ignore_eos), at a stop token, or after
        its ``max_new_tokens``; the batch stops after ``slice_len`` iterations
        or when every row has stopped.
        """

    @staticmethod
    def check_batch(batch: BatchMsg, vocab: int | None = None) -> None:
        """Refuse a malformed batch before any work: an empty context, or ids outside ``vocab``."""
        for r in batch.requests:
            if not r.token_ids:
                raise ValueError(f"request {r.rid!r} has an empty context")
            if vocab is not None:
                bad = [t for t in r.token_ids if t >= vocab]
                if bad:
                    raise ValueError(f"request {r.rid!r}: token id {bad[0]} outside vocab {vocab}")

    def profile(self) -> dict[str, Any] | None:
        """An estimator profile (``sclsd.core.profiles.Profile.to_dict()``) this engine knows
        exactly, sent at register when none is given on the command line; None otherwise."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook, deliberately not abstract
        """Release resources (optional)."""
