"""Block kernels: pack per-layer KV into cross-layer blocks, unpack them, copy blocks between tiers.

The torch reference in :mod:`kvtier.kernels.fallback` is exact and runs on any device. Beside it,
:mod:`kvtier.kernels.cuda` holds the CUDA kernels (compiled at run time through CuPy's NVRTC,
docs/architecture.md#kernels) with the same signatures, and :mod:`kvtier.kernels.copy_engine` the
``cudaMemcpyAsync`` alternative. :mod:`kvtier.kernels.host` builds the host-side streaming-store copy.
Importing this package needs neither CUDA, CuPy nor torch: the fallback's functions below load on
first use (``kvtier check`` imports :mod:`kvtier.kernels.host` without torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.kernels.fallback import copy_blocks, layer_logical_view, pack_blocks, unpack_blocks

__all__ = ["copy_blocks", "layer_logical_view", "pack_blocks", "unpack_blocks"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvtier.kernels import fallback

        return getattr(fallback, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
