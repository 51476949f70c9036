"""The copy-engine path: ``cudaMemcpyAsync`` over address pairs, adjacent copies merged into one.

The alternative to the kernels of :mod:`kvtier.kernels.cuda` (docs/architecture.md#kernels): the DMA
engines move each contiguous piece, fast for large pieces but with a fixed cost per call, so
:func:`coalesce` (pure Python) merges copies that continue one another. Which path a transfer takes
is :class:`kvtier.tiers.gpu.TransferChoice`'s decision; this module only enqueues.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from kvtier.errors import LayoutMismatch
from kvtier.kernels import cuda

__all__ = ["MemcpyRun", "coalesce", "memcpy_async"]

#: ``cudaMemcpyDefault``: the direction is inferred from the (UVA) addresses.
_CUDA_MEMCPY_DEFAULT = 4


class MemcpyRun(NamedTuple):
    """One ``cudaMemcpyAsync``: ``num_bytes`` from address ``src`` to address ``dst``."""

    dst: int
    src: int
    num_bytes: int


def coalesce(dst: Sequence[int], src: Sequence[int], piece_bytes: int) -> list[MemcpyRun]:
    """Copies of ``piece_bytes`` from ``src[i]`` to ``dst[i]``, in order, merged where both sides continue.

    Piece ``i + 1`` joins the run of piece ``i`` when ``dst[i + 1] == dst[i] + piece_bytes`` and
    ``src[i + 1] == src[i] + piece_bytes``: the run then covers exactly the same bytes, so the result
    moves the same bytes to the same places as one copy per piece. Pieces are not reordered, so a
    piece written twice keeps its last value, as with one copy per piece.
    """
    if len(dst) != len(src):
        raise LayoutMismatch(f"{len(dst)} destination addresses but {len(src)} source addresses")
    if piece_bytes <= 0:
        raise LayoutMismatch(f"piece_bytes must be positive, got {piece_bytes}")
    runs: list[MemcpyRun] = []
    if not dst:
        return runs
    run_dst, run_src, run_bytes = dst[0], src[0], piece_bytes
    for d, s in zip(dst[1:], src[1:], strict=True):
        if d == run_dst + run_bytes and s == run_src + run_bytes:
            run_bytes += piece_bytes
            continue
        runs.append(MemcpyRun(run_dst, run_src, run_bytes))
        run_dst, run_src, run_bytes = d, s, piece_bytes
    runs.append(MemcpyRun(run_dst, run_src, run_bytes))
    return runs


def memcpy_async(runs: Sequence[MemcpyRun], device: torch.device, stream: torch.cuda.Stream) -> None:
    """Enqueue one ``cudaMemcpyAsync`` per run on ``stream``; returns without waiting.

    Addresses are device pointers or page-locked host pointers (UVA); the caller keeps their
    memory alive until the stream has passed the copies.
    """
    cupy = cuda.require_cuda()
    memcpy = cupy.cuda.runtime.memcpyAsync
    handle = stream.cuda_stream
    with cupy.cuda.Device(device.index if device.index is not None else torch.cuda.current_device()):
        for run in runs:
            memcpy(run.dst, run.src, run.num_bytes, _CUDA_MEMCPY_DEFAULT, handle)
