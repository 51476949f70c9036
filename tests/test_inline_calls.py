"""TieredCache's calls on the caller's thread: a load served whole by a top CPU tier, and a store into
CPU tiers only, run there instead of on the loop thread (``AsyncTieredCache.load_now``/``store_now``).

They must be indistinguishable from the loop's ``load``/``store`` in everything but the thread: same
results, bytes, counters and residency; same errors; and never ahead of a call handed to the loop
before them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import threading
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import AsyncTieredCache, BlockKey, CacheClosed, LayoutMismatch, TieredCache
from tests.helpers import SMALL_MODEL, make_keys, random_blocks, small_layout

_COUNTED = ("hits", "misses", "stores", "failed_stores", "evictions", "demotions_out", "promotions_in",
            "corrupt_or_lost", "blocks_read", "blocks_written", "bytes_read", "bytes_written", "usage_bytes")


def _cpu_tiers(sizes: tuple[int, ...], *, eviction: str = "default", write_mode: str = "write_back",
               promote_on_hit: bool = True) -> dict[str, Any]:
    block = small_layout().nbytes
    return {"model": dict(SMALL_MODEL), "hash_block_size": 16,
            "tiers": [{"type": "cpu", "name": f"cpu{t}", "capacity": n * block, "eviction": eviction}
                      for t, n in enumerate(sizes)],
            "placement": {"write_mode": write_mode, "promote_on_hit": promote_on_hit}}


def _counts(stats: Any) -> tuple[Any, ...]:
    return ((stats.lookups, stats.lookup_blocks, stats.lookup_hit_blocks, stats.loads, stats.load_blocks,
             stats.loaded_blocks, stats.stored_blocks),
            tuple(tuple(getattr(tier, name) for name in _COUNTED) for tier in stats.tiers))


def _resident(core: AsyncTieredCache) -> list[set[BlockKey]]:
    return [set(tier.keys()) for tier in core.tiers]


_steps = st.lists(st.tuples(st.sampled_from(["store", "load", "lookup"]), st.integers(0, 11),
                            st.integers(1, 5)), min_size=1, max_size=25)


@settings(max_examples=40, deadline=None)
@given(steps=_steps, sizes=st.sampled_from([(4,), (3, 5), (2, 3, 6)]),
       eviction=st.sampled_from(["default", "lru"]),
       write_mode=st.sampled_from(["write_back", "write_through"]), promote=st.booleans())
def test_calls_on_the_callers_thread_equal_the_loops(steps: list[tuple[str, int, int]],
                                                      sizes: tuple[int, ...], eviction: str, write_mode: str,
                                                      promote: bool) -> None:
    """The same script through ``TieredCache`` (on the caller's thread where it can) and through
    ``AsyncTieredCache`` awaited on an event loop ends in the same results, bytes, counters and residency."""
    layout = small_layout()
    keys, blocks = make_keys(16), random_blocks(16, layout, seed=5)
    config = _cpu_tiers(sizes, eviction=eviction, write_mode=write_mode, promote_on_hit=promote)
    loop = asyncio.new_event_loop()
    reference = AsyncTieredCache.from_config(config)
    loop.run_until_complete(reference.start())
    try:
        with TieredCache.from_config(config) as cache:
            for op, start, count in steps:
                chosen = keys[start:start + count]
                predecessors = [keys[i - 1] if i else None for i in range(start, start + len(chosen))]
                if op == "store":
                    got = cache.store(chosen, blocks[start:start + count], predecessors=predecessors)
                    want = loop.run_until_complete(
                        reference.store(chosen, blocks[start:start + count], predecessors=predecessors))
                    assert got == want
                elif op == "load":
                    out = torch.zeros((len(chosen), *layout.shape), dtype=layout.dtype)
                    ref_out = torch.zeros_like(out)
                    got = cache.load(chosen, out)
                    assert got == loop.run_until_complete(reference.load(chosen, ref_out))
                    want_bytes = blocks[start:start + got].view(torch.uint8)
                    assert torch.equal(out[:got].view(torch.uint8), want_bytes)
                    assert torch.equal(out[:got], ref_out[:got])
                else:
                    assert cache.lookup(chosen) == loop.run_until_complete(reference.lookup(chosen))
                assert _resident(cache.core) == _resident(reference)
            assert _counts(cache.stats()) == _counts(reference.stats())
    finally:
        loop.run_until_complete(reference.close())
        loop.close()


def test_a_cpu_hit_and_a_cpu_store_are_done_when_submitted() -> None:
    """No hop to the loop: the futures are done on return, and the store's watcher hears of it on the
    caller's thread."""
    layout = small_layout()
    keys, blocks = make_keys(4), random_blocks(4, layout, seed=6)
    heard: list[int] = []
    with TieredCache.from_config(_cpu_tiers((8,))) as cache:
        on_change = {"residency_changed": lambda self, k: heard.append(threading.get_ident()),
                     "blocks_removed": lambda self, k: None}
        cache.add_watcher(type("W", (), on_change)())
        stored = cache.submit_store(keys, blocks)
        assert stored.done() and stored.result() == 4
        assert heard and set(heard) == {threading.get_ident()}
        out = torch.zeros_like(blocks)
        loaded = cache.submit_load(keys, out)
        assert loaded.done() and loaded.result() == 4 and torch.equal(out, blocks)


def test_a_load_that_needs_a_lower_tier_goes_to_the_loop_and_promotes() -> None:
    layout = small_layout()
    keys, blocks = make_keys(6), random_blocks(6, layout, seed=7)
    with TieredCache.from_config(_cpu_tiers((2, 6), eviction="lru")) as cache:
        for i in range(0, 6, 2):  # keys 0-3 demoted to the second tier
            assert cache.store(keys[i:i + 2], blocks[i:i + 2]) == 2
        assert [cache.core.residency.locate(k) for k in keys[:2]] == [1, 1]
        out = torch.zeros((2, *layout.shape), dtype=layout.dtype)
        assert cache.load(keys[:2], out) == 2 and torch.equal(out, blocks[:2])
        assert [cache.core.residency.locate(k) for k in keys[:2]] == [0, 0]  # promoted
        assert cache.stats().tiers[1].hits == 2 and cache.stats().tiers[0].promotions_in == 2


def test_a_call_never_overtakes_one_queued_on_the_loop() -> None:
    """A load handed to the loop (its blocks sit in the lower tier) is not overtaken by a store that
    could run on the caller's thread: the store, whose room-making evicts those very blocks from the
    lower tier, queues behind it, so the load still finds them."""
    layout = small_layout()
    keys, blocks = make_keys(10), random_blocks(10, layout, seed=8)
    with TieredCache.from_config(_cpu_tiers((2, 4), eviction="lru")) as cache:
        for i in range(0, 6, 2):  # keys 0-3 demoted to the second tier, 4-5 on top
            assert cache.store(keys[i:i + 2], blocks[i:i + 2]) == 2
        out = torch.zeros((2, *layout.shape), dtype=layout.dtype)
        loaded = cache.submit_load(keys[:2], out)  # needs the loop: a lower-tier hit, promoted
        stored = cache.submit_store(keys[6:10], blocks[6:10])  # would evict keys 0-1 if it ran first
        assert loaded.result(timeout=10) == 2 and torch.equal(out, blocks[:2])
        assert stored.result(timeout=10) == 4
        assert cache.stats().tiers[1].hits == 2


def test_a_store_submitted_behind_a_queued_call_is_seen_by_the_next_load() -> None:
    layout = small_layout()
    keys, blocks = make_keys(3), random_blocks(3, layout, seed=8)
    with TieredCache.from_config(_cpu_tiers((4,))) as cache:
        first = cache.submit_load(keys, torch.zeros_like(blocks))  # a miss: handed to the loop
        stored = cache.submit_store(keys, blocks)
        out = torch.zeros_like(blocks)
        loaded = cache.submit_load(keys, out)
        assert first.result(timeout=10) == 0
        assert stored.result(timeout=10) == 3
        assert loaded.result(timeout=10) == 3 and torch.equal(out, blocks)


def test_bad_input_raises_from_the_call_and_from_the_future() -> None:
    layout = small_layout()
    keys, blocks = make_keys(2), random_blocks(2, layout, seed=9)
    with TieredCache.from_config(_cpu_tiers((4,))) as cache:
        assert cache.store(keys, blocks) == 2
        wrong = torch.zeros((2, 3), dtype=layout.dtype)
        with pytest.raises(LayoutMismatch, match="out"):
            cache.load(keys, wrong)
        with pytest.raises(LayoutMismatch, match="blocks"):
            cache.store(make_keys(2, start=10), wrong)
        future = cache.submit_load(keys, wrong)
        with pytest.raises(LayoutMismatch, match="out"):
            future.result(timeout=10)
        future = cache.submit_store(make_keys(2, start=10), wrong)
        with pytest.raises(LayoutMismatch, match="blocks"):
            future.result(timeout=10)
        with pytest.raises(TypeError, match="BlockKey"):
            cache.load(["not a key"], blocks[:1])  # type: ignore[list-item]
        assert cache.stats().stored_blocks == 2  # nothing half-stored
    with pytest.raises(CacheClosed):
        cache.load(keys, torch.zeros_like(blocks))
    with pytest.raises(CacheClosed):
        cache.submit_store(keys, blocks)


def test_a_store_written_through_two_cpu_tiers_counts_each_block_once() -> None:
    layout = small_layout()
    keys, blocks = make_keys(3), random_blocks(3, layout, seed=10)
    with TieredCache.from_config(_cpu_tiers((4, 4), write_mode="write_through")) as cache:
        assert cache.store(keys, blocks) == 3
        assert [set(t.keys()) for t in cache.core.tiers] == [set(keys), set(keys)]
        plan = cache.core.plan_store(make_keys(2, start=5))
        assert cache.core.execute_now(plan, make_keys(2, start=5), random_blocks(2, layout).view(torch.uint8)
                                      .view(2, -1)) == 2
        assert cache.stats().stored_blocks == 5


def test_calls_from_many_threads_stay_exact() -> None:
    """Several threads storing and loading overlapping keys: every load returns the stored bytes."""
    layout = small_layout()
    keys, blocks = make_keys(24), random_blocks(24, layout, seed=11)
    with TieredCache.from_config(_cpu_tiers((10, 30))) as cache:
        def work(seed: int) -> None:
            rng = random.Random(seed)
            for _ in range(150):
                start, count = rng.randrange(24), rng.randrange(1, 5)
                chosen = keys[start:start + count]
                if rng.random() < 0.5:
                    cache.store(chosen, blocks[start:start + count])
                else:
                    out = torch.zeros((len(chosen), *layout.shape), dtype=layout.dtype)
                    got = cache.submit_load(chosen, out).result(timeout=10)
                    assert torch.equal(out[:got].view(torch.uint8),
                                       blocks[start:start + got].view(torch.uint8))

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            for done in [pool.submit(work, seed) for seed in range(4)]:
                done.result(timeout=60)


def _side_call(call: Any) -> Any:
    """Run ``call`` on another thread and return its result; fails if it is still waiting after 10 s
    (it would wait for as long as the calling thread holds the cache's index lock)."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    threading.Thread(target=lambda: future.set_result(call()), daemon=True).start()
    return future.result(timeout=10)


def test_other_threads_look_up_and_load_while_a_store_copies() -> None:
    """A store on the caller's thread copies with the index lock released: another thread's lookup and
    load finish while the copy is under way, and see the store's blocks only once they are written."""
    layout = small_layout()
    hot, hot_blocks = make_keys(2), random_blocks(2, layout, seed=12)
    new, new_blocks = make_keys(3, start=10), random_blocks(3, layout, seed=13)
    rows = new_blocks.view(torch.uint8).view(3, -1)
    with TieredCache.from_config(_cpu_tiers((8,))) as cache:
        assert cache.store(hot, hot_blocks) == 2
        seen: dict[str, Any] = {}

        def fill(slab: torch.Tensor, slots: list[int], idx: list[int] | None) -> None:
            out = torch.zeros_like(hot_blocks)
            seen["hot"] = _side_call(lambda: (cache.lookup(hot), cache.load(hot, out)))
            seen["hot_bytes"] = torch.equal(out, hot_blocks)
            seen["new"] = _side_call(lambda: cache.lookup(new))
            for slot, i in zip(slots, idx if idx is not None else range(3), strict=True):
                slab[slot].copy_(rows[i])

        plan = cache.core.plan_store(new)
        assert cache.core.execute_with(plan, new, fill) == 3
        assert seen == {"hot": (2, 2), "hot_bytes": True, "new": 0}  # pending writes are invisible
        out = torch.zeros_like(new_blocks)
        assert cache.lookup(new) == 3 and cache.load(new, out) == 3
        assert torch.equal(out, new_blocks)


def test_a_failed_fill_frees_its_slots_and_stores_nothing() -> None:
    layout = small_layout()
    keys, blocks = make_keys(3), random_blocks(3, layout, seed=14)
    with TieredCache.from_config(_cpu_tiers((4,))) as cache:
        tier = cache.core.tiers[0]

        def broken(slab: torch.Tensor, slots: list[int], idx: list[int] | None) -> None:
            raise RuntimeError("the engine's copy failed")

        assert cache.core.execute_with(cache.core.plan_store(keys), keys, broken) == 0
        assert cache.lookup(keys) == 0 and set(tier.keys()) == set()
        assert tier._slots.problems() == []

        def wrong(slab: torch.Tensor, slots: list[int], idx: list[int] | None) -> None:
            raise LayoutMismatch("rows of the wrong size")

        with pytest.raises(LayoutMismatch, match="wrong size"):  # a caller's fault is raised, after settling
            cache.core.execute_with(cache.core.plan_store(keys), keys, wrong)
        assert cache.lookup(keys) == 0 and tier._slots.problems() == []
        stats = cache.stats().tiers[0]
        assert (stats.stores, stats.failed_stores, stats.errors) == (0, 6, {"RuntimeError": 1})
        assert cache.store(keys, blocks) == 3  # nothing was left pending
        out = torch.zeros_like(blocks)
        assert cache.load(keys, out) == 3 and torch.equal(out, blocks)


def test_an_interrupted_fill_leaves_no_key_pending_and_no_slot_taken() -> None:
    """A KeyboardInterrupt in a caller's copy (written through to two tiers) propagates after the
    writes are settled: the other tier's write is not filled, every slot is free again and the keys
    can be stored and loaded at once (nothing left PENDING, close() does not wait)."""
    layout = small_layout()
    keys, blocks = make_keys(3), random_blocks(3, layout, seed=16)
    with TieredCache.from_config(_cpu_tiers((4, 4), write_mode="write_through")) as cache:
        calls: list[int] = []

        def interrupted(slab: torch.Tensor, slots: list[int], idx: list[int] | None) -> None:
            calls.append(len(slots))
            raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            cache.core.execute_with(cache.core.plan_store(keys), keys, interrupted)
        assert calls == [3]  # the second tier's write never ran
        assert cache.lookup(keys) == 0
        for tier in cache.core.tiers:
            assert set(tier.keys()) == set() and tier._slots.problems() == []
        assert cache.store(keys, blocks) == 3
        out = torch.zeros_like(blocks)
        assert cache.load(keys, out) == 3 and torch.equal(out, blocks)
        assert [set(tier.keys()) for tier in cache.core.tiers] == [set(keys), set(keys)]


def test_close_waits_for_a_store_that_is_copying() -> None:
    """close() from another thread does not release the tier's memory under a copy in progress."""
    layout = small_layout()
    keys, blocks = make_keys(2), random_blocks(2, layout, seed=15)
    rows = blocks.view(torch.uint8).view(2, -1)
    cache = TieredCache.from_config(_cpu_tiers((4,)))
    closing = threading.Thread(target=cache.close)

    def fill(slab: torch.Tensor, slots: list[int], idx: list[int] | None) -> None:
        closing.start()
        closing.join(timeout=0.3)
        assert closing.is_alive()  # close() waits for this copy
        for slot, i in zip(slots, idx if idx is not None else range(2), strict=True):
            slab[slot].copy_(rows[i])

    assert cache.core.execute_with(cache.core.plan_store(keys), keys, fill) == 2
    closing.join(timeout=10)
    assert not closing.is_alive() and cache.closed
