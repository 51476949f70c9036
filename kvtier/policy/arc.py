"""ARC, the adaptive replacement cache (Megiddo & Modha, FAST'03), as vLLM's offload module has it.

Two LRU lists of resident blocks — ``T1`` seen once recently, ``T2`` seen at least twice — and two
ghost lists of keys evicted from them, ``B1`` and ``B2``. A miss whose key is in ``B1`` means T1
was too small, so the target size ``p`` of T1 grows; a key in ``B2`` shrinks it. Ghost lists are
bounded (``|T1| + |B1| <= c``, all four ``<= 2c``), so memory stays O(capacity).

Through :class:`EvictionPolicy` the adaptation happens when the block is inserted, which is just
after room was made for it (the cache asks for victims first); the textbook adapts just before.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container

from kvtier.blocks import BlockKey
from kvtier.policy.base import EvictionPolicy, InsertHint


class ARCPolicy(EvictionPolicy):
    """ARC over one partition. ``capacity`` in blocks; without it, the most blocks ever held."""

    name = "arc"

    def __init__(self, capacity: int | None = None) -> None:
        if capacity is not None and capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self._fixed = capacity
        self.c = capacity or 0
        self.p = 0.0
        self.t1: OrderedDict[BlockKey, None] = OrderedDict()
        self.t2: OrderedDict[BlockKey, None] = OrderedDict()
        self.b1: OrderedDict[BlockKey, None] = OrderedDict()
        self.b2: OrderedDict[BlockKey, None] = OrderedDict()

    def insert(self, key: BlockKey, hint: InsertHint = InsertHint()) -> None:
        if key in self.t1 or key in self.t2:
            self.access(key)
            return
        if self._fixed is None:
            self.c = max(self.c, len(self.t1) + len(self.t2) + 1)
        if key in self.b1:
            self.p = min(float(self.c), self.p + max(1.0, len(self.b2) / len(self.b1)))
            del self.b1[key]
            self.t2[key] = None
        elif key in self.b2:
            self.p = max(0.0, self.p - max(1.0, len(self.b1) / len(self.b2)))
            del self.b2[key]
            self.t2[key] = None
        else:
            self.t1[key] = None
        self._trim_ghosts()

    def access(self, key: BlockKey) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)

    def remove(self, key: BlockKey) -> None:
        if key in self.t1:
            del self.t1[key]
            self.b1[key] = None
        elif key in self.t2:
            del self.t2[key]
            self.b2[key] = None
        else:
            return
        self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        c = self.c
        while self.b1 and len(self.t1) + len(self.b1) > c:
            self.b1.popitem(last=False)
        while self.b2 and len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * c:
            self.b2.popitem(last=False)

    def victims(self, count: int, pinned: Container[BlockKey]) -> list[BlockKey]:
        out: list[BlockKey] = []
        if count <= 0:
            return out
        # REPLACE: take from T1 while it exceeds its target p (or T2 is empty), else from T2.
        t1 = (k for k in self.t1 if k not in pinned)
        t2 = (k for k in self.t2 if k not in pinned)
        n1 = len(self.t1)
        a = next(t1, None)
        b = next(t2, None)
        while len(out) < count and (a is not None or b is not None):
            if a is not None and (b is None or n1 > self.p):
                out.append(a)
                n1 -= 1
                a = next(t1, None)
            else:
                assert b is not None
                out.append(b)
                b = next(t2, None)
        return out

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def __contains__(self, key: object) -> bool:
        return key in self.t1 or key in self.t2
