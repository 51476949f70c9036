"""Belady's MIN: as many hits as the best eviction schedule found by exhaustive search."""

from __future__ import annotations

from functools import cache

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.blocks import BlockKey
from kvtier.policy.belady import NEVER, BeladyPolicy


def key(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(8, "little"), 0)


def optimum_hits(refs: tuple[int, ...], capacity: int) -> int:
    """Exhaustive search over every eviction choice (every miss is admitted)."""

    @cache
    def best(i: int, cache: frozenset[int]) -> int:
        if i == len(refs):
            return 0
        x = refs[i]
        if x in cache:
            return 1 + best(i + 1, cache)
        if len(cache) < capacity:
            return best(i + 1, cache | {x})
        return max(best(i + 1, (cache - {victim}) | {x}) for victim in cache)

    return best(0, frozenset())


def min_hits(refs: list[int], capacity: int) -> int:
    nxt = [NEVER] * len(refs)
    later: dict[int, int] = {}
    for i in range(len(refs) - 1, -1, -1):
        nxt[i] = later.get(refs[i], NEVER)
        later[refs[i]] = i
    policy = BeladyPolicy()
    hits = 0
    for i, x in enumerate(refs):
        k = key(x)
        policy.observe(k, nxt[i])
        if k in policy:
            policy.access(k)
            hits += 1
            continue
        if len(policy) >= capacity:
            policy.remove(policy.victims(1, set())[0])
        policy.insert(k)
    return hits


@settings(max_examples=120, deadline=None)
@given(st.lists(st.integers(0, 5), max_size=14), st.integers(1, 3))
def test_min_matches_the_exhaustive_optimum(refs: list[int], capacity: int) -> None:
    assert min_hits(refs, capacity) == optimum_hits(tuple(refs), capacity)


def test_min_evicts_the_farthest_next_use_and_never_a_pinned_block() -> None:
    policy = BeladyPolicy()
    for i, next_use in enumerate([50, 10, NEVER, 30]):
        policy.observe(key(i), next_use)
        policy.insert(key(i))
    assert policy.victims(1, set()) == [key(2)]
    assert policy.victims(2, {key(2)}) == [key(0), key(3)]
    assert policy.victims(4, {key(0), key(1), key(2), key(3)}) == []
    policy.observe(key(2), 5)  # referenced again: now it is needed soonest
    assert policy.victims(4, set()) == [key(0), key(3), key(1), key(2)]
