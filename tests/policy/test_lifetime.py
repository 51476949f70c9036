"""The learned-lifetime policy: what it learns, and how it uses it."""

from __future__ import annotations

import pytest

from kvtier.blocks import BlockKey
from kvtier.policy import LearnedLifetimePolicy, LRUPolicy
from kvtier.policy.base import EvictionPolicy, InsertHint


def key(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(8, "little"), 0)


def run(policy: EvictionPolicy, refs: list[int], capacity: int) -> int:
    hits = 0
    for i in refs:
        k = key(i)
        if k in policy:
            policy.access(k)
            hits += 1
            continue
        if len(policy) >= capacity:
            policy.remove(policy.victims(1, set())[0])
        policy.insert(k, InsertHint())
    return hits


def scan_and_hot(n: int) -> list[int]:
    refs, fresh = [], 10**6
    for r in range(n):
        if r % 3:
            refs.append(r % 400)  # a hot set, reused every ~600 references
        else:
            refs.append(fresh)  # a scan: never seen again
            fresh += 1
    return refs


def test_learns_not_to_keep_scans_and_beats_lru() -> None:
    capacity = 300
    policy = LearnedLifetimePolicy(capacity)
    refs = scan_and_hot(60_000)
    hits = run(policy, refs, capacity)
    assert policy.lifetimes[0] == 0  # blocks seen once are not worth a slot
    assert policy.lifetimes[2] > 0
    assert hits > run(LRUPolicy(), refs, capacity) * 1.5


def test_lifetimes_grow_with_the_class() -> None:
    policy = LearnedLifetimePolicy(300)
    run(policy, scan_and_hot(30_000), 300)
    lifetimes = policy.lifetimes
    assert all(b >= a for a, b in zip(lifetimes, lifetimes[1:], strict=False))


def test_stays_lru_on_a_loop_that_fits() -> None:
    policy = LearnedLifetimePolicy(100)
    run(policy, [i % 90 for i in range(20_000)], 100)
    assert policy.weights == [1.0, 1.0, 1.0]


def test_victim_is_the_class_tail_that_most_overstayed() -> None:
    policy = LearnedLifetimePolicy(100)
    for i in range(6):
        policy.insert(key(i))
    policy.access(key(1))
    policy.access(key(1))  # key 1 is now in class 2 (three references)
    policy._set_weights([1.0 / 1000, 1.0 / 2000, 1.0 / 4000])
    now = policy._clock + 1
    resident = [key(i) for i in range(6)]
    brute = max(resident, key=lambda k: (now - policy._queues[policy._meta[k][0]][k]) *
                policy.weights[policy._meta[k][0]])
    assert policy.victims(1, set()) == [brute]
    assert policy.victims(6, set())[0] == brute
    assert key(1) not in policy.victims(5, set())  # the most valuable block goes last


@pytest.mark.parametrize(("kwargs", "match"), [({"classes": 0}, "classes"), ({"min_gain": -1}, "min_gain")])
def test_rejects_bad_arguments(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LearnedLifetimePolicy(**kwargs)  # type: ignore[arg-type]
