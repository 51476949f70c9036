"""Least recently used: the baseline every other policy is measured against."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence
from itertools import islice

from kvtier.blocks import BlockKey
from kvtier.policy.base import EvictionPolicy, InsertHint, take_unpinned


class LRUPolicy(EvictionPolicy):
    """Evicts the block accessed longest ago. An ``OrderedDict``: every operation is O(1)."""

    name = "lru"
    reads_positions = False  # store_new reads no hint

    def __init__(self) -> None:
        self._order: OrderedDict[BlockKey, None] = OrderedDict()

    def insert(self, key: BlockKey, hint: InsertHint = InsertHint()) -> None:
        order = self._order
        if key in order:
            order.move_to_end(key)
        else:
            order[key] = None

    def access(self, key: BlockKey) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: BlockKey) -> None:
        self._order.pop(key, None)

    def insert_new(self, keys: Iterable[BlockKey]) -> None:
        """:meth:`insert` of keys not tracked yet, in order, in one call (a scheduler's batched
        store plan)."""
        self._order.update(dict.fromkeys(keys))

    def access_all(self, keys: Iterable[BlockKey]) -> None:
        """:meth:`access` of each key, in order, in one call (a request's prefix hits, a finished
        request's blocks)."""
        order = self._order
        move = order.move_to_end
        for key in keys:
            if key in order:
                move(key)

    def remove_all(self, keys: Iterable[BlockKey]) -> None:
        """:meth:`remove` of each key, in one call."""
        pop = self._order.pop
        for key in keys:
            pop(key, None)

    def store_new(self, keys: Sequence[BlockKey], hints: Sequence[InsertHint], pinned: Container[BlockKey],
                  free: int) -> tuple[int, list[BlockKey]]:
        """The base class's key-by-key store with all victims taken at once: the keys inserted are
        pinned and the newest, so no victim walk would return them and the victims are simply the
        oldest unpinned keys."""
        count = len(keys) - free
        victims = self.victims(count, pinned) if count > 0 else []
        stored = min(len(keys), free + len(victims))
        pop = self._order.pop
        for key in victims:
            pop(key)
        self._order.update(dict.fromkeys(keys[:stored] if stored < len(keys) else keys))
        return stored, victims

    def victims(self, count: int, pinned: Container[BlockKey]) -> list[BlockKey]:
        if count == 1:  # the common case: the oldest unpinned key
            for key in self._order:
                if key not in pinned:
                    return [key]
            return []
        if count <= 0:
            return []
        out = list(islice(self._order, count))  # the oldest ones, when none is pinned (the usual case)
        if len(out) == count and not any(map(pinned.__contains__, out)):
            return out
        out.clear()
        take_unpinned(self._order, pinned, count, out)
        return out

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order
