"""Storage faults under load: ENOSPC/EIO on writes, reads and renames, a full disk, damaged and deleted
files, damaged Redis values, a Redis that is full.

Each scenario runs 8 threads of store/load/lookup over a small CPU tier in front of the faulty tier
(so evictions demote into it and loads promote out of it) while the fault is active, heals it, measures
how long the tier takes to serve again, and ends with the oracle's sweep and the state checks. The
design says a fault becomes a failed store or a miss — so ``errors`` (exceptions the engine-facing
calls raised) must be 0, and so must ``wrong``.
"""

from __future__ import annotations

import errno
import logging
import random
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvtier import TieredCache
from tests.reliability.conftest import (
    CORRUPTIONS,
    FaultRow,
    Oracle,
    SyscallFaults,
    cache_config,
    consistency_problems,
    corrupt_bytes,
    corrupt_file,
    files_on_disk,
    record,
    redis_options,
    run_workload,
    tier_stats,
    universe,
    wait_for,
)

ERRNO = {"ENOSPC": errno.ENOSPC, "EIO": errno.EIO}


def _background(cache: TieredCache, oracle: Oracle, keys: list[Any], seconds: float,
                seed: int) -> threading.Thread:
    thread = threading.Thread(target=run_workload, args=(cache, oracle, keys),
                              kwargs={"threads": 8, "seconds": seconds, "seed": seed}, daemon=True)
    thread.start()
    return thread


def scenario_syscall_fault(workdir: Path, seconds: float, syscall: str, error: str, rate: float,
                           seed: int = 0) -> tuple[FaultRow, list[str]]:
    """``os.<syscall>`` fails with ``error`` at ``rate`` for the first half of the run, then heals.

    Time to recover: from healing until the file tier completes a write (write faults) or serves a
    read (read faults) again.
    """
    name = (f"{error} on {syscall}, {rate:.0%} of calls" if rate < 1
            else f"{error} on every {syscall} (disk full)")
    oracle = Oracle()
    keys = universe(64, tag=f"{name}-{seed}")
    cfg = cache_config(file_dir=workdir / "files", cpu_blocks=4, file_blocks=24)
    counter = "hits" if syscall == "preadv" else "stores"
    warnings = _WarningCounter()
    with SyscallFaults() as faults, TieredCache.from_config(cfg) as cache, warnings:
        run_workload(cache, oracle, keys[:8], threads=2, seconds=0.3, seed=seed)  # something to read back
        faults.set(syscall, ERRNO[error], rate)
        workload = _background(cache, oracle, keys, seconds, seed)
        time.sleep(seconds / 2)
        faults.clear()
        before = getattr(tier_stats(cache, "file"), counter)
        recover = wait_for(lambda: getattr(tier_stats(cache, "file"), counter) > before, timeout=seconds + 10)
        workload.join(timeout=seconds + 60)
        problems = consistency_problems(cache)
        hits, misses = oracle.sweep(cache)
        problems += consistency_problems(cache)
        errors = tier_stats(cache, "file").errors
    if recover is None:
        problems.append(f"the file tier did not {counter[:-1]} again after the fault healed")
    row = FaultRow.from_oracle(name, oracle, recover,
                               note=f"{faults.injected[syscall]} faults injected, tier errors {errors}; "
                                    f"{warnings.count} warning lines logged")
    if not faults.injected[syscall]:
        problems.append("no fault was injected")
    return row, problems


class _WarningCounter(logging.Handler):
    """Counts kvtier's WARNING+ log lines while active (is one fault one line, or one line per block?)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1

    def __enter__(self) -> _WarningCounter:
        logging.getLogger("kvtier").addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("kvtier").removeHandler(self)


@pytest.mark.parametrize(("syscall", "error", "rate"), [
    ("pwritev", "ENOSPC", 0.3), ("pwritev", "EIO", 0.3), ("preadv", "EIO", 0.3), ("rename", "EIO", 0.3),
    ("pwritev", "ENOSPC", 1.0)])
def test_injected_io_errors_are_failed_stores_or_misses(tmp_path: Path, syscall: str, error: str,
                                                         rate: float) -> None:
    row, problems = scenario_syscall_fault(tmp_path, 3.0, syscall, error, rate)
    record(row)
    assert row.wrong == 0 and row.errors == 0, row
    assert not problems, problems


# --- damaged and deleted files ------------------------------------------------------------------------------
def scenario_damaged_files(workdir: Path, seconds: float, seed: int = 0,
                           kinds: tuple[str, ...] = (*CORRUPTIONS, "delete", "delete_shard",
                                                     "delete_namespace"),
                           name: str = "bit flips, truncation, forged headers, deletions in files"
                           ) -> tuple[FaultRow, list[str]]:
    """A thread damages, forges or deletes block files (and whole directories) while 8 threads work.

    Time to recover: after the last damage, until the file tier completes a write again.
    """
    oracle = Oracle()
    keys = universe(64, tag=f"{name}-{seed}")
    cfg = cache_config(file_dir=workdir / "files", cpu_blocks=4, file_blocks=24)
    rng = random.Random(seed)
    done: dict[str, int] = {}
    warnings = _WarningCounter()
    with TieredCache.from_config(cfg) as cache, warnings:
        tier = cache.core.tiers[1]
        fingerprint = tier._fingerprints[0]
        workload = _background(cache, oracle, keys, seconds, seed)
        deadline = time.monotonic() + seconds * 0.7
        while time.monotonic() < deadline:
            time.sleep(0.01)
            on_disk = sorted(files_on_disk(tier)[0])
            if not on_disk:
                continue
            kind = rng.choice(kinds)
            key = rng.choice(on_disk)
            path = tier.path_of(key)
            if kind == "delete_shard":
                shutil.rmtree(path.parent, ignore_errors=True)
            elif kind == "delete_namespace":
                if rng.random() > 0.1:
                    continue
                shutil.rmtree(tier.directory, ignore_errors=True)
            elif not corrupt_file(path, kind, key, rng, fingerprint):
                continue
            done[kind] = done.get(kind, 0) + 1
        before = tier_stats(cache, "file").stores
        recover = wait_for(lambda: tier_stats(cache, "file").stores > before, timeout=seconds + 10)
        workload.join(timeout=seconds + 60)
        problems = consistency_problems(cache)
        hits, misses = oracle.sweep(cache)
        problems += consistency_problems(cache)
        lost = tier_stats(cache, "file").corrupt_or_lost
    if recover is None:
        problems.append("the file tier did not store again after the damage stopped")
    row = FaultRow.from_oracle(name, oracle, recover,
                               note=f"{sum(done.values())} damages "
                                    f"({', '.join(f'{k} {v}' for k, v in sorted(done.items()))}); "
                                    f"{lost} blocks found damaged or gone and dropped; "
                                    f"{warnings.count} warning lines logged")
    return row, problems


def test_damaged_and_deleted_files_are_misses(tmp_path: Path) -> None:
    row, problems = scenario_damaged_files(tmp_path, 4.0)
    record(row)
    assert row.wrong == 0 and row.errors == 0, row
    assert not problems, problems


# --- Redis values -------------------------------------------------------------------------------------------
def scenario_damaged_redis_values(redis_url: str, seconds: float, seed: int = 0,
                                  name: str = "bit flips, truncation, forged headers in Redis values"
                                  ) -> tuple[FaultRow, list[str]]:
    """A thread damages values under the cache's namespace while 8 threads work (CPU of 4 over Redis)."""
    import redis

    oracle = Oracle()
    keys = universe(64, tag=f"{name}-{seed}")
    cfg = cache_config(cpu_blocks=4, redis=redis_options(redis_url, timeout=2.0, connect_timeout=1.0))
    rng = random.Random(seed)
    client = redis.Redis.from_url(redis_url, socket_timeout=5)
    damaged = 0
    with TieredCache.from_config(cfg) as cache:
        tier = cache.core.tiers[1]
        fingerprint = tier._fingerprints[0]
        by_rkey = {tier.redis_key(k): k for k in keys}
        workload = _background(cache, oracle, keys, seconds, seed)
        deadline = time.monotonic() + seconds * 0.8
        while time.monotonic() < deadline:
            time.sleep(0.01)
            present = [rk for rk in by_rkey if client.exists(rk)]
            if not present:
                continue
            rkey = rng.choice(present)
            value = client.get(rkey)
            if value is None:
                continue
            client.set(rkey, corrupt_bytes(value, rng.choice(CORRUPTIONS), by_rkey[rkey], rng, fingerprint))
            damaged += 1
        workload.join(timeout=seconds + 60)
        problems = consistency_problems(cache)
        hits, misses = oracle.sweep(cache)
        problems += consistency_problems(cache)
        corrupt = tier_stats(cache, "redis").errors.get("corrupt", 0)
    client.close()
    row = FaultRow.from_oracle(name, oracle, note=f"{damaged} values damaged; {corrupt} found corrupt, "
                                                  f"dropped and deleted")
    if not corrupt:
        problems.append("no damaged value was ever read: the scenario tested nothing")
    return row, problems


def test_damaged_redis_values_are_misses(redis_servers: Any) -> None:
    server = redis_servers()
    row, problems = scenario_damaged_redis_values(server.url, 3.0)
    record(row)
    assert row.wrong == 0 and row.errors == 0, row
    assert not problems, problems


def scenario_full_redis(redis_url: str, seconds: float, seed: int = 0) -> tuple[FaultRow, list[str]]:
    """Redis at ``maxmemory`` with ``noeviction``: every SET fails with OOM, then memory is raised.

    Time to recover: from ``CONFIG SET maxmemory 0`` until the Redis tier stores again.
    """
    import redis

    name = "Redis full (maxmemory, noeviction), then raised"
    oracle = Oracle()
    keys = universe(64, tag=f"{name}-{seed}")
    cfg = cache_config(cpu_blocks=4, redis=redis_options(redis_url, timeout=2.0, connect_timeout=1.0))
    client = redis.Redis.from_url(redis_url, socket_timeout=5)
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", str(int(client.info("memory")["used_memory"]) + 64 * 1024))
    with TieredCache.from_config(cfg) as cache:
        workload = _background(cache, oracle, keys, seconds, seed)
        time.sleep(seconds / 2)
        oom = tier_stats(cache, "redis").errors.get("oom", 0)
        before = tier_stats(cache, "redis").stores
        client.config_set("maxmemory", "0")
        recover = wait_for(lambda: tier_stats(cache, "redis").stores > before, timeout=seconds + 10)
        workload.join(timeout=seconds + 60)
        problems = consistency_problems(cache)
        oracle.sweep(cache)
        problems += consistency_problems(cache)
    client.close()
    if not oom:
        problems.append("Redis never answered OOM: the scenario tested nothing")
    if recover is None:
        problems.append("the Redis tier did not store again after maxmemory was raised")
    return FaultRow.from_oracle(name, oracle, recover, note=f"{oom} SETs refused with OOM"), problems


def test_full_redis_is_failed_stores(redis_servers: Any) -> None:
    server = redis_servers()
    row, problems = scenario_full_redis(server.url, 3.0)
    record(row)
    assert row.wrong == 0 and row.errors == 0, row
    assert not problems, problems


def test_namespace_directory_removed_under_a_running_cache(tmp_path: Path) -> None:
    """``rm -rf`` of the whole cache directory (a tmp cleaner, an operator): its blocks become misses and
    the very next demotions are stored again (the tier makes its namespace directory again)."""
    oracle = Oracle()
    keys = universe(12, tag="rm-rf")
    cfg = cache_config(file_dir=tmp_path / "files", cpu_blocks=1, file_blocks=16)
    with TieredCache.from_config(cfg) as cache:
        for i in range(6):
            oracle.store(cache, keys[i:i + 1])
        tier = cache.core.tiers[1]
        assert len(list(tier.keys())) == 5
        shutil.rmtree(tier.directory)
        oracle.sweep(cache, keys[:5])
        stores = tier_stats(cache, "file").stores
        for i in range(6, 12):
            oracle.store(cache, keys[i:i + 1])
        assert tier_stats(cache, "file").stores == stores + 6
        assert consistency_problems(cache) == []
        assert oracle.sweep(cache, keys[6:11]) == (5, 0)
    oracle.assert_clean()
