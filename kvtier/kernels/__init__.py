"""Block kernels: pack per-layer KV into cross-layer blocks, unpack them, copy blocks between tiers.

The torch reference in :mod:`kvtier.kernels.fallback` is exact and runs on any device. Beside it,
:mod:`kvtier.kernels.cuda` holds the CUDA kernels (compiled at run time through CuPy's NVRTC,
docs/architecture.md#kernels) with the same signatures, and :mod:`kvtier.kernels.copy_engine` the
``cudaMemcpyAsync`` alternative. Importing this package never needs CUDA or CuPy: only the fallback is
imported here.
"""

from kvtier.kernels.fallback import copy_blocks, layer_logical_view, pack_blocks, unpack_blocks

__all__ = ["copy_blocks", "layer_logical_view", "pack_blocks", "unpack_blocks"]
