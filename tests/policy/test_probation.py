"""The probation lane: leaf-first LRU with it against its brute-force reference, and the looping
sessions it exists for (each user's session longer than its share of the cache)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.blocks import BlockKey
from kvtier.policy import AdaptiveChainPolicy, InsertHint, make_eviction_policy
from kvtier.policy.probation import LeafProbationPolicy
from kvtier.replay import replay
from tests.policy.references import RefLeafProbation
from tests.policy.test_chains import drive_chains, request
from tests.policy.workloads import sessions


@settings(max_examples=150, deadline=None)
@given(st.lists(request, min_size=20, max_size=200), st.integers(2, 12))
def test_leaf_probation_matches_brute_force_reference(steps: list[tuple[str, int, int]],
                                                      capacity: int) -> None:
    drive_chains(LeafProbationPolicy(), RefLeafProbation(), capacity, steps)


@settings(max_examples=60, deadline=None)
@given(st.lists(request, min_size=20, max_size=200), st.integers(2, 12))
def test_leaf_probation_keeps_every_promise_with_cycles(steps: list[tuple[str, int, int]],
                                                        capacity: int) -> None:
    drive_chains(make_eviction_policy("leaf_probation"), None, capacity, steps, cyclic=True)


KEYS = [BlockKey(i.to_bytes(8, "little"), 0) for i in range(16)]


def _store_chain(policy: LeafProbationPolicy, keys: list[BlockKey]) -> None:
    for j, key in enumerate(keys):
        policy.insert(key, InsertHint(j, -1, keys[j - 1] if j else None))


def test_newest_unhit_chain_leaves_first_from_its_tail_and_a_hit_protects_it() -> None:
    policy = LeafProbationPolicy()
    old, new = KEYS[0:4], KEYS[4:8]
    _store_chain(policy, old)
    _store_chain(policy, new)
    assert policy.victims(2, ()) == [new[3], old[3]]  # newest probation leaves, tails first
    assert policy.victims(1, {new[3]}) == [old[3]]
    for key in new:
        policy.access(key)  # the session came back: its chain is protected, the old one on probation
    policy.remove(old[3])
    assert policy.victims(1, ()) == [old[2]]
    single = LeafProbationPolicy()  # single-block chains never enter the lane: plain LRU
    for key in KEYS[:3]:
        single.insert(key)
    assert single.victims(3, ()) == KEYS[:3]


def test_probation_wins_on_sessions_that_come_back_in_turn_and_the_default_follows() -> None:
    # 8 users take turns in order, each session's context longer than its share of 300 blocks:
    # recency (leaf-first or not) evicts the session that returns next (LRU's loop), probation
    # keeps the oldest stored chains until their sessions come back.
    trace = sessions(80_000, seed=3, users=8, system_blocks=0, in_turn=True)
    ratios = {name: replay(trace, name, [300]).prefix_hit_ratio for name in ("leaf_lru", "leaf_probation")}
    policy = AdaptiveChainPolicy()
    ratios["default"] = replay(trace, "default", [300], make_policy=lambda: policy).prefix_hit_ratio
    assert ratios["leaf_probation"] > ratios["leaf_lru"] + 0.05, ratios
    assert ratios["default"] >= ratios["leaf_probation"] - 0.01, ratios
