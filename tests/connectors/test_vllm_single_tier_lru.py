"""The manager's batched path for one LRU memory tier (:mod:`kvtier.connectors.vllm.single_tier_lru`) against
the general path: the same vLLM call sequences, the same answers and the same index, pins, LRU order,
mirror, removal reports and counters.

Each case runs two managers over identical runtimes, one with the batched path and one without it
(``_fast = None``), through random sequences of vLLM's scheduler calls: stores completed later (as a
set, as vLLM passes them, or refused), loads of what lookups hit, touches, finished requests, resets.
Keys repeat within a call, overlap what is stored or in flight, and the tier is a few blocks, so
evictions, calls that only partly fit and calls nothing fits all happen.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.blocks import BlockKey
from kvtier.connectors.vllm import (
    EPOCH_BYTES,
    KeyCodec,
    KVTierOffloadManager,
    OffloadRuntime,
    kvtier_config_for_engine,
)
from kvtier.connectors.vllm.single_tier_lru import SingleTierLRU
from kvtier.errors import CacheClosed
from tests.connectors.test_vllm_unit import Harness, block_bytes, geometry

GROUPS = ((0, 32, 2), (3, 32, 2))  # two vLLM groups (ids 0 and 3): kvtier groups 0 and 1


def offload_key(n: int, group: int = 0) -> bytes:
    return n.to_bytes(32, "little") + GROUPS[group][0].to_bytes(4, "big")


def index_only_manager(tiers: list[dict[str, Any]], *, events: bool = True) -> KVTierOffloadManager:
    config = kvtier_config_for_engine({"tiers": tiers}, geometry(GROUPS))
    runtime = OffloadRuntime(config, KeyCodec([g for g, _, _ in GROUPS]), index_only=True)
    return KVTierOffloadManager(runtime, enable_events=events)


def lru_tier(blocks: int) -> list[dict[str, Any]]:
    return [{"type": "cpu", "capacity": blocks * 2 * BLOCK, "eviction": "lru"}]  # per group: `blocks`


BLOCK = block_bytes()


def _key(manager: KVTierOffloadManager, key: BlockKey) -> tuple[bool, bytes, int]:
    """A block key with its epoch tag replaced by whether it is the current one (the twins' epochs differ
    after a reset)."""
    return key.block_hash.startswith(manager._codec.epoch), key.block_hash[EPOCH_BYTES:], key.group_id


def state(manager: KVTierOffloadManager) -> dict[str, Any]:
    """Everything the two paths must agree on, epoch tags normalised."""
    core = manager.runtime.core
    index = manager.runtime.residency.tiers[0]
    stats = core.stats().tiers[0]

    def keyed(d: dict[BlockKey, Any]) -> dict[Any, Any]:
        return {_key(manager, k): v for k, v in d.items()}

    return {
        "entries": keyed(index.entries),
        "pins": keyed(index.pins),
        "order": {g: [_key(manager, k) for k in p._order] for g, p in index.policies.items()},  # type: ignore[attr-defined]
        "used": dict(index.used),
        "loadable": {k: _key(manager, v) for k, v in manager._loadable.items()},
        "storing": dict(manager._storing),
        "counts": (stats.stores, stats.failed_stores, stats.evictions),
        "counters": manager.counters,
    }


def plan_view(manager: KVTierOffloadManager, planned: tuple[list[bytes], Any] | None) -> Any:
    if planned is None:
        return None
    chosen, spec = planned
    plan = spec.plan
    return (chosen, [_key(manager, k) for k in spec.keys], spec.placed, None if plan is None else (
        [[_key(manager, k) for k in drops] for drops in plan.drops], plan.writes, plan.demotions))


class Twins:
    """Two managers fed the same calls: ``fast`` with the batched path, ``general`` without it."""

    def __init__(self, fast: KVTierOffloadManager, general: KVTierOffloadManager) -> None:
        assert fast._fast is not None
        general._fast = None
        self.fast, self.general = fast, general

    def both(self, call: str, *args: Any, **kw: Any) -> Any:
        answers = []
        for manager in (self.fast, self.general):
            answer = getattr(manager, call)(*args, **kw)
            if call == "plan_store":
                self.planned(manager, answer)
                answer = plan_view(manager, answer)
            elif call == "prepare_load":
                answer = ([_key(manager, k) for k in answer.keys], answer.sources)
            answers.append(answer)
        assert answers[0] == answers[1], call
        assert self.fast.take_removed() == self.general.take_removed()
        assert state(self.fast) == state(self.general)
        # chain hints: the batched path stores none (LRU with one tier reads none), and drops those of
        # the blocks it evicts
        index = self.fast.runtime.residency.tiers[0]
        assert index.links.keys() <= index.entries.keys() and index.positions.keys() <= index.links.keys()
        return answers[0]

    def planned(self, manager: KVTierOffloadManager, planned: tuple[list[bytes], Any] | None) -> None:
        """A store was planned (the workers in other processes run it; nothing to do here)."""

    def close(self) -> None:
        for manager in (self.fast, self.general):
            manager.runtime.close()


keys_of_one_group = st.builds(lambda g, ns: [(n, g) for n in ns], st.integers(0, 1),
                              st.lists(st.integers(0, 11), max_size=4, unique=True))
store_keys = st.one_of(keys_of_one_group, keys_of_one_group,  # vLLM stores one group's chain, no key twice
                       st.lists(st.tuples(st.integers(0, 11), st.integers(0, 1)), max_size=7))
op = st.one_of(
    st.tuples(st.just("store"), st.integers(0, 5), store_keys, st.booleans()),  # True: completed now
    st.tuples(st.just("store"), st.integers(0, 5), store_keys, st.booleans()),
    st.tuples(st.just("complete_store"), st.integers(0, 3), st.sampled_from(["set", "list", "refused"])),
    st.tuples(st.just("complete_store"), st.integers(0, 3), st.sampled_from(["set", "list"])),
    st.tuples(st.just("load"), st.integers(0, 5),
              st.lists(st.tuples(st.integers(0, 11), st.integers(0, 1)), min_size=1, max_size=6)),
    st.tuples(st.just("complete_load"), st.integers(0, 3)),
    st.tuples(st.just("touch"), st.lists(st.tuples(st.integers(0, 11), st.integers(0, 1)), max_size=5)),
    st.tuples(st.just("finish"), st.integers(0, 5)),
    st.tuples(st.just("reset")),
)


def drive(twins: Twins, ops: Sequence[tuple[Any, ...]], *, placed: bool) -> None:
    stores: list[list[bytes]] = []  # prepared, not completed (placed: the workers' jobs in flight)
    loads: list[list[bytes]] = []
    for step in ops:
        kind = step[0]
        if kind == "store":
            ctx = SimpleNamespace(req_id=str(step[1]))
            planned = twins.both("plan_store", [offload_key(n, g) for n, g in step[2]], ctx)
            if planned is not None and planned[0]:
                if step[3]:
                    twins.both("complete_store", set(planned[0]))
                else:
                    stores.append(planned[0])
        elif kind == "complete_store" and stores:
            keys = stores.pop(step[1] % len(stores))
            if step[2] == "set":
                twins.both("complete_store", set(keys))
            else:
                twins.both("complete_store", keys[::-1], success=step[2] != "refused")
        elif kind == "load":
            ctx = SimpleNamespace(req_id=str(step[1]))
            keys = [offload_key(n, g) for n, g in dict.fromkeys(step[2])]
            hits = []
            for key in keys:  # vLLM loads the prefix its lookups hit
                if twins.both("lookup", key, ctx) != twins.fast._hit:
                    break
                hits.append(key)
            if hits:
                twins.both("prepare_load", hits, ctx)
                loads.append(hits)
        elif kind == "complete_load" and loads:
            twins.both("complete_load", set(loads.pop(step[1] % len(loads))))
        elif kind == "touch":
            twins.both("touch", [offload_key(n, g) for n, g in step[1]])
        elif kind == "finish":
            twins.both("on_request_finished", SimpleNamespace(req_id=str(step[1])))
        elif kind == "reset" and not placed:
            # in one process vLLM resets with no job in flight (its stale-job threshold drops them)
            if not stores and not loads:
                twins.both("reset_cache")
        elif kind == "reset":
            twins.both("reset_cache")
            stores.clear()  # vLLM never completes a job from before a reset
            loads.clear()
    while stores:
        twins.both("complete_store", set(stores.pop()))
    while loads:
        twins.both("complete_load", loads.pop())


@settings(max_examples=150, deadline=None)
@given(blocks=st.integers(1, 6), ops=st.lists(op, max_size=40))
def test_batched_path_equals_the_general_path_with_workers_in_other_processes(
        blocks: int, ops: list[tuple[Any, ...]]) -> None:
    twins = Twins(index_only_manager(lru_tier(blocks)), index_only_manager(lru_tier(blocks)))
    try:
        drive(twins, ops, placed=True)
    finally:
        twins.close()


def replay(twins: Twins, requests: Sequence[tuple[int, list[int]]]) -> None:
    """vLLM's connector per request (bench_vllm_manager.py's sequence): lookups until the first miss, a
    load of the hits, a store of the rest completed at once, the request finished."""
    for r, (group, numbers) in enumerate(requests):
        ctx = SimpleNamespace(req_id=str(r))
        keys = [offload_key(n, group) for n in numbers]
        hits = 0
        while hits < len(keys) and twins.both("lookup", keys[hits], ctx) == twins.fast._hit:
            hits += 1
        if hits:
            twins.both("prepare_load", keys[:hits], ctx)
            twins.both("complete_load", set(keys[:hits]), ctx)
        if hits < len(keys):
            planned = twins.both("plan_store", keys[hits:], ctx)
            if planned is not None:
                twins.both("complete_store", set(planned[0]), ctx)
        twins.both("on_request_finished", ctx)


@settings(max_examples=100, deadline=None)
@given(blocks=st.integers(1, 6), requests=st.lists(
    st.tuples(st.integers(0, 1), st.lists(st.integers(0, 15), min_size=1, max_size=6, unique=True)),
    max_size=30))
def test_batched_path_equals_the_general_path_on_request_sequences(
        blocks: int, requests: list[tuple[int, list[int]]]) -> None:
    twins = Twins(index_only_manager(lru_tier(blocks)), index_only_manager(lru_tier(blocks)))
    try:
        replay(twins, requests)
    finally:
        twins.close()


class HarnessTwins(Twins):
    """The same, with the worker in this process executing each plan on a real CPU tier."""

    def __init__(self, blocks: int) -> None:
        self.harnesses = [Harness(lru_tier(blocks), groups=GROUPS, enable_events=True) for _ in range(2)]
        super().__init__(self.harnesses[0].manager, self.harnesses[1].manager)

    def planned(self, manager: KVTierOffloadManager, planned: tuple[list[bytes], Any] | None) -> None:
        """The worker runs the plan now (vLLM completes the job later)."""
        if planned is not None and planned[0]:
            spec = planned[1]
            rows = [manager.runtime.empty_rows(k.group_id, 1)[0] for k in spec.keys]
            manager.runtime.store(spec.plan, spec.keys, rows).result()

    def close(self) -> None:
        for h in self.harnesses:
            h.close()


@settings(max_examples=60, deadline=None)
@given(blocks=st.integers(1, 6), ops=st.lists(op, max_size=30))
def test_batched_path_equals_the_general_path_with_the_worker_in_this_process(
        blocks: int, ops: list[tuple[Any, ...]]) -> None:
    twins = HarnessTwins(blocks)
    try:
        drive(twins, ops, placed=False)
    finally:
        twins.close()


def test_only_one_lru_memory_tier_that_admits_everything_takes_the_batched_path(tmp_path: Any) -> None:
    cases = {
        "lru": (lru_tier(4), True),
        "default eviction (adaptive)": ([{"type": "cpu", "capacity": 8 * BLOCK}], False),
        "arc": ([{"type": "cpu", "capacity": 8 * BLOCK, "eviction": "arc"}], False),
        "admission": ([{"type": "cpu", "capacity": 8 * BLOCK, "eviction": "lru",
                        "admission": "second_sighting"}], False),
        "two tiers": (lru_tier(4) + [{"type": "file", "path": str(tmp_path), "capacity": 8 * BLOCK,
                                      "eviction": "lru"}], False),
    }
    for name, (tiers, batched) in cases.items():
        manager = index_only_manager(tiers)
        try:
            assert (manager._fast is not None) is batched, name
        finally:
            manager.runtime.close()


def test_batched_path_refuses_what_the_general_path_must_decide() -> None:
    manager = index_only_manager(lru_tier(2))
    fast = manager._fast
    assert isinstance(fast, SingleTierLRU)
    try:
        a, b, c = offload_key(1), offload_key(2), offload_key(3)
        assert fast.plan([a, a]) is None  # repeated
        assert fast.plan([a, offload_key(2, group=1)]) is None  # two groups
        assert fast.plan([b"\0" * 70 + (0).to_bytes(4, "big")]) is None  # a hash kvtier would refuse
        assert fast.plan([b"x" * 32 + (9).to_bytes(4, "big")]) is None  # a group vLLM did not offload
        assert fast.plan([a, b, c]) is None  # more than the tier holds
        planned = fast.plan([a, b])
        assert planned is not None and planned[1].writes == [[0, 1]] and planned[1].drops == [[]]
        assert fast.plan([a]) is None  # already indexed (pending)
        assert fast.plan([c]) is None  # the two pending blocks are pinned: no room
        # and the general path gives the same answers to vLLM's calls
        assert manager.plan_store([c]) is None
        with pytest.raises(Exception, match="group 9"):
            manager.plan_store([b"x" * 32 + (9).to_bytes(4, "big")])
        manager.runtime.close()
        with pytest.raises(CacheClosed):
            fast.plan([c])
    finally:
        manager.runtime.close()


def test_a_touch_reorders_stored_blocks_and_leaves_pending_ones_where_they_are() -> None:
    twins = Twins(index_only_manager(lru_tier(4)), index_only_manager(lru_tier(4)))
    try:
        a, b, c = offload_key(1), offload_key(2), offload_key(3)
        twins.both("plan_store", [c], SimpleNamespace(req_id="r"))  # pending until completed
        for keys in ([a], [b]):
            twins.both("plan_store", keys, SimpleNamespace(req_id="r"))
            twins.both("complete_store", keys)

        def order() -> list[bytes]:
            policy = twins.fast.runtime.residency.tiers[0].policies[0]
            return [twins.fast._codec.offload_key(k) for k in policy._order]  # type: ignore[attr-defined]

        assert order() == [c, a, b]
        twins.both("touch", [a, c])  # the first most recently; c is pending: not moved
        assert order() == [c, b, a]
        twins.both("on_request_finished", SimpleNamespace(req_id="r"))  # used c, a, b: c first, pending
        assert order() == [c, b, a]
    finally:
        twins.close()
