"""ARC: ghost lists stay bounded, and the target size adapts toward the list that was too small."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.blocks import BlockKey
from kvtier.policy import ARCPolicy


def key(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(8, "little"), 0)


def reference(policy: ARCPolicy, i: int, capacity: int) -> None:
    k = key(i)
    if k in policy:
        policy.access(k)
        return
    if len(policy) >= capacity:
        policy.remove(policy.victims(1, set())[0])
    policy.insert(k)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 60), max_size=400), st.integers(1, 12))
def test_ghost_lists_and_target_stay_bounded(refs: list[int], capacity: int) -> None:
    policy = ARCPolicy(capacity)
    for i in refs:
        reference(policy, i, capacity)
        c = capacity
        assert len(policy.t1) + len(policy.t2) <= c
        assert len(policy.t1) + len(policy.b1) <= c
        assert len(policy.t1) + len(policy.t2) + len(policy.b1) + len(policy.b2) <= 2 * c
        assert 0 <= policy.p <= c
        assert not (set(policy.b1) | set(policy.b2)) & (set(policy.t1) | set(policy.t2))


def test_capacity_is_learned_when_not_given() -> None:
    policy = ARCPolicy()
    for i in range(50):
        reference(policy, i % 20, 8)
    assert policy.c == 8
    assert len(policy.b1) + len(policy.t1) <= 8


def test_recency_misses_grow_t1_target_and_frequency_misses_shrink_it() -> None:
    capacity = 10
    policy = ARCPolicy(capacity)
    hot = list(range(5))
    for _ in range(20):  # a hot set seen twice or more lives in T2
        for i in hot:
            reference(policy, i, capacity)
    assert policy.p == 0
    # A loop slightly larger than T1's share keeps missing in B1: p must grow.
    for _ in range(6):
        for i in range(100, 108):
            reference(policy, i, capacity)
    grown = policy.p
    assert grown > 0
    # Now the hot set comes back after being pushed out: B2 hits pull p down again.
    rnd = random.Random(0)
    for _ in range(200):
        reference(policy, rnd.choice(hot + list(range(200, 260))), capacity)
    assert policy.p < grown
