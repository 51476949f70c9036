"""SIEVE (Zhang et al., NSDI'24): a FIFO queue with one "visited" bit and a moving hand.

A hit only sets the block's bit. To evict, the hand walks from the oldest block toward the newest,
clearing set bits, and evicts the first block whose bit is clear; it stays where it stopped, so
blocks that survive a pass keep their place (lazy promotion, quick demotion of new blocks).

``victims`` must not change state, so it simulates the walk and remembers what it would have
cleared; :meth:`remove` applies that when the cache drops the victims in the order given (any
other change forgets the walk). Pinned blocks are passed over without touching their bit.
"""

from __future__ import annotations

from collections.abc import Container

from kvtier.blocks import BlockKey
from kvtier.policy.base import EvictionPolicy, InsertHint


class SievePolicy(EvictionPolicy):
    name = "sieve"

    def __init__(self) -> None:
        self._visited: dict[BlockKey, bool] = {}
        self._newer: dict[BlockKey, BlockKey | None] = {}
        self._older: dict[BlockKey, BlockKey | None] = {}
        self._head: BlockKey | None = None  # newest
        self._tail: BlockKey | None = None  # oldest
        self._hand: BlockKey | None = None
        # victim -> (keys whose bit the walk cleared before reaching it, where the hand goes next)
        self._walk: dict[BlockKey, tuple[list[BlockKey], BlockKey | None]] = {}

    def insert(self, key: BlockKey, hint: InsertHint = InsertHint()) -> None:
        if key in self._visited:
            self.access(key)
            return
        self._walk.clear()
        self._visited[key] = False
        self._older[key] = self._head
        self._newer[key] = None
        if self._head is not None:
            self._newer[self._head] = key
        self._head = key
        if self._tail is None:
            self._tail = key

    def access(self, key: BlockKey) -> None:
        if key in self._visited:
            self._walk.clear()
            self._visited[key] = True

    def remove(self, key: BlockKey) -> None:
        if key not in self._visited:
            return
        if self._walk and next(iter(self._walk)) == key:  # the next victim of the last walk
            cleared, hand = self._walk.pop(key)
            for k in cleared:
                self._visited[k] = False
            self._hand = hand
        else:
            self._walk.clear()
        if self._hand == key:
            self._hand = self._newer[key]
        newer, older = self._newer.pop(key), self._older.pop(key)
        del self._visited[key]
        if newer is None:
            self._head = older
        else:
            self._older[newer] = older
        if older is None:
            self._tail = newer
        else:
            self._newer[older] = newer

    def victims(self, count: int, pinned: Container[BlockKey]) -> list[BlockKey]:
        out: list[BlockKey] = []
        self._walk.clear()
        if count <= 0 or self._tail is None:
            return out
        chosen: set[BlockKey] = set()
        cleared: set[BlockKey] = set()
        batch: list[BlockKey] = []
        node: BlockKey | None = self._hand if self._hand is not None else self._tail
        steps = 2 * len(self._visited) + count  # two passes clear every bit; more means all are pinned
        while len(out) < count and steps > 0:
            steps -= 1
            if node is None:
                node = self._tail
            assert node is not None
            nxt = self._newer[node]
            if node in chosen or node in pinned:
                pass
            elif self._visited[node] and node not in cleared:
                cleared.add(node)
                batch.append(node)
            else:
                out.append(node)
                chosen.add(node)
                self._walk[node] = (batch, nxt)
                batch = []
            node = nxt
        return out

    def __len__(self) -> int:
        return len(self._visited)

    def __contains__(self, key: object) -> bool:
        return key in self._visited
