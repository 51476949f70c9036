"""Belady's MIN, the offline optimum: evict the block whose next reference is farthest away.

It needs the future, so only ``kvtier replay`` can run it: before each reference the harness calls
:meth:`BeladyPolicy.observe` with the position of that key's next reference in the trace
(:data:`NEVER` if there is none). Everything else is the ordinary :class:`EvictionPolicy`
lifecycle, so MIN is replayed through the same residency and placement code as every other policy
and its numbers are the ceiling for the others. Every miss is admitted (no bypass), as for the
online policies; the pending blocks of the store in progress are pinned and never chosen.
"""

from __future__ import annotations

import heapq
import sys
from collections import OrderedDict
from collections.abc import Container

from kvtier.blocks import BlockKey
from kvtier.policy.base import EvictionPolicy, InsertHint

#: Next-use value of a key that is never referenced again.
NEVER = sys.maxsize


class BeladyPolicy(EvictionPolicy):
    name = "min"

    def __init__(self) -> None:
        self._next_use: dict[BlockKey, int] = {}  # resident keys
        self._announced: dict[BlockKey, int] = {}  # observed keys about to be inserted
        self._heap: list[tuple[int, BlockKey]] = []  # (-next use, key) of finite next uses; stale skipped
        # Keys never used again, oldest first. Kept out of the heap: the blocks being stored are
        # usually among them and pinned, and they sit at the end here instead of on top of the heap.
        self._never: OrderedDict[BlockKey, None] = OrderedDict()

    def observe(self, key: BlockKey, next_use: int) -> None:
        """The key is referenced now; its next reference is at ``next_use`` (or :data:`NEVER`)."""
        if key in self._next_use:
            self._set(key, next_use)
        else:
            self._announced[key] = next_use

    def _set(self, key: BlockKey, next_use: int) -> None:
        if self._next_use.get(key) == next_use:
            return  # the live entry already says so
        self._next_use[key] = next_use
        if next_use == NEVER:
            self._never[key] = None
            return
        self._never.pop(key, None)
        heapq.heappush(self._heap, (-next_use, key))
        if len(self._heap) > 2 * len(self._next_use) + 64:
            self._heap = [(-n, k) for k, n in self._next_use.items() if n != NEVER]
            heapq.heapify(self._heap)

    def insert(self, key: BlockKey, hint: InsertHint = InsertHint()) -> None:
        if key in self._next_use:
            return
        self._set(key, self._announced.pop(key, NEVER))

    def access(self, key: BlockKey) -> None:
        """Nothing to learn: :meth:`observe` already moved the key's next use."""

    def remove(self, key: BlockKey) -> None:
        if self._next_use.pop(key, None) is not None:
            self._never.pop(key, None)

    def victims(self, count: int, pinned: Container[BlockKey]) -> list[BlockKey]:
        out: list[BlockKey] = []
        if count <= 0:
            return out
        for key in self._never:
            if key not in pinned:
                out.append(key)
                if len(out) == count:
                    return out
        heap, live = self._heap, self._next_use
        taken: list[tuple[int, BlockKey]] = []
        while heap and len(out) < count:
            neg, key = heap[0]
            if live.get(key) != -neg:
                heapq.heappop(heap)  # stale: forgetting it changes nothing
                continue
            if count == 1 and not taken and key not in pinned:
                return [key]
            taken.append(heapq.heappop(heap))
            if key not in pinned:
                out.append(key)
        for entry in taken:
            heapq.heappush(heap, entry)
        return out

    def __len__(self) -> int:
        return len(self._next_use)

    def __contains__(self, key: object) -> bool:
        return key in self._next_use
