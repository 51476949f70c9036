"""The CUDA kernels: sources compile for sm_90, their index math equals the torch reference on CPU,
they refuse clearly without CUDA, and (on a GPU) every launch equals the fallback bit for bit."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvtier.errors import LayoutMismatch, TierUnavailable
from kvtier.kernels import cuda, fallback
from kvtier.layout import BlockLayout, PerLayerKind, PerLayerLayout, TokenLayout
from tests.gpu_support import requires_gpu

KERNEL_DIR = Path(cuda.__file__).parent
LAYOUTS = [PerLayerLayout(kind, token_layout)
           for kind in (PerLayerKind.FLASH_ATTN, PerLayerKind.FLASHINFER) for token_layout in ("NHD", "HND")]
LAYOUTS.append(PerLayerLayout(PerLayerKind.MLA))
CUDA = torch.cuda.is_available()


def block_layout(per_layer: PerLayerLayout, token_layout: TokenLayout, dtype: torch.dtype = torch.float16,
                 head_dim: int = 8) -> BlockLayout:
    if per_layer.kind is PerLayerKind.MLA:
        return BlockLayout(num_layers=3, num_kv_heads=1, head_dim=head_dim, block_size=4, dtype=dtype,
                           kv_factor=1)
    return BlockLayout(num_layers=3, num_kv_heads=2, head_dim=head_dim, block_size=4, dtype=dtype,
                       token_layout=token_layout)


def arena_layers(per_layer: PerLayerLayout, block: BlockLayout, num_blocks: int, gap: int,
                 seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Random per-layer tensors cut from one byte arena (``gap`` bytes apart) so addresses map to offsets."""
    shape = per_layer.layer_shape(num_blocks, block)
    layer_bytes = torch.Size(shape).numel() * block.itemsize
    arena = torch.randint(0, 256, ((layer_bytes + gap) * block.num_layers,), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(seed))
    layers = [arena[i * (layer_bytes + gap):i * (layer_bytes + gap) + layer_bytes]
              .view(block.dtype).view(shape) for i in range(block.num_layers)]
    return arena, layers


# --- CPU: the .cu sources compile, the index math is right, no CUDA is reported clearly ---------------------


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("source", sorted(p.name for p in KERNEL_DIR.glob("*.cu")))
def test_kernel_compiles_for_sm90_without_spills(source: str, tmp_path: Path) -> None:
    result = subprocess.run(["nvcc", "-arch=sm_90", "-O3", "-std=c++17", "-Xptxas", "-v,-warn-spills",
                             "--cubin", "-o", str(tmp_path / "k.cubin"), str(KERNEL_DIR / source)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert " bytes spill" in result.stderr
    assert all(line.split(" bytes spill")[0].split()[-1] == "0"
               for line in result.stderr.splitlines() if " bytes spill" in line), result.stderr


def test_every_shipped_source_is_listed() -> None:
    assert sorted(cuda.KERNEL_SOURCES) == sorted(p.name for p in KERNEL_DIR.glob("*.cu"))
    source = cuda.kernel_source()
    assert "kvtier_pack_blocks(" in source and "#include" not in source  # NVRTC gets no host headers
    assert f"#define KVTIER_THREADS {cuda.THREADS}\n" in source
    assert f"#define KVTIER_BLOCKS_PER_SM {cuda.BLOCKS_PER_SM}\n" in source


@pytest.mark.parametrize("per_layer", LAYOUTS, ids=lambda p: f"{p.kind.value}-{p.token_layout}")
@pytest.mark.parametrize("token_layout", ["NHD", "HND"])
@pytest.mark.parametrize("head_dim", [8, 3])
def test_kernel_addressing_equals_fallback_pack_and_unpack(per_layer: PerLayerLayout,
                                                           token_layout: TokenLayout,
                                                           head_dim: int) -> None:
    block = block_layout(per_layer, token_layout, head_dim=head_dim)
    arena, layers = arena_layers(per_layer, block, num_blocks=6, gap=50 + 2 * head_dim, seed=head_dim)
    ids = torch.tensor([4, 0, 5, 2])
    geometry = cuda.piece_geometry(layers, per_layer, block)
    if per_layer.kind is not PerLayerKind.MLA and token_layout != per_layer.token_layout:
        assert geometry.rows == block.block_size * block.num_kv_heads
    else:
        assert geometry.rows == 1
    out_stride = block.nbytes + 32
    out = torch.zeros(len(ids) * out_stride, dtype=torch.uint8)
    base = arena.data_ptr()
    ptrs = torch.tensor([layer.data_ptr() - base for layer in layers])
    unit = cuda.vector_unit(*ptrs.tolist(), geometry.engine_block_stride, geometry.engine_kv_stride,
                            geometry.piece_bytes, out_stride,
                            *([geometry.row_bytes, geometry.engine_outer, geometry.engine_inner]
                              if geometry.rows > 1 else []))
    engine, cross = cuda.piece_byte_addresses(geometry, ptrs, ids, 0, torch.arange(len(ids)), out_stride,
                                              unit)
    # wider units than alignment allows leave row tails: the same bytes, in another order
    for wide in (16, 4):
        wide_engine, wide_cross = cuda.piece_byte_addresses(geometry, ptrs, ids, 0, torch.arange(len(ids)),
                                                            out_stride, wide)
        assert torch.equal(torch.sort(wide_cross).values, torch.sort(cross).values)
        assert torch.equal(wide_engine[torch.argsort(wide_cross)], engine[torch.argsort(cross)])
    assert cross.numel() == len(ids) * block.nbytes and cross.unique().numel() == cross.numel()
    out[cross] = arena[engine]

    expected = torch.empty((len(ids), *block.shape), dtype=block.dtype)
    fallback.pack_blocks(layers, ids, per_layer, block, expected)
    packed = out.view(len(ids), out_stride)[:, :block.nbytes]
    assert torch.equal(packed, expected.view(torch.uint8).view(len(ids), block.nbytes))

    before = arena.clone()
    restored = arena.clone()
    restored[engine] = out[cross]
    assert torch.equal(restored, before)  # unpack of the packed bytes writes back exactly what was there
    fresh = torch.randint(0, 256, expected.view(torch.uint8).shape, dtype=torch.uint8).view(block.dtype)
    fresh = fresh.view(expected.shape)
    fallback.unpack_blocks(fresh, layers, ids, per_layer, block)
    mirrored = before.clone()
    mirrored[engine] = fresh.view(torch.uint8).reshape(-1)[
        (cross // out_stride) * block.nbytes + cross % out_stride]
    assert torch.equal(mirrored, arena)


def test_tails_fall_back_to_narrower_units() -> None:
    assert cuda.vector_unit(4096, 2 * 1024 * 1024) == 16
    assert cuda.vector_unit(4096, 6) == 2
    assert cuda.vector_unit(4096, 3) == 1


@pytest.mark.skipif(CUDA, reason="checks the no-CUDA message; this machine has CUDA")
def test_kernels_raise_tier_unavailable_without_cuda() -> None:
    block = block_layout(LAYOUTS[0], "NHD")
    _, layers = arena_layers(LAYOUTS[0], block, 4, 0, 0)
    out = torch.empty((1, *block.shape), dtype=block.dtype)
    for call in (lambda: cuda.pack_blocks(layers, torch.tensor([1]), LAYOUTS[0], block, out),
                 lambda: cuda.unpack_blocks(out, layers, torch.tensor([1]), LAYOUTS[0], block),
                 lambda: cuda.copy_blocks(out, torch.tensor([0]), out, torch.tensor([0])),
                 lambda: cuda.load_module(0)):
        with pytest.raises(TierUnavailable, match="CUDA is unavailable: torch.cuda.is_available"):
            call()


def test_importing_kvtier_needs_no_cupy() -> None:
    """Every GPU module imports without CuPy (and a gpu tier's config validates): CuPy loads at the first
    launch."""
    code = ("import sys, kvtier, kvtier.kernels.cuda, kvtier.kernels.copy_engine, kvtier.tiers.gpu\n"
            "kvtier.load_config({'model': {'name': 'm', 'num_layers': 1, 'num_kv_heads': 1, 'head_dim': 8},\n"
            "                    'tiers': [{'type': 'gpu', 'capacity': '1MiB', "
            "'transfer': {'method': 'kernel'}}]})\n"
            "sys.exit('cupy' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_geometry_refuses_layers_with_different_strides() -> None:
    per_layer = LAYOUTS[0]
    block = block_layout(per_layer, "NHD")
    _, layers = arena_layers(per_layer, block, 4, 0, 0)
    layers[1] = torch.empty((4, 2, 4, 2, 8), dtype=block.dtype).transpose(0, 1)
    with pytest.raises(LayoutMismatch, match="share strides"):
        cuda.piece_geometry(layers, per_layer, block)


# --- GPU: every launch equals the fallback bit for bit ------------------------------------------------------


@requires_gpu
@pytest.mark.parametrize("per_layer", LAYOUTS, ids=lambda p: f"{p.kind.value}-{p.token_layout}")
@pytest.mark.parametrize("token_layout", ["NHD", "HND"])
@pytest.mark.parametrize("pinned", [False, True])
def test_gpu_pack_unpack_equal_fallback(per_layer: PerLayerLayout, token_layout: TokenLayout,
                                        pinned: bool) -> None:
    block = block_layout(per_layer, token_layout, head_dim=64)
    _, cpu_layers = arena_layers(per_layer, block, num_blocks=9, gap=256, seed=1)
    layers = [layer.cuda() for layer in cpu_layers]
    ids = torch.tensor([7, 1, 8, 3, 0])
    expected = torch.empty((len(ids), *block.shape), dtype=block.dtype, device="cuda")
    fallback.pack_blocks(layers, ids, per_layer, block, expected)
    out = torch.empty((len(ids), *block.shape), dtype=block.dtype,
                      device="cpu" if pinned else "cuda", pin_memory=pinned)
    cuda.pack_blocks(layers, ids, per_layer, block, out)
    torch.cuda.synchronize()
    assert torch.equal(out.cuda().view(torch.uint8), expected.view(torch.uint8))

    target = [torch.zeros_like(layer) for layer in layers]
    reference = [torch.zeros_like(layer) for layer in layers]
    cuda.unpack_blocks(out, target, ids, per_layer, block)
    fallback.unpack_blocks(expected, reference, ids, per_layer, block)
    torch.cuda.synchronize()
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(target, reference, strict=True))


@requires_gpu
@pytest.mark.parametrize("block_bytes", [4096, 4096 + 6, 3, cuda.COPY_CHUNK_BYTES,
                                         3 * cuda.COPY_CHUNK_BYTES + 6])  # several chunks, a short last one
def test_gpu_copy_blocks_equal_fallback_both_directions(block_bytes: int) -> None:
    src = torch.randint(0, 256, (8, block_bytes), dtype=torch.uint8, device="cuda")
    host = torch.zeros((8, block_bytes), dtype=torch.uint8).pin_memory()
    src_ids, dst_ids = torch.tensor([5, 0, 7]), torch.tensor([1, 6, 2])
    cuda.copy_blocks(src, src_ids, host, dst_ids)
    torch.cuda.synchronize()
    expected = torch.zeros_like(host)
    fallback.copy_blocks(src, src_ids, expected, dst_ids)
    assert torch.equal(host, expected)
    back = torch.zeros_like(src)
    cuda.copy_blocks([host[i] for i in (1, 6, 2)], None, back, torch.tensor([3, 4, 5]))
    torch.cuda.synchronize()
    assert torch.equal(back[3:6].cpu(), src[[5, 0, 7]].cpu())


def test_reachable_asks_once_per_allocation_whether_it_is_page_locked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch of slot views of one slab costs one CUDA query, and any unreachable view makes it
    unreachable."""
    asked: list[int] = []

    def is_pinned(tensor: torch.Tensor) -> bool:
        asked.append(tensor.data_ptr())
        return tensor.untyped_storage().data_ptr() == slab.untyped_storage().data_ptr()

    slab = torch.zeros((64, 32), dtype=torch.uint8)
    other = torch.zeros((4, 32), dtype=torch.uint8)
    monkeypatch.setattr(torch.Tensor, "is_pinned", is_pinned)
    gpu = torch.device("cuda", 0)
    assert cuda.reachable(list(slab), gpu) and len(asked) == 1
    assert not cuda.reachable([*slab[:3], other[0]], gpu)
    assert cuda.reachable(list(other), torch.device("cpu"))  # the kernel's own device needs no query
    with pytest.raises(LayoutMismatch, match=r"blocks\[2\] is on cpu, which a kernel on cuda:0 cannot reach"):
        cuda._block_addresses([slab[0], slab[1], other[0]], None, gpu, "blocks")


def test_block_views_are_checked_in_one_pass_and_a_bad_one_is_named() -> None:
    slab = torch.zeros((8, 32), dtype=torch.uint8)
    gpu = torch.device("cuda", 0)
    expected = r"blocks\[1\] must be a contiguous 1-D uint8 view of 32 bytes, got "
    for bad, got in ((slab[0, :16], r"torch.uint8 \(16,\)"),
                     (slab[0].view(torch.int32), r"torch.int32 \(8,\)"),
                     (torch.zeros((32, 2), dtype=torch.uint8)[:, 0], r"torch.uint8 \(32,\)")):  # strided
        with pytest.raises(LayoutMismatch, match=expected + got):
            cuda._block_addresses([slab[0], bad, slab[2]], None, gpu, "blocks")
