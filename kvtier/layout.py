"""Physical layout of one offloaded KV block, and of the engine-side tensors it is packed from.

The unit that moves between tiers is a *cross-layer block*: the K and V of every layer of a group
for ``block_size`` tokens, in one contiguous region of logical shape
``[num_layers, kv_factor, block_size, num_kv_heads, head_dim]`` (``kv_factor`` is 2, or 1 for MLA).
The layout travels (as a fingerprint) in every stored block's header, so a reader never interprets
bytes written under another layout. This module only describes layouts; moving bytes between them
is the job of :mod:`kvtier.kernels`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from enum import Enum
from typing import Literal

import torch

from kvtier.errors import LayoutMismatch
from kvtier.geometry import DTYPE_ITEMSIZE, BlockGeometry, canonical_dtype

#: Names of the logical dimensions of a cross-layer block, outermost first.
LOGICAL_DIMS = ("layer", "kv", "token", "head", "dim")

TokenLayout = Literal["NHD", "HND"]

_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_ITEMSIZE}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """Turn ``"float16"``/``"fp16"``/``torch.float16`` into a torch dtype kvtier can store."""
    if isinstance(name, torch.dtype):
        if name not in _DTYPES.values():
            raise LayoutMismatch(f"dtype {name} is not supported; use one of {sorted(_DTYPES)}")
        return name
    return _DTYPES[canonical_dtype(name)]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` → ``"float16"`` (the spelling configs and headers use)."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class BlockLayout:
    """Explicit physical layout of one cross-layer block.

    ``token_layout`` fixes the order of the token and head dimensions inside a block (``NHD``:
    token-major, as FlashAttention; ``HND``: head-major, as FlashInfer's HND mode). The block is
    always contiguous in the order given by :attr:`stride_order`.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype = torch.float16
    kv_factor: int = 2
    token_layout: TokenLayout = "NHD"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise LayoutMismatch(f"BlockLayout.{name} must be a positive int, got {value!r}")
        if self.kv_factor not in (1, 2):
            raise LayoutMismatch(f"BlockLayout.kv_factor must be 2 (K and V) or 1 (MLA), got "
                                 f"{self.kv_factor!r}")
        if self.token_layout not in ("NHD", "HND"):
            raise LayoutMismatch(f"BlockLayout.token_layout must be 'NHD' or 'HND', got "
                                 f"{self.token_layout!r}")
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))

    @property
    def logical_shape(self) -> tuple[int, int, int, int, int]:
        """``(num_layers, kv_factor, block_size, num_kv_heads, head_dim)``, whatever the storage order."""
        return (self.num_layers, self.kv_factor, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def stride_order(self) -> tuple[int, int, int, int, int]:
        """Logical dimensions in physical order, outermost first."""
        return (0, 1, 2, 3, 4) if self.token_layout == "NHD" else (0, 1, 3, 2, 4)

    @functools.cached_property
    def shape(self) -> tuple[int, ...]:
        """Physical (contiguous) shape of one block (computed once: every put, get and check asks for it,
        as for ``numel`` and ``nbytes``)."""
        logical = self.logical_shape
        return tuple(logical[i] for i in self.stride_order)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def layer_nbytes(self) -> int:
        """Bytes of one layer's K and V inside a block."""
        return self.nbytes // self.num_layers

    @functools.cached_property
    def numel(self) -> int:
        return math.prod(self.logical_shape)

    @functools.cached_property
    def nbytes(self) -> int:
        """Bytes of one block: the size of every slot, file payload and Redis value (before codec)."""
        return self.numel * self.itemsize

    @property
    def geometry(self) -> BlockGeometry:
        """The same block by numbers and dtype name (what torch-free code such as ``kvtier check`` uses)."""
        return BlockGeometry(self.num_layers, self.num_kv_heads, self.head_dim, self.block_size,
                             dtype_name(self.dtype), self.kv_factor, self.token_layout)

    def describe(self) -> str:
        return self.geometry.describe()

    def fingerprint(self) -> int:
        """Stable 64-bit id of this layout; stored in every block header and part of the namespace."""
        return self.geometry.fingerprint()

    def logical_view(self, blocks: torch.Tensor) -> torch.Tensor:
        """View ``[n, *shape]`` blocks as ``[n, *logical_shape]`` (a permutation, never a copy)."""
        if tuple(blocks.shape[1:]) != self.shape:
            raise LayoutMismatch(f"blocks have shape {tuple(blocks.shape)}, expected "
                                 f"[n, {', '.join(map(str, self.shape))}]")
        if self.token_layout == "NHD":
            return blocks
        return blocks.permute(0, 1, 2, 4, 3, 5)

    def check_blocks(self, blocks: torch.Tensor, what: str = "blocks") -> torch.Tensor:
        """Validate a ``[n, *shape]`` tensor of this layout and return it viewed as ``[n, nbytes]`` bytes."""
        if not isinstance(blocks, torch.Tensor):
            raise LayoutMismatch(f"{what} must be a torch.Tensor, got {type(blocks).__name__}")
        if blocks.dtype != self.dtype:
            raise LayoutMismatch(f"{what} have dtype {blocks.dtype}, expected {self.dtype} "
                                 f"({self.describe()})")
        if blocks.dim() != len(self.shape) + 1 or tuple(blocks.shape[1:]) != self.shape:
            raise LayoutMismatch(
                f"{what} have shape {tuple(blocks.shape)}, expected [n, {', '.join(map(str, self.shape))}] "
                f"({self.describe()})")
        if not blocks.is_contiguous():
            raise LayoutMismatch(f"{what} must be contiguous (strides {blocks.stride()})")
        return blocks.view(torch.uint8).view(blocks.shape[0], self.nbytes)


class PerLayerKind(str, Enum):
    """How an engine lays out one layer's paged KV tensor."""

    #: ``(2, num_blocks, block_size, heads, dim)`` (NHD) or ``(2, num_blocks, heads, block_size, dim)`` (HND)
    FLASH_ATTN = "flash_attn"
    #: ``(num_blocks, 2, block_size, heads, dim)`` (NHD) or ``(num_blocks, 2, heads, block_size, dim)`` (HND)
    FLASHINFER = "flashinfer"
    #: MLA: ``(num_blocks, block_size, head_dim)`` — one latent vector per token, no K/V split
    MLA = "mla"


@dataclass(frozen=True)
class PerLayerLayout:
    """An engine's per-layer paged KV layout: what kvtier packs into cross-layer blocks."""

    kind: PerLayerKind
    token_layout: TokenLayout = "NHD"

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", PerLayerKind(self.kind))
        except ValueError:
            raise LayoutMismatch(f"unknown per-layer kind {self.kind!r}; use one of "
                                 f"{[k.value for k in PerLayerKind]}") from None
        if self.token_layout not in ("NHD", "HND"):
            raise LayoutMismatch(f"PerLayerLayout.token_layout must be 'NHD' or 'HND', got "
                                 f"{self.token_layout!r}")
        if self.kind is PerLayerKind.MLA:
            object.__setattr__(self, "token_layout", "NHD")  # one head: NHD and HND are the same bytes

    def layer_shape(self, num_blocks: int, block: BlockLayout) -> tuple[int, ...]:
        """Shape of one layer's tensor holding ``num_blocks`` engine blocks of ``block``'s geometry."""
        bs, h, d = block.block_size, block.num_kv_heads, block.head_dim
        inner = (bs, h, d) if self.token_layout == "NHD" else (h, bs, d)
        if self.kind is PerLayerKind.FLASH_ATTN:
            return (2, num_blocks, *inner)
        if self.kind is PerLayerKind.FLASHINFER:
            return (num_blocks, 2, *inner)
        return (num_blocks, bs, d)
