"""Block geometry by numbers and dtype names only, without torch.

``kvtier check`` and config validation need a block's size, description and fingerprint but must
not pay torch's import (seconds). :class:`kvtier.layout.BlockLayout` adds the torch side (tensors,
views) and takes its description and fingerprint from here, so both always agree byte for byte.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import xxhash

from kvtier.errors import LayoutMismatch

#: Bytes per element of every dtype kvtier stores, by its canonical (torch) name.
DTYPE_ITEMSIZE: dict[str, int] = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

_ALIASES = {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32", "float": "float32",
            "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def canonical_dtype(name: str) -> str:
    """``"fp16"``, ``"torch.float16"`` or ``"float16"`` → ``"float16"``; anything else is a LayoutMismatch."""
    key = _ALIASES.get(name, name).removeprefix("torch.")
    if key not in DTYPE_ITEMSIZE:
        raise LayoutMismatch(f"dtype {name!r} is not supported; use one of {sorted(DTYPE_ITEMSIZE)}")
    return key


@dataclass(frozen=True)
class BlockGeometry:
    """The numbers of one cross-layer block (see :class:`kvtier.layout.BlockLayout`), dtype by name."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str = "float16"
    kv_factor: int = 2
    token_layout: str = "NHD"

    @property
    def nbytes(self) -> int:
        """Bytes of one block."""
        numel = math.prod((self.num_layers, self.kv_factor, self.block_size, self.num_kv_heads,
                           self.head_dim))
        return numel * DTYPE_ITEMSIZE[canonical_dtype(self.dtype)]

    def describe(self) -> str:
        return (f"cross_layer[L={self.num_layers},kv={self.kv_factor},tokens={self.block_size},"
                f"heads={self.num_kv_heads},dim={self.head_dim}] {canonical_dtype(self.dtype)} "
                f"{self.token_layout}")

    def fingerprint(self) -> int:
        """Stable 64-bit id of this layout; stored in every block header and part of the namespace."""
        return xxhash.xxh3_64_intdigest(self.describe().encode())
