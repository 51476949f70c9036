"""Counters the cache keeps per tier, and a snapshot type users read (``cache.stats()``).

Tiers count their own I/O (:class:`kvtier.tiers.base.TierCounters`); the cache counts decisions
(hits, misses, evictions, demotions, promotions). A snapshot joins both.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class TierActivity:
    """What the cache did with one tier."""

    hits: int = 0
    stores: int = 0
    failed_stores: int = 0
    evictions: int = 0
    demotions_out: int = 0
    promotions_in: int = 0
    corrupt_or_lost: int = 0


@dataclass(frozen=True)
class TierStats:
    name: str
    kind: str
    hits: int
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
