"""Block kernels: pack per-layer KV into cross-layer blocks, unpack them, copy blocks between tiers.

The torch reference in :mod:`kvtier.kernels.fallback` is exact and runs on any device; the CUDA
kernels (compiled at run time with CuPy, DESIGN §6) will sit beside it with the same signatures.
Importing this package never needs CUDA.
"""

from kvtier.kernels.fallback import copy_blocks, layer_logical_view, pack_blocks, unpack_blocks

__all__ = ["copy_blocks", "layer_logical_view", "pack_blocks", "unpack_blocks"]
