"""TieredCache over CPU + Redis: two processes with their own caches share blocks through Redis."""

from __future__ import annotations

import multiprocessing as mp
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import torch

from kvtier import TieredCache
from tests.helpers import SMALL_MODEL, make_keys, random_blocks, small_layout


@pytest.fixture()
def shared_config(redis_url: str) -> Iterator[dict[str, Any]]:
    model = dict(SMALL_MODEL, name=f"shared-{uuid.uuid4().hex[:8]}")
    cfg = {"model": model, "tiers": [{"type": "cpu", "capacity": 2 * small_layout().nbytes},
                                     {"type": "redis", "url": redis_url}]}
    yield cfg
    with TieredCache.from_config(cfg) as cache:
        assert cache.core.namespace is not None
        pattern = f"kvtier:{cache.core.namespace.id}:*"
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=pattern))
    if keys:
        client.unlink(*keys)
    client.close()


def _child_loads(cfg: dict[str, Any], n: int, result: Any) -> None:
    layout = small_layout()
    with TieredCache.from_config(cfg) as cache:
        keys = make_keys(n)
        out = torch.empty((n, *layout.shape), dtype=layout.dtype)
        found = cache.lookup(keys)
        loaded = cache.load(keys, out)
        expected = random_blocks(n, layout, seed=7)
        same = torch.equal(out.view(torch.uint8), expected.view(torch.uint8))
        result.put((found, loaded, same, cache.stats().tiers[1].hits))


def test_process_b_hits_what_process_a_stored(shared_config: dict[str, Any]) -> None:
    layout = small_layout()
    n = 6
    with TieredCache.from_config(shared_config) as cache:
        # the CPU tier holds 2 blocks: storing 6 one by one demotes 4 to Redis; write the rest through
        blocks = random_blocks(n, layout, seed=7)
        for i in range(n):
            assert cache.store(make_keys(1, start=i), blocks[i:i + 1]) == 1
        assert cache.stats().tiers[1].stores == n - 2  # write-back: only evicted blocks reach Redis
    shared_config["placement"] = {"write_mode": "write_through"}
    with TieredCache.from_config(shared_config) as cache:
        cache.store(make_keys(n), random_blocks(n, layout, seed=7))  # CPU copies are per process
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    child = ctx.Process(target=_child_loads, args=(shared_config, n, result))
    child.start()
    found, loaded, same, redis_hits = result.get(timeout=60)
    child.join(timeout=30)
    assert (found, loaded, same) == (n, n, True)
    assert redis_hits == n
