"""Byte buffers shared by the tiers: page-aligned allocation and batching of block rows."""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from typing import overload

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


class RowBatch(Sequence[torch.Tensor]):
    """A caller's ``[n, nbytes]`` uint8 batch seen as n blocks, without making n row tensors.

    The cache passes blocks around as sequences; a row tensor is made only when one is asked for,
    while a tier that copies whole batches (the CPU tier) gets the rows it needs as one tensor
    (:meth:`take`): one check and one copy per batch instead of one per block.
    """

    __slots__ = ("rows",)

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    @overload
    def __getitem__(self, i: int) -> torch.Tensor: ...

    @overload
    def __getitem__(self, i: slice) -> RowBatch: ...

    def __getitem__(self, i: int | slice) -> torch.Tensor | RowBatch:
        if isinstance(i, slice):
            return RowBatch(self.rows[i])
        return self.rows[i]

    def take(self, idx: Sequence[int], *, writable: bool) -> torch.Tensor | None:
        """Rows ``idx`` as one ``[len(idx), nbytes]`` tensor: a view when they are consecutive (a
        batch's usual case); a copy otherwise, or None when ``writable`` (a copy would swallow what a
        read writes into it)."""
        if not idx:
            return None
        first = idx[0]
        if idx[-1] - first == len(idx) - 1 and list(idx) == list(range(first, first + len(idx))):
            return self.rows[first:first + len(idx)]
        if writable:
            return None
        return self.rows[torch.tensor(list(idx), dtype=torch.long)]
