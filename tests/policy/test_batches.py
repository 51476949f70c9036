"""Batch calls (``store_new``, ``access_all``) do exactly what the per-key calls they stand for do.

Each policy may override them to save Python calls (the replay and the cache's store plans go
through them); the base class's versions are the per-key definition, so a policy run through its own
batches must end every step in the state the base versions leave, victims and all.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.blocks import BlockKey
from kvtier.policy import EVICTION_POLICIES, AdaptiveChainPolicy, EvictionPolicy, InsertHint
from kvtier.policy import make_eviction_policy as make
from kvtier.traces import Trace
from tests.helpers import make_keys
from tests.policy.workloads import chat, sessions, zipf

KEYS = make_keys(40)


def _step(policy: EvictionPolicy, batched: bool, op: tuple[str, list[int], list[int], int]) -> list[BlockKey]:
    """Apply one op; returns the victims a store evicted."""
    kind, ids, pinned_ids, free = op
    if kind == "access":
        keys = [KEYS[i] for i in ids]
        (policy.access_all if batched else lambda ks: EvictionPolicy.access_all(policy, ks))(keys)
        return []
    if kind == "remove":
        policy.remove(KEYS[ids[0]])
        return []
    keys = [k for k in dict.fromkeys(KEYS[i] for i in ids) if k not in policy]
    if kind == "store_unlinked":  # no chain links (a cache fed without hints)
        hints = [InsertHint(j) for j in range(len(keys))]
    else:
        hints = [InsertHint(j, -1, keys[j - 1] if j else KEYS[pinned_ids[0]] if pinned_ids else None)
                 for j in range(len(keys))]
    pinned = {*keys, *(KEYS[i] for i in pinned_ids)}
    store = policy.store_new if batched else lambda *a: EvictionPolicy.store_new(policy, *a)
    stored, victims = store(keys, hints, pinned, free)
    assert 0 <= stored <= len(keys) and not set(victims) & pinned
    return [*keys[:stored], *victims]


_Op = tuple[str, list[int], list[int], int]
_OP = st.tuples(st.sampled_from(["store", "store", "store_unlinked", "access", "remove"]),
                st.lists(st.integers(0, 39), min_size=1, max_size=10),
                st.lists(st.integers(0, 39), max_size=4), st.integers(0, 6))


@pytest.mark.parametrize("name", sorted(EVICTION_POLICIES))
@settings(max_examples=60, deadline=None)
@given(ops=st.lists(_OP, max_size=40))
def test_batches_do_what_per_key_calls_do(name: str, ops: list[_Op]) -> None:
    fast, slow = make(name), make(name)
    for op in ops:
        assert _step(fast, True, op) == _step(slow, False, op)
        assert len(fast) == len(slow)
        assert fast.victims(40, ()) == slow.victims(40, ())


def _drive(trace: Trace, policy: EvictionPolicy, capacity: int, batched: bool) -> list[BlockKey]:
    """A one-tier replay with every write settled at once; returns every victim, in order."""
    evicted: list[BlockKey] = []
    for keys, hints in zip(trace.requests, trace.chain_hints(), strict=True):
        k0 = 0
        while k0 < len(keys) and keys[k0] in policy:
            k0 += 1
        if batched:
            policy.access_all(keys[:k0])
        else:
            EvictionPolicy.access_all(policy, keys[:k0])
        rest = keys[k0:]
        if rest and len(set(rest)) == len(rest) and not any(k in policy for k in rest):
            store = policy.store_new if batched else lambda *a: EvictionPolicy.store_new(policy, *a)
            stored, victims = store(rest, hints[k0:], set(rest), capacity - len(policy))
            evicted.extend(victims)
        elif rest:
            for key, hint in zip(rest, hints[k0:], strict=True):
                if key in policy:
                    policy.access(key)
                    continue
                if len(policy) >= capacity:
                    victim = policy.victims(1, ())
                    policy.remove(victim[0])
                    evicted.append(victim[0])
                policy.insert(key, hint)
    return evicted


@pytest.mark.parametrize("trace,capacity", [(chat(30_000, seed=1), 600), (sessions(30_000, seed=1), 300),
                                            (zipf(5_000, 20_000, 0.9), 400),
                                            (sessions(30_000, seed=3, users=8, system_blocks=0, in_turn=True),
                                             300)],
                         ids=["chat", "sessions", "zipf", "sessions_in_turn"])
def test_the_default_batched_evicts_what_it_evicts_key_by_key(trace: Trace, capacity: int) -> None:
    """Long enough to refit the lifetimes many times (and learn them where the workload rewards it);
    sessions that come back in turn make the probation lane choose about half the victims."""
    fast, slow = AdaptiveChainPolicy(), AdaptiveChainPolicy()
    assert _drive(trace, fast, capacity, True) == _drive(trace, slow, capacity, False)
    assert fast.weights == slow.weights and fast.leader == slow.leader
    assert fast.victims(capacity, ()) == slow.victims(capacity, ())
    assert fast.probation.members == slow.probation.members
    assert fast.probation.fresh_roots == slow.probation.fresh_roots


@settings(max_examples=80, deadline=None)
@given(ops=st.lists(_OP, max_size=40))
def test_the_default_batched_matches_per_key_calls_when_ghost_slots_collide(ops: list[_Op]) -> None:
    """Ghosts in 8 slots: a stored key's slot is often a victim's, whose ghost it must (or must not)
    see as the per-key order has it; the learned statistics and the ghosts end equal too."""
    fast, slow = AdaptiveChainPolicy(), AdaptiveChainPolicy()
    for op in ops:
        for policy in (fast, slow):
            policy._slot_mask = 7
        assert _step(fast, True, op) == _step(slow, False, op)
        assert fast.victims(40, ()) == slow.victims(40, ())
        assert list(fast._table[:8]) == list(slow._table[:8])
        assert fast._refs == slow._refs and fast._hist == slow._hist
