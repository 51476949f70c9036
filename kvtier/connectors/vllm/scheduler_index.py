"""The scheduler's own residency when the bytes live in other processes (vLLM's multiprocess executor,
tensor parallelism): the tiers' indexes, pins and policies with no storage behind them.

The manager plans on it exactly as on a full cache (:meth:`AsyncTieredCache.plan_store`, ``lease``,
``touch``, ``clear``); every worker executes each plan on its own tiers, in order, so all ranks hold
the same blocks. The manager settles a plan (its writes become readable) when vLLM completes the
store, i.e. once every worker finished it. A memory-tier block is on every rank by construction; a
file or Redis block can vanish on one rank, so the manager promises one only after every rank staged
it (:mod:`.stage_channel`; docs/vllm.md, "Tensor parallel and several processes").
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from kvtier.blocks import BlockKey
from kvtier.cache import AsyncTieredCache
from kvtier.config import (
    CpuTierConfig,
    FileTierConfig,
    KVTierConfig,
    RedisTierConfig,
    build_spec,
    split_capacity,
    tier_name,
)
from kvtier.errors import KVTierConfigError
from kvtier.policy.admission import make_admission_policy
from kvtier.policy.placement import PlacementPolicy
from kvtier.residency import Residency, TierIndex
from kvtier.tiers.base import Tier

#: tier types whose blocks every rank holds by construction (the workers run the same plans)
MEMORY_TIER_TYPES = ("cpu",)
#: tier types a rank can lose blocks of on its own: served through every rank's staged copy
SLOW_TIER_TYPES = ("file", "redis")


class IndexOnlyTier(Tier):
    """A memory tier as the scheduler sees it: its name and capacity, no bytes (those are the workers')."""

    kind = "cpu"
    addressable = True

    async def put(self, keys: Sequence[BlockKey], blocks: Sequence[torch.Tensor]) -> list[bool]:
        return [False] * len(keys)

    async def get(self, keys: Sequence[BlockKey], out: Sequence[torch.Tensor]) -> list[bool]:
        return [False] * len(keys)

    async def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        return [False] * len(keys)

    async def delete(self, keys: Sequence[BlockKey]) -> None:
        return None

    def keys(self) -> Iterator[BlockKey]:
        return iter(())

    def usage_bytes(self) -> int:
        return 0


class IndexOnlyFileTier(IndexOnlyTier):
    """A file tier as the scheduler sees it: capacity and index only; the workers hold the files."""

    kind = "file"
    addressable = False


class IndexOnlyRemoteTier(IndexOnlyTier):
    """A Redis tier as the scheduler sees it: nothing indexed (Redis evicts on its own); workers ask it."""

    kind = "redis"
    addressable = False
    self_evicting = True


def index_only_cache(config: KVTierConfig) -> AsyncTieredCache:
    """A cache over :class:`IndexOnlyTier` s with the config's capacities, policies and placement.

    Raises :class:`KVTierConfigError` naming the first tier of a type it cannot index (a ``gpu`` tier).
    """
    spec = build_spec(config)
    layouts = {g.group_id: g.layout for g in spec.groups}
    block_bytes = {g: layout.nbytes for g, layout in layouts.items()}
    tiers: list[Tier] = []
    indexes, admissions = [], []
    for i, tc in enumerate(config.tiers):
        name = tier_name(tc, i)
        if isinstance(tc, RedisTierConfig):
            capacity = {g: 0 for g in layouts}
            tiers.append(IndexOnlyRemoteTier(name, layouts, capacity))
            indexes.append(TierIndex(name, capacity, block_bytes, "default", self_evicting=True))
        elif isinstance(tc, CpuTierConfig | FileTierConfig):
            capacity = split_capacity(tc.capacity, spec)
            kind = IndexOnlyTier if isinstance(tc, CpuTierConfig) else IndexOnlyFileTier
            tiers.append(kind(name, layouts, capacity))
            indexes.append(TierIndex(name, capacity, block_bytes, getattr(tc, "eviction", "default")))
        else:
            raise KVTierConfigError(
                f"tiers[{i}].type",
                f"is {tc.type!r}: with vLLM's scheduler and workers in different processes "
                f"(tensor parallelism, the multiprocess executor) kvtier offloads to "
                f"{', '.join(MEMORY_TIER_TYPES + SLOW_TIER_TYPES)} tiers (docs/vllm.md)")
        admissions.append(make_admission_policy(tc.admission, config.placement.admission_history))
    p = config.placement
    placement = PlacementPolicy(admission=admissions, write_mode=p.write_mode,
                                promote_on_hit=p.promote_on_hit, promote_to=p.promote_to,
                                keep_lower_copy=p.keep_lower_copy)
    return AsyncTieredCache(spec, tiers, Residency(indexes, placement), persist_on_close=False)
