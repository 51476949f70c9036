"""Torch reference for kvtier's block kernels: exact, batched, on any device.

The moves the CUDA kernels make (:func:`pack_blocks`, :func:`unpack_blocks`, :func:`copy_blocks`;
docs/architecture.md#kernels), one indexed torch op per layer on views of the caller's tensors,
copying bits rather than values (NaN payloads and float8 survive). The tests check the fast kernels
against it; it is not the fast path on a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.errors import LayoutMismatch
from kvtier.layout import BlockLayout, PerLayerKind, PerLayerLayout
from kvtier.pages import PageMover

__all__ = ["copy_blocks", "layer_logical_view", "pack_blocks", "unpack_blocks"]

#: Integer dtype of each width; moving bits through these keeps every dtype exact.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def layer_logical_view(layer: torch.Tensor, per_layer: PerLayerLayout) -> torch.Tensor:
    """View one layer's paged tensor as ``[num_blocks, kv_factor, block_size, heads, dim]``.

    A permutation (plus two unit dims for MLA), never a copy: indexing this view along dim 0 picks
    engine blocks whatever the engine's kind and token layout, and its strides show where each
    logical dimension lives in memory (what layout detection reads).
    """
    if per_layer.kind is PerLayerKind.MLA:
        return layer.unsqueeze(1).unsqueeze(3)
    view = layer.transpose(0, 1) if per_layer.kind is PerLayerKind.FLASH_ATTN else layer
    return view if per_layer.token_layout == "NHD" else view.transpose(2, 3)


def pack_blocks(layers: Sequence[torch.Tensor], block_ids: torch.Tensor, per_layer: PerLayerLayout,
                block: BlockLayout, out: torch.Tensor) -> None:
    """Gather engine blocks ``block_ids`` of every layer into cross-layer blocks ``out[i]``.

    ``out`` is ``[len(block_ids), *block.shape]`` (any strides); layer ``l`` of engine block
    ``block_ids[i]`` lands in ``out[i, l]``, transposed between token- and head-major when
    ``block.token_layout`` differs from ``per_layer.token_layout``. The layers are
    :mod:`kvtier.pages` regions, so this is the shared page mover's gather: one ``index_select`` per
    layer straight into ``out`` (each block contiguous; otherwise through one staging copy). Raises
    :class:`LayoutMismatch` before touching anything.
    """
    num_blocks = _check_layers(layers, per_layer, block)
    device = layers[0].device
    ids = _check_ids(block_ids, num_blocks, "block_ids", device, unique=False)
    _check_block_tensor(out, block, ids.numel(), device, "out")
    if ids.numel() == 0:
        return
    mover = _page_mover(layers, per_layer, block)
    if _blocks_contiguous(out):
        mover.gather(ids, _block_bytes(out, "out"))
        return
    staged = torch.empty(out.shape, dtype=out.dtype, device=out.device)
    mover.gather(ids, staged)
    _bits(out).copy_(_bits(staged))


def unpack_blocks(blocks: torch.Tensor, layers: Sequence[torch.Tensor], block_ids: torch.Tensor,
                  per_layer: PerLayerLayout, block: BlockLayout) -> None:
    """Scatter cross-layer blocks ``blocks[i]`` back into engine block ``block_ids[i]`` of every layer.

    The exact inverse of :func:`pack_blocks`. ``block_ids`` must be duplicate-free (two blocks
    written to one place would leave the result to chance); the page mover's scatter, one
    ``index_copy_`` per layer.
    """
    num_blocks = _check_layers(layers, per_layer, block)
    device = layers[0].device
    ids = _check_ids(block_ids, num_blocks, "block_ids", device, unique=True)
    _check_block_tensor(blocks, block, ids.numel(), device, "blocks")
    if ids.numel() == 0:
        return
    source = blocks if _blocks_contiguous(blocks) else blocks.contiguous()
    _page_mover(layers, per_layer, block).scatter(_block_bytes(source, "blocks"), ids)


def _page_mover(layers: Sequence[torch.Tensor], per_layer: PerLayerLayout, block: BlockLayout) -> PageMover:
    """The layers as page regions: each layer's ``[num_blocks, kv, token, head, dim]`` in the block's
    token order (a head_dim that is not contiguous moves element by element)."""
    regions = []
    for layer in layers:
        view = layer_logical_view(layer, per_layer)
        if block.token_layout == "HND":
            view = view.transpose(2, 3)
        regions.append(view if view.stride(-1) == 1 else view.unsqueeze(-1))
    return PageMover(regions, 1, block.nbytes)


def _blocks_contiguous(blocks: torch.Tensor) -> bool:
    """Whether each block of ``[n, ...]`` is one contiguous region (what :func:`_block_bytes` views)."""
    expected = 1
    for size, stride in zip(reversed(blocks.shape[1:]), reversed(blocks.stride()[1:]), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return blocks.shape[0] <= 1 or blocks.stride(0) >= expected


def copy_blocks(src: torch.Tensor, src_ids: torch.Tensor, dst: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """Copy whole blocks ``src[src_ids[i]]`` to ``dst[dst_ids[i]]``, bit for bit.

    ``src`` and ``dst`` are block buffers ``[num_blocks, ...]`` (e.g. ``[num_blocks, *block.shape]``
    or ``[num_blocks, nbytes]`` uint8) whose blocks are each one contiguous region of the same byte
    size; dtypes may differ (a typed GPU slab and a byte host slab) and so may devices. The reference
    for the CUDA GPU↔host copy kernel. When ``dst_ids`` cover a contiguous run of slots (a staging
    buffer, freshly allocated slab slots) and the buffers are distinct and on one device, it gathers
    straight into ``dst``; otherwise it stages through one temporary of the copied blocks.
    """
    src_bytes = _block_bytes(src, "src")
    dst_bytes = _block_bytes(dst, "dst")
    if src_bytes.shape[1] != dst_bytes.shape[1]:
        raise LayoutMismatch(f"src blocks have {src_bytes.shape[1]} bytes ({tuple(src.shape)} {src.dtype}) "
                             f"but dst blocks have {dst_bytes.shape[1]} ({tuple(dst.shape)} {dst.dtype})")
    src_index = _check_ids(src_ids, src_bytes.shape[0], "src_ids", src.device, unique=False)
    dst_index = _check_ids(dst_ids, dst_bytes.shape[0], "dst_ids", dst.device, unique=True)
    count = src_index.numel()
    if count != dst_index.numel():
        raise LayoutMismatch(f"src_ids has {count} ids but dst_ids has {dst_index.numel()}")
    if count == 0:
        return
    src_words, dst_words = _as_words(src_bytes, dst_bytes)
    if src.device == dst.device and src.untyped_storage().data_ptr() != dst.untyped_storage().data_ptr():
        first, last = (int(bound) for bound in torch.aminmax(dst_index))
        if last - first + 1 == count:  # unique ids filling a run: a permutation of first..last
            order = torch.argsort(dst_index)
            torch.index_select(src_words, 0, src_index[order], out=dst_words[first:last + 1])
            return
    staged = src_words.index_select(0, src_index).to(dst.device)
    dst_words.index_copy_(0, dst_index, staged)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The same memory as integers of the same width (a view), so copies move bits exactly."""
    return tensor.view(_BITS[tensor.element_size()])


def _check_layers(layers: Sequence[torch.Tensor], per_layer: PerLayerLayout, block: BlockLayout) -> int:
    """Validate the per-layer tensors against ``per_layer``/``block``; return their number of blocks."""
    if per_layer.kind is PerLayerKind.MLA:
        if block.kv_factor != 1 or block.num_kv_heads != 1:
            raise LayoutMismatch(f"MLA layers pack into blocks with kv_factor=1 and num_kv_heads=1, "
                                 f"got {block.describe()}")
    elif block.kv_factor != 2:
        raise LayoutMismatch(f"{per_layer.kind.value} layers hold K and V; the block needs kv_factor=2, "
                             f"got {block.describe()}")
    if isinstance(layers, torch.Tensor) or len(layers) != block.num_layers:
        got = "one tensor" if isinstance(layers, torch.Tensor) else f"{len(layers)} tensors"
        raise LayoutMismatch(f"layers must be a sequence of {block.num_layers} per-layer tensors "
                             f"({block.describe()}), got {got}")
    first = layers[0]
    if not isinstance(first, torch.Tensor):
        raise LayoutMismatch(f"layer 0 must be a torch.Tensor, got {type(first).__name__}")
    block_dim = 1 if per_layer.kind is PerLayerKind.FLASH_ATTN else 0
    num_blocks = first.shape[block_dim] if first.dim() > block_dim else 0
    expected = per_layer.layer_shape(num_blocks, block)
    for index, layer in enumerate(layers):
        if not isinstance(layer, torch.Tensor):
            raise LayoutMismatch(f"layer {index} must be a torch.Tensor, got {type(layer).__name__}")
        if tuple(layer.shape) != expected:
            raise LayoutMismatch(
                f"layer {index} has shape {tuple(layer.shape)}, expected {expected} "
                f"({per_layer.kind.value} {per_layer.token_layout}, {block.describe()})")
        if layer.dtype != block.dtype:
            raise LayoutMismatch(f"layer {index} has dtype {layer.dtype}, expected {block.dtype}")
        if layer.device != first.device:
            raise LayoutMismatch(f"layer {index} is on {layer.device}, layer 0 on {first.device}")
    return num_blocks


def _check_block_tensor(blocks: torch.Tensor, block: BlockLayout, count: int, device: torch.device,
                        what: str) -> None:
    """Validate a ``[count, *block.shape]`` tensor of cross-layer blocks on ``device`` (any strides)."""
    if not isinstance(blocks, torch.Tensor):
        raise LayoutMismatch(f"{what} must be a torch.Tensor, got {type(blocks).__name__}")
    expected = (count, *block.shape)
    if tuple(blocks.shape) != expected:
        raise LayoutMismatch(f"{what} has shape {tuple(blocks.shape)}, expected {expected} "
                             f"({count} blocks of {block.describe()})")
    if blocks.dtype != block.dtype:
        raise LayoutMismatch(f"{what} has dtype {blocks.dtype}, expected {block.dtype}")
    if blocks.device != device:
        raise LayoutMismatch(f"{what} is on {blocks.device} but the layers are on {device}")


def _check_ids(ids: torch.Tensor, num_blocks: int, what: str, device: torch.device, *,
               unique: bool) -> torch.Tensor:
    """Validate block ids (1-D integers in ``[0, num_blocks)``); return them as int64 on ``device``.

    Costs one device sync on a GPU (the range check), which a reference implementation can afford.
    """
    if not isinstance(ids, torch.Tensor):
        raise LayoutMismatch(f"{what} must be a torch.Tensor of block ids, got {type(ids).__name__}")
    if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise LayoutMismatch(f"{what} must be a 1-D integer tensor, got shape {tuple(ids.shape)} {ids.dtype}")
    index = ids.to(device=device, dtype=torch.int64)
    if index.numel() == 0:
        return index
    low, high = torch.aminmax(index)
    if low.item() < 0 or high.item() >= num_blocks:
        bad = index[(index < 0) | (index >= num_blocks)]
        raise LayoutMismatch(f"{what} {bad[:8].tolist()} out of range [0, {num_blocks})")
    if unique:
        ordered = torch.sort(index).values
        repeated = ordered[1:][ordered[1:] == ordered[:-1]]
        if repeated.numel():
            raise LayoutMismatch(f"{what} must not repeat a block, got {repeated.unique()[:8].tolist()} "
                                 f"twice or more")
    return index


def _block_bytes(blocks: torch.Tensor, what: str) -> torch.Tensor:
    """View a ``[num_blocks, ...]`` buffer as ``[num_blocks, block_nbytes]`` uint8, refusing copies."""
    if not isinstance(blocks, torch.Tensor):
        raise LayoutMismatch(f"{what} must be a torch.Tensor, got {type(blocks).__name__}")
    if blocks.dim() < 2:
        raise LayoutMismatch(f"{what} must be a block buffer [num_blocks, ...], got shape "
                             f"{tuple(blocks.shape)}")
    if blocks.shape[1:].numel() == 0:
        raise LayoutMismatch(f"{what} has empty blocks, shape {tuple(blocks.shape)}")
    expected_stride = 1
    for size, stride in zip(reversed(blocks.shape[1:]), reversed(blocks.stride()[1:]), strict=True):
        if size != 1 and stride != expected_stride:
            raise LayoutMismatch(f"each block of {what} must be one contiguous region; shape "
                                 f"{tuple(blocks.shape)} has strides {blocks.stride()}")
        expected_stride *= size
    if blocks.shape[0] > 1 and blocks.stride(0) < expected_stride:
        raise LayoutMismatch(f"blocks of {what} overlap: block stride {blocks.stride(0)} < block size "
                             f"{expected_stride} elements")
    return blocks.view(blocks.shape[0], expected_stride).view(torch.uint8)


def _as_words(*buffers: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """View ``[num_blocks, nbytes]`` byte buffers as the widest integer all of them allow.

    Moving 8-byte words instead of bytes makes torch's indexed copies several times faster on CPU.
    """
    for width in (8, 4, 2):
        if all(buffer.shape[1] % width == 0 and buffer.stride(0) % width == 0
               and buffer.storage_offset() % width == 0 for buffer in buffers):
            return tuple(buffer.view(_BITS[width]) for buffer in buffers)
    return buffers
