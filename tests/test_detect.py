"""Layout detection: cross-layer vs per-layer vs MLA from shapes and strides, without copies."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvtier.detect import DetectedKVLayout, detect_kv_layout, make_cross_layer_kv
from kvtier.errors import LayoutMismatch
from kvtier.kernels import copy_blocks, pack_blocks, unpack_blocks
from kvtier.layout import BlockLayout, PerLayerKind, PerLayerLayout, TokenLayout

FA = PerLayerLayout(PerLayerKind.FLASH_ATTN, "NHD")
GEOMETRY = {"block_size": 4, "num_kv_heads": 2, "head_dim": 8}


def filled(shape: tuple[int, ...], dtype: torch.dtype = torch.float16) -> torch.Tensor:
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape).to(dtype)


def detect(layers: list[torch.Tensor] | dict[str, torch.Tensor], **kwargs: object) -> DetectedKVLayout:
    return detect_kv_layout(layers, **{**GEOMETRY, **kwargs})  # type: ignore[arg-type]


@pytest.mark.parametrize("token_layout", ["NHD", "HND"])
def test_make_cross_layer_kv_views_share_the_buffer(token_layout: TokenLayout) -> None:
    block = BlockLayout(3, 2, 8, 4, torch.float16, token_layout=token_layout)
    base, views = make_cross_layer_kv(5, block)
    assert base.shape == (5, *block.shape) and base.is_contiguous()
    assert len(views) == 3 and all(view.shape == (2, 5, 4, 2, 8) for view in views)
    assert all(view.untyped_storage().data_ptr() == base.data_ptr() for view in views)
    views[2][1, 4, 3, 0, 5] = 9.0  # V of layer 2, block 4, token 3, head 0, dim 5
    assert block.logical_view(base)[4, 2, 1, 3, 0, 5] == 9.0
    assert int(torch.count_nonzero(base)) == 1


@pytest.mark.parametrize("token_layout", ["NHD", "HND"])
def test_cross_layer_is_detected_and_base_is_the_engine_storage(token_layout: TokenLayout) -> None:
    block = BlockLayout(3, 2, 8, 4, torch.bfloat16, token_layout=token_layout)
    base, views = make_cross_layer_kv(6, block)
    base.copy_(filled(tuple(base.shape), torch.bfloat16))
    found = detect(views)
    assert found.cross_layer and found.per_layer is None
    assert (found.num_blocks, found.num_layers, found.block) == (6, 3, block)
    assert found.base is not None
    assert found.base.data_ptr() == base.untyped_storage().data_ptr()
    assert found.base.stride() == base.stride() and found.base.shape == base.shape
    assert torch.equal(found.base, base)


def test_cross_layer_base_agrees_with_packing_the_views() -> None:
    """One copy of ``base[b]`` moves exactly what packing the per-layer views would."""
    block = BlockLayout(4, 2, 8, 4, torch.float16, token_layout="HND")
    base, views = make_cross_layer_kv(7, block)
    base.copy_(filled(tuple(base.shape)))
    found = detect({f"model.layers.{i}.self_attn": view for i, view in enumerate(views)})
    assert found.base is not None
    ids = torch.tensor([5, 0, 3])
    packed = torch.empty((3, *block.shape), dtype=block.dtype)
    pack_blocks(views, ids, FA, found.block, packed)
    copied = torch.empty_like(packed)
    copy_blocks(found.base, ids, copied, torch.arange(3))
    assert torch.equal(packed, copied)


def test_flashinfer_cross_layer_and_padded_block_stride() -> None:
    """FlashInfer-shaped views of ``[blocks, layers(+spare), 2, tokens, heads, dim]`` are cross-layer."""
    buffer = filled((5, 4, 2, 4, 2, 8))
    views = [buffer[:, layer] for layer in range(3)]  # layer 3 is spare room in every block
    found = detect(views)
    assert found.cross_layer and found.block.num_layers == 3 and found.block.token_layout == "NHD"
    assert found.base is not None and found.base.stride(0) == buffer.stride(0)
    assert torch.equal(found.base[2], buffer[2, :3])


@pytest.mark.parametrize("per_layer", [PerLayerLayout(kind, token_layout)
                                       for kind in (PerLayerKind.FLASH_ATTN, PerLayerKind.FLASHINFER)
                                       for token_layout in ("NHD", "HND")],
                         ids=lambda p: f"{p.kind.value}-{p.token_layout}")
def test_separate_tensors_are_per_layer(per_layer: PerLayerLayout) -> None:
    block = BlockLayout(3, num_kv_heads=2, head_dim=8, block_size=4)
    layers = [torch.zeros(per_layer.layer_shape(7, block), dtype=torch.float16) for _ in range(3)]
    found = detect(layers)
    assert not found.cross_layer and found.base is None
    assert found.per_layer == per_layer and found.num_blocks == 7 and found.num_layers == 3
    assert found.block == BlockLayout(3, 2, 8, 4, torch.float16, token_layout=per_layer.token_layout)


def test_one_storage_but_layer_major_is_per_layer() -> None:
    buffer = torch.zeros((3, 2, 5, 4, 2, 8), dtype=torch.float16)
    assert not detect(list(buffer.unbind(0))).cross_layer


def test_layers_out_of_storage_order_are_per_layer_and_still_pack_correctly() -> None:
    block = BlockLayout(3, 2, 8, 4, torch.float16)
    base, views = make_cross_layer_kv(5, block)
    base.copy_(filled(tuple(base.shape)))
    shuffled = [views[1], views[0], views[2]]
    found = detect(shuffled)
    assert not found.cross_layer and found.per_layer == FA
    restored = [torch.zeros_like(view) for view in shuffled]
    packed = torch.empty((2, *found.block.shape), dtype=block.dtype)
    pack_blocks(shuffled, torch.tensor([4, 2]), FA, found.block, packed)
    unpack_blocks(packed, restored, torch.tensor([4, 2]), FA, found.block)
    assert all(torch.equal(back[:, [4, 2]], view[:, [4, 2]])
               for back, view in zip(restored, shuffled, strict=True))


def test_mla_per_layer_and_cross_layer() -> None:
    layers = [torch.zeros((6, 4, 576), dtype=torch.bfloat16) for _ in range(2)]
    found = detect_kv_layout(layers, block_size=4, num_kv_heads=1, head_dim=576)
    assert not found.cross_layer and found.per_layer == PerLayerLayout(PerLayerKind.MLA)
    assert found.block == BlockLayout(2, 1, 576, 4, torch.bfloat16, kv_factor=1)

    block = BlockLayout(3, 1, 576, 4, torch.bfloat16, kv_factor=1)
    base, views = make_cross_layer_kv(6, block)
    assert views[0].shape == (6, 4, 576)
    found = detect_kv_layout(views, block_size=4, num_kv_heads=1, head_dim=576)
    assert found.cross_layer and found.block == block
    assert found.base is not None and found.base.data_ptr() == base.data_ptr()


def test_mla_needs_one_head() -> None:
    with pytest.raises(LayoutMismatch, match=r"MLA, which has one latent head: pass num_kv_heads=1"):
        detect_kv_layout([torch.zeros((6, 4, 576))], block_size=4, num_kv_heads=8, head_dim=576)
    with pytest.raises(LayoutMismatch, match=r"one latent head"):
        make_cross_layer_kv(2, BlockLayout(1, 2, 8, 4, kv_factor=1))


def test_two_blocks_is_ambiguous_unless_hinted() -> None:
    layers = [torch.zeros((2, 2, 4, 2, 8)) for _ in range(2)]
    with pytest.raises(LayoutMismatch, match=r"layer 0 has shape \(2, 2, 4, 2, 8\), which fits several.*"
                                             r"FLASH_ATTN.*FLASHINFER.*pass hint="):
        detect(layers)
    assert detect(layers, hint=PerLayerKind.FLASHINFER).per_layer == PerLayerLayout(PerLayerKind.FLASHINFER)
    assert detect(layers, hint=PerLayerKind.FLASH_ATTN).per_layer == FA


def test_block_size_equal_to_heads_needs_a_full_hint() -> None:
    layers = [torch.zeros((2, 5, 4, 4, 8)) for _ in range(2)]
    with pytest.raises(LayoutMismatch, match=r"'NHD'.*'HND'.*pass hint="):
        detect(layers, num_kv_heads=4)
    with pytest.raises(LayoutMismatch, match=r"fits several"):
        detect(layers, num_kv_heads=4, hint=PerLayerKind.FLASH_ATTN)
    hinted = PerLayerLayout(PerLayerKind.FLASH_ATTN, "HND")
    found = detect(layers, num_kv_heads=4, hint=hinted)
    assert found.per_layer == hinted and found.block.token_layout == "HND"


def test_hint_that_does_not_fit_is_an_error() -> None:
    with pytest.raises(LayoutMismatch, match=r"does not fit hint"):
        detect([torch.zeros((2, 5, 4, 2, 8))], hint=PerLayerKind.FLASHINFER)
    with pytest.raises(LayoutMismatch, match=r"hint must be a PerLayerKind or PerLayerLayout"):
        detect([torch.zeros((2, 5, 4, 2, 8))], hint="paged")


def test_errors_name_the_bad_layer() -> None:
    good = torch.zeros((2, 5, 4, 2, 8), dtype=torch.float16)
    with pytest.raises(LayoutMismatch, match=r"model.layers.1 is \(2, 5, 4, 2, 8\) torch.float32 .* "
                                             r"model.layers.0 is \(2, 5, 4, 2, 8\) torch.float16"):
        detect({"model.layers.0": good, "model.layers.1": good.float()})
    with pytest.raises(LayoutMismatch, match=r"layer 1 is \(2, 6, 4, 2, 8\)"):
        detect([good, torch.zeros((2, 6, 4, 2, 8), dtype=torch.float16)])
    with pytest.raises(LayoutMismatch,
                       match=r"layer 0 has shape \(2, 5, 4, 3, 8\), which is no paged KV layout"):
        detect([torch.zeros((2, 5, 4, 3, 8))])
    with pytest.raises(LayoutMismatch, match=r"dtype torch.int32 is not supported"):
        detect([torch.zeros((2, 5, 4, 2, 8), dtype=torch.int32)])
    with pytest.raises(LayoutMismatch, match=r"kv_caches is empty"):
        detect([])
    with pytest.raises(LayoutMismatch, match=r"layer 1 must be a torch.Tensor, got list"):
        detect([good, [1, 2]])  # type: ignore[list-item]


def test_offset_views_keep_their_offset_in_base() -> None:
    """Cross-layer views that start inside a larger allocation: ``base`` starts where they do."""
    block = BlockLayout(2, 2, 8, 4, torch.float16)
    arena = torch.zeros(100 + 5 * block.numel, dtype=torch.float16)
    base = arena[100:].view(5, *block.shape)
    views = [block.logical_view(base)[:, layer].transpose(0, 1) for layer in range(2)]
    found = detect(views)
    assert found.cross_layer and found.base is not None
    assert found.base.data_ptr() == arena.data_ptr() + 100 * 2
    found.base[3, 1, 0, 2, 1, 7] = 5.0
    assert views[1][0, 3, 2, 1, 7] == 5.0


@settings(max_examples=40, deadline=None)
@given(num_layers=st.integers(1, 4), heads=st.integers(1, 4), head_dim=st.integers(1, 16),
       block_size=st.integers(1, 8), num_blocks=st.integers(1, 6),
       token_layout=st.sampled_from(["NHD", "HND"]),
       dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn]))
def test_detection_recovers_any_cross_layer_buffer(num_layers: int, heads: int, head_dim: int,
                                                   block_size: int, num_blocks: int,
                                                   token_layout: TokenLayout, dtype: torch.dtype) -> None:
    assume(num_blocks != 2 and block_size != heads)
    # with a unit dim NHD and HND are one layout
    assume(heads > 1 and block_size > 1 or token_layout == "NHD")
    block = BlockLayout(num_layers, heads, head_dim, block_size, dtype, token_layout=token_layout)
    base, views = make_cross_layer_kv(num_blocks, block)
    found = detect_kv_layout(views, block_size=block_size, num_kv_heads=heads, head_dim=head_dim)
    assert found.cross_layer and found.block == block and found.num_blocks == num_blocks
    assert found.base is not None and found.base.data_ptr() == base.data_ptr()
    assert found.base.stride() == base.stride()
