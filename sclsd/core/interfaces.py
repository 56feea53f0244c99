"""What policies plug into: the cost model, batcher, offloader and interval protocols.

The schedulers, the named policies and their parts (batchers, offloaders,
interval rules) all speak these protocols, and this module depends on none of
them, so the policy modules never need one another for their types.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np

    from .batch import Batch
    from .estimator import Estimator
    from .request import Request

__all__ = ["Batcher", "CachedCost", "CostModel", "GrantCost", "Interval", "LinearCost", "Offloader"]


class CostModel(Protocol):
    """Serving time and memory predicate of a worker (homogeneous workers)."""

    def t_serve(self, n: int, input_len: int, slice_len: int) -> float:
        """Estimated seconds to serve a batch of ``n`` requests padded to ``input_len``."""
        ...

    def oom(self, n: int, input_len: int, slice_len: int) -> bool:
        """True when such a batch would not fit in memory."""
        ...


@runtime_checkable
class LinearCost(Protocol):
    """Optional fast path of a :class:`CostModel`, which the DP batcher looks for.

    Both methods take a numpy array of input lengths and must agree with
    ``t_serve`` and ``oom``: ``t_serve(n, L, S) == a·n + b`` and
    ``oom(n, L, S)`` exactly when ``n > max_batch`` (memory is monotone in n).
    """

    def linear_terms(self, L: np.ndarray, S: int) -> tuple[np.ndarray, np.ndarray]:
        """``(a, b)`` per input length with ``t_serve(n, L, S) = a·n + b``."""
        ...

    def max_batch(self, L: np.ndarray, S: int) -> np.ndarray:
        """Largest batch size that fits, per input length."""
        ...


@runtime_checkable
class CachedCost(Protocol):
    """Optional part of a :class:`CostModel` that KV reuse needs (every built-in profile has it).

    A batch whose rows are partly cached on its worker: each row's first positions
    are held there (its retained KV), the rest are new. The worker lays the batch
    out as ``past`` positions (the longest held prefix, others left-padded) then
    ``new`` positions (the longest uncached tail, others left-padded) and prefills
    only the ``new`` ones. Without KV held, ``past = 0`` and ``new`` is the input
    length: ``t_serve_cached(n, 0, L, S) == t_serve(n, L, S)``.
    """

    @property
    def kv_bytes_per_token(self) -> int:
        """Δ, bytes of KV per token."""
        ...

    @property
    def device_kv_bytes(self) -> float:
        """KV bytes a worker's device may hold (the running batch and retained KV beside it)."""
        ...

    @property
    def retain_bytes(self) -> float:
        """KV bytes one worker can hold for the requests it serves, device and host together."""
        ...

    def t_serve_cached(self, n: int, past: int, new: int, slice_len: int) -> float:
        """Estimated seconds of a batch holding ``past`` positions per row and prefilling ``new``."""
        ...

    def linear_terms_cached(
        self, past: np.ndarray, new: np.ndarray, S: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(a, b)`` per (held, new) pair with ``t_serve_cached(n, past, new, S) = a·n + b``."""
        ...

    def copy_s(self, nbytes: float) -> float:
        """Seconds to bring ``nbytes`` of retained KV back from host memory (0: no host tier)."""
        ...


class Batcher(Protocol):
    """Decides what to batch: a partition of the pool."""

    def __call__(
        self, reqs: Sequence[Request], slice_len: int, cost: CostModel
    ) -> list[list[Request]]:
        """Split the pool into batches; every request in exactly one batch."""
        ...


class Offloader(Protocol):
    """Decides where each batch goes."""

    def assign(self, batches: Sequence[Batch], loads: Mapping[str, float]) -> list[str]:
        """Pick a worker for each batch (same order as ``batches``); never mutates ``loads``."""
        ...


class Interval(Protocol):
    """Decides when the next scheduling round runs."""

    @property
    def initial(self) -> float:
        """Seconds until the first round."""
        ...

    def next(self, loads: Mapping[str, float]) -> float:
        """Seconds until the next scheduling round, given the active workers' loads."""
        ...


class GrantCost(CostModel, Protocol):
    """What the slice-grant scheduler needs of its cost model: the estimator it prices grants
    with, and the KV a worker may reserve (Δ, ζ · M_ava, the engine's KV page)."""

    @property
    def estimator(self) -> Estimator:
        """The serving-time model (its coefficients price a grant's decode and prefill)."""
        ...

    @property
    def kv_bytes_per_token(self) -> int:
        """Δ, bytes of KV per token."""
        ...

    @property
    def device_kv_bytes(self) -> float:
        """KV bytes one worker's grants may reserve (ζ · M_ava)."""
        ...

    @property
    def kv_page_tokens(self) -> int:
        """The engine's KV page in tokens: grants reserve whole pages (1: tokens)."""
        ...
