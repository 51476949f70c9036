"""The copy-engine path's run merging: the same bytes land in the same places as one copy per piece."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import LayoutMismatch
from kvtier.kernels.copy_engine import MemcpyRun, coalesce
from tests.gpu_support import requires_gpu


def apply(runs: list[MemcpyRun], dst: torch.Tensor, src: torch.Tensor) -> None:
    """What the copy engine does with ``runs``, on two byte arenas addressed from 0 (dst) and 1 << 40
    (src)."""
    for run in runs:
        s = run.src - (1 << 40)
        dst[run.dst:run.dst + run.num_bytes] = src[s:s + run.num_bytes]


def test_adjacent_pieces_merge_and_others_stay_apart() -> None:
    assert coalesce([0, 4, 8, 20, 24], [100, 104, 108, 50, 54], 4) == [
        MemcpyRun(0, 100, 12), MemcpyRun(20, 50, 8)]
    # only dst continues
    assert coalesce([0, 4], [100, 200], 4) == [MemcpyRun(0, 100, 4), MemcpyRun(4, 200, 4)]
    assert coalesce([8, 4], [104, 100], 4) == [MemcpyRun(8, 104, 4), MemcpyRun(4, 100, 4)]  # never reordered
    assert coalesce([], [], 4) == []


def test_refuses_mismatched_lists_and_empty_pieces() -> None:
    with pytest.raises(LayoutMismatch, match="2 destination addresses but 1 source"):
        coalesce([0, 4], [0], 4)
    with pytest.raises(LayoutMismatch, match="piece_bytes must be positive"):
        coalesce([0], [0], 0)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 24), st.lists(st.tuples(st.integers(0, 15), st.integers(0, 15)), max_size=24))
def test_runs_move_the_same_bytes_as_one_copy_per_piece(piece: int, pairs: list[tuple[int, int]]) -> None:
    dst = [d * piece for d, _ in pairs]
    src = [(1 << 40) + s * piece for _, s in pairs]
    source = torch.randint(0, 256, (16 * piece,), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(piece))
    merged, single = torch.zeros(16 * piece, dtype=torch.uint8), torch.zeros(16 * piece, dtype=torch.uint8)
    runs = coalesce(dst, src, piece)
    apply(runs, merged, source)
    apply([MemcpyRun(d, s, piece) for d, s in zip(dst, src, strict=True)], single, source)
    assert torch.equal(merged, single)
    assert sum(run.num_bytes for run in runs) == piece * len(pairs) and len(runs) <= len(pairs)


@requires_gpu
def test_memcpy_async_moves_runs_between_device_and_pinned_host() -> None:
    from kvtier.kernels.copy_engine import memcpy_async

    device = torch.device("cuda", torch.cuda.current_device())
    src = torch.randint(0, 256, (8, 4096), dtype=torch.uint8, device=device)
    host = torch.zeros((8, 4096), dtype=torch.uint8).pin_memory()
    order = [2, 3, 4, 0, 7]
    runs = coalesce([host[i].data_ptr() for i in range(5)], [src[i].data_ptr() for i in order], 4096)
    assert len(runs) == 3
    stream = torch.cuda.Stream(device)
    memcpy_async(runs, device, stream)
    stream.synchronize()
    assert torch.equal(host[:5], src[order].cpu())
