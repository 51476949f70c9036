"""CUDA block kernels (``copy_blocks.cu``), compiled at run time with CuPy and launched on torch streams.

The moves of :mod:`kvtier.kernels.fallback` (plus a ``stream``); blocks may be in device memory or in
page-locked host memory reached by its mapped address, so one launch moves many blocks between GPU
and host. Compiled on first launch; without CUDA or CuPy every entry point raises
:class:`~kvtier.errors.TierUnavailable`. :func:`piece_geometry` / :func:`piece_byte_addresses` mirror
the kernels' address math in torch, so CPU tests check it without a GPU.
"""

from __future__ import annotations

import functools
import importlib.resources
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.errors import LayoutMismatch, TierUnavailable
from kvtier.kernels import fallback
from kvtier.layout import BlockLayout, PerLayerLayout

__all__ = ["KERNEL_SOURCES", "NVRTC_OPTIONS", "PieceGeometry", "copy_addresses", "copy_blocks",
           "kernel_source", "load_module", "pack_blocks", "piece_byte_addresses", "piece_geometry",
           "reachable", "require_cuda", "unpack_blocks"]

#: The CUDA sources shipped in this package (``kvtier/kernels/*.cu``).
KERNEL_SOURCES = ("copy_blocks.cu",)
#: Threads per CUDA block (``KVTIER_THREADS`` in the source): one CUDA block walks one piece at a time.
THREADS = 256
#: CUDA blocks per SM of the grid-stride loops (``KVTIER_BLOCKS_PER_SM``, the ``__launch_bounds__``).
BLOCKS_PER_SM = 4
#: Bytes of a block that one CUDA block copies at a time in ``kvtier_copy_blocks`` (a multiple of 16):
#: small enough that a call of a few large blocks still spreads over every SM.
COPY_CHUNK_BYTES = 64 * 1024
#: Options :func:`load_module` hands CuPy's NVRTC (CuPy adds ``-arch``, ``-ftz=true``, include paths and,
#: from NVRTC 12, ``--device-as-default-execution-space``). CI compiles the shipped source with exactly
#: these through NVRTC itself (``tests/kernels/nvrtc.py``), so a source nvcc accepts but NVRTC refuses
#: fails there, not at the first transfer on a GPU.
NVRTC_OPTIONS = ("-std=c++17",)


@dataclass(frozen=True)
class PieceGeometry:
    """Where the pieces of a pack/unpack live; every size and stride in bytes (mirrors the kernel's args).

    A piece is one (engine block, layer, K|V) slab of ``piece_bytes``; it is ``rows`` rows of
    ``row_bytes``. On the engine side row ``r`` sits at ``(r // inner) * engine_outer + (r % inner) *
    engine_inner``; on the cross-layer side rows are dense. ``rows == 1`` when both sides are
    contiguous (same token layout), otherwise rows are ``head_dim`` vectors (an NHD↔HND transpose).
    """

    num_layers: int
    kv_factor: int
    engine_block_stride: int
    engine_kv_stride: int
    piece_bytes: int
    rows: int
    row_bytes: int
    inner: int
    engine_outer: int
    engine_inner: int


def require_cuda() -> Any:
    """Return the ``cupy`` module, or raise :class:`TierUnavailable` saying why the kernels cannot run."""
    if not torch.cuda.is_available():
        raise TierUnavailable("CUDA is unavailable: torch.cuda.is_available() is False, so the GPU tier and "
                              "the CUDA kernels cannot run (kvtier.kernels.fallback works on any device)")
    try:
        import cupy
    except ImportError as exc:
        raise TierUnavailable(f"CuPy is not installed ({exc}): pip install 'kvtier[cuda]' "
                              "(or the cupy-cudaXXx wheel matching this machine's CUDA)") from None
    return cupy


def kernel_source(name: str = "copy_blocks.cu") -> str:
    """The CUDA C source of ``name``, read from the installed package (works from a wheel or a zip)."""
    return importlib.resources.files("kvtier.kernels").joinpath(name).read_text(encoding="utf-8")


@functools.cache
def load_module(device_index: int) -> Any:
    """Compile ``copy_blocks.cu`` with NVRTC for ``device_index`` (once per process and device)."""
    cupy = require_cuda()
    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=kernel_source(), options=NVRTC_OPTIONS)
        module.compile()
    return module


def piece_geometry(layers: Sequence[torch.Tensor], per_layer: PerLayerLayout,
                   block: BlockLayout) -> PieceGeometry:
    """Byte geometry of the pieces of ``layers`` (validated like the fallback) for cross-layer ``block``.

    Raises :class:`LayoutMismatch` when the layers do not share strides or their head dimension is
    not contiguous: the kernel reads every layer with one set of strides.
    """
    fallback._check_layers(layers, per_layer, block)
    views = [fallback.layer_logical_view(layer, per_layer) for layer in layers]
    strides = views[0].stride()
    if any(view.stride() != strides for view in views):
        raise LayoutMismatch(f"per-layer tensors must share strides for the CUDA kernels, got "
                             f"{sorted({view.stride() for view in views})}")
    _, _, tokens, heads, dim = views[0].shape
    if dim > 1 and strides[4] != 1:
        raise LayoutMismatch(f"head_dim must be contiguous in each layer, got logical strides {strides}")
    item = block.itemsize
    s_block, s_kv, s_token, s_head = (stride * item for stride in strides[:4])
    if block.token_layout == "NHD":
        outer, inner, engine_outer, engine_inner = tokens, heads, s_token, s_head
    else:
        outer, inner, engine_outer, engine_inner = heads, tokens, s_head, s_token
    row_bytes = dim * item
    piece_bytes = tokens * heads * row_bytes
    dense = (inner == 1 or engine_inner == row_bytes) and (outer == 1 or engine_outer == inner * row_bytes)
    if dense:
        return PieceGeometry(len(layers), block.kv_factor, s_block, s_kv, piece_bytes, 1, piece_bytes, 1,
                             0, 0)
    return PieceGeometry(len(layers), block.kv_factor, s_block, s_kv, piece_bytes, outer * inner, row_bytes,
                         inner, engine_outer, engine_inner)


def vector_unit(*values: int) -> int:
    """Widest access (16, 8, 4, 2 or 1 bytes) that every address and stride in ``values`` is aligned to."""
    for unit in (16, 8, 4, 2):
        if all(value % unit == 0 for value in values):
            return unit
    return 1


def piece_byte_addresses(geometry: PieceGeometry, layer_ptrs: torch.Tensor, block_ids: torch.Tensor,
                         cross_base: int, cross_ids: torch.Tensor, cross_stride: int,
                         unit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch mirror of the pack kernel's addressing: ``(engine_address, cross_address)`` of every byte.

    Follows ``kvtier_pack_blocks`` step by step — piece ``p = (i * num_layers + layer) * kv_factor +
    kv``, ``unit``-byte accesses over each piece's rows, then the per-row tail byte by byte — and
    expands each access into its bytes. Byte ``k`` of the result is one byte the kernel moves
    (unpack moves the same pairs the other way); CPU tests gather with these addresses and compare
    with :func:`kvtier.kernels.fallback.pack_blocks`.
    """
    g = geometry
    num_pieces = block_ids.numel() * g.num_layers * g.kv_factor
    piece = torch.arange(num_pieces, dtype=torch.int64)
    per_block = g.num_layers * g.kv_factor
    slab, i = piece % per_block, piece // per_block
    layer, kv = slab // g.kv_factor, slab % g.kv_factor
    engine_piece = layer_ptrs.to(torch.int64)[layer] + block_ids.to(torch.int64)[i] * g.engine_block_stride \
        + kv * g.engine_kv_stride
    cross_piece = cross_base + cross_ids.to(torch.int64)[i] * cross_stride + slab * g.piece_bytes

    units_per_row = g.row_bytes // unit
    head = units_per_row * unit
    tail = g.row_bytes - head
    unit_index = torch.arange(g.rows * units_per_row, dtype=torch.int64)
    unit_row, unit_col = unit_index // units_per_row, (unit_index % units_per_row) * unit
    tail_index = torch.arange(g.rows * tail, dtype=torch.int64)
    tail_row, tail_col = tail_index // max(tail, 1), head + tail_index % max(tail, 1)
    byte = torch.arange(unit, dtype=torch.int64)
    rows = torch.cat([unit_row.repeat_interleave(unit), tail_row])
    cols = torch.cat([(unit_col[:, None] + byte).reshape(-1), tail_col])
    outer, inner = rows // g.inner, rows % g.inner
    engine_in_piece = outer * g.engine_outer + inner * g.engine_inner + cols
    cross_in_piece = outer * (g.inner * g.row_bytes) + inner * g.row_bytes + cols
    engine = (engine_piece[:, None] + engine_in_piece).reshape(-1)
    cross = (cross_piece[:, None] + cross_in_piece).reshape(-1)
    return engine, cross


# --- launches (need a CUDA device and CuPy) -----------------------------------------------------------------


def pack_blocks(layers: Sequence[torch.Tensor], block_ids: torch.Tensor, per_layer: PerLayerLayout,
                block: BlockLayout, out: torch.Tensor | Sequence[torch.Tensor], *,
                stream: torch.cuda.Stream | None = None, out_ids: torch.Tensor | None = None) -> None:
    """Gather engine blocks ``block_ids`` of every CUDA layer into cross-layer blocks ``out`` with one launch.

    ``out`` is ``[n, *block.shape]`` (device or page-locked host memory, each block contiguous), a
    buffer of blocks with ``out_ids`` naming the ``n`` it fills (e.g. a pinned slab of
    ``block.nbytes`` rows), or a sequence of ``n`` 1-D uint8 slot views of ``block.nbytes`` (e.g.
    CPU-tier slots). Enqueued on ``stream`` (default: the current stream); returns without waiting.
    ``block_ids`` and ``out_ids`` must be valid (unlike the fallback, nothing here syncs the device to
    range-check them).
    """
    _launch_pieces("kvtier_pack_blocks", layers, block_ids, per_layer, block, out, stream, out_ids)


def unpack_blocks(blocks: torch.Tensor | Sequence[torch.Tensor], layers: Sequence[torch.Tensor],
                  block_ids: torch.Tensor, per_layer: PerLayerLayout, block: BlockLayout, *,
                  stream: torch.cuda.Stream | None = None, blocks_ids: torch.Tensor | None = None) -> None:
    """Scatter cross-layer blocks (rows ``blocks_ids`` of a buffer, when given) back into engine blocks
    ``block_ids`` of every layer (one launch, no repeats)."""
    _launch_pieces("kvtier_unpack_blocks", layers, block_ids, per_layer, block, blocks, stream, blocks_ids)


def copy_blocks(src: torch.Tensor | Sequence[torch.Tensor], src_ids: torch.Tensor | None,
                dst: torch.Tensor | Sequence[torch.Tensor], dst_ids: torch.Tensor | None, *,
                stream: torch.cuda.Stream | None = None) -> None:
    """Copy blocks ``src[src_ids[i]]`` to ``dst[dst_ids[i]]`` with one kernel launch.

    Each side is a block buffer ``[num_blocks, ...]`` with its ids (as in the fallback), or a
    sequence of 1-D uint8 block views with ids ``None`` (the views are the blocks, in order). Either
    side may be page-locked host memory; at least one must be on a CUDA device.
    """
    require_cuda()
    device = _device_of(src, dst)
    stream = _resolve_stream(device, stream)
    with torch.cuda.stream(stream):
        _copy_blocks(device, stream, src, src_ids, dst, dst_ids)


def copy_addresses(src: torch.Tensor, dst: torch.Tensor, nbytes: int, *, unit: int,
                   stream: torch.cuda.Stream | None = None) -> None:
    """Copy ``nbytes`` from address ``src[k]`` to address ``dst[k]`` for every ``k``, with one launch.

    For moves whose pieces no block buffer describes (an engine's per-layer pages gathered into
    cross-layer blocks): ``src`` and ``dst`` are int64 tensors of raw addresses, on the CUDA device
    that runs the copy, each pointing into that device's memory or into page-locked host memory
    (mapped). ``unit`` (16, 8, 4, 2 or 1) must divide every address; :func:`vector_unit` finds it.
    """
    require_cuda()
    device = src.device
    if device.type != "cuda" or dst.device != device:
        raise LayoutMismatch(f"address tensors must be on one CUDA device, got {src.device} and {dst.device}")
    if src.dtype != torch.int64 or dst.dtype != torch.int64 or src.shape != dst.shape or src.dim() != 1:
        raise LayoutMismatch(f"address tensors must be 1-D int64 of one length, got {src.dtype} "
                             f"{tuple(src.shape)} and {dst.dtype} {tuple(dst.shape)}")
    if unit not in (16, 8, 4, 2, 1) or nbytes <= 0:
        raise LayoutMismatch(f"copy_addresses needs nbytes > 0 and a unit of 16, 8, 4, 2 or 1, "
                             f"got {nbytes}, {unit}")
    count = src.numel()
    if count == 0:
        return
    stream = _resolve_stream(device, stream)
    with torch.cuda.stream(stream):
        _launch_copy(device, stream, _ptr(0), src, 1, _ptr(0), dst, 1, count, nbytes, unit)


def _copy_blocks(device: torch.device, stream: torch.cuda.Stream, src: torch.Tensor | Sequence[torch.Tensor],
                 src_ids: torch.Tensor | None, dst: torch.Tensor | Sequence[torch.Tensor],
                 dst_ids: torch.Tensor | None) -> None:
    src_base, src_index, src_stride, src_bytes, src_align = _block_addresses(src, src_ids, device, "src")
    dst_base, dst_index, dst_stride, dst_bytes, dst_align = _block_addresses(dst, dst_ids, device, "dst")
    if src_bytes != dst_bytes:
        raise LayoutMismatch(f"src blocks have {src_bytes} bytes but dst blocks have {dst_bytes}")
    if src_index.numel() != dst_index.numel():
        raise LayoutMismatch(f"{src_index.numel()} src blocks but {dst_index.numel()} dst blocks")
    count = src_index.numel()
    if count == 0:
        return
    _launch_copy(device, stream, _ptr(src_base), src_index, src_stride, _ptr(dst_base), dst_index, dst_stride,
                 count, src_bytes, min(src_align, dst_align))


def _launch_copy(device: torch.device, stream: torch.cuda.Stream, src_base: Any, src_ids: torch.Tensor,
                 src_stride: int, dst_base: Any, dst_ids: torch.Tensor, dst_stride: int, count: int,
                 block_bytes: int, unit: int) -> None:
    """Launch ``kvtier_copy_blocks`` with one piece per :data:`COPY_CHUNK_BYTES` of each block."""
    chunks = -(-block_bytes // COPY_CHUNK_BYTES)
    _launch(device, stream, "kvtier_copy_blocks", count * chunks,
            src_base, src_ids, _i64(src_stride), dst_base, dst_ids, _i64(dst_stride),
            _i64(count), _i64(block_bytes), _i64(COPY_CHUNK_BYTES), _i32(unit))


def _launch_pieces(kernel: str, layers: Sequence[torch.Tensor], block_ids: torch.Tensor,
                   per_layer: PerLayerLayout, block: BlockLayout,
                   cross: torch.Tensor | Sequence[torch.Tensor],
                   stream: torch.cuda.Stream | None, cross_ids: torch.Tensor | None = None) -> None:
    require_cuda()
    geometry = piece_geometry(layers, per_layer, block)
    device = layers[0].device
    if device.type != "cuda":
        raise LayoutMismatch(f"the CUDA kernels need CUDA layers, got {device}; use kvtier.kernels.fallback")
    stream = _resolve_stream(device, stream)
    with torch.cuda.stream(stream):
        _pack_pieces(kernel, device, stream, geometry, layers, block_ids, block, cross, cross_ids)


def _pack_pieces(kernel: str, device: torch.device, stream: torch.cuda.Stream, geometry: PieceGeometry,
                 layers: Sequence[torch.Tensor], block_ids: torch.Tensor, block: BlockLayout,
                 cross: torch.Tensor | Sequence[torch.Tensor], chosen: torch.Tensor | None) -> None:
    if isinstance(cross, torch.Tensor) and chosen is None:
        fallback._check_block_tensor(cross, block, block_ids.numel(), cross.device, "blocks")
        chosen = torch.arange(block_ids.numel())
    elif chosen is not None and not isinstance(cross, torch.Tensor):
        raise LayoutMismatch("ids of cross-layer blocks name rows of a buffer; a list of views needs none")
    cross_base, cross_ids, cross_stride, cross_bytes, cross_align = _block_addresses(cross, chosen, device,
                                                                                     "blocks")
    if cross_bytes != block.nbytes or cross_ids.numel() != block_ids.numel():
        raise LayoutMismatch(f"{block_ids.numel()} block ids need {block_ids.numel()} cross-layer blocks of "
                             f"{block.nbytes} bytes, got {cross_ids.numel()} of {cross_bytes}")
    count = block_ids.numel()
    if count == 0:
        return
    g = geometry
    layer_ptrs = [layer.data_ptr() for layer in layers]
    strides = [g.engine_block_stride, g.engine_kv_stride, g.piece_bytes]
    if g.rows > 1:
        strides += [g.row_bytes, g.engine_outer, g.engine_inner]
    unit = min(vector_unit(*layer_ptrs, *strides), cross_align)
    ptrs = torch.tensor(layer_ptrs, dtype=torch.int64).to(device, non_blocking=True)
    ids = block_ids.to(device=device, dtype=torch.int64, non_blocking=True)
    _launch(device, stream, kernel, count * g.num_layers * g.kv_factor,
            ptrs, ids, _i64(count), _i32(g.num_layers), _i32(g.kv_factor), _i64(g.engine_block_stride),
            _i64(g.engine_kv_stride), _ptr(cross_base), cross_ids, _i64(cross_stride), _i64(g.piece_bytes),
            _i64(g.rows), _i64(g.row_bytes), _i64(g.inner), _i64(g.engine_outer), _i64(g.engine_inner),
            _i32(unit))


def _device_of(*sides: torch.Tensor | Sequence[torch.Tensor]) -> torch.device:
    for side in sides:
        first = side if isinstance(side, torch.Tensor) else (side[0] if len(side) else None)
        if first is not None and first.device.type == "cuda":
            return first.device
    raise LayoutMismatch("copy_blocks needs at least one side on a CUDA device; use kvtier.kernels.fallback")


def _block_addresses(side: torch.Tensor | Sequence[torch.Tensor], ids: torch.Tensor | None,
                     device: torch.device, what: str) -> tuple[int, torch.Tensor, int, int, int]:
    """``(base, ids on device, stride, block bytes, alignment)``: block ``k`` is at
    ``base + ids[k] * stride``.

    A sequence of views becomes base 0, stride 1 and ids = the views' addresses. ``alignment`` is
    the :func:`vector_unit` every block start is aligned to, computed on the host (no device sync).
    """
    if isinstance(side, torch.Tensor):
        if ids is None:
            raise LayoutMismatch(f"{what} is a block buffer, so its ids are needed")
        _check_reachable(side, device, what)
        rows = fallback._block_bytes(side, what)
        index = ids.to(device=device, dtype=torch.int64, non_blocking=True)
        return (rows.data_ptr(), index, rows.stride(0), rows.shape[1],
                vector_unit(rows.data_ptr(), rows.stride(0)))
    if ids is not None:
        raise LayoutMismatch(f"{what} is a sequence of block views; pass None for its ids")
    views = list(side)
    size = views[0].numel() if views else 0
    # One C-level pass per property over a batch of a thousand slots (a per-view check cost ~3 µs a
    # block, 5-10 % of an H200's PCIe time); the per-view loop only runs to name a bad view.
    if views and not (set(map(_DTYPE, views)) == {torch.uint8} and set(map(_SHAPE, views)) == {(size,)}
                      and set(map(_STRIDE, views)) == {(1,)}):
        for k, view in enumerate(views):
            if view.dtype != torch.uint8 or view.dim() != 1 or view.numel() != size \
                    or not view.is_contiguous():
                raise LayoutMismatch(f"{what}[{k}] must be a contiguous 1-D uint8 view of {size} bytes, got "
                                     f"{view.dtype} {tuple(view.shape)}")
    if not reachable(views, device):
        bad = next(k for k, view in enumerate(views) if not reachable([view], device))
        _check_reachable(views[bad], device, f"{what}[{bad}]")
    addresses = list(map(_DATA_PTR, views))
    index = torch.tensor(addresses, dtype=torch.int64).to(device, non_blocking=True)
    return 0, index, 1, size, vector_unit(16, *addresses)


def reachable(tensors: Sequence[torch.Tensor], device: torch.device) -> bool:
    """Whether a kernel on ``device`` can read and write every tensor: on ``device``, or page-locked host
    memory.

    Asks CUDA whether memory is page-locked once per underlying allocation (the views of one CPU
    tier slab share it), not once per view: a batch of a thousand slot views costs one query.
    """
    devices = set(map(_DEVICE, tensors))
    others = devices - {device}
    if not others:
        return True
    if any(other.type != "cpu" for other in others):
        return False
    hosted = [tensor for tensor in tensors if tensor.device != device] if device in devices else tensors
    allocations = {id(a): a for a in (t if base is None else base
                                      for t, base in zip(hosted, map(_BASE, hosted), strict=True))}
    return all(allocation.is_pinned() for allocation in allocations.values())


_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")
_DEVICE = operator.attrgetter("device")
_BASE = operator.attrgetter("_base")
_STRIDE = operator.methodcaller("stride")
_DATA_PTR = operator.methodcaller("data_ptr")


def _check_reachable(tensor: torch.Tensor, device: torch.device, what: str) -> None:
    if reachable([tensor], device):
        return
    raise LayoutMismatch(f"{what} is on {tensor.device}, which a kernel on {device} cannot reach; "
                         f"use {device} or page-locked host memory (a pinned CPU tier slab)")


def _resolve_stream(device: torch.device, stream: torch.cuda.Stream | None) -> torch.cuda.Stream:
    return stream if stream is not None else torch.cuda.current_stream(device)


def _cupy_stream(cupy: Any, stream: torch.cuda.Stream, index: int) -> Any:
    """``stream`` as a CuPy stream: through the CUDA stream protocol where CuPy has it (CuPy 14 deprecates
    ``ExternalStream``), else by its handle."""
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None and hasattr(stream, "__cuda_stream__"):
        return from_external(stream)
    return cupy.cuda.ExternalStream(stream.cuda_stream, index)


def _launch(device: torch.device, stream: torch.cuda.Stream, kernel: str, pieces: int,
            *args: Any) -> None:
    """Launch ``kernel`` on ``stream``; tensors in ``args`` become pointers and are kept alive for the
    stream."""
    cupy = require_cuda()
    index = device.index if device.index is not None else torch.cuda.current_device()
    sms = torch.cuda.get_device_properties(index).multi_processor_count
    grid = max(1, min(pieces, sms * BLOCKS_PER_SM))
    function = load_module(index).get_function(kernel)
    with cupy.cuda.Device(index), _cupy_stream(cupy, stream, index):
        function((grid,), (THREADS,), tuple(_arg(arg) for arg in args))
    for arg in args:
        if isinstance(arg, torch.Tensor) and arg.device.type == "cuda":
            arg.record_stream(stream)


def _arg(value: Any) -> Any:
    import numpy as np

    if isinstance(value, torch.Tensor):
        return np.uint64(value.data_ptr())
    return value


def _ptr(address: int) -> Any:
    import numpy as np

    return np.uint64(address)


def _i64(value: int) -> Any:
    import numpy as np

    return np.int64(value)


def _i32(value: int) -> Any:
    import numpy as np

    return np.int32(value)
