"""Chains through TieredCache: predecessors reach eviction, survive a file-tier restart, bad data is
harmless."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier import TieredCache
from kvtier.policy import DEFAULT_EVICTION
from tests.helpers import SMALL_MODEL, make_keys, random_blocks, small_layout


def _file_only(tmp_path: Path, blocks: int) -> dict[str, Any]:
    return {"model": dict(SMALL_MODEL), "hash_block_size": 16,
            "tiers": [{"type": "file", "path": str(tmp_path / "files"),
                       "capacity": blocks * small_layout().nbytes}]}


def _chain(keys: list[Any]) -> list[Any]:
    return [None, *keys[:-1]]


def test_the_default_eviction_is_the_chain_aware_default(two_tier_config: dict[str, Any]) -> None:
    with TieredCache.from_config(two_tier_config) as cache:
        policies = [index.policies[0] for index in cache.core.residency.tiers]
        assert [p.name for p in policies] == [DEFAULT_EVICTION, DEFAULT_EVICTION] == ["adaptive", "adaptive"]


def test_a_chain_is_evicted_from_its_tail(two_tier_config: dict[str, Any]) -> None:
    layout = small_layout()
    chain, other = make_keys(4), make_keys(2, start=100)
    with TieredCache.from_config(_file_only(Path(two_tier_config["tiers"][1]["path"]), 5)) as cache:
        cache.store(chain, random_blocks(4, layout, seed=1), predecessors=_chain(chain))
        cache.store(other, random_blocks(2, layout, seed=2))  # room for one: the chain's tail goes
        assert cache.lookup(chain) == 3
        assert cache.lookup(other) == 2


def test_chains_survive_a_restart_of_the_file_tier(tmp_path: Path) -> None:
    layout = small_layout()
    chain, blocks = make_keys(6), random_blocks(6, layout, seed=3)
    with TieredCache.from_config(_file_only(tmp_path, 8)) as cache:
        # stored tail first, one call per block, so neither store order nor age says which is the head
        for i in reversed(range(6)):
            cache.store(chain[i:i + 1], blocks[i:i + 1], predecessors=[chain[i - 1] if i else None])
    assert (tmp_path / "files").rglob("chains.log")
    with TieredCache.from_config(_file_only(tmp_path, 8)) as cache:
        cache.store(make_keys(4, start=50), random_blocks(4, layout, seed=4))  # two of the chain must go
        assert cache.lookup(chain) == 4  # its tail went, its head stayed whole
        out = torch.empty((4, *layout.shape), dtype=layout.dtype)
        assert cache.load(chain[:4], out) == 4
        assert torch.equal(out.view(torch.uint8), blocks[:4].view(torch.uint8))


def test_a_torn_chain_log_costs_only_chain_order(tmp_path: Path) -> None:
    layout = small_layout()
    chain = make_keys(3)
    with TieredCache.from_config(_file_only(tmp_path, 8)) as cache:
        cache.store(chain, random_blocks(3, layout), predecessors=_chain(chain))
    (log,) = (tmp_path / "files").rglob("chains.log")
    log.write_bytes(log.read_bytes()[:-3] + b"\xff\xff\xff")  # a crash mid-append
    with TieredCache.from_config(_file_only(tmp_path, 8)) as cache:
        assert cache.lookup(chain) == 3
        index = cache.core.residency.tiers[0]
        assert index.hint(chain[1]).predecessor == chain[0] and chain[2] not in index.links


def test_bad_predecessor_data(two_tier_config: dict[str, Any]) -> None:
    layout = small_layout()
    keys = make_keys(3)
    with TieredCache.from_config(two_tier_config) as cache:
        with pytest.raises(ValueError, match="predecessors"):
            cache.store(keys, random_blocks(3, layout), predecessors=[None])
        with pytest.raises(TypeError, match=r"predecessors\[1\]"):
            cache.store(keys, random_blocks(3, layout), predecessors=[None, b"raw", None])  # type: ignore[list-item]
        assert cache.lookup(keys) == 0  # nothing half-stored
        # a cycle, a block naming itself, a parent never stored: all stored, nothing fails
        cycle = [keys[2], keys[0], keys[1]]
        assert cache.store(keys, random_blocks(3, layout), predecessors=cycle) == 3
        assert cache.store(keys[:1], random_blocks(1, layout), predecessors=[keys[0]]) == 1
        more = make_keys(12, start=200)
        assert cache.store(more, random_blocks(12, layout),
                           predecessors=[make_keys(1, start=999)[0]] * 12) == 12
        assert cache.lookup(more[-4:]) == 4  # the newest are in the top tier, the rest demoted
