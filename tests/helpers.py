"""Helpers shared by the tests: small layouts, keys and real random blocks."""

from __future__ import annotations

import torch

from kvtier.blocks import BlockKey
from kvtier.layout import BlockLayout

SMALL_MODEL = {"name": "tiny-llama", "num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "dtype": "float16"}


def small_layout(block_size: int = 16) -> BlockLayout:
    return BlockLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=block_size)


def make_keys(n: int, group_id: int = 0, start: int = 0) -> list[BlockKey]:
    return [BlockKey(i.to_bytes(16, "little"), group_id) for i in range(start, start + n)]


def random_blocks(n: int, layout: BlockLayout, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((n, *layout.shape), generator=gen).to(layout.dtype)
