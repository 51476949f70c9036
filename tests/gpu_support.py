"""Whether this machine can run the GPU tests (a CUDA device and CuPy), and the mark that says so.

Tests decorated with :func:`requires_gpu` carry the ``gpu`` marker (``pytest -m gpu`` selects them)
and skip with the missing piece as the reason. With ``KVTIER_REQUIRE_GPU=1`` (set by
``benchmarks/run_gpu_checks.sh`` on a GPU machine) they never skip: a missing CUDA or CuPy then fails
them with kvtier's own :class:`~kvtier.errors.TierUnavailable` message instead of passing unseen.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import TypeVar

import pytest
import torch

F = TypeVar("F", bound=Callable[..., object])


def gpu_unavailable_reason() -> str | None:
    """Why the GPU tests cannot run here, or None when they can."""
    if not torch.cuda.is_available():
        return "needs a CUDA device: torch.cuda.is_available() is False"
    if importlib.util.find_spec("cupy") is None:
        return ("needs CuPy: pip install 'kvtier[cuda]' "
                "(or the cupy-cudaXXx wheel matching this machine's CUDA)")
    return None


REASON = gpu_unavailable_reason()
REQUIRED = os.environ.get("KVTIER_REQUIRE_GPU") == "1"


def requires_gpu(test: F) -> F:
    """Mark ``test`` as a GPU test that skips, saying why, where CUDA or CuPy is missing."""
    marked = pytest.mark.gpu(test)
    if REASON is not None and not REQUIRED:
        marked = pytest.mark.skip(reason=REASON)(marked)
    return marked
