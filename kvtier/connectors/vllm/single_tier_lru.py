"""The manager's batched path for the usual vLLM setup: one memory tier, LRU eviction, every block admitted.

vLLM's scheduler calls the manager for every request, on its own thread. With one CPU tier and LRU the
general path does work that decides nothing there: a plan built block by block through
:class:`~kvtier.residency.Residency`, chain hints no policy reads, watchers that re-derive vLLM's keys
from kvtier's, a lookup per evicted block to learn it left every tier. This path makes the same
changes to the same structures (the tier's index and pins, its LRU order, its byte count, the
activity counters, the mirror vLLM's lookups read) in batched dict operations, with vLLM's keys at
hand. A call outside its case (a key already indexed, repeated keys, several groups, not room for all)
returns None and the manager takes the general path, so the two never disagree
(tests/connectors/test_vllm_single_tier_lru.py holds them equal).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from operator import itemgetter
from typing import TYPE_CHECKING, cast

from kvtier.blocks import BlockKey
from kvtier.codec import MAX_HASH_BYTES
from kvtier.connectors.vllm.geometry import EPOCH_BYTES
from kvtier.policy.admission import AdmitAll
from kvtier.policy.lru import LRUPolicy
from kvtier.residency import PENDING, READY, Plan

if TYPE_CHECKING:
    from kvtier.connectors.vllm.runtime import OffloadRuntime

_SUFFIX = itemgetter(slice(-4, None))  # an offload key's group suffix (KeyCodec's layout)
#: the longest offload key whose block hash (epoch tag + hash) kvtier accepts
_MAX_KEY_BYTES = MAX_HASH_BYTES - EPOCH_BYTES + 4


class SingleTierLRU:
    """Plans, settles and touches of one memory tier with LRU eviction, batched (see the module)."""

    def __init__(self, runtime: OffloadRuntime) -> None:
        self._core = runtime.core
        self._index = runtime.residency.tiers[0]
        self._activity = runtime.core._activity[0]
        self._mirror = runtime.mirror
        self._watchers = [runtime.mirror]
        self._codec = runtime.codec
        self._group_of = {suffix: group for group, suffix in enumerate(runtime.codec.suffixes)}

    @classmethod
    def of(cls, runtime: OffloadRuntime) -> SingleTierLRU | None:
        """The batched path of ``runtime``, or None when its tiers are not one memory tier with LRU
        eviction that admits every block."""
        core, residency = runtime.core, runtime.residency
        if len(core.tiers) != 1 or runtime.memory_tiers != (0,) or runtime.slow_tiers or runtime.has_remote:
            return None
        index = residency.tiers[0]
        if index.self_evicting or type(residency.placement.admission[0]) is not AdmitAll:
            return None
        if not index.policies or any(type(policy) is not LRUPolicy for policy in index.policies.values()):
            return None
        return cls(runtime)

    def plan(self, keys: Sequence[bytes]) -> tuple[list[BlockKey], Plan] | None:
        """Plan storing ``keys`` (vLLM's offload keys, none held or being stored): their block keys and
        the plan, exactly as :meth:`AsyncTieredCache.plan_store` would make it; the blocks it evicts are
        reported removed now. None, having changed nothing, when the general path must decide."""
        count = len(keys)
        suffixes = set(map(_SUFFIX, keys))
        if not count or len(suffixes) != 1 or len(set(keys)) != count or max(map(len, keys)) > _MAX_KEY_BYTES:
            return None
        group_id = self._group_of.get(suffixes.pop())
        if group_id is None:
            return None
        epoch, new = self._codec.epoch, tuple.__new__
        block_keys = [new(BlockKey, (epoch + key[:-4], group_id)) for key in keys]
        core, index = self._core, self._index
        entries, pins = index.entries, index.pins
        with core._index_lock:
            core._check_open()
            if core._watchers != self._watchers or not entries.keys().isdisjoint(block_keys) or (
                    pins and not pins.keys().isdisjoint(block_keys)):
                return None
            per_block = index.block_bytes[group_id]
            need = index.used[group_id] + count * per_block - index.capacity[group_id]
            evict = -(-need // per_block) if need > 0 else 0
            policy = cast(LRUPolicy, index.policies[group_id])
            victims = policy.victims(evict, pins) if evict else []
            if len(victims) != evict:
                return None  # not room for all: the general path stores what fits
            if victims:  # TierIndex.discard of each, batched
                for victim in victims:
                    del entries[victim]
                index.drop_links(victims)
                policy.remove_all(victims)
                self._mirror.evicted(victims)  # one tier: an evicted block left every tier
            # TierIndex.add(ready=False) of each key: pending and pinned until settled. No chain hints:
            # LRU ignores them, and with one tier nothing is demoted or promoted to carry them along
            entries.update(dict.fromkeys(block_keys, PENDING))
            pins.update(dict.fromkeys(block_keys, 1))
            policy.insert_new(block_keys)
            index.used[group_id] += (count - evict) * per_block
        plan = Plan(1)
        plan.drops[0] = victims
        plan.writes[0] = list(range(count))
        return block_keys, plan

    def settle(self, plan: Plan, block_keys: Sequence[BlockKey], offload_keys: Sequence[bytes]) -> bool:
        """:meth:`AsyncTieredCache.settle` of a plan of this tier that the workers executed, its writes
        being ``block_keys`` (vLLM's ``offload_keys``): readable now. False, having changed nothing,
        when the general settle must run (a plan that does not write every key once, pins taken meanwhile)."""
        written = plan.writes[0]
        count = len(block_keys)
        if len(written) != count or plan.demotions[0]:
            return False
        core, index = self._core, self._index
        entries, pins = index.entries, index.pins
        with core._index_lock:
            if core._closed:
                return True  # as settle: nothing left to record
            if core._watchers != self._watchers or list(map(pins.get, block_keys)).count(1) != count or (
                    list(map(entries.get, block_keys)).count(PENDING) != count):
                return False
            # TierIndex.settle_many(ok=True), batched: unpinned and READY
            deque(map(pins.__delitem__, block_keys), maxlen=0)
            entries.update(dict.fromkeys(block_keys, READY))
            activity = self._activity
            activity.evictions += len(plan.drops[0])
            activity.stores += count
            self._mirror.stored(offload_keys, block_keys)
        return True

    def touch(self, keys: Sequence[BlockKey]) -> None:
        """:meth:`AsyncTieredCache.touch`: each READY key recently used, in order."""
        entries = self._index.entries
        policies = self._index.policies
        core = self._core
        with core._index_lock:
            core._check_open()
            ready = [key for key in keys if entries.get(key) == READY]
            if len(policies) == 1:
                cast(LRUPolicy, next(iter(policies.values()))).access_all(ready)
            else:
                for key in ready:
                    policies[key.group_id].access(key)
