"""SlotAllocator: the free list and slot map the CPU and GPU tiers share, against a plain model."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.blocks import BlockKey
from kvtier.tiers.slots import SlotAllocator


def key(n: int, group: int = 0) -> BlockKey:
    return BlockKey(n.to_bytes(4, "little"), group)


def test_assign_reuses_a_key_slot_refuses_when_full_and_frees_on_release() -> None:
    slots = SlotAllocator({0: 2, 1: 1})
    assert (slots.assign(key(1)), slots.assign(key(2))) == (0, 1)
    assert slots.assign(key(1)) == 0          # a stored key keeps its slot
    assert slots.assign(key(3)) is None       # group 0 is full ...
    assert slots.assign(key(3, 1)) == 0       # ... group 1 is not
    assert slots.release(key(1)) == 0 and slots.release(key(1)) is None
    assert slots.assign(key(3)) == 0          # the freed slot is handed out again
    assert sorted(slots.keys()) == sorted([key(2), key(3), key(3, 1)])
    assert (slots.used(0), slots.capacity(0), slots.used(1)) == (2, 2, 1)
    assert key(2) in slots and key(1) not in slots and "not a key" not in slots
    assert slots.problems() == []


def test_unknown_group_and_empty_group_hold_nothing() -> None:
    slots = SlotAllocator({0: 0})
    assert slots.assign(key(1)) is None and slots.assign(key(1, 9)) is None
    assert slots.slot(key(1, 9)) is None and slots.release(key(1, 9)) is None
    assert (slots.capacity(9), slots.used(9)) == (0, 0)
    with pytest.raises(ValueError, match="group 4"):
        SlotAllocator({4: -1})


def test_keys_is_a_snapshot() -> None:
    slots = SlotAllocator({0: 4})
    for n in range(4):
        slots.assign(key(n))
    for k in slots.keys():
        slots.release(k)
    assert list(slots.keys()) == [] and slots.problems() == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 9), st.integers(0, 1)), max_size=80),
       st.integers(0, 4), st.integers(0, 4))
def test_matches_a_model_and_never_shares_or_loses_a_slot(ops: list[tuple[bool, int, int]], cap0: int,
                                                          cap1: int) -> None:
    capacity = {0: cap0, 1: cap1}
    slots = SlotAllocator(capacity)
    model: dict[BlockKey, int] = {}
    for store, n, group in ops:
        k = key(n, group)
        if store:
            slot = slots.assign(k)
            held = sum(1 for m in model if m.group_id == group)
            if k in model:
                assert slot == model[k]
            elif held < capacity[group]:
                assert slot is not None and 0 <= slot < capacity[group]
                assert slot not in {s for m, s in model.items() if m.group_id == group}
                model[k] = slot
            else:
                assert slot is None
        else:
            assert slots.release(k) == model.pop(k, None)
        assert slots.problems() == []
    assert {k: slots.slot(k) for k in slots.keys()} == model
    assert [slots.used(g) for g in (0, 1)] == [sum(1 for m in model if m.group_id == g) for g in (0, 1)]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["assign", "release", "slots"]),
                          st.lists(st.integers(0, 9), max_size=6), st.integers(0, 2)), max_size=30),
       st.integers(0, 5))
def test_batch_calls_equal_one_call_per_key(ops: list[tuple[str, list[int], int]], cap: int) -> None:
    """assign_many / slots_of / release_many give what assign / slot / release give key by key (group 2
    is unknown: no slots)."""
    batched, single = SlotAllocator({0: cap, 1: cap}), SlotAllocator({0: cap, 1: cap})
    for op, ns, group in ops:
        keys = [key(n, group) for n in ns]
        if op == "assign":
            assert batched.assign_many(group, keys) == [single.assign(k) for k in keys]
        elif op == "slots":
            assert batched.slots_of(group, keys) == [single.slot(k) for k in keys]
        else:
            batched.release_many(keys)
            for k in keys:
                single.release(k)
        assert {k: batched.slot(k) for k in batched.keys()} == {k: single.slot(k) for k in single.keys()}
        assert batched.problems() == []
