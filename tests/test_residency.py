"""Residency plans: room-making, demotion cascades, admission, pins — metadata only."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.policy import EVICTION_POLICIES, InsertHint
from kvtier.policy.admission import AdmitAll, SecondSighting
from kvtier.policy.placement import PlacementPolicy
from kvtier.residency import Plan, Residency, TierIndex
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


class _AdmitAllKeyByKey(AdmitAll):
    """Admits all like AdmitAll, but is not AdmitAll itself: the residency plans such a tier key by key."""


class _NoFullMemo(Residency):
    """Asks the policy for victims every time, as if no partition had been found full during a plan."""

    def _make_room(self, t: int, group_id: int, plan: Plan) -> bool:
        self._full.clear()
        return super()._make_room(t, group_id, plan)


_OPS = st.lists(st.tuples(st.sampled_from(["store", "pin", "unpin", "touch", "settle"]),
                          st.lists(st.integers(0, 30), min_size=1, max_size=8)), max_size=40)


def _run_side_by_side(a: Residency, b: Residency, ops: list[tuple[str, list[int]]], group_size: int,
                      chained: bool) -> None:
    """Apply ``ops`` to both residencies; plans, indexes and eviction orders must agree after each."""
    keys = make_keys(31)
    pending: list[tuple[object, list]] = []
    for op, ids in ops:
        chosen = [keys[i] for i in ids][:group_size]
        hints = ([InsertHint(j, -1, chosen[j - 1] if j else keys[ids[0] - 1] if ids[0] else None)
                  for j in range(len(chosen))] if chained else None)
        for r in (a, b):
            top = r.tiers[0]
            if op == "store":
                plan = r.plan_store(chosen, hints)
                pending.append((plan, chosen))
            elif op == "pin":
                top.pin(chosen[0])
            elif op == "unpin":
                top.unpin(chosen[0])
            elif op == "touch" and chosen[0] in top.entries:
                r.touch(0, chosen[0])
        if op == "store":
            (plan_a, _), (plan_b, _) = pending[-2], pending[-1]
            assert plan_a.writes == plan_b.writes and plan_a.drops == plan_b.drops  # type: ignore[attr-defined]
            assert plan_a.demotions == plan_b.demotions  # type: ignore[attr-defined]
            assert plan_a.skipped == plan_b.skipped  # type: ignore[attr-defined]
        if op == "settle" and pending:
            for r, (plan, stored) in zip((a, b), pending[:2], strict=True):
                settle(r, plan, stored)
            del pending[:2]
        for x, y in zip(a.tiers, b.tiers, strict=True):
            assert x.entries == y.entries and x.pins == y.pins and x.used == y.used
            assert x.links == y.links and x.positions == y.positions
            assert list(x.policies[0].victims(31, ())) == list(y.policies[0].victims(31, ()))


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(EVICTION_POLICIES)), st.integers(1, 12), st.integers(1, 6), st.booleans(), _OPS)
def test_one_pass_store_plans_what_key_by_key_plans(policy: str, slots: int, group_size: int, chained: bool,
                                                    ops: list[tuple[str, list[int]]]) -> None:
    """A single tier plans a store of new keys in one policy call (``store_new``): plans, index and
    eviction order are the key-by-key ones, for every policy, with and without chain hints."""
    one_pass = Residency([TierIndex("t0", {0: slots * 10 + 5}, {0: 10}, policy)],
                         PlacementPolicy([AdmitAll()]))
    by_key = _NoFullMemo([TierIndex("t0", {0: slots * 10 + 5}, {0: 10}, policy)],
                         PlacementPolicy([_AdmitAllKeyByKey()]))
    _run_side_by_side(one_pass, by_key, ops, group_size, chained)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(EVICTION_POLICIES)), st.integers(1, 4), st.integers(1, 6),
       st.sampled_from(["write_back", "write_through"]), st.booleans(), _OPS)
def test_a_full_partition_is_not_asked_again_within_a_plan(policy: str, slots: int, group_size: int,
                                                           write_mode: str, chained: bool,
                                                           ops: list[tuple[str, list[int]]]) -> None:
    """Once a partition cannot make room, the rest of the plan skips it without a victim walk: the same
    plans as asking every time, in two tiers, both write modes."""
    def make(kind: type[Residency]) -> Residency:
        tiers = [TierIndex(f"t{t}", {0: (slots + 2 * t) * 10}, {0: 10}, policy) for t in range(2)]
        return kind(tiers, PlacementPolicy([_AdmitAllKeyByKey(), _AdmitAllKeyByKey()], write_mode=write_mode))

    _run_side_by_side(make(Residency), make(_NoFullMemo), ops, group_size, chained)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "pin", "settle_ok", "settle_fail"]),
                          st.lists(st.integers(0, 7), max_size=6)), max_size=25))
def test_settle_many_equals_settle_of_each_key(ops: list[tuple[str, list[int]]]) -> None:
    """TierIndex.settle_many (whose usual batch takes a path without Python per key) leaves what one
    settle per key leaves: entries, pins, bytes used and the policy's order."""
    from kvtier.blocks import BlockKey

    def key(n: int) -> BlockKey:
        return BlockKey(n.to_bytes(4, "little"), 0)

    batched, single = (TierIndex(f"t{i}", {0: 1000}, {0: 10}, "lru") for i in range(2))
    for op, ns in ops:
        keys = [key(n) for n in ns]
        if op == "add":
            for index in (batched, single):
                for k in keys:
                    if k not in index.entries:
                        index.add(k, InsertHint(), ready=False)
        elif op == "pin":
            for index in (batched, single):
                for k in keys:
                    index.pin(k)
        else:
            ok = op == "settle_ok"
            batched.settle_many(keys, ok)
            for k in keys:
                single.settle(k, ok)
        assert batched.entries == single.entries
        assert batched.pins == single.pins
        assert batched.used == single.used
        assert batched.policies[0].victims(8, {}) == single.policies[0].victims(8, {})


def test_a_demoted_block_keeps_its_chain_link_and_position_and_no_hint_object_stays() -> None:
    """Chained blocks demoted from a one-block top tier arrive below with their predecessor and chain
    position; a block stored without a predecessor keeps none; the index holds keys and ints, not
    the InsertHint objects (no object per cached block for Python's garbage collector)."""
    import gc

    r = residency(1, 8, write_mode="write_back")
    keys = make_keys(4)
    hints = [InsertHint(position=0)] + [InsertHint(position=i, request_id=7, predecessor=keys[i - 1])
                                         for i in range(1, 4)]
    for key, hint in zip(keys, hints, strict=True):
        settle(r, r.plan_store([key], [hint]), [key])
    top, below = r.tiers
    assert [r.locate(k) for k in keys] == [1, 1, 1, 0]
    assert below.hint(keys[0]) == InsertHint()
    for i in (1, 2):
        assert below.hint(keys[i]) == InsertHint(position=i, predecessor=keys[i - 1])  # no request_id
    assert top.hint(keys[3]) == InsertHint(position=3, predecessor=keys[2])
    del hints, hint
    gc.collect()
    assert not any(isinstance(o, InsertHint) and o.predecessor in keys for o in gc.get_objects())
    below.discard(keys[2])
    assert keys[2] not in below.links and keys[2] not in below.positions
