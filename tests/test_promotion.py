"""One promotion step: TieredCache and ``kvtier replay`` plan it with the same Residency call, so the
same requests leave the same blocks in the same tiers in both."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvtier import AsyncTieredCache, TieredCache
from kvtier.blocks import BlockKey, KVCacheSpec, KVGroup
from kvtier.layout import BlockLayout
from kvtier.policy import EvictionPolicy, InsertHint, make_eviction_policy
from kvtier.policy.admission import AdmitAll
from kvtier.policy.placement import PlacementPolicy
from kvtier.replay import chain_hints, replay
from kvtier.residency import READY, Residency, TierIndex
from kvtier.tiers.cpu import CpuTier
from kvtier.traces import Trace

LAYOUT = BlockLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4)
Residencies = list[list[set[BlockKey]]]  # per request, per tier: the keys it holds


def chains(requests: list[list[int]]) -> list[list[BlockKey]]:
    """Keys of prefix chains: block j of a request is named by the request's first j+1 ids."""
    names: dict[tuple[int, ...], BlockKey] = {}
    out = []
    for ids in requests:
        keys = []
        for j in range(len(ids)):
            prefix = tuple(ids[:j + 1])
            if prefix not in names:
                names[prefix] = BlockKey(len(names).to_bytes(16, "little"), 0)
            keys.append(names[prefix])
        out.append(keys)
    return out


def placement(num_tiers: int, rules: dict[str, Any]) -> PlacementPolicy:
    return PlacementPolicy([AdmitAll() for _ in range(num_tiers)], **rules)


def through_replay(requests: list[list[BlockKey]], policy: str, capacities: list[int],
                   rules: dict[str, Any]) -> Residencies:
    """Which tier holds which key after each request, replaying the first r+1 requests each time."""
    seen: Residencies = []
    for r in range(len(requests)):
        made: list[EvictionPolicy] = []

        def make(made: list[EvictionPolicy] = made) -> EvictionPolicy:
            made.append(make_eviction_policy(policy))
            return made[-1]

        head = requests[:r + 1]
        trace = Trace("t", "synthetic", LAYOUT.block_size, head, [len(k) * LAYOUT.block_size for k in head],
                      len({k for keys in head for k in keys}))
        replay(trace, policy, capacities, placement(len(capacities), rules), make_policy=make)
        universe = {k for keys in head for k in keys}
        seen.append([{k for k in universe if k in tier_policy} for tier_policy in made])
    return seen


def through_cache(requests: list[list[BlockKey]], policy: str, capacities: list[int],
                  rules: dict[str, Any]) -> Residencies:
    """The same requests as an engine drives the cache: load the leading cached blocks, store the rest."""
    spec = KVCacheSpec(LAYOUT.block_size, (KVGroup(0, LAYOUT.block_size, LAYOUT),), 1)
    size = {0: LAYOUT.nbytes}
    tiers = [CpuTier(f"cpu{t}", {0: LAYOUT}, {0: cap * LAYOUT.nbytes}, pinned=False)
             for t, cap in enumerate(capacities)]
    residency = Residency([TierIndex(tier.name, tier.capacity_bytes, size, policy) for tier in tiers],
                          placement(len(capacities), rules))
    seen: Residencies = []
    with TieredCache(AsyncTieredCache(spec, tiers, residency)) as cache:
        for keys in requests:
            n = len(keys)
            # a block's bytes name its key, so a load from any tier is checked against its key
            blocks = torch.stack([torch.full(LAYOUT.shape, float(int.from_bytes(k.block_hash, "little")),
                                             dtype=LAYOUT.dtype) for k in keys])
            out = torch.empty_like(blocks)
            k0 = cache.load(keys, out)
            assert torch.equal(out[:k0], blocks[:k0])
            if k0 < n:
                cache.store(keys[k0:], blocks[k0:], hints=chain_hints(keys, k0, n))
            seen.append([{k for k, state in index.entries.items() if state == READY}
                         for index in residency.tiers])
    return seen


requests_strategy = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=6), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# a chain promoted under leaf-first LRU: its blocks must keep their links in the top tier
@example(requests=[[0, 0, 0, 0], [0, 0, 0, 0, 0]], policy="leaf_lru", capacities=[2, 4],
         keep_lower_copy=False, promote_on_hit=True, write_mode="write_back", promote_to=0)
@given(requests=requests_strategy,
       policy=st.sampled_from(["lru", "leaf_lru", "adaptive", "arc", "sieve"]),
       capacities=st.sampled_from([[2, 4], [3, 3], [1, 2, 6], [2, 2, 3]]),
       keep_lower_copy=st.booleans(), promote_on_hit=st.booleans(),
       write_mode=st.sampled_from(["write_back", "write_through"]), promote_to=st.sampled_from([0, 1]))
def test_cache_and_replay_leave_the_same_blocks_in_the_same_tiers(
        requests: list[list[int]], policy: str, capacities: list[int], keep_lower_copy: bool,
        promote_on_hit: bool, write_mode: str, promote_to: int) -> None:
    promote_to = min(promote_to, len(capacities) - 2)
    rules = {"keep_lower_copy": keep_lower_copy, "promote_on_hit": promote_on_hit, "write_mode": write_mode,
             "promote_to": promote_to}
    keys = chains(requests)
    assert through_cache(keys, policy, capacities, rules) == through_replay(keys, policy, capacities, rules)


def test_a_worked_sequence_promotes_and_drops_the_lower_copy_in_both() -> None:
    # the second request pushes the first one's blocks down; the third reads them there, promotes them
    # (pushing the second one's down) and, caching exclusively, removes them from the tier below
    keys = chains([[0, 1], [5, 6], [0, 1]])
    rules = {"keep_lower_copy": False}
    cache = through_cache(keys, "lru", [2, 4], rules)
    assert cache == through_replay(keys, "lru", [2, 4], rules)
    (a, b), (e, f), _ = keys
    assert cache == [[{a, b}, set()], [{e, f}, {a, b}], [{a, b}, {e, f}]]


def test_the_cache_keeps_a_leased_lower_copy_when_it_promotes_exclusively() -> None:
    spec = KVCacheSpec(LAYOUT.block_size, (KVGroup(0, LAYOUT.block_size, LAYOUT),), 1)
    tiers = [CpuTier(f"cpu{t}", {0: LAYOUT}, {0: cap * LAYOUT.nbytes}, pinned=False)
             for t, cap in enumerate([2, 4])]
    indexes = [TierIndex(tier.name, tier.capacity_bytes, {0: LAYOUT.nbytes}, "lru") for tier in tiers]
    residency = Residency(indexes, placement(2, {"keep_lower_copy": False}))
    (a, b), (e, f) = chains([[0, 1], [5, 6]])
    blocks = torch.randn((4, *LAYOUT.shape)).to(LAYOUT.dtype)
    with TieredCache(AsyncTieredCache(spec, tiers, residency)) as cache:
        cache.store([a, b], blocks[:2])
        cache.store([e, f], blocks[2:])  # pushes a and b down
        where = cache.lease([b])  # another reader holds the lower copy of b
        assert where == [1]
        out = torch.empty_like(blocks[:2])
        assert cache.load([a, b], out) == 2 and torch.equal(out, blocks[:2])
        top, low = residency.tiers
        assert top.is_ready(a) and top.is_ready(b)
        assert a not in low and low.is_ready(b)  # a moved up; b's leased copy stays below
        cache.release([b], where)
        assert cache.stats().tiers[0].promotions_in == 2


def _two_tiers(keep_lower_copy: bool) -> Residency:
    size = {0: 1}
    return Residency([TierIndex("top", {0: 2}, size, "lru"), TierIndex("low", {0: 4}, size, "lru")],
                     placement(2, {"keep_lower_copy": keep_lower_copy}))


def test_exclusive_promotion_keeps_a_lower_copy_another_load_is_reading() -> None:
    residency = _two_tiers(keep_lower_copy=False)
    a, b = chains([[0, 1]])[0]
    low = residency.tiers[1]
    low.add(a, InsertHint(0), ready=True)
    low.add(b, InsertHint(1, -1, a), ready=True)
    low.pin(b)  # a concurrent load reads b from the lower tier
    promotion = residency.plan_promotion([a, b], [1, 1])
    assert promotion is not None and promotion.plan.writes[0] == [0, 1]
    for key in promotion.keys:
        residency.finish_write(0, key, True)
    assert residency.finish_promotion(promotion, [0, 1]) == {1: [a]}
    assert b in low and a not in low
    assert residency.tiers[0].hint(b).predecessor == a  # the chain link travels up with the block


def test_promotion_plans_nothing_when_placement_says_no() -> None:
    residency = _two_tiers(keep_lower_copy=True)
    a, b = chains([[0, 1]])[0]
    assert residency.plan_promotion([a, b], [0, 0]) is None  # both already on top
    residency.tiers[1].add(a, InsertHint(0), ready=True)
    promotion = residency.plan_promotion([a], [1])
    assert promotion is not None and promotion.sources == [1] and promotion.target == 0
    residency.finish_write(0, a, True)
    assert residency.finish_promotion(promotion, [0]) == {}  # inclusive: the lower copy stays
    assert a in residency.tiers[1] and residency.tiers[0].is_ready(a)
