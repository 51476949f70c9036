"""kvtier: keep LLM KV caches in a hierarchy of storage tiers (GPU, pinned CPU, NVMe, Redis).

Public API::

    from kvtier import TieredCache, load_config, BlockKey
    cache = TieredCache.from_config("kvtier.yaml")
    n = cache.lookup(keys)            # leading cached blocks
    cache.load(keys[:n], out)         # bit-exact, or reported missing
    cache.store(keys, blocks)
"""

from kvtier.blocks import BlockKey, KVCacheSpec, KVGroup
from kvtier.cache import AsyncTieredCache, TieredCache
from kvtier.config import KVTierConfig, load_config
from kvtier.errors import CorruptBlock, KVTierConfigError, KVTierError, LayoutMismatch, TierUnavailable
from kvtier.hashing import Namespace, hash_token_blocks
from kvtier.layout import BlockLayout, PerLayerKind, PerLayerLayout
from kvtier.policy import InsertHint

__version__ = "0.1.0"

__all__ = [
    "AsyncTieredCache", "BlockKey", "BlockLayout", "CorruptBlock", "InsertHint", "KVCacheSpec", "KVGroup",
    "KVTierConfig", "KVTierConfigError", "KVTierError", "LayoutMismatch", "Namespace", "PerLayerKind",
    "PerLayerLayout", "TierUnavailable", "TieredCache", "hash_token_blocks", "load_config",
]
