"""Residency plans: room-making, demotion cascades, admission, pins — metadata only."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.policy.admission import AdmitAll, SecondSighting
from kvtier.policy.placement import PlacementPolicy
from kvtier.residency import Residency, TierIndex
from tests.helpers import make_keys


def residency(*blocks: int, write_mode: str = "write_back", admission: list | None = None) -> Residency:
    tiers = [TierIndex(f"t{i}", {0: n * 10}, {0: 10}) for i, n in enumerate(blocks)]
    adm = admission or [AdmitAll() for _ in blocks]
    return Residency(tiers, PlacementPolicy(adm, write_mode=write_mode))  # type: ignore[arg-type]


def settle(r: Residency, plan, keys) -> None:  # type: ignore[no-untyped-def]
    for t, moves in enumerate(plan.demotions):
        for key, dst in moves:
            r.finish_demotion(t, dst, key, True)
    for t, idx in enumerate(plan.writes):
        for i in idx:
            r.finish_write(t, keys[i], True)


def test_eviction_cascades_bottom_up() -> None:
    r = residency(1, 1)
    keys = make_keys(3)
    for i in range(3):
        plan = r.plan_store(keys[i:i + 1])
        settle(r, plan, keys[i:i + 1])
    # third store: t0 evicts k1 → demoted to t1, which drops k0
    assert r.locate(keys[2]) == 0 and r.locate(keys[1]) == 1 and r.locate(keys[0]) is None


def test_pending_blocks_are_invisible_and_unevictable() -> None:
    r = residency(2)
    keys = make_keys(3)
    plan = r.plan_store(keys[:2])
    assert r.locate(keys[0]) is None
    plan2 = r.plan_store(keys[2:])
    assert plan2.writes == [[]]  # nothing could be evicted: both slots pending
    settle(r, plan, keys[:2])
    assert r.locate_prefix(keys) == [0, 0]


def test_second_sighting_admission_skips_one_hit_blocks() -> None:
    r = residency(1, 4, admission=[AdmitAll(), SecondSighting(16)])
    keys = make_keys(3)
    for key in keys:
        settle(r, r.plan_store([key]), [key])
    assert r.locate(keys[0]) is None  # first demotion offer only recorded the key


def test_write_through_lands_everywhere() -> None:
    r = residency(2, 2, write_mode="write_through")
    keys = make_keys(1)
    plan = r.plan_store(keys)
    assert plan.writes == [[0], [0]]


@settings(max_examples=50)
@given(ops=st.lists(st.tuples(st.integers(0, 15), st.booleans()), max_size=60))
def test_usage_never_exceeds_capacity(ops: list[tuple[int, bool]]) -> None:
    r = residency(3, 5)
    keys = make_keys(16)
    for k, fail in ops:
        plan = r.plan_store([keys[k]])
        for t, moves in enumerate(plan.demotions):
            for key, dst in moves:
                r.finish_demotion(t, dst, key, not fail)
        for t, idx in enumerate(plan.writes):
            if idx:
                r.finish_write(t, keys[k], not fail)
        for index in r.tiers:
            assert index.usage() <= index.capacity[0]
            assert index.usage() == 10 * len(index.entries)
            assert len(index.policies[0]) == len(index.entries)
        assert not any(index.pins for index in r.tiers)
