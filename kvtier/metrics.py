"""Counters the cache keeps per tier, and a snapshot type users read (``cache.stats()``).

Tiers count their own I/O (:class:`kvtier.tiers.base.TierCounters`); the cache counts decisions
(hits, misses, evictions, demotions, promotions). A snapshot joins both.
"""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass, field

#: Upper bounds (seconds) of the latency histogram buckets: 50 µs … 10 s, roughly ×2.5 apart.
LATENCY_BUCKETS: tuple[float, ...] = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
                                      0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class LatencyHistogram:
    """Fixed-bucket histogram of one batched operation's latency (cumulative-free counts)."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total_seconds: float = 0.0
    count: int = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.total_seconds += seconds
        self.count += 1

    def copy(self) -> LatencyHistogram:
        return LatencyHistogram(list(self.counts), self.total_seconds, self.count)


@dataclass
class TierActivity:
    """What the cache did with one tier."""

    hits: int = 0
    #: blocks a load asked this tier for (not found above it) that it did not serve
    misses: int = 0
    stores: int = 0
    failed_stores: int = 0
    evictions: int = 0
    demotions_out: int = 0
    promotions_in: int = 0
    corrupt_or_lost: int = 0
    #: latency of each batched tier call by op (``get``, ``put``, ``contains``, ``delete``)
    latency: dict[str, LatencyHistogram] = field(default_factory=dict)

    def observe(self, op: str, seconds: float) -> None:
        hist = self.latency.get(op)
        if hist is None:
            hist = self.latency[op] = LatencyHistogram()
        hist.observe(seconds)


@dataclass(frozen=True)
class TierStats:
    name: str
    kind: str
    hits: int
    misses: int
    stores: int
    failed_stores: int
    evictions: int
    demotions_out: int
    promotions_in: int
    corrupt_or_lost: int
    blocks_read: int
    blocks_written: int
    bytes_read: int
    bytes_written: int
    read_seconds: float
    write_seconds: float
    usage_bytes: int
    capacity_bytes: int
    errors: dict[str, int] = field(default_factory=dict)
    latency: dict[str, LatencyHistogram] = field(default_factory=dict)
    #: ``"ok"`` or why the tier is degraded (circuit open, writes failing)
    health: str = "ok"

    @property
    def read_gbps(self) -> float:
        return self.bytes_read / self.read_seconds / 1e9 if self.read_seconds else 0.0

    @property
    def write_gbps(self) -> float:
        return self.bytes_written / self.write_seconds / 1e9 if self.write_seconds else 0.0


@dataclass(frozen=True)
class CacheStats:
    """A consistent snapshot of the whole cache."""

    lookups: int
    lookup_blocks: int
    lookup_hit_blocks: int
    loads: int
    load_blocks: int
    loaded_blocks: int
    stored_blocks: int
    tiers: tuple[TierStats, ...]

    @property
    def hit_ratio(self) -> float:
        return self.loaded_blocks / self.load_blocks if self.load_blocks else 0.0

    def as_dict(self) -> dict[str, object]:
        return asdict(self)
