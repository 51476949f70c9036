"""The default policy: never worse than LRU by more than 0.01 on the workloads we can generate, and
it follows the better of its two experts on workloads built so that each wins one."""

from __future__ import annotations

import pytest

from kvtier.policy import DEFAULT_EVICTION, AdaptiveChainPolicy, make_eviction_policy
from kvtier.replay import replay
from kvtier.traces import Trace
from tests.policy.workloads import scan_hot, sessions, standard_workloads

WORKLOADS = standard_workloads()


@pytest.mark.parametrize(("trace", "capacities"), WORKLOADS,
                         ids=[f"{t.name}-{i}" for i, (t, _) in enumerate(WORKLOADS)])
def test_default_is_within_a_hundredth_of_lru_or_better(trace: Trace, capacities: list[int]) -> None:
    for capacity in capacities:
        lru = replay(trace, "lru", [capacity])
        default = replay(trace, "default", [capacity])
        assert default.policy == DEFAULT_EVICTION
        assert default.prefix_hit_ratio >= lru.prefix_hit_ratio - 0.01, (capacity, default, lru)
        assert default.block_hit_ratio >= lru.block_hit_ratio - 0.01, (capacity, default, lru)


def test_default_is_the_adaptive_chain_policy() -> None:
    assert make_eviction_policy("default").name == DEFAULT_EVICTION == "adaptive"


def _run(trace: Trace, capacity: int) -> tuple[dict[str, float], AdaptiveChainPolicy]:
    """Prefix-hit ratio of each expert alone and of the default, and the default's policy object."""
    ratios = {name: replay(trace, name, [capacity]).prefix_hit_ratio for name in ("leaf_lru", "lifetime")}
    policy = AdaptiveChainPolicy()
    ratios["default"] = replay(trace, "default", [capacity], make_policy=lambda: policy).prefix_hit_ratio
    return ratios, policy


def test_default_follows_the_lifetime_expert_where_dead_blocks_dominate() -> None:
    # A hot set re-read between scans of blocks never seen again: learned lifetimes keep the hot
    # set through the scans, recency (leaf-first or not: no chains here) lets each scan flush it.
    ratios, policy = _run(scan_hot(800, 60_000, 2000, 3000), 1000)
    assert ratios["lifetime"] > ratios["leaf_lru"] + 0.05, ratios
    assert ratios["default"] >= ratios["lifetime"] - 0.01, ratios
    assert policy.leader == "lifetime"


def test_default_follows_leaf_first_lru_where_chains_dominate() -> None:
    # Long sessions of concurrent users: chains come back whole after the other users' turns.
    ratios, _ = _run(sessions(80_000, seed=1), 300)
    assert ratios["leaf_lru"] > ratios["lifetime"] + 0.05, ratios
    assert ratios["default"] >= ratios["leaf_lru"] - 0.005, ratios
