"""TieredCache behaviour through the public API, over real CPU and file tiers."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import AsyncTieredCache, BlockKey, LayoutMismatch, TieredCache
from kvtier.tiers.base import Tier
from tests.helpers import SMALL_MODEL, make_keys, random_blocks, small_layout


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_store_lookup_load_round_trip(two_tier_config: dict[str, Any]) -> None:
    layout = small_layout()
    keys, blocks = make_keys(10), random_blocks(10, layout)
    with TieredCache.from_config(two_tier_config) as cache:
        assert cache.lookup(keys) == 0
        assert cache.store(keys, blocks) == 10
        assert cache.lookup(keys) == 10
        out = torch.empty_like(blocks)
        assert cache.load(keys, out) == 10
        assert same(out, blocks)
        stats = cache.stats()
        assert stats.loaded_blocks == 10
        assert sum(t.hits for t in stats.tiers) == 10


def test_lookup_counts_only_the_leading_run(two_tier_config: dict[str, Any]) -> None:
    layout = small_layout()
    keys = make_keys(6)
    with TieredCache.from_config(two_tier_config) as cache:
        cache.store(keys[:2] + keys[3:], random_blocks(5, layout))
        assert cache.lookup(keys) == 2
        out = torch.empty((6, *layout.shape), dtype=layout.dtype)
        assert cache.load(keys, out) == 2


def test_eviction_demotes_to_the_file_tier_and_hits_are_promoted(two_tier_config: dict[str, Any]) -> None:
    layout = small_layout()
    keys, blocks = make_keys(12), random_blocks(12, layout, seed=1)
    with TieredCache.from_config(two_tier_config) as cache:
        for i in range(12):  # one at a time: the CPU tier (4 blocks) evicts the oldest each time
            cache.store(keys[i:i + 1], blocks[i:i + 1])
        cpu, disk = cache.stats().tiers
        assert cpu.usage_bytes == 4 * layout.nbytes
        assert cpu.evictions == 8 and cpu.demotions_out == 8 and disk.stores == 8
        out = torch.empty((1, *layout.shape), dtype=layout.dtype)
        assert cache.load(keys[:1], out) == 1 and same(out[0], blocks[0])
        cpu, disk = cache.stats().tiers
        assert disk.hits == 1 and cpu.promotions_in == 1
        assert cache.core.residency.locate(keys[0]) == 0


def test_capacity_is_never_exceeded_and_everything_stored_stays_exact(
        two_tier_config: dict[str, Any]) -> None:
    layout = small_layout()
    keys, blocks = make_keys(40), random_blocks(40, layout, seed=2)
    with TieredCache.from_config(two_tier_config) as cache:
        for start in range(0, 40, 5):
            cache.store(keys[start:start + 5], blocks[start:start + 5])
            for tier, index in zip(cache.core.tiers, cache.core.residency.tiers, strict=True):
                assert index.usage() <= sum(tier.capacity_bytes.values())
                assert tier.usage_bytes() == index.usage()
        out = torch.empty((1, *layout.shape), dtype=layout.dtype)
        for i, key in enumerate(keys):
            if cache.load([key], out):
                assert same(out[0], blocks[i])


def test_pinned_blocks_survive_eviction_pressure(two_tier_config: dict[str, Any]) -> None:
    layout = small_layout()
    keys = make_keys(30)

    async def scenario() -> None:
        cache = AsyncTieredCache.from_config(two_tier_config)
        async with cache:
            await cache.store(keys[:4], random_blocks(4, layout))
            cpu = cache.residency.tiers[0]
            for key in keys[:4]:
                cpu.pin(key)  # as an in-flight load does
            await cache.store(keys[4:], random_blocks(26, layout, seed=3))
            assert all(cpu.is_ready(k) for k in keys[:4])
            assert all(not cpu.is_ready(k) for k in keys[4:])

    asyncio.run(scenario())


def test_write_through_writes_every_tier(two_tier_config: dict[str, Any]) -> None:
    layout = small_layout()
    two_tier_config["placement"] = {"write_mode": "write_through"}
    with TieredCache.from_config(two_tier_config) as cache:
        cache.store(make_keys(3), random_blocks(3, layout))
        cpu, disk = cache.stats().tiers
        assert cpu.stores == 3 and disk.stores == 3


def test_exclusive_promotion_moves_the_block(two_tier_config: dict[str, Any]) -> None:
    layout = small_layout()
    two_tier_config["placement"] = {"keep_lower_copy": False}
    keys, blocks = make_keys(6), random_blocks(6, layout)
    with TieredCache.from_config(two_tier_config) as cache:
        for i in range(6):
            cache.store(keys[i:i + 1], blocks[i:i + 1])
        out = torch.empty((1, *layout.shape), dtype=layout.dtype)
        assert cache.load(keys[:1], out) == 1 and same(out[0], blocks[0])
        file_index = cache.core.residency.tiers[1]
        assert keys[0] not in file_index


def test_file_tier_restart_keeps_a_warm_cache(two_tier_config: dict[str, Any]) -> None:
    layout = small_layout()
    keys, blocks = make_keys(8), random_blocks(8, layout, seed=4)
    with TieredCache.from_config(two_tier_config) as cache:
        for i in range(8):
            cache.store(keys[i:i + 1], blocks[i:i + 1])
    with TieredCache.from_config(two_tier_config) as cache:
        assert cache.lookup(keys[:4]) == 4  # the first four were demoted to files
        out = torch.empty((4, *layout.shape), dtype=layout.dtype)
        assert cache.load(keys[:4], out) == 4 and same(out, blocks[:4])


def test_bad_input_names_the_problem(two_tier_config: dict[str, Any]) -> None:
    layout = small_layout()
    with TieredCache.from_config(two_tier_config) as cache:
        with pytest.raises(LayoutMismatch, match="shape"):
            cache.store(make_keys(2), torch.zeros((2, 3, 4), dtype=layout.dtype))
        with pytest.raises(LayoutMismatch, match="dtype"):
            cache.store(make_keys(2), torch.zeros((2, *layout.shape), dtype=torch.float32))
        with pytest.raises(LayoutMismatch, match="group 7"):
            cache.store([BlockKey(b"k" * 16, 7)], random_blocks(1, layout))
        with pytest.raises(LayoutMismatch, match="3 blocks|first dimension"):
            cache.store(make_keys(2), random_blocks(3, layout))
        with pytest.raises(TypeError, match="BlockKey"):
            cache.lookup([b"not a key"])  # type: ignore[list-item]
        assert cache.lookup(make_keys(2)) == 0  # nothing half-stored


class BrokenTier(Tier):
    """A tier whose every call raises: the cache must turn that into misses."""

    kind = "broken"

    async def put(self, keys, blocks):  # type: ignore[no-untyped-def]
        raise OSError("device gone")

    async def get(self, keys, out):  # type: ignore[no-untyped-def]
        raise OSError("device gone")

    async def contains(self, keys):  # type: ignore[no-untyped-def]
        raise OSError("device gone")

    async def delete(self, keys):  # type: ignore[no-untyped-def]
        raise OSError("device gone")

    def keys(self):  # type: ignore[no-untyped-def]
        return iter(())

    def usage_bytes(self) -> int:
        return 0


def test_a_failing_tier_is_a_miss_never_an_exception() -> None:
    from kvtier.blocks import KVCacheSpec, KVGroup
    from kvtier.policy.admission import AdmitAll
    from kvtier.policy.placement import PlacementPolicy
    from kvtier.residency import Residency, TierIndex

    layout = small_layout()
    spec = KVCacheSpec(16, (KVGroup(0, 16, layout),), 1)
    tier = BrokenTier("broken", {0: layout}, {0: 8 * layout.nbytes})
    residency = Residency([TierIndex("broken", tier.capacity_bytes, {0: layout.nbytes})],
                          PlacementPolicy([AdmitAll()]))
    with TieredCache(AsyncTieredCache(spec, [tier], residency)) as cache:
        keys, blocks = make_keys(3), random_blocks(3, layout)
        assert cache.store(keys, blocks) == 0
        assert cache.lookup(keys) == 0
        assert tier.counters.errors == {"OSError": 1}


def test_submit_returns_futures(two_tier_config: dict[str, Any]) -> None:
    layout = small_layout()
    keys, blocks = make_keys(3), random_blocks(3, layout)
    with TieredCache.from_config(two_tier_config) as cache:
        assert cache.submit_store(keys, blocks).result(timeout=10) == 3
        out = torch.empty_like(blocks)
        assert cache.submit_load(keys, out).result(timeout=10) == 3 and same(out, blocks)


def test_multiple_groups_with_their_own_block_sizes(tmp_path: Path) -> None:
    cfg = {"model": {"name": "hybrid", "num_layers": 2, "num_kv_heads": 2, "head_dim": 32},
           "hash_block_size": 16,
           "groups": [{"block_size": 16}, {"block_size": 32, "name": "sliding_window"}],
           "tiers": [{"type": "cpu", "capacity": "1MiB"},
                     {"type": "file", "path": str(tmp_path), "capacity": "4MiB"}]}
    with TieredCache.from_config(cfg) as cache:
        spec = cache.spec
        hashes = [i.to_bytes(16, "little") for i in range(8)]
        keys = spec.block_keys(hashes)
        assert len(keys[0]) == 8 and len(keys[1]) == 4
        for g in spec.groups:
            blocks = random_blocks(len(keys[g.group_id]), g.layout, seed=g.group_id)
            assert cache.store(keys[g.group_id], blocks) == len(blocks)
            out = torch.empty_like(blocks)
            assert cache.load(keys[g.group_id], out) == len(blocks) and same(out, blocks)


# --- leases: pins taken on the caller's thread (docs/architecture.md#leases) --------------------------------
def test_lease_pins_the_top_most_ready_copy_until_release(two_tier_config: dict[str, Any]) -> None:
    layout = small_layout()
    two_tier_config["placement"] = {"write_mode": "write_through"}
    keys, blocks = make_keys(3), random_blocks(3, layout)
    with TieredCache.from_config(two_tier_config) as cache:
        cache.store(keys[:2], blocks[:2])
        cpu, disk = cache.core.residency.tiers
        where = cache.lease(keys)
        assert where == [0, 0, None]  # the third key is nowhere: nothing pinned for it
        assert cpu.pins == {keys[0]: 1, keys[1]: 1} and not disk.pins
        assert cache.lease(keys[:1], tiers=[1]) == [1]  # only the tiers asked for
        assert disk.pins == {keys[0]: 1}
        cache.release(keys, where)
        cache.release(keys[:1], [1])
        assert not cpu.pins and not disk.pins


def test_leased_blocks_are_never_evicted_or_overwritten(two_tier_config: dict[str, Any]) -> None:
    layout = small_layout()
    keys, blocks = make_keys(30), random_blocks(30, layout, seed=5)
    with TieredCache.from_config(two_tier_config) as cache:
        cache.store(keys[:4], blocks[:4])
        where = cache.lease(keys[:4])
        assert where == [0] * 4
        for i in range(4, 30):  # a full CPU tier of leased blocks: every store goes below it
            cache.store(keys[i:i + 1], blocks[i:i + 1])
        cache.store(keys[:4], random_blocks(4, layout, seed=6))  # the same keys again: only touched
        cpu = cache.core.residency.tiers[0]
        assert all(cpu.is_ready(k) for k in keys[:4])
        out = torch.empty((4, *layout.shape), dtype=layout.dtype)
        cache.read_leased(keys[:4], where, out)
        assert same(out, blocks[:4])
        cache.release(keys[:4], where)
        cache.store(keys[4:8], blocks[4:8])  # released: now they can go
        assert not any(cpu.is_ready(k) for k in keys[:4])


def test_read_leased_counts_hits_and_refuses_an_unleased_block(two_tier_config: dict[str, Any]) -> None:
    layout = small_layout()
    keys, blocks = make_keys(2), random_blocks(2, layout)
    with TieredCache.from_config(two_tier_config) as cache:
        cache.store(keys, blocks)
        out = torch.empty((1, *layout.shape), dtype=layout.dtype)
        with pytest.raises(ValueError, match="not leased"):
            cache.read_leased(keys[:1], [0], out)
        where = cache.lease(keys)
        cache.read_leased(keys[1:], where[1:], out)
        cache.release(keys, where)
        assert same(out[0], blocks[1])
        stats = cache.stats()
        assert stats.tiers[0].hits == 1 and stats.loaded_blocks == 1


def test_leases_from_many_threads_hold_under_concurrent_stores_and_loads(
        two_tier_config: dict[str, Any]) -> None:
    layout = small_layout()
    block = layout.nbytes
    two_tier_config["tiers"][0]["capacity"] = 8 * block
    two_tier_config["tiers"][1]["capacity"] = 24 * block
    keys, blocks = make_keys(40), random_blocks(40, layout, seed=7)
    errors: list[BaseException] = []
    leased_blocks = [0]
    done = threading.Event()

    def leaser(seed: int, cache: TieredCache) -> None:
        rng = random.Random(seed)
        indexes = cache.core.residency.tiers
        try:
            while not done.is_set():
                picked = rng.sample(range(40), 4)
                chosen = [keys[i] for i in picked]
                where = cache.lease(chosen, tiers=[0])
                held = [(i, key, t) for i, key, t in zip(picked, chosen, where, strict=True) if t is not None]
                time.sleep(0.001)  # stores and evictions run meanwhile
                for _, key, t in held:
                    assert indexes[t].is_ready(key) and key in indexes[t].pins
                if held:
                    out = torch.empty((len(held), *layout.shape), dtype=layout.dtype)
                    cache.read_leased([k for _, k, _ in held], [t for _, _, t in held], out)
                    for row, (i, _, _) in enumerate(held):
                        assert same(out[row], blocks[i]), f"leased block {i} changed under its lease"
                    leased_blocks[0] += len(held)
                cache.release(chosen, where)
        except BaseException as exc:  # surfaced by the main thread
            errors.append(exc)

    with TieredCache.from_config(two_tier_config) as cache:
        threads = [threading.Thread(target=leaser, args=(seed, cache)) for seed in range(3)]
        for thread in threads:
            thread.start()
        rng = random.Random(0)
        out = torch.empty((1, *layout.shape), dtype=layout.dtype)
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and not errors:
            i = rng.randrange(40)
            if rng.random() < 0.6:
                cache.store(keys[i:i + 1], blocks[i:i + 1])
            elif cache.load(keys[i:i + 1], out) == 1:  # a hit below is promoted: more churn
                assert same(out[0], blocks[i])
        done.set()
        for thread in threads:
            thread.join(timeout=10)
        assert not errors, errors[0]
        assert leased_blocks[0] > 0
        for tier, index in zip(cache.core.tiers, cache.core.residency.tiers, strict=True):
            assert not index.pins
            assert tier.usage_bytes() == index.usage()


# --- watchers ---------------------------------------------------------------------------------------------
class Recorder:
    """A ResidencyWatcher that writes down what it hears."""

    def __init__(self) -> None:
        self.changed: list[BlockKey] = []
        self.removed: list[BlockKey] = []

    def residency_changed(self, keys: Sequence[BlockKey]) -> None:
        self.changed.extend(keys)

    def blocks_removed(self, keys: Sequence[BlockKey]) -> None:
        self.removed.extend(keys)


def test_watchers_hear_of_changes_and_of_blocks_that_left_every_tier(tmp_path: Path) -> None:
    layout = small_layout()
    block = layout.nbytes
    config = {"model": dict(SMALL_MODEL), "hash_block_size": 16,
              "tiers": [{"type": "cpu", "capacity": 2 * block},
                        {"type": "file", "path": str(tmp_path), "capacity": 2 * block}]}
    keys, blocks = make_keys(6), random_blocks(6, layout)
    with TieredCache.from_config(config) as cache:
        cache.store(keys[:1], blocks[:1])
        recorder = Recorder()
        cache.add_watcher(recorder)
        assert recorder.changed == keys[:1]  # what is indexed already, once
        for i in range(1, 4):
            cache.store(keys[i:i + 1], blocks[i:i + 1])
        assert recorder.removed == []  # evicted from memory but demoted: still cached
        assert set(keys[:4]) <= set(recorder.changed)
        for i in range(4, 6):
            cache.store(keys[i:i + 1], blocks[i:i + 1])
        assert recorder.removed == keys[:2]  # pushed out of the bottom tier: gone
        assert [cache.core.residency.locate(k) for k in keys[:2]] == [None, None]


def test_a_lost_block_is_reported_removed(tmp_path: Path) -> None:
    layout = small_layout()
    config = {"model": dict(SMALL_MODEL), "hash_block_size": 16,
              "tiers": [{"type": "file", "path": str(tmp_path), "capacity": "1MiB"}]}
    keys, blocks = make_keys(2), random_blocks(2, layout)
    with TieredCache.from_config(config) as cache:
        cache.store(keys, blocks)
        recorder = Recorder()
        cache.add_watcher(recorder)
        cache.core.tiers[0].path_of(keys[1]).unlink()  # type: ignore[attr-defined]
        out = torch.empty((2, *layout.shape), dtype=layout.dtype)
        assert cache.load(keys, out) == 1
        assert recorder.removed == keys[1:]


def test_clear_empties_the_chosen_tiers_but_keeps_pinned_blocks(two_tier_config: dict[str, Any]) -> None:
    layout = small_layout()
    keys, blocks = make_keys(3), random_blocks(3, layout, seed=4)
    two_tier_config = {**two_tier_config, "placement": {"write_mode": "write_through"}}
    with TieredCache.from_config(two_tier_config) as cache:
        assert cache.store(keys, blocks) == 3
        assert cache.lease(keys[:1], [0]) == [0]  # a read in flight pins the first block
        assert sorted(cache.clear([0])) == sorted(keys[1:])
        assert cache.stats().tiers[0].usage_bytes == layout.nbytes
        out = torch.empty((3, *layout.shape), dtype=layout.dtype)
        cache.read_leased(keys[:1], [0], out[:1])
        cache.release(keys[:1], [0])
        assert same(out[0], blocks[0])
        assert cache.load(keys, out) == 3 and same(out, blocks)  # the file tier still holds every block


def _cpu_only_config(blocks: int) -> dict[str, Any]:
    return {"model": dict(SMALL_MODEL), "hash_block_size": 16,
            "tiers": [{"type": "cpu", "capacity": blocks * small_layout().nbytes}]}


def test_execute_now_runs_a_cpu_plan_on_the_callers_thread_bit_exact() -> None:
    layout = small_layout()
    keys, blocks = make_keys(6), random_blocks(6, layout, seed=11)
    rows = [block.contiguous().view(torch.uint8).view(-1) for block in blocks]
    with TieredCache.from_config(_cpu_only_config(4)) as cache:
        core = cache.core
        removed: list[BlockKey] = []
        core.add_watcher(type("W", (), {"residency_changed": lambda self, k: None,
                                         "blocks_removed": lambda self, k: removed.extend(k)})())
        plan = core.plan_store(keys[:4])
        assert cache.lookup(keys[:4]) == 0  # planned, not executed: pending, invisible
        assert core.execute_now(plan, keys[:4], rows[:3] + [None]) == 3  # the fourth's bytes never came
        assert cache.lookup(keys[:4]) == 3 and cache.stats().stored_blocks == 3
        plan = core.plan_store(keys[4:])  # two evictions, reported by the plan
        assert len(removed) == 1  # one free slot (the failed write's), one victim
        assert core.execute_now(plan, keys[4:], rows[4:]) == 2
        out = torch.empty((2, *layout.shape), dtype=layout.dtype)
        assert cache.load(keys[4:], out) == 2 and same(out, blocks[4:])
        with pytest.raises(LayoutMismatch, match=r"rows\[0\] must be a contiguous"):
            core.execute_now(core.plan_store(keys[:1]), keys[:1], [blocks[0]])  # typed, not bytes


def test_execute_now_of_one_row_batch_tensor_is_bit_exact_and_names_a_wrong_one() -> None:
    layout = small_layout()
    keys, blocks = make_keys(6), random_blocks(6, layout, seed=12)
    batch = blocks.view(torch.uint8).reshape(6, -1)
    with TieredCache.from_config(_cpu_only_config(4)) as cache:
        core = cache.core
        assert cache.store(keys[1:2], blocks[1:2]) == 1
        plan = core.plan_store(keys[:3])  # keys[1] is cached: the plan writes keys 0 and 2 (not a run)
        assert core.execute_now(plan, keys[:3], batch[:3]) == 2
        assert cache.lookup(keys[:3]) == 3
        plan = core.plan_store(keys[3:])  # room for one, two victims (the oldest)
        assert core.execute_now(plan, keys[3:], batch[3:]) == 3
        out = torch.empty((3, *layout.shape), dtype=layout.dtype)
        assert cache.load(keys[3:], out) == 3 and same(out, blocks[3:])
        assert cache.stats().stored_blocks == 1 + 2 + 3
        with pytest.raises(LayoutMismatch, match=r"rows\[0\] must be a contiguous"):
            core.execute_now(core.plan_store(keys[:2]), keys[:2], batch[:2, :100])
        with pytest.raises(LayoutMismatch, match="2 keys but 3 rows"):
            core.execute_now(core.plan_store(keys[:2]), keys[:2], batch[:3])


def test_read_leased_into_one_tensor_copies_each_block_from_its_slot() -> None:
    layout = small_layout()
    keys, blocks = make_keys(5), random_blocks(5, layout, seed=13)
    with TieredCache.from_config(_cpu_only_config(5)) as cache:
        assert cache.store(keys, blocks) == 5
        order = [3, 0, 4, 1]  # slots out of step: no row run
        where = cache.lease([keys[i] for i in order])
        assert where == [0] * 4
        out = torch.empty((4, *layout.shape), dtype=layout.dtype)
        cache.read_leased([keys[i] for i in order], where, out)
        cache.release([keys[i] for i in order], where)
        assert same(out, blocks[order])
        assert cache.stats().tiers[0].hits == 4


def test_a_read_straight_from_the_slots_counts_each_block_once() -> None:
    """``read_leased_with`` (an engine copying out of the CPU tier's slots itself) counts what
    ``read_leased`` counts: each block read once, in the tier's counters and in its hits."""
    layout = small_layout()
    keys, blocks = make_keys(4), random_blocks(4, layout, seed=14)
    with TieredCache.from_config(_cpu_only_config(4)) as cache:
        assert cache.store(keys, blocks) == 4
        counters = cache.core.tiers[0].counters
        got: list[torch.Tensor] = []
        where = cache.lease(keys)
        assert cache.core.read_leased_with(keys, where, lambda slab, slots: got.append(slab[slots].clone()))
        cache.release(keys, where)
        assert counters.blocks_read == 4 and counters.bytes_read == 4 * layout.nbytes
        assert same(got[0].view(layout.dtype).view(4, *layout.shape), blocks)
        out = torch.empty((4, *layout.shape), dtype=layout.dtype)
        where = cache.lease(keys)
        cache.read_leased(keys, where, out)
        cache.release(keys, where)
        assert counters.blocks_read == 8 and counters.bytes_read == 8 * layout.nbytes
        assert cache.stats().tiers[0].hits == 8


@settings(max_examples=30, deadline=None)
@given(order=st.permutations(range(5)), count=st.integers(1, 5))
def test_read_leased_into_raw_rows_equals_the_typed_read(order: list[int], count: int) -> None:
    """An engine's ``[n, nbytes]`` uint8 load buffer is filled with each key's bytes, as a typed tensor is;
    a key not leased is refused before anything is copied."""
    layout = small_layout()
    keys, blocks = make_keys(5), random_blocks(5, layout, seed=17)
    chosen = [keys[i] for i in order[:count]]
    with TieredCache.from_config(_cpu_only_config(5)) as cache:
        assert cache.store(keys, blocks) == 5
        rows = torch.zeros((count, layout.nbytes), dtype=torch.uint8)
        with pytest.raises(ValueError, match="not leased"):
            cache.read_leased(chosen, [0] * count, rows)
        assert not rows.any()
        where = cache.lease(chosen)
        cache.read_leased(chosen, where, rows)
        typed = torch.empty((count, *layout.shape), dtype=layout.dtype)
        cache.read_leased(chosen, where, typed)
        cache.release(chosen, where)
        assert torch.equal(rows, typed.view(torch.uint8).view(count, -1))
        assert same(typed, blocks[order[:count]])
        stats = cache.stats()
        assert stats.tiers[0].hits == 2 * count and stats.tiers[0].bytes_read == 2 * count * layout.nbytes


def test_execute_now_declines_slow_tiers_and_refuses_after_close(two_tier_config: dict[str, Any]) -> None:
    from kvtier import CacheClosed

    layout = small_layout()
    keys, blocks = make_keys(1), random_blocks(1, layout)
    row = blocks[0].contiguous().view(torch.uint8).view(-1)
    with TieredCache.from_config(two_tier_config) as cache:  # a file tier: its calls wait on I/O
        plan = cache.core.plan_store(keys)
        assert cache.core.execute_now(plan, keys, [row]) is None
        assert cache._call(cache.core.execute(plan, keys, [blocks[0]])) == 1  # declined plans run on the loop
    cache = TieredCache.from_config(_cpu_only_config(2))
    plan = cache.core.plan_store(keys)
    cache.close()
    with pytest.raises(CacheClosed):
        cache.core.execute_now(plan, keys, [row])


@pytest.mark.parametrize("order", ["interleaved", "reversed"])
def test_load_into_one_tensor_from_two_cpu_tiers_in_any_order(order: str) -> None:
    """A CPU tier fills a caller's batch tensor in one call only where its rows are a run; any other
    mix of tiers must still land every block in its own row."""
    layout = small_layout()
    block = layout.nbytes
    config = {"model": dict(SMALL_MODEL), "hash_block_size": 16,
              "tiers": [{"type": "cpu", "name": "top", "capacity": 4 * block, "pinned": False},
                        {"type": "cpu", "name": "lower", "capacity": 16 * block, "pinned": False}],
              "placement": {"promote_on_hit": False}}
    keys, blocks = make_keys(8), random_blocks(8, layout, seed=11)
    with TieredCache.from_config(config) as cache:
        for i in range(8):  # the top tier keeps the last four, the first four are demoted
            assert cache.store(keys[i:i + 1], blocks[i:i + 1]) == 1
        top, lower = cache.stats().tiers
        assert top.demotions_out == 4 and lower.stores == 4
        picked = [0, 4, 1, 5, 2, 6, 3, 7] if order == "interleaved" else list(range(7, -1, -1))
        out = torch.zeros((8, *layout.shape), dtype=layout.dtype)
        assert cache.load([keys[i] for i in picked], out) == 8
        for row, i in enumerate(picked):
            assert same(out[row], blocks[i])


@settings(max_examples=40, deadline=None)
@given(slots=st.integers(1, 8), chained=st.booleans(),
       ops=st.lists(st.tuples(st.sampled_from(["store", "load"]), st.lists(st.integers(0, 15), max_size=10)),
                    max_size=12))
def test_a_batched_store_leaves_what_key_by_key_planning_and_per_block_copies_leave(
        slots: int, chained: bool, ops: list[tuple[str, list[int]]]) -> None:
    """A store of one tensor into a CPU tier (planned in one policy call, checked and copied as one batch)
    leaves the index, pins, eviction order and bytes that key-by-key planning with one buffer per block
    leaves, whatever the batch holds (repeats, cached keys, more keys than room); a load (located,
    pinned, unpinned and touched in one call each) leaves what those steps key by key leave."""
    layout = small_layout()
    keys, blocks = make_keys(16), random_blocks(16, layout, seed=3)

    async def run() -> None:
        batched = AsyncTieredCache.from_config(_cpu_only_config(slots))
        by_key = AsyncTieredCache.from_config(_cpu_only_config(slots))
        by_key.residency._plan_batch = lambda *args: False  # type: ignore[method-assign]
        # and a load's per-key steps one call per key (the batched cache takes each in one call)
        residency, index = by_key.residency, by_key.residency.tiers[0]
        residency.locate_all = lambda ks: [residency.locate(k) for k in ks]  # type: ignore[method-assign]
        residency.touch_all = lambda t, ks: [residency.touch(t, k) for k in ks]  # type: ignore[method-assign]
        index.pin_many = lambda ks: [index.pin(k) for k in ks]  # type: ignore[method-assign]
        index.unpin_many = lambda ks: [index.unpin(k) for k in ks]  # type: ignore[method-assign]
        for cache in (batched, by_key):
            await cache.start()
        try:
            for op, ns in ops:
                ks = [keys[n] for n in ns]
                preds = [keys[n - 1] if n else None for n in ns] if chained else None
                if op == "store":
                    got = await batched.store(ks, blocks[ns], predecessors=preds)
                    want = await by_key.store(ks, [blocks[n] for n in ns], predecessors=preds)
                else:
                    outs = [torch.zeros((len(ns), *layout.shape), dtype=layout.dtype) for _ in range(2)]
                    got = await batched.load(ks, outs[0])
                    want = await by_key.load(ks, list(outs[1].unbind(0)))
                    assert same(outs[0][:got], outs[1][:want])
                assert got == want
                counts = [(s.stored_blocks, s.loaded_blocks,
                           [(t.hits, t.misses, t.stores, t.failed_stores, t.evictions, t.blocks_written,
                             t.bytes_written, t.usage_bytes) for t in s.tiers])
                          for s in (batched.stats(), by_key.stats())]
                assert counts[0] == counts[1]
                one, other = batched.residency.tiers[0], by_key.residency.tiers[0]
                assert one.entries == other.entries and one.pins == other.pins and one.used == other.used
                assert one.links == other.links and one.positions == other.positions
                assert one.policies[0].victims(16, {}) == other.policies[0].victims(16, {})
                for key, n in zip(keys, range(16), strict=True):
                    if key in one.entries:
                        row = batched.tiers[0].views([key])[0]
                        assert torch.equal(row, by_key.tiers[0].views([key])[0])
                        assert torch.equal(row, blocks[n].view(torch.uint8).reshape(-1))
        finally:
            await batched.close()
            await by_key.close()

    asyncio.run(run())
