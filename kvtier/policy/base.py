"""The eviction interface: one policy object per (tier, KV-cache group) partition.

A policy knows keys and the order in which they should leave, nothing else: it never touches bytes
or tiers. The cache (and ``kvtier replay``, which drives the very same objects) tells it what was
inserted, accessed and removed, and asks it for victims. Pinned keys — blocks an in-flight load or
store is using — are passed in and must never be returned.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Container, Iterable, Sequence
from typing import NamedTuple

from kvtier.blocks import BlockKey


class InsertHint(NamedTuple):
    """What the cache knows about a block when it is stored; policies may use it or ignore it.

    ``position`` is the block's index in its request's chain (0 = first block after nothing): a block
    is only useful if all blocks before it are cached too, so prefix-aware policies evict tails first.
    ``predecessor`` is the key of the block before it in its chain (``None``: a chain head, or not
    known). Engines chain their block hashes, so the caller usually knows it; chain-aware policies
    (:mod:`kvtier.policy.chains`) use it to evict a chain's tail before its head. It may be wrong
    (a cycle, a parent never stored): policies must treat it as advice, never fail on it.
    """

    position: int = 0
    request_id: int = -1
    predecessor: BlockKey | None = None


class EvictionPolicy(ABC):
    """Orders the blocks of one partition for eviction.

    Lifecycle: :meth:`insert` when a block is admitted (it may be pending and pinned), :meth:`access`
    on each hit, :meth:`victims` when room is needed (no state change), :meth:`remove` when the cache
    really drops a block (evicted, deleted, failed). Every method is O(1) or O(log n) amortised,
    except :meth:`victims`, which is O(k + pinned keys skipped).
    """

    #: Name used in config (``eviction: lru``) and in replay tables.
    name: str = ""
    #: Whether :meth:`store_new` reads :attr:`InsertHint.position` (else a batch without hints gets one
    #: shared default hint instead of a hint object per key; set False only where it never does).
    reads_positions: bool = True

    @abstractmethod
    def insert(self, key: BlockKey, hint: InsertHint = InsertHint()) -> None:
        """A block was admitted to the partition (a key already present counts as an access)."""

    @abstractmethod
    def access(self, key: BlockKey) -> None:
        """The block was hit (loaded, or looked up by a request that will load it)."""

    @abstractmethod
    def remove(self, key: BlockKey) -> None:
        """The block left the partition; unknown keys are ignored."""

    @abstractmethod
    def victims(self, count: int, pinned: Container[BlockKey]) -> list[BlockKey]:
        """Up to ``count`` distinct resident keys to evict first, none in ``pinned``; changes nothing."""

    @abstractmethod
    def __len__(self) -> int:
        """Resident keys tracked."""

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    def miss(self, key: BlockKey) -> None:  # noqa: B027 - optional hook, most policies ignore misses
        """A lookup for a key this partition does not hold (ghost-list policies learn from it)."""

    def store_new(self, keys: Sequence[BlockKey], hints: Sequence[InsertHint], pinned: Container[BlockKey],
                  free: int) -> tuple[int, list[BlockKey]]:
        """Insert ``keys`` (distinct, none tracked) in order as a tier stores them one by one.

        The first ``free`` go in as they are; each later one first evicts ``victims(1, pinned)``
        (removed at once), and the first key no victim can be found for ends the batch. Returns how
        many keys went in and the victims, in order. ``pinned`` must already hold every key of
        ``keys`` (they are pending writes). Exactly that sequence of :meth:`victims`, :meth:`remove`
        and :meth:`insert` calls; a policy overrides it only to do the same in fewer Python calls
        (:meth:`kvtier.residency.Residency.plan_store` batches a store through it).
        """
        out: list[BlockKey] = []
        for i, key in enumerate(keys):
            if i >= free:
                victim = self.victims(1, pinned)
                if not victim:
                    return i, out
                self.remove(victim[0])
                out.append(victim[0])
            self.insert(key, hints[i])
        return len(keys), out

    def access_all(self, keys: Iterable[BlockKey]) -> None:
        """:meth:`access` of each key in order (a request's prefix hits), in one call."""
        access = self.access
        for key in keys:
            access(key)


def take_unpinned(order: Iterable[BlockKey], pinned: Container[BlockKey], count: int,
                  out: list[BlockKey]) -> bool:
    """Append the keys of ``order`` that are not pinned to ``out`` until it holds ``count``; True once full.

    The walk every policy's :meth:`EvictionPolicy.victims` ends in, over its own eviction order."""
    if len(out) >= count:
        return True
    for key in order:
        if key not in pinned:
            out.append(key)
            if len(out) == count:
                return True
    return False
