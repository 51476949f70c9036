"""The shared page mover (kvtier.pages): torch moves against a block-by-block reference, and the CUDA
mover's address math replayed with ``memmove`` on CPU memory."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import LayoutMismatch
from kvtier.pages import CudaPageMover, PageMover, Region, page_mover, transfer_stream


def make_region(kind: str, num_blocks: int, page: int, gen: torch.Generator) -> tuple[Region, torch.Tensor]:
    """A region of ``kind`` and the tensor that owns its memory.

    ``padded``: vLLM's ``(rows, page_bytes)`` with 16 bytes past each page; ``dense``: a
    ``[num_blocks, elements]`` tensor; ``strided``: ``[num_blocks, rows, row]`` rows of a head-major
    tensor, as a transformers cache's ``[heads, tokens, dim]`` read block by block (``page`` = 2 rows);
    ``tokens``: the same tensor read token-major, ``[num_blocks, tokens, heads, dim]`` (rows of ``dim``).
    """
    if kind == "padded":
        owner = torch.randint(-128, 127, (num_blocks, page + 16), dtype=torch.int8, generator=gen)
        return (owner, page), owner
    if kind == "dense":
        owner = torch.randint(-2**15, 2**15 - 1, (num_blocks, page // 2), dtype=torch.int16, generator=gen)
        return owner, owner
    if kind == "strided":
        heads, row = 2, page // 2
        owner = torch.randint(-128, 127, (heads, num_blocks * row + 8), dtype=torch.int8, generator=gen)
        region = owner[:, :num_blocks * row].view(heads, num_blocks, row).permute(1, 0, 2)
        return region, owner
    heads, tokens = 2, 2 if page % 4 == 0 and page % 3 else 3  # token-major pages of a head-major tensor
    dim = page // (heads * tokens)
    owner = torch.randint(-128, 127, (heads, num_blocks * tokens + 1, dim), dtype=torch.int8, generator=gen)
    region = owner[:, :num_blocks * tokens].unflatten(1, (num_blocks, tokens)).permute(1, 2, 0, 3)
    return region, owner


def region_bytes(region: Region) -> torch.Tensor:
    """``[num_blocks, page_bytes]``: each block's page, read independently of the mover."""
    if isinstance(region, tuple):
        rows, page = region
        return rows.view(torch.uint8)[:, :page].clone()
    return torch.stack([block.contiguous().view(torch.uint8).reshape(-1) for block in region])


def reference_blocks(regions: list[Region], ids: list[int], bpc: int) -> torch.Tensor:
    """Offloaded blocks ``[region][engine block][page]``, built one page at a time."""
    pages = [region_bytes(region) for region in regions]
    chunks = []
    for c in range(len(ids) // bpc):
        chunks.append(torch.cat([p[ids[c * bpc + w]] for p in pages for w in range(bpc)]))
    return torch.stack(chunks)


def replay_with_memmove(pieces: list[tuple[int, torch.Tensor, torch.Tensor]], *, into_engine: bool) -> None:
    """Do what the CUDA page mover's kernel launches do with these addresses, with ``memmove`` on the host."""
    for size, engine, cross in pieces:
        for e, c in zip(engine.tolist(), cross.tolist(), strict=True):
            ctypes.memmove(e, c, size) if into_engine else ctypes.memmove(c, e, size)


kinds = st.sampled_from(["padded", "dense", "strided", "tokens"])


@settings(max_examples=80, deadline=None)
@given(data=st.data(), bpc=st.integers(1, 3), layouts=st.lists(kinds, min_size=1, max_size=4),
       sizes=st.lists(st.sampled_from([48, 32, 6]), min_size=4, max_size=4))
def test_gather_and_scatter_move_each_page_to_its_place(data: st.DataObject, bpc: int, layouts: list[str],
                                                        sizes: list[int]) -> None:
    """Torch moves, range ids and the CUDA mover's address math (memmove) all agree with a
    block-by-block reference: chunks, skip, padding past pages, strided rows, pages of several sizes."""
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    num_blocks = 12
    made = [make_region(kind, num_blocks, size, gen) for kind, size in zip(layouts, sizes, strict=False)]
    regions = [region for region, _ in made]
    block_bytes = sum(size for size in sizes[:len(layouts)]) * bpc
    mover = PageMover(regions, bpc, block_bytes)
    assert mover.cross_layer is (len(regions) == 1)
    chunks = data.draw(st.integers(1, num_blocks // bpc))
    ids = data.draw(st.permutations(range(num_blocks)))[:chunks * bpc]
    expected = reference_blocks(regions, ids, bpc)

    got = torch.full((chunks, block_bytes), 0xAB, dtype=torch.uint8)
    mover.gather(torch.tensor(ids), got)
    assert torch.equal(got, expected)
    # numpy ids (a worker's), and the torch copies of devices other than the host: the same blocks
    from_numpy = torch.full_like(got, 0xAB)
    mover.gather(np.array(ids, dtype=data.draw(st.sampled_from([np.int64, np.int32]))), from_numpy)
    assert torch.equal(from_numpy, expected)
    torch_mover = PageMover(regions, bpc, block_bytes)
    torch_mover._host = None  # what a CUDA engine without the kernels runs
    by_torch = torch.full_like(got, 0xAB)
    torch_mover.gather(torch.tensor(ids), by_torch)
    assert torch.equal(by_torch, expected)
    replayed = torch.full_like(got, 0xAB)
    replay_with_memmove(mover.piece_addresses(torch.tensor(ids), replayed.data_ptr()), into_engine=False)
    assert torch.equal(replayed, expected)
    first = data.draw(st.integers(0, num_blocks - chunks * bpc))
    in_order = torch.empty_like(got)
    mover.gather(range(first, first + chunks * bpc), in_order)
    assert torch.equal(in_order, reference_blocks(regions, list(range(first, first + chunks * bpc)), bpc))

    skip = data.draw(st.integers(0, bpc - 1))
    count = data.draw(st.integers(1, chunks * bpc - skip))
    targets = data.draw(st.permutations(range(num_blocks)))[:count]
    owners = [owner for _, owner in made]
    before = [owner.clone() for owner in owners]
    mover.scatter(expected, torch.tensor(targets), skip)
    scattered = [owner.clone() for owner in owners]
    pages = [region_bytes(region) for region in regions]
    offset = 0
    for page, size in zip(pages, sizes, strict=False):
        positions = [skip + k for k in range(count)]
        want = torch.stack([expected[p // bpc, offset + (p % bpc) * size:offset + (p % bpc + 1) * size]
                            for p in positions])
        assert torch.equal(page[targets], want)
        offset += size * bpc
    for move in (lambda: mover.scatter(expected, np.array(targets), skip),
                 lambda: torch_mover.scatter(expected, torch.tensor(targets), skip)):
        for owner, old in zip(owners, before, strict=True):
            owner.copy_(old)
        move()
        for owner, want in zip(owners, scattered, strict=True):
            assert torch.equal(owner, want)
    for owner, old in zip(owners, before, strict=True):
        owner.copy_(old)
    pieces = mover.piece_addresses(torch.tensor(targets), expected.data_ptr(), skip)
    replay_with_memmove(pieces, into_engine=True)
    for owner, want in zip(owners, scattered, strict=True):
        assert torch.equal(owner, want)  # the same pages written, padding and other rows untouched


def test_scatter_by_range_writes_consecutive_blocks() -> None:
    gen = torch.Generator().manual_seed(2)
    (rows, page), owner = make_region("padded", 8, 32, gen)
    mover = PageMover([(rows, page)], 2, 64)
    blocks = torch.randint(0, 255, (2, 64), dtype=torch.uint8, generator=gen)
    before = owner.clone()
    mover.scatter(blocks, range(3, 6), skip=1)
    got = owner.view(torch.uint8)[:, :32]
    assert torch.equal(got[3:6], blocks.view(4, 32)[1:4])
    assert torch.equal(owner[:3], before[:3]) and torch.equal(owner[6:], before[6:])
    assert torch.equal(owner[:, 32:], before[:, 32:])  # past the page: untouched


def test_typed_blocks_move_as_their_bytes() -> None:
    """``out``/``blocks`` may be any contiguous tensor of whole blocks (a cache's ``[n, *layout.shape]``)."""
    layer = torch.randn(6, 2, 4, dtype=torch.float32)
    mover = PageMover([layer.view(6, 8)], 1, 32)
    out = torch.empty((3, 2, 4), dtype=torch.float32)
    mover.gather(torch.tensor([5, 0, 2]), out)
    assert torch.equal(out, layer[[5, 0, 2]])
    mover.scatter(out.flip(0).contiguous(), range(0, 3))
    assert torch.equal(layer[:3], out.flip(0))


def test_block_view_is_the_engine_memory_when_a_block_is_one_contiguous_page() -> None:
    base = torch.zeros((4, 2, 16), dtype=torch.float16)
    cross = PageMover([base.view(4, 32)], 1, 64)
    view = cross.block_view(2)
    assert view is not None and view.data_ptr() == base[2].data_ptr() and view.numel() == 64
    view.fill_(7)
    assert base[2].view(torch.uint8).eq(7).all() and not base[1].any()
    with pytest.raises(LayoutMismatch, match="out of range"):
        cross.block_view(4)
    per_layer = PageMover([base[:, 0], base[:, 1]], 1, 64)
    assert per_layer.block_view(0) is None
    dense = torch.zeros((4, 2, 4, 4), dtype=torch.float16)  # [block, ...] dims that lie densely: one page
    assert PageMover([dense], 1, 64).block_view(1) is not None
    # token-major rows of a head-major page
    assert PageMover([dense.transpose(1, 2)], 1, 64).block_view(1) is None


def test_bad_layouts_and_moves_are_refused_by_name() -> None:
    rows = torch.zeros((4, 64), dtype=torch.int8)
    with pytest.raises(LayoutMismatch, match="model.num_kv_heads"):
        PageMover([(rows, 64)], 1, 128)
    with pytest.raises(LayoutMismatch, match="no KV pages"):
        PageMover([], 1, 64)
    with pytest.raises(LayoutMismatch, match="does not fit rows"):
        PageMover([(rows, 65)], 1, 65)
    with pytest.raises(LayoutMismatch, match="each row of a page must be contiguous"):
        PageMover([torch.zeros((4, 8, 2)).transpose(1, 2)], 1, 64)
    with pytest.raises(LayoutMismatch, match="KV region 1"):
        PageMover([rows, torch.zeros(4)], 1, 128)
    mover = PageMover([(rows, 32)], 2, 64)
    with pytest.raises(LayoutMismatch, match="needs 4 engine block ids, got 3"):
        mover.gather(torch.tensor([0, 1, 2]), torch.empty((2, 64), dtype=torch.uint8))
    with pytest.raises(LayoutMismatch, match=r"in \[0, 4\)"):
        mover.gather(range(2, 6), torch.empty((2, 64), dtype=torch.uint8))
    with pytest.raises(LayoutMismatch, match="do not fit"):
        mover.scatter(torch.empty((1, 64), dtype=torch.uint8), torch.tensor([0, 1]), skip=1)
    with pytest.raises(LayoutMismatch, match="whole blocks"):
        mover.gather(torch.tensor([0, 1]), torch.empty((1, 65), dtype=torch.uint8))


def test_the_torch_mover_is_chosen_off_cuda() -> None:
    assert transfer_stream(torch.device("cpu")) is None
    mover = page_mover([torch.zeros((4, 64), dtype=torch.uint8)], 1, 64, transfer_stream(torch.device("cpu")))
    assert type(mover) is PageMover
    with pytest.raises(LayoutMismatch, match="CUDA device, got cpu"):
        CudaPageMover([torch.zeros((4, 64), dtype=torch.uint8)], 1, 64, stream=None)  # type: ignore[arg-type]


def test_words_follow_every_stride_even_of_a_single_block() -> None:
    """A one-block region whose block stride is 2 bytes moves in 2-byte words, not 8 (torch refuses those)."""
    region = torch.arange(8, dtype=torch.int16).as_strided((1, 4), (1, 1))
    mover = PageMover([region], 1, 8)
    out = torch.empty((1, 8), dtype=torch.uint8)
    mover.gather(torch.tensor([0]), out)
    assert out.view(torch.int16).tolist() == [[0, 1, 2, 3]]
    mover.scatter(torch.full((1, 8), 1, dtype=torch.uint8), range(1))
    assert region.tolist() == [[257] * 4]


@pytest.mark.parametrize("bad", [[-1, 0], [0, 4], [0.0, 1.0]])
def test_engine_block_ids_out_of_range_are_refused_before_any_copy(bad: list[float]) -> None:
    """numpy would wrap a negative id around (another block's pages): refused, and nothing moves."""
    layer = torch.arange(4 * 8, dtype=torch.uint8).view(4, 8)
    before = layer.clone()
    mover = PageMover([layer], 1, 8)
    out = torch.zeros((2, 8), dtype=torch.uint8)
    with pytest.raises(LayoutMismatch, match=r"\[0, 4\)|integers"):
        mover.gather(np.array(bad), out)
    with pytest.raises(LayoutMismatch, match=r"\[0, 4\)|integers"):
        mover.scatter(out + 1, np.array(bad))
    assert not out.any() and torch.equal(layer, before)
