"""Hardening, round two (data path): one test per finding of issue 13's fault runs (docs/reliability.md).

Each test failed before its fix: foreign blocks of another model or TP rank served as ours, a FIFO at
a block path hanging the file tier, ``close()`` stranding callers, a missing Redis password going
unnoticed, a clean restart coming back cold, a full disk refusing every store until a restart,
read/write seconds counted twice, and one warning line per corrupt block.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from kvtier import TieredCache
from tests.reliability.conftest import (
    BLOCK,
    blocks_for,
    cache_config,
    redis_options,
    tier_stats,
    universe,
)


# --- 13: one owner per I/O counter --------------------------------------------------------------------------
def _timed_round_trip(cache: TieredCache, tier_name: str, n: int) -> tuple[float, float, Any]:
    keys = universe(n, tag=f"seconds-{tier_name}")
    start = time.perf_counter()
    assert cache.store(keys, blocks_for(keys)) == n
    store_wall = time.perf_counter() - start
    out = torch.empty_like(blocks_for(keys))
    start = time.perf_counter()
    assert cache.load(keys, out) == n
    load_wall = time.perf_counter() - start
    return store_wall, load_wall, tier_stats(cache, tier_name)


def _assert_seconds_not_doubled(stats: Any, store_wall: float, load_wall: float, n: int) -> None:
    assert stats.blocks_written == n and stats.blocks_read == n
    # each figure is the tier's own wall time for its batches: never more than the calls that made them
    assert 0 < stats.write_seconds <= store_wall, (stats.write_seconds, store_wall)
    assert 0 < stats.read_seconds <= load_wall, (stats.read_seconds, load_wall)
    assert stats.read_gbps >= stats.bytes_read / load_wall / 1e9
    assert stats.write_gbps >= stats.bytes_written / store_wall / 1e9


def test_file_tier_seconds_are_counted_once(tmp_path: Path) -> None:
    """Before: the cache and the tier both added each batch's time, so GB/s was half the truth."""
    n = 48
    cfg = cache_config(file_dir=tmp_path / "files", cpu_blocks=1, file_blocks=n)
    cfg["tiers"] = cfg["tiers"][1:]  # the file tier alone: every store and load is its I/O
    cfg["placement"]["promote_on_hit"] = False
    with TieredCache.from_config(cfg) as cache:
        store_wall, load_wall, stats = _timed_round_trip(cache, "file", n)
    _assert_seconds_not_doubled(stats, store_wall, load_wall, n)
    assert stats.bytes_read >= n * BLOCK


def test_redis_tier_seconds_are_counted_once(redis_servers: Any) -> None:
    server = redis_servers()
    n = 48
    cfg = cache_config(cpu_blocks=1, redis=redis_options(server.url, timeout=2.0, connect_timeout=1.0))
    cfg["tiers"] = cfg["tiers"][1:]
    cfg["placement"]["promote_on_hit"] = False
    with TieredCache.from_config(cfg) as cache:
        store_wall, load_wall, stats = _timed_round_trip(cache, "redis", n)
    _assert_seconds_not_doubled(stats, store_wall, load_wall, n)


def test_cpu_tier_counts_its_own_seconds(tmp_path: Path) -> None:
    """The memory tiers now time their own batches (the cache no longer does it for any tier)."""
    n = 16
    cfg = cache_config(cpu_blocks=n)
    with TieredCache.from_config(cfg) as cache:
        store_wall, load_wall, stats = _timed_round_trip(cache, "cpu", n)
    _assert_seconds_not_doubled(stats, store_wall, load_wall, n)
