"""The replay's one-tier hot loop against the generic one, and the trace's shared insert hints.

``kvtier replay`` inlines lookup, touch and settle for a single tier; these tests drive the same
:class:`~kvtier.residency.Residency` step by step (locate_prefix, touch, plan_store, finish_write),
as the cache does, and require the same hits, writes and evictions for several policies.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.blocks import BlockKey
from kvtier.policy import make_eviction_policy
from kvtier.policy.admission import AdmitAll
from kvtier.policy.placement import PlacementPolicy
from kvtier.replay import READY, chain_hints, replay
from kvtier.residency import Residency, TierIndex
from kvtier.traces import Trace
from tests.policy.workloads import chat, sessions


def reference(trace: Trace, policy: str, capacity: int) -> tuple[int, int, int, int]:
    """(block hits, prefix-hit tokens, blocks written, blocks evicted), request by request."""
    index = TierIndex("tier0", {0: capacity}, {0: 1}, policies={0: make_eviction_policy(policy)})
    residency = Residency([index], PlacementPolicy([AdmitAll()]))
    hits = tokens = written = evicted = 0
    for r, keys in enumerate(trace.requests):
        found = residency.locate_prefix(keys)
        k0 = len(found)
        for j in range(k0):
            residency.touch(found[j], keys[j])
        if k0:
            tokens += k0 * trace.block_tokens if k0 < len(keys) else trace.tokens[r]
        hits += k0
        if k0 < len(keys):
            hits += sum(1 for key in keys[k0 + 1:] if index.entries.get(key) == READY)
            rest = keys[k0:]
            plan = residency.plan_store(rest, chain_hints(keys, k0, len(keys)))
            evicted += len(plan.drops[0])
            written += len(plan.writes[0])
            for i in plan.writes[0]:
                residency.finish_write(0, rest[i], True)
    return hits, tokens, written, evicted


def random_trace(seed: int, requests: int) -> Trace:
    """Requests that share prefixes, repeat blocks inside a request, and some empty ones."""
    rnd = random.Random(seed)
    keys = [BlockKey(i.to_bytes(8, "little"), 0) for i in range(50)]
    out: list[list[BlockKey]] = []
    for _ in range(requests):
        base = rnd.randrange(4) * 10
        out.append([keys[base + rnd.randrange(12) if rnd.random() < 0.1 else base + j]
                    for j in range(rnd.randrange(0, 9))])
    tokens = [max(0, 16 * len(r) - rnd.randrange(16)) for r in out]  # a partial last block
    return Trace("random", "synthetic", 16, out, tokens, len({k for r in out for k in r}))


@pytest.mark.parametrize("policy", ["lru", "leaf_lru", "adaptive", "arc", "lifetime"])
def test_one_tier_loop_matches_the_residency_steps(policy: str) -> None:
    for trace, capacity in ((chat(6000, seed=3), 300), (sessions(6000, seed=4, users=6), 150)):
        result = replay(trace, policy, [capacity])
        tier = result.tiers[0]
        assert (result.block_hits, result.prefix_hit_tokens, tier.written, tier.evicted) == \
            reference(trace, policy, capacity)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), capacity=st.integers(1, 12), policy=st.sampled_from(["lru", "adaptive"]))
def test_one_tier_loop_on_random_requests(seed: int, capacity: int, policy: str) -> None:
    trace = random_trace(seed, 60)
    result = replay(trace, policy, [capacity])
    assert (result.block_hits, result.prefix_hit_tokens, result.tiers[0].written,
            result.tiers[0].evicted) == reference(trace, policy, capacity)


def test_trace_hints_are_the_chain_hints_and_shared() -> None:
    trace = sessions(3000, seed=1)
    hints = trace.chain_hints()
    assert hints is trace.chain_hints()  # built once
    for keys, row in zip(trace.requests, hints, strict=True):
        assert row == chain_hints(keys, 0, len(keys))
    distinct = {id(h) for row in hints for h in row}
    assert len(distinct) < trace.references  # one object per (position, predecessor), not per reference
