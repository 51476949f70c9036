"""Learned lifetimes: give each frequency class the lifetime that buys the most hits per slot.

A block's reference count (kept across evictions in a small tagged table) puts it in one of three
classes; reuse distances per class, sampled and decayed, define how many hits each class would earn
per slot for each lifetime, and every half capacity of references a greedy walk over those curves
picks the lifetimes. The victim is the oldest block of the class that most overstays its lifetime;
when the model shows no gain over one common lifetime the policy is exactly LRU. O(1) per reference,
O(classes) per victim; memory is the table (up to 16 bytes per reference of reach). docs/policies.md
describes the algorithm and its results.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Container
from zlib import crc32

from kvtier.blocks import BlockKey
from kvtier.policy.base import EvictionPolicy, InsertHint

_SUB = 4  # histogram bins per octave of reuse distance
_BINS = 48 * _SUB
#: Lower edge of each histogram bin, and the value used for distances inside it.
_EDGE = [(1 << (b // _SUB)) + (((b % _SUB) << (b // _SUB)) // _SUB) for b in range(_BINS + 1)]
_MID = [(lo + hi) / 2 for lo, hi in zip(_EDGE, _EDGE[1:], strict=False)]
_LIFETIME = [float(hi) for hi in _EDGE[1:]]  # the lifetime that keeps every distance inside bin b
_NEVER_KEEP = 1e18  # eviction weight of a class whose lifetime is zero
_STEP = 1.05  # each class keeps at least this much longer than the one below (heads before tails)
_RECHOOSE = 8  # references for which the class chosen to evict from stays chosen
_MIN_REACH = 1 << 17  # references: small partitions still learn from a long history
_HISTORY = 16  # capacities of references the reuse histograms remember
_SAMPLE_SHIFT = 31  # reuse statistics come from the keys whose 32-bit hash has its top bit clear


def _bin(distance: int) -> int:
    e = distance.bit_length() - 1
    if e < 2:
        return e * _SUB + (distance - (1 << e)) * (_SUB >> e) if e else 0
    return e * _SUB + ((distance >> (e - 2)) & 3)


def _upper_hull(points: list[tuple[float, float, float]]) -> list[tuple[float, float, float]]:
    """Upper concave hull of (occupancy, hits, lifetime) points sorted by occupancy."""
    hull: list[tuple[float, float, float]] = []
    for p in points:
        while len(hull) >= 2:
            (x1, y1, _), (x2, y2, _) = hull[-2], hull[-1]
            if (x2 - x1) * (p[1] - y1) - (y2 - y1) * (p[0] - x1) >= 0:
                hull.pop()
            else:
                break
        hull.append(p)
    return hull


class LearnedLifetimePolicy(EvictionPolicy):
    """Per-class lifetimes learned from reuse distances; see the module docstring.

    ``capacity`` (blocks) sizes the horizons and the allocation; without it the policy uses the most
    blocks it has held, which is the capacity once the partition has filled (no eviction happens
    before that). ``classes`` is K; ``min_gain`` the modelled gain below which it stays LRU.
    """

    name = "lifetime"

    def __init__(self, capacity: int | None = None, *, classes: int = 3, min_gain: float = 0.02) -> None:
        if capacity is not None and capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        if not 1 <= classes <= 15:
            raise ValueError(f"classes must be in 1..15, got {classes}")
        if min_gain < 0:
            raise ValueError(f"min_gain must be >= 0, got {min_gain}")
        self._fixed = capacity
        self._classes = classes
        self._min_gain = min_gain
        self._queues: list[OrderedDict[BlockKey, int]] = [OrderedDict() for _ in range(classes)]
        self._meta: dict[BlockKey, list[int]] = {}  # key -> [class, key hash]
        self._clock = 0
        #: Eviction weight per class (1 / lifetime, relative); all equal means LRU.
        self.weights = [1.0] * classes
        self._lanes = [(queue, 1.0) for queue in self._queues]
        self._lane: OrderedDict[BlockKey, int] | None = None
        self._lane_until = 0.0  # learned: time until which the lane stands; LRU: its oldest bound
        self._learned = False
        #: Learned lifetime per class in references (``inf``: no limit), for reports and tests.
        self.lifetimes = [float("inf")] * classes
        self._hist = [[0.0] * _BINS for _ in range(classes)]
        self._refs = [0.0] * classes
        self._capacity = 0
        self._sized_for = 0
        self._top = classes - 1
        self._table = array("q")
        self._resize(capacity or 1)

    # --- sizing ------------------------------------------------------------------------------------
    def _resize(self, capacity: int) -> None:
        """Size the history for ``capacity`` blocks (the table again only if it grew by an eighth)."""
        self._capacity = capacity
        if capacity < self._sized_for + self._sized_for // 8:
            return
        self._sized_for = capacity
        self._reach = max(4 * capacity, _MIN_REACH)
        self._repeat_within = self._reach // 4
        self._bins = min(_BINS, _SUB * (self._reach.bit_length() + 1))
        slots = 1 << (2 * self._reach - 1).bit_length()
        if len(self._table) != slots:
            self._table = array("q", bytes(8 * slots))  # only while the partition first fills
        self._slot_mask = slots - 1  # slot by the hash's low bits, tagged with its high 16 bits
        self._refit_every = max(2048, capacity // 2)
        self._decay = 1.0 - self._refit_every / max(1 << 16, _HISTORY * capacity)
        self._next_refit = self._clock + self._refit_every

    # --- per reference -----------------------------------------------------------------------------
    def insert(self, key: BlockKey, hint: InsertHint = InsertHint()) -> None:
        meta = self._meta
        if key in meta:
            self.access(key)
            return
        h = crc32(*key)  # key_hash(key) inlined (crc32 of block_hash seeded by group_id): a hot path
        t = self._clock = self._clock + 1
        entry = self._table[h & self._slot_mask]
        if entry and (entry >> 4) & 0xFFFF == h >> 16 and t - (entry >> 20) <= self._reach:
            old = entry & 15  # seen within the reach: back in its class, one up if it came back soon
            cls = old + 1 if old < self._top and t - (entry >> 20) <= self._repeat_within else old
            if not h >> _SAMPLE_SHIFT:
                self._hist[old][_bin(t - (entry >> 20))] += 1.0
                self._refs[cls] += 1.0
        else:
            cls = 0
            if not h >> _SAMPLE_SHIFT:
                self._refs[0] += 1.0
        meta[key] = [cls, h]
        self._queues[cls][key] = t
        if t >= self._next_refit:
            self._refit()

    def access(self, key: BlockKey) -> None:
        meta = self._meta.get(key)
        if meta is None:
            return
        t = self._clock = self._clock + 1
        old, h = meta
        if old < self._top:
            cls = meta[0] = old + 1
            then = self._queues[old].pop(key)
            self._queues[cls][key] = t
        else:
            cls = old
            queue = self._queues[old]
            then = queue[key]
            queue[key] = t
            queue.move_to_end(key)
        if not h >> _SAMPLE_SHIFT:
            if t - then <= self._reach:
                self._hist[old][_bin(t - then)] += 1.0
            self._refs[cls] += 1.0
        if t >= self._next_refit:
            self._refit()

    def remove(self, key: BlockKey) -> None:
        meta = self._meta.pop(key, None)
        if meta is None:
            return
        cls, h = meta
        then = self._queues[cls].pop(key)
        self._table[h & self._slot_mask] = (then << 20) | ((h >> 16) << 4) | cls

    # --- learning ----------------------------------------------------------------------------------
    def _refit(self) -> None:
        if self._fixed is None and len(self._meta) > self._capacity:
            self._resize(len(self._meta))  # the partition is still filling: learn its size
        self._next_refit = self._clock + self._refit_every
        total = sum(self._refs)
        if total >= 256:
            self._solve(total)
        keep = self._decay
        self._refs = [n * keep for n in self._refs]
        self._hist = [[x * keep for x in hist] for hist in self._hist]

    def _solve(self, total: float) -> None:
        """Pick per-class lifetimes maximising modelled hits within the capacity (module docstring)."""
        budget = self._capacity * total  # slot-references available per sampled reference window
        curves: list[list[tuple[float, float, float]]] = []
        segments: list[tuple[float, int, float, float, float, float]] = []
        for c in range(self._classes):
            n = self._refs[c]
            points = [(0.0, 0.0, 0.0)]
            append = points.append
            hits = occupied = 0.0
            # distances beyond the reach are not recorded: the first ``bins`` bins
            for count, mid, lifetime in zip(self._hist[c], _MID, _LIFETIME[:self._bins], strict=False):
                if count:
                    hits += count
                    occupied += count * mid
                append((occupied + (n - hits) * lifetime, hits, lifetime))
            curves.append(points)
            hull = _upper_hull(points)
            for (x0, y0, a0), (x1, y1, a1) in zip(hull, hull[1:], strict=False):
                if x1 > x0 and y1 > y0:
                    segments.append(((y1 - y0) / (x1 - x0), c, x1 - x0, y1 - y0, a0, a1))
        segments.sort(key=lambda s: -s[0])
        lifetimes = [0.0] * self._classes
        left, best = budget, 0.0
        for _, c, width, gain, a0, a1 in segments:
            if left <= 0:
                break
            share = min(1.0, left / width)
            lifetimes[c] = max(lifetimes[c], a0 + (a1 - a0) * share)
            best += gain * share
            left -= width * share
        if left > 0:  # everything the model knows fits: nothing to choose between
            self._use_lru()
            return
        # One common lifetime for all classes: what LRU would get under the same model.
        lru = None
        previous = None
        for column in zip(*curves, strict=True):  # the classes' points at one common lifetime
            occupied = sum([p[0] for p in column])
            if previous is not None and occupied >= budget:
                o0 = sum([p[0] for p in previous])
                h0 = sum([p[1] for p in previous])
                h1 = sum([p[1] for p in column])
                lru = h0 + (h1 - h0) * (budget - o0) / max(occupied - o0, 1e-9)
                break
            previous = column
        if lru is None or best < lru * (1.0 + self._min_gain):
            self._use_lru()
            return
        # A block seen more often keeps at least as long: along a chain counts only fall, so heads
        # then outlive their tails and a kept block is not orphaned by an evicted prefix.
        for c in range(1, self._classes):
            lifetimes[c] = max(lifetimes[c], lifetimes[c - 1] * _STEP)
        self.lifetimes = lifetimes
        self._set_weights([1.0 / a if a >= 1.0 else _NEVER_KEEP for a in lifetimes])

    def _use_lru(self) -> None:
        self.lifetimes = [float("inf")] * self._classes
        self._set_weights([1.0] * self._classes)

    def _set_weights(self, weights: list[float]) -> None:
        self.weights = weights
        self._learned = len(set(weights)) > 1  # else it is LRU, exactly
        self._lane = None
        # (queue, weight) per class; classes that are never kept first, so their tails go first
        self._lanes = sorted(zip(self._queues, weights, strict=True), key=lambda lane: lane[1] != _NEVER_KEEP)

    # --- decisions ---------------------------------------------------------------------------------
    def victims(self, count: int, pinned: Container[BlockKey]) -> list[BlockKey]:
        out: list[BlockKey] = []
        if count <= 0:
            return out
        now = self._clock + 1
        weights = self.weights
        if count == 1:  # the common case: compare the oldest block of each class
            lane = self._lane
            if lane:
                key = next(iter(lane))
                # LRU: still the oldest while older than every other class's oldest was (those only
                # get younger). Learned: the class chosen stays the choice for a few references.
                if key not in pinned and (now < self._lane_until if self._learned
                                          else lane[key] <= self._lane_until):
                    return [key]
            best: BlockKey | None = None
            best_score = runner_up = -1.0
            for queue, weight in self._lanes:
                if not queue:
                    continue
                key = next(iter(queue))
                if key in pinned:
                    if self._learned:
                        continue  # pins are mostly the store in progress: this class sits it out
                    best = None  # as LRU, exactly: the walk below skips pinned blocks
                    break
                if weight == _NEVER_KEEP:  # such classes come first
                    best, lane = key, queue
                    break
                score = (now - queue[key]) * weight
                if score > best_score:
                    best, best_score, runner_up, lane = key, score, best_score, queue
                elif score > runner_up:
                    runner_up = score
            if best is not None:
                self._lane = lane
                self._lane_until = now + _RECHOOSE if self._learned else now - max(runner_up, 1.0)
                return [best]
        iters = [(k for k in queue if k not in pinned) for queue in self._queues]
        heads = [next(it, None) for it in iters]
        while len(out) < count:
            pick, pick_score = -1, -1.0
            for c, head in enumerate(heads):
                if head is not None:
                    score = (now - self._queues[c][head]) * weights[c]
                    if score > pick_score:
                        pick, pick_score = c, score
            if pick < 0:
                break
            chosen = heads[pick]
            assert chosen is not None
            out.append(chosen)
            heads[pick] = next(iters[pick], None)
        return out

    def __len__(self) -> int:
        return len(self._meta)

    def __contains__(self, key: object) -> bool:
        return key in self._meta
