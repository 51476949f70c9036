"""Prefix-aware LRU: among the coldest blocks, evict chain tails before chain heads.

A KV block is only useful while every block before it in its chain is cached: evicting block 3 of
a 10-block chain makes blocks 4..9 useless for prefix hits, while evicting block 9 costs one block.
So recency is kept at a coarse grain — *epochs* of ``capacity / 8`` references — and within the
oldest epoch the block with the highest chain position (``InsertHint.position``, remembered from
the store) leaves first. A heap orders (epoch, -position, age); stale heap entries are skipped and
the heap is rebuilt when they outnumber live ones, so operations are O(log n) amortised.
"""

from __future__ import annotations

import heapq
from collections.abc import Container

from kvtier.blocks import BlockKey
from kvtier.policy.base import EvictionPolicy, InsertHint


class PrefixAwarePolicy(EvictionPolicy):
    """``capacity`` in blocks sizes the epoch; without it, the most blocks ever held."""

    name = "prefix"

    def __init__(self, capacity: int | None = None, *, epochs: int = 8) -> None:
        if capacity is not None and capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        if epochs <= 0:
            raise ValueError(f"epochs must be positive, got {epochs}")
        self._fixed = capacity
        self._epochs = epochs
        self._capacity = capacity or 1
        self._epoch = 0
        self._epoch_left = self._epoch_length()
        self._seq = 0
        # key -> (epoch, position, seq of its live heap entry)
        self._meta: dict[BlockKey, tuple[int, int, int]] = {}
        self._heap: list[tuple[int, int, int, BlockKey]] = []

    def _epoch_length(self) -> int:
        return max(1, self._capacity // self._epochs)

    def _tick(self) -> int:
        self._epoch_left -= 1
        if self._epoch_left <= 0:
            self._epoch += 1
            self._epoch_left = self._epoch_length()
        self._seq += 1
        return self._seq

    def _push(self, key: BlockKey, position: int) -> None:
        seq = self._tick()
        self._meta[key] = (self._epoch, position, seq)
        heapq.heappush(self._heap, (self._epoch, -position, seq, key))
        if len(self._heap) > 2 * len(self._meta) + 64:
            self._heap = [(e, -p, s, k) for k, (e, p, s) in self._meta.items()]
            heapq.heapify(self._heap)

    def insert(self, key: BlockKey, hint: InsertHint = InsertHint()) -> None:
        old = self._meta.get(key)
        if self._fixed is None and old is None and len(self._meta) >= self._capacity:
            self._capacity = len(self._meta) + 1
        self._push(key, hint.position if old is None else old[1])

    def access(self, key: BlockKey) -> None:
        old = self._meta.get(key)
        if old is not None:
            self._push(key, old[1])

    def remove(self, key: BlockKey) -> None:
        self._meta.pop(key, None)

    def _drop_stale_top(self) -> None:
        heap, meta = self._heap, self._meta
        while heap:
            entry = meta.get(heap[0][3])
            if entry is not None and entry[2] == heap[0][2]:
                return
            heapq.heappop(heap)

    def victims(self, count: int, pinned: Container[BlockKey]) -> list[BlockKey]:
        out: list[BlockKey] = []
        if count <= 0:
            return out
        self._drop_stale_top()  # forgets dead entries only: the order of live blocks is unchanged
        heap = self._heap
        if not heap:
            return out
        if count == 1 and heap[0][3] not in pinned:
            return [heap[0][3]]
        taken: list[tuple[int, int, int, BlockKey]] = []
        while heap and len(out) < count:
            entry = heapq.heappop(heap)
            live = self._meta.get(entry[3])
            if live is None or live[2] != entry[2]:
                continue
            taken.append(entry)
            if entry[3] not in pinned:
                out.append(entry[3])
        for entry in taken:
            heapq.heappush(heap, entry)
        return out

    def __len__(self) -> int:
        return len(self._meta)

    def __contains__(self, key: object) -> bool:
        return key in self._meta
