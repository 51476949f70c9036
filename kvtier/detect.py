"""Find out how an engine laid out its KV cache: cross-layer blocks or classic per-layer tensors.

Engines hand kvtier one paged KV tensor per layer. When those tensors are strided views of one buffer in
which each engine block holds the K and V of every layer in one contiguous region (vLLM's cross-layer
layout, docs/architecture.md#cross-layer-blocks), a block moves with one copy; otherwise kvtier packs it
from ``2 × num_layers`` places (:func:`kvtier.kernels.pack_blocks`). :func:`detect_kv_layout` tells the
two apart from shapes and strides alone, without copying or touching the data;
:func:`make_cross_layer_kv` allocates such a buffer (for tests, benchmarks and embedded use). This module
decides layouts; it does not move bytes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from kvtier.errors import LayoutMismatch
from kvtier.kernels.fallback import layer_logical_view
from kvtier.layout import BlockLayout, PerLayerKind, PerLayerLayout, TokenLayout, parse_dtype

__all__ = ["DetectedKVLayout", "detect_kv_layout", "make_cross_layer_kv"]


@dataclass(frozen=True)
class DetectedKVLayout:
    """What :func:`detect_kv_layout` found; ``block`` is the layout of one engine block of all layers.

    Cross-layer (``cross_layer=True``): ``base`` is a ``[num_blocks, *block.shape]`` view of the
    engine's own storage (``base[b]`` is engine block ``b``, ready for
    :func:`kvtier.kernels.copy_blocks`) and ``per_layer`` is None. Per-layer: ``per_layer`` says
    how to read each layer's tensor (for :func:`kvtier.kernels.pack_blocks`), ``base`` is None, and
    ``block.token_layout`` follows the engine's so packing needs no transpose.
    """

    cross_layer: bool
    per_layer: PerLayerLayout | None
    num_blocks: int
    num_layers: int
    block: BlockLayout
    base: torch.Tensor | None = field(default=None, compare=False, repr=False)


def detect_kv_layout(kv_caches: Mapping[str, torch.Tensor] | Sequence[torch.Tensor], *, block_size: int,
                     num_kv_heads: int, head_dim: int,
                     hint: PerLayerKind | PerLayerLayout | None = None) -> DetectedKVLayout:
    """Detect the layout of an engine's per-layer KV tensors (layer order = iteration order).

    The per-layer kind comes from the shapes: ``(2, n, ·, ·, d)`` is FlashAttention,
    ``(n, 2, ·, ·, d)`` FlashInfer, ``(n, block_size, d)`` MLA (``num_kv_heads`` must then be 1);
    NHD/HND from where ``block_size`` and ``num_kv_heads`` sit. When a shape fits several readings
    (``num_blocks == 2``, or ``block_size == num_kv_heads``) pass ``hint``: a kind, or a full
    :class:`PerLayerLayout` to fix the token layout too; otherwise :class:`LayoutMismatch` says so.
    The layout is cross-layer when all tensors view one storage with block-major strides and layer
    ``l`` of every block at offset ``l × layer_bytes`` of one contiguous block region.
    """
    names, tensors = _named_tensors(kv_caches)
    first = tensors[0]
    for name, tensor in zip(names, tensors, strict=True):
        if tuple(tensor.shape) != tuple(first.shape) or tensor.dtype != first.dtype \
                or tensor.device != first.device:
            raise LayoutMismatch(f"{name} is {tuple(tensor.shape)} {tensor.dtype} on {tensor.device} but "
                                 f"{names[0]} is {tuple(first.shape)} {first.dtype} on {first.device}; all "
                                 f"layers of one KV group must match")
    dtype = parse_dtype(first.dtype)
    per_layer, num_blocks = _per_layer_layout(names[0], tuple(first.shape), block_size, num_kv_heads,
                                              head_dim, hint)
    mla = per_layer.kind is PerLayerKind.MLA
    views = [layer_logical_view(tensor, per_layer) for tensor in tensors]

    def block_layout(token_layout: TokenLayout) -> BlockLayout:
        return BlockLayout(num_layers=len(tensors), num_kv_heads=1 if mla else num_kv_heads,
                           head_dim=head_dim, block_size=block_size, dtype=dtype, kv_factor=1 if mla else 2,
                           token_layout=token_layout)

    found = _cross_layer_strides(tensors, views, per_layer.token_layout)
    if found is None:
        return DetectedKVLayout(cross_layer=False, per_layer=per_layer, num_blocks=num_blocks,
                                num_layers=len(tensors), block=block_layout(per_layer.token_layout))
    token_layout, block_stride = found
    block = block_layout(token_layout)
    base = views[0].as_strided((num_blocks, *block.shape), (block_stride, *_contiguous_strides(block.shape)),
                               views[0].storage_offset())
    return DetectedKVLayout(cross_layer=True, per_layer=None, num_blocks=num_blocks, num_layers=len(tensors),
                            block=block, base=base)


def make_cross_layer_kv(num_blocks: int, block: BlockLayout,
                        device: torch.device | str = "cpu") -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Allocate a zeroed cross-layer KV buffer and the per-layer views an engine would attend over.

    Returns ``base`` (``[num_blocks, *block.shape]``, contiguous) and one view per layer in
    FlashAttention order ``(2, num_blocks, block_size, heads, dim)`` (MLA: ``(num_blocks,
    block_size, dim)``), strided into ``base`` as vLLM's cross-layer layout is: writing a view
    writes ``base``, and no view is a copy.
    """
    if num_blocks <= 0:
        raise LayoutMismatch(f"num_blocks must be positive, got {num_blocks}")
    if block.kv_factor == 1 and block.num_kv_heads != 1:
        raise LayoutMismatch(f"an MLA block (kv_factor=1) has one latent head, got {block.describe()}")
    base = torch.zeros((num_blocks, *block.shape), dtype=block.dtype, device=device)
    logical = block.logical_view(base)
    if block.kv_factor == 1:
        return base, [logical[:, layer, 0, :, 0, :] for layer in range(block.num_layers)]
    return base, [logical[:, layer].transpose(0, 1) for layer in range(block.num_layers)]


def _named_tensors(kv_caches: Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
                   ) -> tuple[list[str], list[torch.Tensor]]:
    if isinstance(kv_caches, Mapping):
        names, tensors = [str(name) for name in kv_caches], list(kv_caches.values())
    elif isinstance(kv_caches, torch.Tensor):
        raise LayoutMismatch("kv_caches must be a mapping or sequence of per-layer tensors, got one tensor")
    else:
        tensors = list(kv_caches)
        names = [f"layer {index}" for index in range(len(tensors))]
    if not tensors:
        raise LayoutMismatch("kv_caches is empty: there is no KV cache to detect")
    for name, tensor in zip(names, tensors, strict=True):
        if not isinstance(tensor, torch.Tensor):
            raise LayoutMismatch(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    return names, tensors


def _per_layer_layout(name: str, shape: tuple[int, ...], block_size: int, num_kv_heads: int, head_dim: int,
                      hint: PerLayerKind | PerLayerLayout | None) -> tuple[PerLayerLayout, int]:
    """Read the per-layer kind and token layout off a shape; the only reading, or an error."""
    geometry = BlockLayout(num_layers=1, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size)
    readings: list[tuple[PerLayerLayout, int]] = []
    if len(shape) == 3 and num_kv_heads == 1:
        readings.append((PerLayerLayout(PerLayerKind.MLA), shape[0]))
    elif len(shape) == 5:
        for kind in (PerLayerKind.FLASH_ATTN, PerLayerKind.FLASHINFER):
            for token_layout in ("NHD", "HND"):
                layout = PerLayerLayout(kind, token_layout)
                num_blocks = shape[1] if kind is PerLayerKind.FLASH_ATTN else shape[0]
                readings.append((layout, num_blocks))
    readings = [(layout, n) for layout, n in readings if n > 0 and layout.layer_shape(n, geometry) == shape]
    wanted = f"block_size={block_size}, num_kv_heads={num_kv_heads}, head_dim={head_dim}"
    if not readings:
        hint_mla = " (a 3-D tensor is MLA, which has one latent head: pass num_kv_heads=1)" \
            if len(shape) == 3 and num_kv_heads != 1 else ""
        raise LayoutMismatch(
            f"{name} has shape {shape}, which is no paged KV layout for {wanted}{hint_mla}; expected "
            f"(2, num_blocks, {block_size}, {num_kv_heads}, {head_dim}) (FlashAttention NHD), "
            f"(num_blocks, 2, {block_size}, {num_kv_heads}, {head_dim}) (FlashInfer NHD), the same with "
            f"heads before tokens (HND), or (num_blocks, {block_size}, {head_dim}) (MLA)")
    if hint is not None:
        hinted = _normalise_hint(hint)
        readings = [(layout, n) for layout, n in readings if _fits_hint(layout, hinted)]
        if not readings:
            raise LayoutMismatch(f"{name} has shape {shape}, which does not fit hint={hint!r} for {wanted}")
    if len(readings) > 1:
        options = ", ".join(f"PerLayerLayout(PerLayerKind.{layout.kind.name}, {layout.token_layout!r})"
                            for layout, _ in readings)
        raise LayoutMismatch(f"{name} has shape {shape}, which fits several layouts for {wanted}: {options}; "
                             f"pass hint= with the one the engine uses")
    return readings[0]


def _normalise_hint(hint: PerLayerKind | PerLayerLayout) -> PerLayerKind | PerLayerLayout:
    if isinstance(hint, PerLayerLayout):
        return hint
    try:
        return PerLayerKind(hint)
    except ValueError:
        raise LayoutMismatch(f"hint must be a PerLayerKind or PerLayerLayout, got {hint!r}") from None


def _fits_hint(layout: PerLayerLayout, hint: PerLayerKind | PerLayerLayout) -> bool:
    if isinstance(hint, PerLayerKind):
        return layout.kind is hint
    return layout.kind is hint.kind and (layout.kind is PerLayerKind.MLA
                                         or layout.token_layout == hint.token_layout)


def _cross_layer_strides(tensors: list[torch.Tensor], views: list[torch.Tensor],
                         preferred: TokenLayout) -> tuple[TokenLayout, int] | None:
    """``(physical token layout, block stride)`` when the layers form cross-layer blocks, else None.

    ``views`` are the layers as ``[num_blocks, kv, tokens, heads, dim]``. Cross-layer means: one
    storage; each layer's ``[kv, tokens, heads, dim]`` is contiguous in NHD or HND order; layer
    ``l`` starts ``l`` layer-sizes after layer 0; and the block stride leaves room for all layers.
    """
    storage = tensors[0].untyped_storage().data_ptr()
    if any(tensor.untyped_storage().data_ptr() != storage for tensor in tensors):
        return None
    first = views[0]
    if any(view.stride() != first.stride() for view in views):
        return None
    num_blocks, kv, tokens, heads, dim = first.shape
    layer_elems = kv * tokens * heads * dim
    other: TokenLayout = "HND" if preferred == "NHD" else "NHD"
    orders = {"NHD": (1, 2, 3, 4), "HND": (1, 3, 2, 4)}
    token_layout = next((layout for layout in (preferred, other) if _is_contiguous_in(first, orders[layout])),
                        None)
    if token_layout is None:
        return None
    offset = first.storage_offset()
    if any(view.storage_offset() != offset + index * layer_elems for index, view in enumerate(views)):
        return None
    block_elems = len(views) * layer_elems
    block_stride = first.stride(0) if num_blocks > 1 else block_elems
    if block_stride < block_elems:
        return None
    return token_layout, block_stride


def _is_contiguous_in(view: torch.Tensor, order: tuple[int, ...]) -> bool:
    """Whether dims ``order`` (outermost first) of ``view`` are densely packed in that order."""
    expected = 1
    for dim in reversed(order):
        if view.shape[dim] != 1 and view.stride(dim) != expected:
            return False
        expected *= view.shape[dim]
    return True


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(shape[index + 1:]) for index in range(len(shape)))
