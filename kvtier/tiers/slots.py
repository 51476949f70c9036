"""Which key holds which fixed-size slot of a slab, per KV-cache group; shared by the CPU and GPU tiers.

The memory tiers own one slab of equal slots per group and only need to know where a block lives and
which slots are free. This bookkeeping is the same whatever the memory (host mapping, CUDA device),
so it lives here once and is tested on CPU. It never evicts: the cache decides what to delete before
a ``put``, and a full group simply refuses new keys.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import repeat
from typing import cast

from kvtier.blocks import BlockKey


class _GroupSlots:
    __slots__ = ("capacity", "free", "slot_of")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        #: A stack; popped from the end, so slot 0 is handed out first and freed slots are reused first.
        self.free = list(range(capacity - 1, -1, -1))
        self.slot_of: dict[BlockKey, int] = {}


class SlotAllocator:
    """Per group: a free list of slot numbers and a map from key to its slot.

    Its changes are serialised by a lock of its own: a cache's store on the caller's thread fills its
    slots outside the cache's index lock while the loop thread may run the tier's calls (and a failed
    fill frees its slots there).
    """

    def __init__(self, slots_per_group: Mapping[int, int]) -> None:
        for group_id, count in slots_per_group.items():
            if count < 0:
                raise ValueError(f"group {group_id}: slot count must not be negative, got {count}")
        self._groups = {g: _GroupSlots(count) for g, count in slots_per_group.items()}
        self._lock = threading.Lock()

    def capacity(self, group_id: int) -> int:
        """How many slots the group has (0 for an unknown group)."""
        group = self._groups.get(group_id)
        return group.capacity if group is not None else 0

    def used(self, group_id: int) -> int:
        """How many of the group's slots hold a key."""
        group = self._groups.get(group_id)
        return len(group.slot_of) if group is not None else 0

    def slot(self, key: BlockKey) -> int | None:
        """The slot holding ``key``, or None."""
        group = self._groups.get(key.group_id)
        return group.slot_of.get(key) if group is not None else None

    def assign(self, key: BlockKey) -> int | None:
        """The slot for storing ``key``: the one it already holds, else a free one; None when full."""
        with self._lock:
            group = self._groups.get(key.group_id)
            if group is None:
                return None
            slot = group.slot_of.get(key)
            if slot is None:
                if not group.free:
                    return None
                slot = group.slot_of[key] = group.free.pop()
            return slot

    def release(self, key: BlockKey) -> int | None:
        """Free the slot of ``key`` (returned; None when it held none)."""
        with self._lock:
            group = self._groups.get(key.group_id)
            if group is None:
                return None
            slot = group.slot_of.pop(key, None)
            if slot is not None:
                group.free.append(slot)
            return slot

    def assign_many(self, group_id: int, keys: Sequence[BlockKey]) -> list[int | None]:
        """:meth:`assign` of each of ``keys``, all of group ``group_id`` (one call for a store's batch).

        The usual batch (distinct keys, none holding a slot, room for all) takes the top of the free
        list in one slice and maps the keys in one ``dict.update``: no Python per key.
        """
        with self._lock:
            group = self._groups.get(group_id)
            if group is None:
                return [None] * len(keys)
            slot_of, free = group.slot_of, group.free
            count = len(keys)
            if count <= len(free) and (not slot_of or slot_of.keys().isdisjoint(keys)) \
                    and len(set(keys)) == count:
                # what popping the free list once per key hands out: its last ``count`` slots, last first
                start = len(free) - count
                taken = free[start:]
                taken.reverse()
                del free[start:]
                slot_of.update(zip(keys, taken, strict=True))
                return cast("list[int | None]", taken)  # no copy: list is invariant
            slots: list[int | None] = []
            append = slots.append
            for key in keys:
                slot = slot_of.get(key)
                if slot is None:
                    if not free:
                        append(None)
                        continue
                    slot = slot_of[key] = free.pop()
                append(slot)
            return slots

    def slots_of(self, group_id: int, keys: Sequence[BlockKey]) -> list[int | None]:
        """:meth:`slot` of each of ``keys``, all of group ``group_id``."""
        group = self._groups.get(group_id)
        if group is None:
            return [None] * len(keys)
        return list(map(group.slot_of.get, keys))

    def release_many(self, keys: Iterable[BlockKey]) -> None:
        """:meth:`release` of each key (one call for a batch of evictions).

        Per group, the keys' slots are popped with one ``map`` and pushed on the free list in key order,
        as one :meth:`release` per key would (a key of another group is in no other group's map).
        """
        with self._lock:
            keys = keys if isinstance(keys, (list, tuple)) else list(keys)
            if not keys:
                return
            for group in self._groups.values():
                slot_of = group.slot_of
                if not slot_of:
                    continue
                slots = list(map(slot_of.pop, keys, repeat(None)))
                if None in slots:
                    group.free.extend([slot for slot in slots if slot is not None])
                else:
                    group.free.extend(slots)  # type: ignore[arg-type]  # none of them is None

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, BlockKey):
            return False
        group = self._groups.get(key.group_id)
        return group is not None and key in group.slot_of

    def keys(self) -> Iterator[BlockKey]:
        """Every key with a slot, from a snapshot (deleting while iterating is safe)."""
        snapshot = [key for group in self._groups.values() for key in group.slot_of]
        return iter(snapshot)

    def problems(self) -> list[str]:
        """Broken invariants (a slot lost, shared, or both free and held); empty when sound. For tests."""
        found = []
        for group_id, group in self._groups.items():
            held = list(group.slot_of.values())
            free = set(group.free)
            if (len(set(held)) != len(held) or len(free) != len(group.free) or free & set(held)
                    or len(held) + len(free) != group.capacity
                    or any(not 0 <= slot < group.capacity for slot in (*held, *free))):
                found.append(f"group {group_id}: {len(held)} held and {len(group.free)} free slots do not "
                             f"partition its {group.capacity} slots")
        return found
