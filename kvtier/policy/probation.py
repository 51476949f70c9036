"""Loop resistance for chains: a probation lane evicted newest first, and leaf-first LRU with it.

When sessions come back in turn and each is longer than its share of the cache, any recency order
evicts the session that returns next (the looping pattern where LRU gets nothing and MIN keeps a
stable subset). The lane fixes that the way LIFO fixes a loop: a chain stored by a request that
missed its very first block is on *probation*, and probation leaves go first, the newest first, so
the older stored chains stay until their session returns and hits them. A hit ends probation, and
blocks stored after a hit prefix (the session's new turn) inherit it: a returning session's chain
grows whole. Single-block chains never enter the lane (classic workloads are left to the owner).

The lane only decides while the blocks not on probation fill at most :data:`PROTECTED_SHARE` of the
partition; beyond that its owner's order runs, so sessions that stopped coming back age out and a
changing workload is not locked out. docs/policies.md (Probation) has the rules and the figures.
"""

from __future__ import annotations

import heapq
from collections.abc import Container

from kvtier.blocks import BlockKey
from kvtier.policy.base import InsertHint
from kvtier.policy.chains import LeafLRUPolicy

#: Most of the partition that blocks off probation (hit, or stored after a hit) may hold while the
#: lane decides; beyond it the owner's order runs.
PROTECTED_SHARE = 0.3


class ProbationLane:
    """Which resident keys are on probation, and the newest probation leaf (module docstring).

    The owner tells it what happens to keys (:meth:`stored`, :meth:`touched`, :meth:`left`,
    :meth:`became_leaf`) and asks :meth:`victim` first when it needs room. Every call is O(1) or
    O(log n) amortised: leaves wait in a max-heap by store time, stale entries skipped.
    """

    __slots__ = ("fresh_roots", "members", "heap")

    def __init__(self) -> None:
        self.fresh_roots: dict[BlockKey, int] = {}  # chain heads stored, not hit, no successor yet
        self.members: dict[BlockKey, int] = {}  # probation keys -> store time
        #: (-store time, key) of probation leaves, stale entries skipped by :meth:`victim`; an owner that
        #: inlines :meth:`stored` or :meth:`became_leaf` pushes here (the list is replaced by compaction)
        self.heap: list[tuple[int, BlockKey]] = []

    def stored(self, key: BlockKey, pred: BlockKey | None, t: int, leaf: bool) -> None:
        """``key`` was stored at ``t`` after ``pred`` (its hint); ``leaf``: it has no resident successor."""
        members = self.members
        if pred is None or pred == key:
            self.fresh_roots[key] = t
            return
        if pred in members:
            members[key] = t
        else:
            then = self.fresh_roots.pop(pred, None)
            if then is None:
                return  # after a hit or protected block: the chain is protected
            members[pred] = then  # a fresh head with a successor: a chain on probation
            members[key] = t
        if leaf:
            heapq.heappush(self.heap, (-t, key))

    def touched(self, key: BlockKey) -> None:
        """``key`` was hit: it is protected from now on."""
        if self.members.pop(key, None) is None:
            self.fresh_roots.pop(key, None)

    def left(self, key: BlockKey) -> None:
        if self.members.pop(key, None) is None:
            self.fresh_roots.pop(key, None)

    def became_leaf(self, key: BlockKey) -> None:
        """``key``'s last resident successor left."""
        t = self.members.get(key)
        if t is not None:
            heapq.heappush(self.heap, (-t, key))

    def applies(self, resident: int) -> bool:
        """Whether the lane decides now: the protected blocks hold at most their share of ``resident``."""
        return bool(self.members) and resident - len(self.members) <= PROTECTED_SHARE * resident

    def take(self, count: int, pinned: Container[BlockKey],
             inner: Container[BlockKey]) -> tuple[list[BlockKey], Container[BlockKey]]:
        """Up to ``count`` victims of the lane (:meth:`victim`, repeatedly), and ``pinned`` plus them:
        what the owner's own order must skip for the rest."""
        out: list[BlockKey] = []
        skip: Container[BlockKey] = pinned
        while len(out) < count:
            key = self.victim(skip, inner)
            if key is None:
                break
            out.append(key)
            skip = Excluding(pinned, out)
        return out, skip

    def victim(self, pinned: Container[BlockKey], inner: Container[BlockKey]) -> BlockKey | None:
        """The newest probation leaf (not in ``inner``) outside ``pinned``; changes no order."""
        heap, members = self.heap, self.members
        held: list[tuple[int, BlockKey]] = []
        found: BlockKey | None = None
        while heap:
            entry = heap[0]
            key = entry[1]
            if members.get(key) != -entry[0] or key in inner:
                heapq.heappop(heap)  # stale: a leaf again re-enters by became_leaf
                continue
            if key not in pinned:
                found = key
                break
            held.append(heapq.heappop(heap))  # a request's own pending tail: rare, and few
        for entry in held:
            heapq.heappush(heap, entry)
        if len(heap) > 2 * len(members) + 64:
            self.heap = [(-t, k) for k, t in members.items() if k not in inner]
            heapq.heapify(self.heap)
        return found


class LeafProbationPolicy(LeafLRUPolicy):
    """Leaf-first LRU with the probation lane (module docstring): the expert on its own."""

    name = "leaf_probation"

    def __init__(self) -> None:
        super().__init__()
        self.probation = ProbationLane()

    def insert(self, key: BlockKey, hint: InsertHint = InsertHint()) -> None:
        if key in self._time:
            self.access(key)
            return
        super().insert(key, hint)
        self.probation.stored(key, hint.predecessor, self._clock, key not in self._inner)

    def access(self, key: BlockKey) -> None:
        if key in self._time:
            self.probation.touched(key)
            super().access(key)

    def remove(self, key: BlockKey) -> None:
        if key not in self._time:
            return
        pred = self.chains.pred.get(key)
        super().remove(key)
        self.probation.left(key)
        if pred is not None and pred in self._time and pred not in self._inner:
            self.probation.became_leaf(pred)

    def victims(self, count: int, pinned: Container[BlockKey]) -> list[BlockKey]:
        if count <= 0:
            return []
        if not self._detached and self.probation.applies(len(self._time)):
            out, skip = self.probation.take(count, pinned, self._inner)
            if len(out) < count:
                out.extend(super().victims(count - len(out), skip))
            return out
        return super().victims(count, pinned)


class Excluding:
    """``pinned`` plus the victims already chosen, as one container."""

    __slots__ = ("a", "b")

    def __init__(self, a: Container[BlockKey], b: list[BlockKey]) -> None:
        self.a, self.b = a, set(b)

    def __contains__(self, key: object) -> bool:
        return key in self.a or key in self.b
