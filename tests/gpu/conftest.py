"""The GPU tier: every test here needs CUDA and is skipped without it.

Run on a box with a GPU: ``.venv/bin/python -m pytest -q tests/gpu``. ``make test``
collects these too; on a machine without CUDA each one reports its skip.
"""

from __future__ import annotations

import pytest


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.fixture(autouse=True)
def _needs_cuda() -> None:
    if not cuda_available():
        pytest.skip("needs CUDA (tests/gpu)")
