"""The torch reference kernels: bit-exact pack/unpack/copy for every layout, and errors that name the
culprit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import LayoutMismatch
from kvtier.kernels import copy_blocks, pack_blocks, unpack_blocks
from kvtier.layout import BlockLayout, PerLayerKind, PerLayerLayout, TokenLayout

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn]
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
LAYOUTS = [PerLayerLayout(kind, token_layout)
           for kind in (PerLayerKind.FLASH_ATTN, PerLayerKind.FLASHINFER) for token_layout in ("NHD", "HND")]
LAYOUTS.append(PerLayerLayout(PerLayerKind.MLA))


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(BITS[tensor.element_size()])


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal bit for bit (NaNs included), which ``torch.equal`` on floats is not."""
    assert actual.shape == expected.shape
    assert torch.equal(bits(actual), bits(expected))


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Arbitrary bit patterns (NaNs, infinities, subnormals) of ``dtype``."""
    width = BITS[torch.empty((), dtype=dtype).element_size()]
    info = torch.iinfo(width)
    return torch.randint(info.min, info.max, shape, dtype=width, generator=generator).view(dtype)


def geometry(per_layer: PerLayerLayout, dtype: torch.dtype, token_layout: TokenLayout, num_layers: int = 3,
             heads: int = 2, head_dim: int = 8, block_size: int = 4) -> BlockLayout:
    if per_layer.kind is PerLayerKind.MLA:
        return BlockLayout(num_layers, 1, head_dim, block_size, dtype, kv_factor=1, token_layout=token_layout)
    return BlockLayout(num_layers, heads, head_dim, block_size, dtype, token_layout=token_layout)


def make_layers(per_layer: PerLayerLayout, block: BlockLayout, num_blocks: int,
                seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [random_tensor(per_layer.layer_shape(num_blocks, block), block.dtype, generator)
            for _ in range(block.num_layers)]


def naive_block(layers: list[torch.Tensor], engine_block: int, per_layer: PerLayerLayout,
                block: BlockLayout) -> torch.Tensor:
    """One cross-layer block assembled piece by piece, layer by layer, K then V: the obvious way."""
    pieces = []
    for layer in layers:
        if per_layer.kind is PerLayerKind.MLA:
            pieces.append(layer[engine_block][None, :, None, :])  # (kv=1, tokens, heads=1, dim)
            continue
        kv = []
        for k in range(2):
            flash = per_layer.kind is PerLayerKind.FLASH_ATTN
            piece = layer[k, engine_block] if flash else layer[engine_block, k]
            kv.append(piece if per_layer.token_layout == "NHD" else piece.transpose(0, 1))
        pieces.append(torch.stack(kv))
    logical = torch.stack(pieces)  # (layers, kv, tokens, heads, dim)
    return logical if block.token_layout == "NHD" else logical.transpose(2, 3)


def engine_blocks(layer: torch.Tensor, per_layer: PerLayerLayout, ids: torch.Tensor) -> torch.Tensor:
    return layer[:, ids] if per_layer.kind is PerLayerKind.FLASH_ATTN else layer[ids]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_token_layout", ["NHD", "HND"])
@pytest.mark.parametrize("per_layer", LAYOUTS, ids=lambda p: f"{p.kind.value}-{p.token_layout}")
def test_pack_matches_naive_and_round_trips(per_layer: PerLayerLayout, block_token_layout: TokenLayout,
                                            dtype: torch.dtype) -> None:
    block = geometry(per_layer, dtype, block_token_layout)
    layers = make_layers(per_layer, block, num_blocks=9)
    ids = torch.tensor([7, 2, 5, 0, 8])
    out = torch.empty((len(ids), *block.shape), dtype=dtype)
    pack_blocks(layers, ids, per_layer, block, out)
    for i, engine_block in enumerate(ids.tolist()):
        assert_bits_equal(out[i], naive_block(layers, engine_block, per_layer, block))

    restored = [torch.zeros_like(layer) for layer in layers]
    unpack_blocks(out, restored, ids, per_layer, block)
    untouched = torch.tensor(sorted(set(range(9)) - set(ids.tolist())))
    for original, back in zip(layers, restored, strict=True):
        assert_bits_equal(engine_blocks(back, per_layer, ids), engine_blocks(original, per_layer, ids))
        assert not bits(engine_blocks(back, per_layer, untouched)).any()


@settings(max_examples=60, deadline=None)
@given(data=st.data(), per_layer=st.sampled_from(LAYOUTS), dtype=st.sampled_from(DTYPES),
       block_token_layout=st.sampled_from(["NHD", "HND"]), num_layers=st.integers(1, 4),
       heads=st.integers(1, 4), head_dim=st.integers(1, 16), block_size=st.integers(1, 8),
       num_blocks=st.integers(1, 12))
def test_round_trip_any_geometry(data: st.DataObject, per_layer: PerLayerLayout, dtype: torch.dtype,
                                 block_token_layout: TokenLayout, num_layers: int, heads: int, head_dim: int,
                                 block_size: int, num_blocks: int) -> None:
    block = geometry(per_layer, dtype, block_token_layout, num_layers, heads, head_dim, block_size)
    layers = make_layers(per_layer, block, num_blocks, seed=data.draw(st.integers(0, 2**16)))
    chosen = data.draw(st.lists(st.integers(0, num_blocks - 1), unique=True, max_size=num_blocks))
    ids = torch.tensor(chosen, dtype=data.draw(st.sampled_from([torch.int64, torch.int32])))
    out = torch.empty((len(chosen), *block.shape), dtype=dtype)
    pack_blocks(layers, ids, per_layer, block, out)
    for i, engine_block in enumerate(chosen):
        assert_bits_equal(out[i], naive_block(layers, engine_block, per_layer, block))
    restored = [torch.zeros_like(layer) for layer in layers]
    unpack_blocks(out, restored, ids, per_layer, block)
    if chosen:
        index = torch.tensor(chosen)
        for original, back in zip(layers, restored, strict=True):
            assert_bits_equal(engine_blocks(back, per_layer, index),
                              engine_blocks(original, per_layer, index))


def test_pack_writes_into_strided_out_in_place() -> None:
    """``out`` may be a strided view (every other slot of a slab); the slab itself is written."""
    per_layer = PerLayerLayout(PerLayerKind.FLASH_ATTN, "HND")
    block = geometry(per_layer, torch.float16, "NHD")
    layers = make_layers(per_layer, block, num_blocks=6)
    slab = torch.zeros((8, *block.shape), dtype=torch.float16)
    ids = torch.tensor([4, 1, 3, 5])
    pointer = slab.data_ptr()
    pack_blocks(layers, ids, per_layer, block, slab[::2])
    assert slab.data_ptr() == pointer
    for i, engine_block in enumerate(ids.tolist()):
        assert_bits_equal(slab[2 * i], naive_block(layers, engine_block, per_layer, block))
        assert not bits(slab[2 * i + 1]).any()


def test_empty_ids_are_a_no_op() -> None:
    per_layer = PerLayerLayout(PerLayerKind.FLASHINFER)
    block = geometry(per_layer, torch.float16, "NHD")
    layers = make_layers(per_layer, block, num_blocks=3)
    out = torch.empty((0, *block.shape), dtype=torch.float16)
    pack_blocks(layers, torch.tensor([], dtype=torch.int64), per_layer, block, out)
    unpack_blocks(out, layers, torch.tensor([], dtype=torch.int64), per_layer, block)


FA = PerLayerLayout(PerLayerKind.FLASH_ATTN)
FA_BLOCK = geometry(FA, torch.float16, "NHD", num_layers=4)


@pytest.fixture
def fa_layers() -> list[torch.Tensor]:
    return make_layers(FA, FA_BLOCK, num_blocks=5)


def fa_out(count: int) -> torch.Tensor:
    return torch.full((count, *FA_BLOCK.shape), 7.0, dtype=torch.float16)


def test_error_names_the_bad_layer_and_nothing_is_written(fa_layers: list[torch.Tensor]) -> None:
    fa_layers[3] = torch.zeros((2, 5, 4, 3, 8), dtype=torch.float16)
    out = fa_out(2)
    with pytest.raises(LayoutMismatch,
                       match=r"layer 3 has shape \(2, 5, 4, 3, 8\), expected \(2, 5, 4, 2, 8\)"):
        pack_blocks(fa_layers, torch.tensor([0, 1]), FA, FA_BLOCK, out)
    assert bool((out == 7).all())


def test_error_names_the_bad_dtype(fa_layers: list[torch.Tensor]) -> None:
    fa_layers[2] = fa_layers[2].float()
    with pytest.raises(LayoutMismatch, match=r"layer 2 has dtype torch.float32, expected torch.float16"):
        pack_blocks(fa_layers, torch.tensor([0]), FA, FA_BLOCK, fa_out(1))


def test_error_on_layer_count(fa_layers: list[torch.Tensor]) -> None:
    with pytest.raises(LayoutMismatch, match=r"sequence of 4 per-layer tensors .* got 3 tensors"):
        pack_blocks(fa_layers[:3], torch.tensor([0]), FA, FA_BLOCK, fa_out(1))


def test_error_on_out_shape_and_dtype(fa_layers: list[torch.Tensor]) -> None:
    with pytest.raises(LayoutMismatch,
                       match=r"out has shape \(3, 4, 2, 4, 2, 8\), expected \(2, 4, 2, 4, 2, 8\)"):
        pack_blocks(fa_layers, torch.tensor([0, 1]), FA, FA_BLOCK, fa_out(3))
    with pytest.raises(LayoutMismatch, match=r"out has dtype torch.bfloat16"):
        pack_blocks(fa_layers, torch.tensor([0]), FA, FA_BLOCK, fa_out(1).bfloat16())
    with pytest.raises(LayoutMismatch, match=r"blocks has shape"):
        unpack_blocks(fa_out(1), fa_layers, torch.tensor([0, 1]), FA, FA_BLOCK)


def test_error_on_block_ids(fa_layers: list[torch.Tensor]) -> None:
    with pytest.raises(LayoutMismatch, match=r"block_ids \[5, -1\] out of range \[0, 5\)"):
        pack_blocks(fa_layers, torch.tensor([0, 5, -1]), FA, FA_BLOCK, fa_out(3))
    with pytest.raises(LayoutMismatch, match=r"1-D integer tensor"):
        pack_blocks(fa_layers, torch.tensor([0.0]), FA, FA_BLOCK, fa_out(1))
    with pytest.raises(LayoutMismatch, match=r"must be a torch.Tensor of block ids, got list"):
        pack_blocks(fa_layers, [0], FA, FA_BLOCK, fa_out(1))  # type: ignore[arg-type]
    with pytest.raises(LayoutMismatch, match=r"block_ids must not repeat a block, got \[2\]"):
        unpack_blocks(fa_out(3), fa_layers, torch.tensor([2, 0, 2]), FA, FA_BLOCK)


def test_pack_allows_repeated_ids(fa_layers: list[torch.Tensor]) -> None:
    out = fa_out(2)
    pack_blocks(fa_layers, torch.tensor([3, 3]), FA, FA_BLOCK, out)
    assert_bits_equal(out[0], out[1])


def test_error_on_kind_and_kv_factor(fa_layers: list[torch.Tensor]) -> None:
    mla = PerLayerLayout(PerLayerKind.MLA)
    with pytest.raises(LayoutMismatch, match=r"MLA layers pack into blocks with kv_factor=1"):
        pack_blocks(fa_layers, torch.tensor([0]), mla, FA_BLOCK, fa_out(1))
    mla_block = geometry(mla, torch.float16, "NHD", num_layers=4)
    with pytest.raises(LayoutMismatch, match=r"flash_attn layers hold K and V"):
        pack_blocks(fa_layers, torch.tensor([0]), FA, mla_block, torch.empty((1, *mla_block.shape)))


def byte_slab(count: int, block: BlockLayout, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (count, block.nbytes), dtype=torch.uint8, generator=generator)


def test_copy_blocks_between_typed_and_byte_buffers() -> None:
    block = BlockLayout(2, 2, 8, 4, torch.bfloat16, token_layout="HND")
    typed = random_tensor((6, *block.shape), block.dtype, torch.Generator().manual_seed(1))
    host = byte_slab(5, block, seed=2)
    before = host.clone()
    copy_blocks(typed, torch.tensor([4, 0, 5]), host, torch.tensor([1, 3, 0]))
    for src, dst in ((4, 1), (0, 3), (5, 0)):
        assert torch.equal(host[dst], typed[src].reshape(-1).view(torch.uint8))
    assert torch.equal(host[[2, 4]], before[[2, 4]])

    back = torch.zeros_like(typed)
    copy_blocks(host, torch.tensor([1, 3]), back, torch.tensor([2, 5]))
    assert_bits_equal(back[[2, 5]], typed[[4, 0]])
    assert not bits(back[[0, 1, 3, 4]]).any()


def test_copy_blocks_into_a_strided_slab_and_within_one_buffer() -> None:
    block = BlockLayout(1, 1, 8, 2, torch.float32)
    slab = byte_slab(8, block, seed=3)
    original = slab.clone()
    # overlapping: as if simultaneous
    copy_blocks(slab, torch.tensor([0, 1, 2]), slab, torch.tensor([1, 2, 3]))
    assert torch.equal(slab[1:4], original[0:3])
    every_other = slab[::2]
    copy_blocks(original, torch.tensor([7, 6]), every_other, torch.tensor([0, 3]))
    assert torch.equal(slab[0], original[7]) and torch.equal(slab[6], original[6])


@pytest.mark.parametrize("block_bytes", [64, 12, 3])
def test_copy_blocks_into_a_permuted_run_of_slots(block_bytes: int) -> None:
    """Destination ids that fill a run of slots (any order) take the direct path; any block width works."""
    src = torch.randint(0, 256, (6, block_bytes), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(4))
    dst = torch.zeros((5, block_bytes), dtype=torch.uint8)
    copy_blocks(src, torch.tensor([5, 0, 2]), dst, torch.tensor([3, 1, 2]))
    assert torch.equal(dst[1], src[0]) and torch.equal(dst[2], src[2]) and torch.equal(dst[3], src[5])
    assert not dst[[0, 4]].any()


def test_copy_blocks_errors() -> None:
    block = BlockLayout(1, 1, 8, 2, torch.float32)
    src, dst = byte_slab(4, block, 0), byte_slab(4, block, 1)
    with pytest.raises(LayoutMismatch, match=r"src blocks have 128 bytes .* dst blocks have 32"):
        copy_blocks(src, torch.tensor([0]), dst[:, :32], torch.tensor([0]))
    with pytest.raises(LayoutMismatch, match=r"src_ids \[4\] out of range \[0, 4\)"):
        copy_blocks(src, torch.tensor([4]), dst, torch.tensor([0]))
    with pytest.raises(LayoutMismatch, match=r"dst_ids must not repeat a block"):
        copy_blocks(src, torch.tensor([0, 1]), dst, torch.tensor([3, 3]))
    with pytest.raises(LayoutMismatch, match=r"src_ids has 2 ids but dst_ids has 1"):
        copy_blocks(src, torch.tensor([0, 1]), dst, torch.tensor([3]))
    with pytest.raises(LayoutMismatch, match=r"each block of dst must be one contiguous region"):
        copy_blocks(src.view(4, 2, 64), torch.tensor([0]), dst.view(4, 64, 2).transpose(1, 2),
                    torch.tensor([0]))
    with pytest.raises(LayoutMismatch, match=r"blocks of dst overlap"):
        copy_blocks(src, torch.tensor([0]), dst[:1].expand(4, 128), torch.tensor([0]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_round_trip_on_cuda_and_copy_to_host() -> None:
    per_layer = PerLayerLayout(PerLayerKind.FLASH_ATTN, "HND")
    block = geometry(per_layer, torch.bfloat16, "NHD")
    layers = [layer.cuda() for layer in make_layers(per_layer, block, num_blocks=9)]
    ids = torch.tensor([6, 1, 8])
    out = torch.empty((3, *block.shape), dtype=block.dtype, device="cuda")
    pack_blocks(layers, ids, per_layer, block, out)
    host = torch.zeros((4, block.nbytes), dtype=torch.uint8)
    copy_blocks(out, torch.tensor([0, 1, 2]), host, torch.tensor([3, 0, 1]))
    for i, engine_block in enumerate(ids.tolist()):
        expected = naive_block([layer.cpu() for layer in layers], engine_block, per_layer, block)
        assert torch.equal(host[(3, 0, 1)[i]], expected.contiguous().view(-1).view(torch.uint8))
    restored = [torch.zeros_like(layer) for layer in layers]
    unpack_blocks(out, restored, ids.cuda(), per_layer, block)
    for original, back in zip(layers, restored, strict=True):
        assert torch.equal(bits(back[:, ids.cuda()]), bits(original[:, ids.cuda()]))
