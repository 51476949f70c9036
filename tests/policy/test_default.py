"""The default policy: never worse than LRU by more than 0.01 on the workloads we can generate."""

from __future__ import annotations

import pytest

from kvtier.policy import DEFAULT_EVICTION, make_eviction_policy
from kvtier.replay import Trace, replay
from tests.policy.workloads import standard_workloads

WORKLOADS = standard_workloads()


@pytest.mark.parametrize(("trace", "capacities"), WORKLOADS, ids=[f"{t.name}-{i}" for i, (t, _) in enumerate(WORKLOADS)])
def test_default_is_within_a_hundredth_of_lru_or_better(trace: Trace, capacities: list[int]) -> None:
    for capacity in capacities:
        lru = replay(trace, "lru", [capacity])
        default = replay(trace, "default", [capacity])
        assert default.policy == DEFAULT_EVICTION
        assert default.prefix_hit_ratio >= lru.prefix_hit_ratio - 0.01, (capacity, default, lru)
        assert default.block_hit_ratio >= lru.block_hit_ratio - 0.01, (capacity, default, lru)


def test_default_is_the_learned_lifetime_policy() -> None:
    assert make_eviction_policy("default").name == DEFAULT_EVICTION == "lifetime"
