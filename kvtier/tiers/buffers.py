"""Byte buffers shared by the tiers: page-aligned allocation and batching of block rows."""

from __future__ import annotations

import mmap
from collections.abc import Sequence

import numpy as np
import torch

PAGE = mmap.PAGESIZE


def aligned_empty(num_bytes: int) -> torch.Tensor:
    """A page-aligned uint8 CPU tensor (an anonymous mapping): fast for preadv/pwritev and O_DIRECT."""
    mapping = mmap.mmap(-1, max(num_bytes, 1))
    return torch.from_numpy(np.frombuffer(mapping, dtype=np.uint8, count=num_bytes))


def is_aligned(buf: torch.Tensor, alignment: int = PAGE) -> bool:
    return buf.data_ptr() % alignment == 0


def as_rows(buffers: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``[n, nbytes]`` view when the 1-D buffers are consecutive equal-size rows of one tensor, else None.

    Callers usually hand kvtier one ``[n, *block_shape]`` tensor; recognising it lets a batch move
    with one indexed copy instead of n.
    """
    first = buffers[0]
    n, size = len(buffers), first.numel()
    base = first.data_ptr()
    # the view below is built over ``first``'s storage: rows at the buffers' addresses are the buffers
    if [buf.data_ptr() for buf in buffers] != list(range(base, base + n * size, size)) or size == 0:
        return None
    if any(buf.numel() != size for buf in buffers):
        return None
    storage = first.untyped_storage()
    offset = first.storage_offset()
    if offset + n * size > storage.nbytes():
        return None
    return torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage, offset, (n, size), (size, 1))


def strided_rows(array: np.ndarray, rows: Sequence[int]) -> np.ndarray | None:
    """A view of ``array[rows]`` when ``rows`` step evenly (``5, 6, 7`` or ``9, 8, 7``), else None.

    A memory tier's slots for a batch usually are such a run (a free list hands them out in order), and
    one ``np.copyto`` over the view moves the batch in one call instead of one per block.
    """
    n = len(rows)
    if n == 0:
        return None
    first = rows[0]
    if n == 1:
        return array[first:first + 1]
    step = rows[1] - rows[0]
    if step == 0 or rows != list(range(first, first + step * n, step)):
        return None
    last = first + step * (n - 1)
    if step > 0:
        return array[first:last + 1:step]
    return array[first:last - 1 if last > 0 else None:step]
