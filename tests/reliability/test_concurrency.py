"""Concurrency: 8 threads on one cache, and 2 processes sharing a file directory and a Redis.

Each scenario runs store/load/lookup on overlapping keys (with eviction, demotion and promotion, since
the tiers hold a fraction of the keys) for a bounded time, then checks: no wrong bytes, no
exception, no call over its timeout (deadlock), no pins or pending entries left, usage counters equal
to what the tiers hold, and the final sweep of the oracle.

What two processes may expect (the design's promise, and its limit): Redis is shared — a block one
process stores is a hit for the other at once. A file tier directory may be shared, but each process
indexes it when it starts, so a live process does not see blocks the other wrote since; after a
restart it does. Two live processes never serve each other wrong bytes from it (every file is
complete and checksummed; a file the other process deleted is a miss), but each one's capacity
accounting covers only its own blocks, so the directory may hold up to the sum of both capacities
until a restart trims it.
"""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path
from typing import Any

import pytest

from kvtier import TieredCache
from tests.reliability.conftest import (
    FaultRow,
    Oracle,
    cache_config,
    consistency_problems,
    record,
    redis_options,
    run_workload,
    universe,
)


def scenario_threads(workdir: Path, seconds: float, *, name: str = "8 threads, cpu+file",
                     keep_lower_copy: bool = True, write_mode: str = "write_back",
                     redis_url: str | None = None, seed: int = 0) -> tuple[FaultRow, list[str]]:
    """8 threads over a CPU tier of 4 blocks and a file tier of 16 (and Redis), 96 overlapping keys."""
    oracle = Oracle(call_timeout=30.0)
    redis = redis_options(redis_url) if redis_url else None
    cfg = cache_config(file_dir=workdir / "files", cpu_blocks=4, file_blocks=16, redis=redis,
                       write_mode=write_mode, keep_lower_copy=keep_lower_copy)
    keys = universe(96, tag=f"{name}-{seed}")
    with TieredCache.from_config(cfg) as cache:
        run_workload(cache, oracle, keys, threads=8, seconds=seconds, seed=seed)
        problems = consistency_problems(cache)
        hits, misses = oracle.sweep(cache)
        problems += consistency_problems(cache)
        stats = cache.stats()
    moves = sum(t.evictions for t in stats.tiers), sum(t.promotions_in for t in stats.tiers)
    row = FaultRow.from_oracle(name, oracle, note=f"{moves[0]} evictions, {moves[1]} promotions; "
                                                  f"final sweep {hits} hits, {misses} misses")
    return row, problems


@pytest.mark.parametrize("keep_lower_copy", [True, False], ids=["inclusive", "exclusive-promotion"])
def test_eight_threads_share_one_cache(tmp_path: Path, keep_lower_copy: bool) -> None:
    name = f"8 threads, cpu+file, {'inclusive' if keep_lower_copy else 'exclusive promotion'}"
    row, problems = scenario_threads(tmp_path, 4.0, name=name, keep_lower_copy=keep_lower_copy)
    record(row)
    assert row.wrong == 0 and row.errors == 0, row
    assert not problems, problems
    assert row.verified > 0 and row.operations > 200, row


def test_eight_threads_write_through_to_redis(tmp_path: Path, redis_servers: Any) -> None:
    server = redis_servers()
    row, problems = scenario_threads(tmp_path, 3.0, name="8 threads, cpu+file+redis, write-through",
                                     write_mode="write_through", redis_url=server.url)
    record(row)
    assert row.wrong == 0 and row.errors == 0, row
    assert not problems, problems


# --- two processes ----------------------------------------------------------------------------------------
def _process_worker(cfg: dict[str, Any], shared: list[tuple[bytes, int]], own: list[tuple[bytes, int]],
                    other: list[tuple[bytes, int]], seconds: float, seed: int, barrier: Any,
                    results: Any) -> None:
    """One of the two processes: a workload over shared + own keys, then loads of the other's keys."""
    from kvtier import BlockKey

    shared_keys, own_keys, other_keys = ([BlockKey(h, g) for h, g in keys] for keys in (shared, own, other))
    oracle = Oracle()
    with TieredCache.from_config(cfg) as cache:
        barrier.wait(timeout=120)
        run_workload(cache, oracle, shared_keys + own_keys, threads=4, seconds=seconds, seed=seed)
        for i in range(0, len(own_keys), 4):  # make sure every own key was offered once
            oracle.store(cache, own_keys[i:i + 4])
        barrier.wait(timeout=120)  # both have written: the other's keys are in Redis now
        cross_hits = sum(oracle.load(cache, [key]) or 0 for key in other_keys)
        problems = consistency_problems(cache, disk=False)
    results.put({"seed": seed, "cross_hits": cross_hits, "problems": problems, **oracle.counts()})


def scenario_two_processes(workdir: Path, redis_url: str, seconds: float,
                           name: str = "2 processes, shared file dir + Redis",
                           ) -> tuple[FaultRow, dict[str, Any]]:
    cfg = cache_config(file_dir=workdir / "shared-files", cpu_blocks=4, file_blocks=24,
                       redis=redis_options(redis_url, timeout=2.0, connect_timeout=1.0),
                       write_mode="write_through", model="two-processes")
    shared = [tuple(k) for k in universe(48, tag=f"{name}-shared")]
    mine = [[tuple(k) for k in universe(12, tag=f"{name}-own-{i}")] for i in range(2)]
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    children = [ctx.Process(target=_process_worker,
                            args=(cfg, shared, mine[i], mine[1 - i], seconds, i, barrier, results))
                for i in range(2)]
    for child in children:
        child.start()
    reports = [results.get(timeout=seconds + 180) for _ in children]
    for child in children:
        child.join(timeout=30)
    oracle = Oracle()
    for report in reports:
        oracle.merge(report)
    started = time.monotonic()
    with TieredCache.from_config(cfg) as cache:  # a restart: the file tier now indexes both processes' blocks
        restart_seconds = time.monotonic() - started
        file_tier = cache.core.tiers[1]
        indexed = set(file_tier.keys())
        seen = [sum(1 for k in universe(12, tag=f"{name}-own-{i}") if k in indexed) for i in range(2)]
        problems = consistency_problems(cache)
        hits, misses = oracle.sweep(cache)
        problems += consistency_problems(cache)
    row = FaultRow.from_oracle(name, oracle, restart_seconds,
                               note=f"cross-process Redis hits {reports[0]['cross_hits']}+"
                                    f"{reports[1]['cross_hits']} "
                                    f"of 2×12; after restart the file index holds {seen[0]}+{seen[1]} of the "
                                    f"processes' own keys; sweep {hits} hits, {misses} misses")
    details = {"reports": reports, "problems": problems + [p for r in reports for p in r["problems"]],
               "seen": seen, "exitcodes": [c.exitcode for c in children]}
    return row, details


def test_two_processes_share_file_and_redis_tiers(tmp_path: Path, redis_servers: Any) -> None:
    server = redis_servers()
    row, details = scenario_two_processes(tmp_path, server.url, 3.0)
    record(row)
    assert details["exitcodes"] == [0, 0]
    assert row.wrong == 0 and row.errors == 0, row
    assert not details["problems"], details["problems"]
    assert all(r["cross_hits"] > 0 for r in details["reports"]), \
        "Redis did not share blocks between processes"
    assert all(n > 0 for n in details["seen"]), "after a restart the file index misses a process's blocks"
