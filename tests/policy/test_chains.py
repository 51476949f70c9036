"""Chains in a partition: leaf-first LRU against its brute-force reference, and bad chain data."""

from __future__ import annotations

from collections.abc import Container

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.blocks import BlockKey
from kvtier.policy import InsertHint, make_eviction_policy
from kvtier.policy.chains import ChainForest, LeafLRUPolicy
from tests.policy.references import RefLeafLRU

KEYS = [BlockKey(i.to_bytes(8, "little"), 0) for i in range(32)]

# A request is a chain: a start key and a length (key i's predecessor is key i - 1, as engines chain
# their hashes), or a key with another declared predecessor (bad data: itself, absent, a stranger).
# For the comparison with the reference, declared predecessors always have lower indexes (no cycle:
# the reference has no rule for them); `cyclic` allows any, for the tests that only check promises.
request = st.one_of(
    st.tuples(st.just("chain"), st.integers(0, 31), st.integers(1, 6)),
    st.tuples(st.just("odd"), st.integers(0, 31), st.integers(-1, 31)),
    st.tuples(st.just("drop"), st.integers(0, 31), st.just(0)),
    st.tuples(st.just("victims"), st.integers(0, 2 ** 32 - 1), st.integers(1, 5)),
)


def _chain(start: int, length: int) -> list[tuple[BlockKey, BlockKey | None]]:
    start = min(start, 32 - length)
    keys = [KEYS[start + j] for j in range(length)]
    return [(k, keys[j - 1] if j else None) for j, k in enumerate(keys)]


def _links(kind: str, a: int, b: int, cyclic: bool) -> list[tuple[BlockKey, BlockKey | None]]:
    if kind == "chain":
        return _chain(a, b)
    if b < 0 or (not cyclic and b > a):
        return [(KEYS[a], None)]
    return [(KEYS[a], KEYS[b])]


def drive_chains(policy: object, reference: RefLeafLRU | None, capacity: int,
                 steps: list[tuple[str, int, int]], cyclic: bool = False) -> None:
    """Replay-like driving: a request touches its cached blocks and stores the rest, the blocks
    being stored pinned while room is made; every victims answer must equal the reference's (or,
    without one, keep the interface's promises)."""
    if reference is None:
        reference = _Promises()
    resident: set[BlockKey] = set()
    for kind, a, b in steps:
        if kind in ("chain", "odd"):
            links = _links(kind, a, b, cyclic)
            pending: set[BlockKey] = set()
            for key, pred in links:
                if key in resident:
                    policy.access(key)  # type: ignore[attr-defined]
                    reference.access(key)
                    continue
                if len(resident) >= capacity:
                    got = policy.victims(1, pending)  # type: ignore[attr-defined]
                    assert got == reference.victims(1, pending)
                    if not got:
                        continue
                    policy.remove(got[0])  # type: ignore[attr-defined]
                    reference.remove(got[0])
                    resident.discard(got[0])
                hint = InsertHint(predecessor=pred)
                policy.insert(key, hint)  # type: ignore[attr-defined]
                reference.insert(key, hint)
                resident.add(key)
                pending.add(key)
        elif kind == "drop":
            policy.remove(KEYS[a])  # type: ignore[attr-defined]
            reference.remove(KEYS[a])
            resident.discard(KEYS[a])
        else:
            pinned = {k for i, k in enumerate(KEYS) if a >> i & 1}
            assert policy.victims(b, pinned) == reference.victims(b, pinned)  # type: ignore[attr-defined]
        assert len(policy) == len(resident)  # type: ignore[arg-type]


class _Promises(RefLeafLRU):
    """Stands in for the reference where its rules do not reach (cycles): any answer that keeps the
    interface's promises is right — resident, distinct, unpinned keys, as many as there are."""

    def victims(self, count: int, pinned: Container[BlockKey]) -> list[BlockKey]:
        return _AnyValid(set(self.time), pinned, count)  # type: ignore[return-value]


class _AnyValid:
    def __init__(self, resident: set[BlockKey], pinned: Container[BlockKey], count: int) -> None:
        self.free = {k for k in resident if k not in pinned}
        self.count = count

    def __eq__(self, got: object) -> bool:
        return (isinstance(got, list) and len(got) == len(set(got)) == min(self.count, len(self.free))
                and set(got) <= self.free)

    def __hash__(self) -> int:
        return 0


@settings(max_examples=150, deadline=None)
@given(st.lists(request, min_size=20, max_size=200), st.integers(2, 12))
def test_leaf_lru_matches_brute_force_reference(steps: list[tuple[str, int, int]], capacity: int) -> None:
    drive_chains(LeafLRUPolicy(), RefLeafLRU(), capacity, steps)


@settings(max_examples=100, deadline=None)
@given(st.lists(request, min_size=20, max_size=200), st.integers(2, 12),
       st.sampled_from(["leaf_lru", "adaptive"]))
def test_cycles_and_strangers_keep_every_promise(steps: list[tuple[str, int, int]], capacity: int,
                                                 name: str) -> None:
    drive_chains(make_eviction_policy(name), None, capacity, steps, cyclic=True)


def test_leaf_lru_evicts_a_chain_from_its_tail() -> None:
    policy = LeafLRUPolicy()
    for key, pred in _chain(0, 5):
        policy.insert(key, InsertHint(predecessor=pred))
    order = []
    while len(policy):
        (victim,) = policy.victims(1, set())
        order.append(victim)
        policy.remove(victim)
    assert order == list(reversed(KEYS[:5]))


def test_leaf_lru_sends_detached_successors_first_and_takes_them_back() -> None:
    policy = LeafLRUPolicy()
    for key, pred in _chain(0, 3) + _chain(10, 3):  # chains 0-1-2 (older) and 10-11-12
        policy.insert(key, InsertHint(predecessor=pred))
    policy.remove(KEYS[0])  # the head of the older chain left: 1 and 2 are useless here
    assert policy.victims(2, set()) == [KEYS[2], KEYS[12]]
    assert policy.victims(1, {KEYS[2]}) == [KEYS[12]]  # 1 is inner (2 continues it), so 12 is next
    policy.insert(KEYS[0])  # it came back: the chain is whole again, its tail the oldest leaf
    assert policy.victims(2, set()) == [KEYS[2], KEYS[12]]


def test_bad_predecessor_data_is_harmless() -> None:
    policy = make_eviction_policy("leaf_lru")
    a, b, c = KEYS[:3]
    policy.insert(a, InsertHint(predecessor=b))  # parent not resident: a root
    policy.insert(b, InsertHint(predecessor=a))  # a cycle a -> b -> a
    policy.insert(c, InsertHint(predecessor=c))  # names itself
    policy.insert(c, InsertHint(predecessor=a))  # again, with another parent: only an access
    assert sorted(policy.victims(3, set())) == sorted([a, b, c])
    for key in (a, b, c):
        policy.remove(key)
    policy.remove(a)  # twice: ignored
    assert len(policy) == 0 and policy.victims(1, set()) == []


def test_forest_walks_each_block_once_even_with_cycles() -> None:
    forest = ChainForest()
    resident = {KEYS[0], KEYS[1]}
    forest.children[KEYS[0]] = [KEYS[1]]
    forest.children[KEYS[1]] = [KEYS[0]]  # corrupt: a cycle in the child lists
    assert sorted(forest.subtree([KEYS[0]])) == sorted(resident)
