"""Every eviction policy: against a brute-force reference, and the interface's promises (pins)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.blocks import BlockKey
from kvtier.policy import (
    DEFAULT_EVICTION,
    EVICTION_POLICIES,
    ARCPolicy,
    InsertHint,
    LearnedLifetimePolicy,
    LRUPolicy,
    PrefixAwarePolicy,
    SievePolicy,
    WTinyLFUPolicy,
    make_eviction_policy,
)
from kvtier.policy.tinylfu import key_hash
from tests.policy.references import RefARC, RefLRU, RefPrefix, RefSieve, RefTinyLFU

UNIVERSE = 24
KEYS = [BlockKey(i.to_bytes(8, "little"), 0) for i in range(UNIVERSE)]

# One step: reference a key (hit → access, miss → make room, then insert), drop a key, or ask for
# victims with some keys pinned.
step = st.one_of(
    st.tuples(st.just("ref"), st.integers(0, 11), st.integers(0, 6)),  # mostly a hot dozen
    st.tuples(st.just("ref"), st.integers(0, UNIVERSE - 1), st.integers(0, 6)),
    st.tuples(st.just("ref"), st.integers(0, 5), st.integers(0, 6)),
    st.tuples(st.just("drop"), st.integers(0, UNIVERSE - 1), st.just(0)),
    st.tuples(st.just("victims"), st.integers(0, 2 ** UNIVERSE - 1), st.integers(1, 4)),
)
steps_strategy = st.lists(step, min_size=30, max_size=300)


def drive(policy: Any, reference: Any, capacity: int, steps: list[tuple[str, int, int]]) -> None:
    """Run both through the same steps; every victims answer must be identical."""
    resident: set[BlockKey] = set()
    for kind, a, b in steps:
        if kind == "ref":
            key = KEYS[a]
            if key in resident:
                policy.access(key)
                reference.access(key)
                continue
            if len(resident) >= capacity:
                got, want = policy.victims(1, frozenset()), reference.victims(1, frozenset())
                assert got == want
                policy.remove(got[0])
                reference.remove(got[0])
                resident.discard(got[0])
            policy.insert(key, InsertHint(position=b))
            reference.insert(key, InsertHint(position=b))
            resident.add(key)
        elif kind == "drop":
            key = KEYS[a]
            policy.remove(key)
            reference.remove(key)
            resident.discard(key)
        else:
            pinned = {k for i, k in enumerate(KEYS) if a >> i & 1}
            assert policy.victims(b, pinned) == reference.victims(b, pinned)
        assert len(policy) == len(resident)


@settings(max_examples=80, deadline=None)
@given(steps_strategy, st.integers(2, 10))
def test_lru_matches_reference(steps: list[tuple[str, int, int]], capacity: int) -> None:
    drive(LRUPolicy(), RefLRU(), capacity, steps)


@settings(max_examples=80, deadline=None)
@given(steps_strategy, st.integers(2, 10))
def test_arc_matches_reference(steps: list[tuple[str, int, int]], capacity: int) -> None:
    drive(ARCPolicy(capacity), RefARC(capacity), capacity, steps)


@settings(max_examples=80, deadline=None)
@given(steps_strategy, st.integers(2, 10))
def test_sieve_matches_reference(steps: list[tuple[str, int, int]], capacity: int) -> None:
    drive(SievePolicy(), RefSieve(), capacity, steps)


@settings(max_examples=80, deadline=None)
@given(steps_strategy, st.integers(2, 10))
def test_prefix_matches_reference(steps: list[tuple[str, int, int]], capacity: int) -> None:
    drive(PrefixAwarePolicy(capacity), RefPrefix(capacity), capacity, steps)


def test_tinylfu_test_keys_do_not_collide_in_the_sketch() -> None:
    """The reference counts exactly; the policy's sketch must agree on the test keys."""
    policy = WTinyLFUPolicy(10)
    mask = policy.sketch._mask
    hashes = [key_hash(k) for k in KEYS]
    assert len({h & mask for h in hashes}) == UNIVERSE or len({(h >> 32) & mask for h in hashes}) == UNIVERSE


@settings(max_examples=80, deadline=None)
@given(steps_strategy, st.integers(2, 10))
def test_tinylfu_matches_reference(steps: list[tuple[str, int, int]], capacity: int) -> None:
    drive(WTinyLFUPolicy(capacity), RefTinyLFU(capacity), capacity, steps)


@settings(max_examples=40, deadline=None)
@given(steps_strategy, st.integers(2, 10))
def test_lifetime_is_lru_until_it_has_learned(steps: list[tuple[str, int, int]], capacity: int) -> None:
    drive(LearnedLifetimePolicy(capacity), RefLRU(), capacity, steps)


@pytest.mark.parametrize("name", sorted(EVICTION_POLICIES))
@settings(max_examples=40, deadline=None)
@given(steps=steps_strategy)
def test_victims_are_resident_distinct_unpinned_and_enough(name: str,
                                                           steps: list[tuple[str, int, int]]) -> None:
    policy = make_eviction_policy(name)
    resident: set[BlockKey] = set()
    capacity = 8
    for kind, a, b in steps:
        if kind == "ref":
            key = KEYS[a]
            if key in resident:
                policy.access(key)
            else:
                if len(resident) >= capacity:
                    victim = policy.victims(1, frozenset())[0]
                    policy.remove(victim)
                    resident.discard(victim)
                policy.insert(key, InsertHint(position=b))
                resident.add(key)
        elif kind == "drop":
            policy.remove(KEYS[a])
            resident.discard(KEYS[a])
        else:
            pinned = {k for i, k in enumerate(KEYS) if a >> i & 1}
            got = policy.victims(b, pinned)
            assert len(got) == len(set(got))
            assert not set(got) & pinned
            assert set(got) <= resident
            assert len(got) == min(b, len(resident - pinned))
        assert len(policy) == len(resident)
        assert all(k in policy for k in resident)


@pytest.mark.parametrize("name", sorted(EVICTION_POLICIES))
def test_everything_pinned_means_no_victim(name: str) -> None:
    policy = make_eviction_policy(name)
    for key in KEYS[:5]:
        policy.insert(key)
    assert policy.victims(3, set(KEYS[:5])) == []
    assert policy.victims(0, set()) == []
    assert policy.victims(2, set(KEYS[1:5])) == [KEYS[0]]


def test_registry_and_default() -> None:
    assert DEFAULT_EVICTION in EVICTION_POLICIES
    assert type(make_eviction_policy("default")) is EVICTION_POLICIES[DEFAULT_EVICTION]
    for name, factory in EVICTION_POLICIES.items():
        assert factory().name == name
    with pytest.raises(KeyError, match="known"):
        make_eviction_policy("nope")


def test_prefix_policy_evicts_chain_tails_first() -> None:
    policy = PrefixAwarePolicy(64)
    chain = KEYS[:6]
    for position, key in enumerate(chain):
        policy.insert(key, InsertHint(position=position))
    assert policy.victims(6, set()) == list(reversed(chain))


@pytest.mark.parametrize("factory", [ARCPolicy, WTinyLFUPolicy, PrefixAwarePolicy, LearnedLifetimePolicy])
def test_capacity_must_be_positive(factory: Any) -> None:
    with pytest.raises(ValueError, match="capacity"):
        factory(0)
