"""W-TinyLFU (Einziger, Friedman & Manes, 2017): a frequency filter in front of a segmented LRU.

New blocks enter a small LRU window; a block pushed out of it enters the segmented-LRU main area only
if a count-min sketch says it was referenced more often than the main area's victim (sizes in
docs/policies.md). Also here: :class:`CountMinSketch` and :func:`key_hash`, shared with the
learned-lifetime policy and the TinyLFU admission filter.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterator
from zlib import crc32

import numpy as np

from kvtier.blocks import BlockKey
from kvtier.policy.base import EvictionPolicy, InsertHint

_WIDTH_FACTOR = 4  # sketch counters per reference of horizon, per row


def key_hash(key: BlockKey) -> int:
    """A 32-bit hash of a key that is the same in every process (Python's ``hash`` is salted).

    CRC-32 of the block hash, seeded with the group: engine hashes are uniform already, and CRC
    spreads the small integer ids replayed traces use. Users take disjoint-enough bit ranges.
    """
    return crc32(key.block_hash, key.group_id)


class CountMinSketch:
    """Approximate reference counts over a sliding horizon, in ``2 × width`` bytes.

    Two rows of ``width`` byte counters (the power of two at or above ``4 × horizon``, so few keys
    share a counter) saturating at ``max_count``, with conservative update: only the counters equal
    to the current minimum are raised, which keeps over-estimates small; an estimate is never
    below the true count. After ``horizon`` increments every counter is halved (TinyLFU's reset),
    so old history fades.
    Keys are given as :func:`key_hash` values.
    """

    __slots__ = ("horizon", "max_count", "_additions", "_mask", "_shift", "_row0", "_row1", "_views")

    def __init__(self, horizon: int, *, max_count: int = 15) -> None:
        if horizon <= 0:
            raise ValueError(f"horizon must be positive, got {horizon}")
        if not 1 <= max_count <= 255:
            raise ValueError(f"max_count must be in 1..255, got {max_count}")
        bits = min(31, max(8, (_WIDTH_FACTOR * horizon - 1).bit_length()))
        width = 1 << bits
        self.horizon = horizon
        self.max_count = max_count
        self._mask = width - 1
        self._shift = 32 - bits  # row 1 reads the top bits of the hash, row 0 the bottom ones
        self._row0 = bytearray(width)
        self._row1 = bytearray(width)
        self._views = (np.frombuffer(self._row0, dtype=np.uint8), np.frombuffer(self._row1, dtype=np.uint8))
        self._additions = 0

    def increment(self, h: int) -> int:
        """Count one reference of the key hashed to ``h``; return its new estimate."""
        i = h & self._mask
        j = h >> self._shift
        a = self._row0[i]
        b = self._row1[j]
        v = a if a < b else b
        if v < self.max_count:
            v += 1
            if a < v:
                self._row0[i] = v
            if b < v:
                self._row1[j] = v
        self._additions += 1
        if self._additions >= self.horizon:
            self._age()
        return v

    def estimate(self, h: int) -> int:
        """Estimated references of the key hashed to ``h`` within the horizon (never under-counts)."""
        a = self._row0[h & self._mask]
        b = self._row1[h >> self._shift]
        return a if a < b else b

    def _age(self) -> None:
        for view in self._views:
            view >>= 1
        self._additions //= 2


class WTinyLFUPolicy(EvictionPolicy):
    """W-TinyLFU with a 1 % window and an 80 % protected segment, as in Caffeine.

    ``capacity`` (blocks) sizes the window, the segments and the sketch; without it the policy
    uses the most blocks it has held, which equals the capacity once the partition has filled (no
    eviction happens before that).
    """

    name = "tinylfu"

    def __init__(self, capacity: int | None = None, *, window: float = 0.01, protected: float = 0.8,
                 sample_factor: int = 10) -> None:
        if capacity is not None and capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        if not 0.0 < window < 1.0:
            raise ValueError(f"window must be a fraction in (0, 1), got {window}")
        if not 0.0 < protected < 1.0:
            raise ValueError(f"protected must be a fraction in (0, 1), got {protected}")
        self._fixed = capacity
        self._window_share = window
        self._protected_share = protected
        self._sample_factor = sample_factor
        self._window: OrderedDict[BlockKey, None] = OrderedDict()
        self._probation: OrderedDict[BlockKey, None] = OrderedDict()
        self._protected: OrderedDict[BlockKey, None] = OrderedDict()
        self._hashes: dict[BlockKey, int] = {}
        self._capacity = 0
        self._window_max = 1
        self._protected_max = 0
        self.sketch = CountMinSketch(1024)
        self._resize(capacity or 1)

    # --- sizing ------------------------------------------------------------------------------------
    def _resize(self, capacity: int) -> None:
        self._capacity = capacity
        self._window_max = max(1, round(capacity * self._window_share))
        self._protected_max = int((capacity - self._window_max) * self._protected_share)
        horizon = max(1024, self._sample_factor * capacity)
        if horizon > 2 * self.sketch.horizon:
            self.sketch = CountMinSketch(horizon)  # only while the partition first fills

    # --- notifications -----------------------------------------------------------------------------
    def insert(self, key: BlockKey, hint: InsertHint = InsertHint()) -> None:
        if key in self._hashes:
            self.access(key)
            return
        h = key_hash(key)
        self._hashes[key] = h
        self.sketch.increment(h)
        self._window[key] = None
        if self._fixed is None and len(self._hashes) > self._capacity:
            self._resize(len(self._hashes))
        if len(self._window) > self._window_max:
            candidate, _ = self._window.popitem(last=False)
            self._probation[candidate] = None  # it won its contest in victims(), or main had room
        while len(self._protected) > self._protected_max:
            demoted, _ = self._protected.popitem(last=False)
            self._probation[demoted] = None

    def access(self, key: BlockKey) -> None:
        h = self._hashes.get(key)
        if h is None:
            return
        self.sketch.increment(h)
        if key in self._window:
            self._window.move_to_end(key)
        elif key in self._probation:
            del self._probation[key]
            self._protected[key] = None
            if len(self._protected) > self._protected_max:
                demoted, _ = self._protected.popitem(last=False)
                self._probation[demoted] = None
        else:
            self._protected.move_to_end(key)

    def remove(self, key: BlockKey) -> None:
        if self._hashes.pop(key, None) is None:
            return
        for area in (self._window, self._probation, self._protected):
            if key in area:
                del area[key]
                return

    # --- decisions ---------------------------------------------------------------------------------
    def victims(self, count: int, pinned: Container[BlockKey]) -> list[BlockKey]:
        out: list[BlockKey] = []
        if count <= 0:
            return out
        candidates = self._unpinned(iter(self._window), pinned)
        main = self._unpinned(self._main_order(), pinned)
        # The window overflows on the next insert when it is full: its LRU block contests the
        # main area's victim, and the less frequent of the two leaves.
        contests = max(0, len(self._window) + count - self._window_max)
        candidate = next(candidates, None) if contests else None
        victim = next(main, None)
        while len(out) < count and (candidate is not None or victim is not None):
            if candidate is None:
                assert victim is not None
                out.append(victim)
                victim = next(main, None)
            elif victim is None:
                out.append(candidate)
                candidate = next(candidates, None)
            elif self.sketch.estimate(self._hashes[candidate]) > self.sketch.estimate(self._hashes[victim]):
                out.append(victim)
                victim = next(main, None)
            else:
                out.append(candidate)
                contests -= 1
                candidate = next(candidates, None) if contests else None
        if len(out) < count:  # contests are over: the window's remaining blocks are fair game too
            seen = set(out)
            for key in self._unpinned(iter(self._window), pinned):
                if key not in seen:
                    out.append(key)
                    if len(out) == count:
                        break
        return out

    def _main_order(self) -> Iterator[BlockKey]:
        yield from self._probation
        yield from self._protected

    @staticmethod
    def _unpinned(keys: Iterator[BlockKey], pinned: Container[BlockKey]) -> Iterator[BlockKey]:
        return (k for k in keys if k not in pinned)

    def __len__(self) -> int:
        return len(self._hashes)

    def __contains__(self, key: object) -> bool:
        return key in self._hashes
