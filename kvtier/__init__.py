"""kvtier: keep LLM KV caches in a hierarchy of storage tiers (GPU, pinned CPU, NVMe, Redis).

Public API::

    from kvtier import TieredCache, load_config, BlockKey
    cache = TieredCache.from_config("kvtier.yaml")
    n = cache.lookup(keys)            # leading cached blocks
    cache.load(keys[:n], out)         # bit-exact, or reported missing
    cache.store(keys, blocks)

The names below are imported on first use, so ``kvtier --help`` and ``kvtier check`` start without
torch (seconds of import).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: public name → the module that defines it
_EXPORTS = {
    "AsyncTieredCache": "kvtier.cache", "TieredCache": "kvtier.cache",
    "BlockKey": "kvtier.blocks", "KVCacheSpec": "kvtier.blocks", "KVGroup": "kvtier.blocks",
    "KVTierConfig": "kvtier.config", "load_config": "kvtier.config",
    "CacheClosed": "kvtier.errors", "CacheForked": "kvtier.errors", "CalledOnLoopThread": "kvtier.errors",
    "CorruptBlock": "kvtier.errors", "KVTierConfigError": "kvtier.errors", "KVTierError": "kvtier.errors",
    "LayoutMismatch": "kvtier.errors", "TierUnavailable": "kvtier.errors",
    "Namespace": "kvtier.hashing", "hash_token_blocks": "kvtier.hashing",
    "BlockLayout": "kvtier.layout", "PerLayerKind": "kvtier.layout", "PerLayerLayout": "kvtier.layout",
    "InsertHint": "kvtier.policy",
}

__all__ = [
    "AsyncTieredCache", "BlockKey", "BlockLayout", "CacheClosed", "CacheForked", "CalledOnLoopThread",
    "CorruptBlock", "InsertHint", "KVCacheSpec", "KVGroup", "KVTierConfig", "KVTierConfigError",
    "KVTierError", "LayoutMismatch", "Namespace", "PerLayerKind", "PerLayerLayout", "TierUnavailable",
    "TieredCache", "hash_token_blocks", "load_config",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtier' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:
    from kvtier.blocks import BlockKey, KVCacheSpec, KVGroup
    from kvtier.cache import AsyncTieredCache, TieredCache
    from kvtier.config import KVTierConfig, load_config
    from kvtier.errors import (
        CacheClosed,
        CacheForked,
        CalledOnLoopThread,
        CorruptBlock,
        KVTierConfigError,
        KVTierError,
        LayoutMismatch,
        TierUnavailable,
    )
    from kvtier.hashing import Namespace, hash_token_blocks
    from kvtier.layout import BlockLayout, PerLayerKind, PerLayerLayout
    from kvtier.policy import InsertHint
