"""Remote faults: Redis killed and restarted, a cluster node killed and restarted, the network cut (a
server that accepts and never answers), a slow Redis.

The cache under test has a CPU tier of 4 blocks over Redis (write-back: evictions demote into Redis,
loads of evicted blocks come back from it), driven by 8 threads. Besides the oracle, each engine-facing
call must return within its deadline (:func:`deadline_of`: the tier's timeouts, not the outage, bound
it), and after the fault ends the Redis tier must serve again by itself — the time it takes is the
"time to recover" (circuit breaker cool-down 0.3 s here; 5 s by default).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import torch

from kvtier import BlockKey, TieredCache
from tests.reliability.conftest import (
    FaultProxy,
    FaultRow,
    Oracle,
    cache_config,
    consistency_problems,
    deadline_of,
    expected_bytes,
    record,
    redis_options,
    run_workload,
    tier_stats,
    universe,
    wait_for,
)


def _background(cache: TieredCache, oracle: Oracle, keys: list[BlockKey], seconds: float,
                seed: int) -> threading.Thread:
    thread = threading.Thread(target=run_workload, args=(cache, oracle, keys),
                              kwargs={"threads": 8, "seconds": seconds, "seed": seed}, daemon=True)
    thread.start()
    return thread


def redis_round_trip(cache: TieredCache, keys: list[BlockKey]) -> bool:
    """Put and get ``keys`` through the cache's own Redis tier (its pools and breakers), on the cache's
    loop."""
    tier = cache.core.tiers[-1]
    blocks = [expected_bytes(k) for k in keys]
    if not all(cache._call(tier.put(keys, blocks))):
        return False
    out = [torch.empty_like(b) for b in blocks]
    return all(cache._call(tier.get(keys, out))) and all(torch.equal(a, b)
                                                         for a, b in zip(out, blocks, strict=True))


def _finish(cache: TieredCache, oracle: Oracle, workload: threading.Thread, seconds: float) -> list[str]:
    workload.join(timeout=seconds + 120)
    problems = consistency_problems(cache)
    oracle.sweep(cache)
    return problems + consistency_problems(cache)


def scenario_redis_restart(server: Any, seconds: float, seed: int = 0) -> tuple[FaultRow, list[str]]:
    """Kill the server a quarter into the run (SIGKILL: connections reset, data gone), restart it at half."""
    name = "Redis killed (SIGKILL) and restarted"
    redis = redis_options(server.url)
    oracle = Oracle(call_timeout=deadline_of(redis) * 4)
    keys = universe(64, tag=f"{name}-{seed}")
    probe = universe(1, tag=f"{name}-probe-{seed}")
    with TieredCache.from_config(cache_config(cpu_blocks=4, redis=redis)) as cache:
        workload = _background(cache, oracle, keys, seconds, seed)
        time.sleep(seconds / 4)
        server.kill()
        time.sleep(seconds / 4)
        server.start()
        recover = wait_for(lambda: redis_round_trip(cache, probe), timeout=seconds + 10, interval=0.02)
        problems = _finish(cache, oracle, workload, seconds)
        errors = tier_stats(cache, "redis").errors
    problems += _deadline_problems(oracle, redis)
    if recover is None:
        problems.append("the Redis tier did not serve again after the restart")
    return FaultRow.from_oracle(name, oracle, recover, note=f"tier errors {errors}"), problems


def _deadline_problems(oracle: Oracle, redis: dict[str, Any]) -> list[str]:
    limit = deadline_of(redis)
    if oracle.max_latency > limit:
        return [f"a call took {oracle.max_latency:.2f} s, over its deadline of {limit:.2f} s"]
    return []


def test_redis_killed_and_restarted(redis_servers: Any) -> None:
    row, problems = scenario_redis_restart(redis_servers(), 3.0)
    record(row)
    assert row.wrong == 0 and row.errors == 0, row
    assert not problems, problems


def scenario_cluster_node(cluster: Any, seconds: float, seed: int = 0) -> tuple[FaultRow, list[str]]:
    """Kill one of three masters a quarter into the run, restart it (same port and node file) at half."""
    name = "Redis Cluster: a master killed and restarted"
    redis = redis_options(startup_nodes=cluster.startup_nodes)
    oracle = Oracle(call_timeout=deadline_of(redis) * 4)
    keys = universe(64, tag=f"{name}-{seed}")
    with TieredCache.from_config(cache_config(cpu_blocks=4, redis=redis)) as cache:
        tier = cache.core.tiers[-1]
        victim = cluster.nodes[0]
        workload = _background(cache, oracle, keys, seconds, seed)
        time.sleep(seconds / 4)
        owned = _keys_on_node(tier, victim.port, universe(256, tag=f"{name}-probe-{seed}"))[:2]
        victim.kill()
        time.sleep(seconds / 4)
        victim.start()
        recover = wait_for(lambda: redis_round_trip(cache, owned), timeout=seconds + 30, interval=0.05)
        problems = _finish(cache, oracle, workload, seconds)
        errors = tier_stats(cache, "redis").errors
    problems += _deadline_problems(oracle, redis)
    if recover is None:
        problems.append("the restarted node's slots did not serve again")
    return FaultRow.from_oracle(name, oracle, recover, note=f"tier errors {errors}"), problems


def _keys_on_node(tier: Any, port: int, candidates: list[BlockKey]) -> list[BlockKey]:
    import redis
    from redis.crc import key_slot

    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)
    try:
        ranges = client.execute_command("CLUSTER SLOTS")
    finally:
        client.close()
    mine = [(int(r[0]), int(r[1])) for r in ranges if int(r[2][1]) == port]
    return [k for k in candidates if any(lo <= key_slot(tier.redis_key(k)) <= hi for lo, hi in mine)]


def test_cluster_node_killed_and_restarted(cluster: Any) -> None:
    row, problems = scenario_cluster_node(cluster, 4.0)
    record(row)
    assert row.wrong == 0 and row.errors == 0, row
    assert not problems, problems


def scenario_network_cut(server_url: str, seconds: float, seed: int = 0) -> tuple[FaultRow, list[str]]:
    """A proxy in front of Redis blackholes traffic (accepts, reads, never answers) for the middle half."""
    name = "network to Redis cut (blackhole), then restored"
    host, port = server_url.split("//")[1].split("/")[0].split(":")
    with FaultProxy((host, int(port))) as proxy:
        redis = redis_options(proxy.url)
        oracle = Oracle(call_timeout=deadline_of(redis) * 4)
        keys = universe(64, tag=f"{name}-{seed}")
        probe = universe(1, tag=f"{name}-probe-{seed}")
        with TieredCache.from_config(cache_config(cpu_blocks=4, redis=redis)) as cache:
            workload = _background(cache, oracle, keys, seconds, seed)
            time.sleep(seconds / 4)
            proxy.mode = "blackhole"
            time.sleep(seconds / 2)
            proxy.mode = "pass"
            recover = wait_for(lambda: redis_round_trip(cache, probe), timeout=seconds + 10, interval=0.02)
            problems = _finish(cache, oracle, workload, seconds)
            errors = tier_stats(cache, "redis").errors
    problems += _deadline_problems(oracle, redis)
    if recover is None:
        problems.append("the Redis tier did not serve again after the network came back")
    if not errors.get("timeout"):
        problems.append("no request timed out: the cut was not exercised")
    return FaultRow.from_oracle(name, oracle, recover, note=f"tier errors {errors}"), problems


def test_network_cut_and_restored(redis_servers: Any) -> None:
    row, problems = scenario_network_cut(redis_servers().url, 4.0)
    record(row)
    assert row.wrong == 0 and row.errors == 0, row
    assert not problems, problems


def scenario_server_never_answers(seconds: float, seed: int = 0) -> tuple[FaultRow, list[str]]:
    """Redis is a socket that accepts connections and never answers, from the start."""
    name = "Redis accepts and never answers"
    with FaultProxy(None) as hung:
        redis = redis_options(hung.url)
        oracle = Oracle(call_timeout=deadline_of(redis) * 4)
        keys = universe(64, tag=f"{name}-{seed}")
        with TieredCache.from_config(cache_config(cpu_blocks=4, redis=redis)) as cache:
            run_workload(cache, oracle, keys, threads=8, seconds=seconds, seed=seed)
            problems = consistency_problems(cache)
            oracle.sweep(cache)
            errors = tier_stats(cache, "redis").errors
    problems += _deadline_problems(oracle, redis)
    if not errors.get("timeout") or not errors.get("circuit_open"):
        problems.append(f"expected timeouts, then an open circuit; tier errors {errors}")
    return FaultRow.from_oracle(name, oracle, note=f"tier errors {errors}"), problems


def test_server_that_never_answers(tmp_path: Path) -> None:
    row, problems = scenario_server_never_answers(2.0)
    record(row)
    assert row.wrong == 0 and row.errors == 0, row
    assert not problems, problems


def scenario_slow_redis(server_url: str, seconds: float, delay: float,
                        seed: int = 0) -> tuple[FaultRow, list[str]]:
    """Every reply from Redis is held ``delay`` seconds (below or above the tier's 0.5 s timeout)."""
    name = f"slow Redis: replies held {delay:.2f} s (timeout 0.5 s)"
    host, port = server_url.split("//")[1].split("/")[0].split(":")
    with FaultProxy((host, int(port)), mode="slow", delay=delay) as proxy:
        redis = redis_options(proxy.url)
        oracle = Oracle(call_timeout=deadline_of(redis) * 4)
        keys = universe(64, tag=f"{name}-{seed}")
        with TieredCache.from_config(cache_config(cpu_blocks=4, redis=redis)) as cache:
            run_workload(cache, oracle, keys, threads=8, seconds=seconds, seed=seed)
            problems = consistency_problems(cache)
            stats = tier_stats(cache, "redis")
    problems += _deadline_problems(oracle, redis)
    if delay < 0.5 and not stats.hits:
        problems.append("a slow but answering Redis served no hit")
    row = FaultRow.from_oracle(name, oracle, note=f"{stats.hits} Redis hits; tier errors {stats.errors}")
    return row, problems


def test_slow_redis_still_serves_within_the_deadline(redis_servers: Any) -> None:
    server = redis_servers()
    for delay in (0.05, 0.8):
        row, problems = scenario_slow_redis(server.url, 2.0, delay)
        record(row)
        assert row.wrong == 0 and row.errors == 0, row
        assert not problems, problems
