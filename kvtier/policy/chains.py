"""Prefix chains inside one partition (:class:`ChainForest`), and leaf-first LRU (:class:`LeafLRUPolicy`).

A block is only usable when its whole prefix is cached, so evicting an inner block orphans its
successors. :class:`ChainForest` links blocks under their resident predecessor
(:attr:`InsertHint.predecessor`), detaches the successors of a block that leaves, and tolerates bad
links (self links, unknown parents, cycles). :class:`LeafLRUPolicy` evicts detached blocks first,
then the least recently used leaf. docs/policies.md (Chains) has the rules.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable, Iterator, Sequence

from kvtier.blocks import BlockKey
from kvtier.policy.base import EvictionPolicy, InsertHint, take_unpinned

_NONE: tuple[BlockKey, ...] = ()  # an empty result, shared


class ChainForest:
    """Chain links among the resident keys of one partition (see the module docstring).

    The owning policy calls :meth:`link` after it records a new key and :meth:`unlink` when a key
    leaves; both return what changed so the policy can move keys between its leaf and inner sets.
    """

    __slots__ = ("pred", "children", "detached")

    def __init__(self) -> None:
        self.pred: dict[BlockKey, BlockKey] = {}  # resident key -> declared predecessor
        self.children: dict[BlockKey, list[BlockKey]] = {}  # declared predecessor -> resident keys
        self.detached: set[BlockKey] = set()

    def link(self, key: BlockKey, pred: BlockKey | None, resident: Container[BlockKey]) -> tuple[
            BlockKey | None, bool, Sequence[BlockKey], Sequence[BlockKey]]:
        """Record the new resident ``key``.

        Returns ``(parent, inner, attached, detached)``: ``parent`` is the resident predecessor that
        was a leaf and now is not (None otherwise); ``inner`` says ``key`` already has resident
        successors (they arrived first); ``attached`` are keys that were detached and are no more;
        ``detached`` are successors that arrived first and now hang under a detached ``key``.
        """
        parent: BlockKey | None = None
        if pred is not None and pred != key:
            self.pred[key] = pred
            kids = self.children.get(pred)
            if kids is None:
                self.children[pred] = [key]
                if pred in resident:
                    parent = pred
            else:
                kids.append(key)
            if pred in self.detached:
                self.detached.add(key)
        if key not in self.children:
            return parent, False, _NONE, _NONE  # the usual case: a new tail
        return (parent, *self.adopt(key, pred, resident))

    def adopt(self, key: BlockKey, pred: BlockKey | None, resident: Container[BlockKey]) -> tuple[
            bool, Sequence[BlockKey], Sequence[BlockKey]]:
        """The end of :meth:`link` for a ``key`` whose successors arrived first (callers that inline the
        usual case call it when ``key in children``): ``(inner, attached, detached)`` as there."""
        kids = self.children.get(key)
        if kids and pred is not None and pred in resident:
            self._break_cycles(key, kids, resident)
            kids = self.children.get(key)
        if not kids:
            return False, _NONE, _NONE
        if key not in self.detached:
            attached = [k for k in self.subtree(kids) if k in self.detached]
            self.detached.difference_update(attached)
            return True, attached, _NONE
        detached = [k for k in self.subtree(kids) if k not in self.detached]
        self.detached.update(detached)
        return True, _NONE, detached

    def unlink(self, key: BlockKey,
               resident: Container[BlockKey]) -> tuple[BlockKey | None, Sequence[BlockKey]]:
        """Forget the departed ``key``.

        Returns ``(parent, detached)``: the resident predecessor that became a leaf (or None), and
        the resident keys this departure newly detached (its successors and theirs).
        """
        parent: BlockKey | None = None
        pred = self.pred.pop(key, None)
        if pred is not None:
            kids = self.children[pred]
            kids.remove(key)
            if not kids:
                del self.children[pred]
                if pred in resident:
                    parent = pred
        return parent, self.release(key)

    def release(self, key: BlockKey) -> Sequence[BlockKey]:
        """The end of :meth:`unlink`: the resident keys the departure of ``key`` newly detaches (callers
        that inline the usual case, a leaf that was not detached, call it when ``key`` is detached or
        has successors)."""
        if key in self.detached:
            self.detached.discard(key)
            return _NONE
        successors = self.children.get(key)
        if not successors:
            return _NONE  # the usual case: a leaf left
        detached = [k for k in self.subtree(successors) if k not in self.detached]
        self.detached.update(detached)
        return detached

    def _break_cycles(self, key: BlockKey, kids: list[BlockKey], resident: Container[BlockKey]) -> None:
        """Successors that arrived before ``key`` and are also its ancestors (bad data: a cycle) lose
        their link to it and become roots, so every chain has a head and a tail."""
        ancestors: set[BlockKey] = set()
        node = self.pred.get(key)
        while node is not None and node in resident and node not in ancestors:
            ancestors.add(node)
            node = self.pred.get(node)
        for k in [k for k in kids if k in ancestors]:
            kids.remove(k)
            del self.pred[k]
        if not kids:
            del self.children[key]

    def subtree(self, roots: list[BlockKey]) -> Iterator[BlockKey]:
        """``roots`` and every resident key below them (each once, even with bad data)."""
        seen: set[BlockKey] = set()
        stack = list(roots)
        while stack:
            k = stack.pop()
            if k in seen:
                continue
            seen.add(k)
            yield k
            stack.extend(self.children.get(k, ()))

    def has_children(self, key: BlockKey) -> bool:
        return key in self.children


class LeafLRUPolicy(EvictionPolicy):
    """Leaf-first LRU: detached leaves, then LRU among leaves, then LRU among inner blocks."""

    name = "leaf_lru"

    def __init__(self) -> None:
        self._clock = 0
        self._time: dict[BlockKey, int] = {}  # resident key -> last reference
        self._leaves: OrderedDict[BlockKey, None] = OrderedDict()  # attached leaves, oldest first
        self._late: dict[BlockKey, int] = {}  # attached leaves that re-entered out of order
        self._inner: dict[BlockKey, None] = {}  # blocks with resident successors
        self._detached: dict[BlockKey, None] = {}  # detached leaves
        self.chains = ChainForest()

    def _leave_lanes(self, key: BlockKey) -> None:
        if self._leaves.pop(key, 0) is None or self._late.pop(key, 0) or self._detached.pop(key, 0) is None:
            return
        self._inner.pop(key, None)

    def _enter_leaf(self, key: BlockKey) -> None:
        """``key`` became a leaf: place it by its last reference time."""
        if key in self.chains.detached:
            self._detached[key] = None
            return
        t = self._time[key]
        leaves = self._leaves
        if not leaves or t >= self._time[next(reversed(leaves))]:
            leaves[key] = None
        elif t <= self._time[next(iter(leaves))]:  # the usual case: a parent is older than its child
            leaves[key] = None
            leaves.move_to_end(key, last=False)
        else:
            self._late[key] = t

    def insert(self, key: BlockKey, hint: InsertHint = InsertHint()) -> None:
        if key in self._time:
            self.access(key)
            return
        self._clock += 1
        self._time[key] = self._clock
        parent, inner, attached, detached = self.chains.link(key, hint.predecessor, self._time)
        if parent is not None:
            self._leave_lanes(parent)
            self._inner[parent] = None
        for k in attached:
            if self._detached.pop(k, 0) is None:
                self._enter_leaf(k)
        for k in detached:
            if k in self._leaves or k in self._late:
                self._leave_lanes(k)
                self._detached[k] = None
        if inner:
            self._inner[key] = None
        else:
            self._enter_leaf(key)

    def access(self, key: BlockKey) -> None:
        if key not in self._time:
            return
        self._clock += 1
        self._time[key] = self._clock
        if key in self._leaves:
            self._leaves.move_to_end(key)
        elif self._late.pop(key, 0):
            self._leaves[key] = None  # now the newest leaf
        elif key in self._detached:
            self._detached[key] = None

    def remove(self, key: BlockKey) -> None:
        if self._time.pop(key, None) is None:
            return
        self._leave_lanes(key)
        parent, detached = self.chains.unlink(key, self._time)
        for k in detached:
            if k in self._leaves or k in self._late:
                self._leave_lanes(k)
                self._detached[k] = None
        if parent is not None:
            self._inner.pop(parent, None)
            self._enter_leaf(parent)

    def _by_time(self, keys: Iterable[BlockKey]) -> list[BlockKey]:
        return sorted(keys, key=self._time.__getitem__)

    def _attached_leaves(self) -> Iterator[BlockKey]:
        """Attached leaves oldest first: the ordered lane merged with the late ones."""
        if not self._late:
            yield from self._leaves
            return
        late = self._by_time(self._late)
        time, i = self._time, 0
        for key in self._leaves:
            t = time[key]
            while i < len(late) and time[late[i]] < t:
                yield late[i]
                i += 1
            yield key
        yield from late[i:]

    def victims(self, count: int, pinned: Container[BlockKey]) -> list[BlockKey]:
        out: list[BlockKey] = []
        if count <= 0:
            return out
        if self._detached and take_unpinned(self._by_time(self._detached), pinned, count, out):
            return out
        if take_unpinned(self._attached_leaves(), pinned, count, out):
            return out
        if self._inner:  # every leaf is pinned: an inner block must go, least recently used first
            take_unpinned(self._by_time(self._inner), pinned, count, out)
        return out

    def __len__(self) -> int:
        return len(self._time)

    def __contains__(self, key: object) -> bool:
        return key in self._time
