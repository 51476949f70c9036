"""CpuTier: slab slots, zero-copy views, batched copies, per-group capacity."""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import LayoutMismatch
from kvtier.tiers.base import TierCounters
from kvtier.tiers.buffers import PAGE, strided_rows
from kvtier.tiers.cpu import CpuTier
from tests.helpers import make_keys, random_blocks, small_layout


def rows(blocks: torch.Tensor) -> list[torch.Tensor]:
    return list(blocks.view(torch.uint8).reshape(blocks.shape[0], -1))


def test_put_get_round_trip_batched_and_single() -> None:
    layout = small_layout()
    tier = CpuTier("cpu", {0: layout}, {0: 8 * layout.nbytes}, pinned=False)
    keys, blocks = make_keys(5), random_blocks(5, layout)
    assert asyncio.run(tier.put(keys, rows(blocks))) == [True] * 5
    out = torch.empty_like(blocks)
    assert asyncio.run(tier.get(keys[::-1], rows(out)[::-1])) == [True] * 5
    assert torch.equal(out.view(torch.uint8), blocks.view(torch.uint8))
    assert asyncio.run(tier.contains(make_keys(6))) == [True] * 5 + [False]
    assert tier.usage_bytes() == 5 * layout.nbytes


def test_slots_are_page_aligned_views_and_full_slab_refuses() -> None:
    layout = small_layout()
    tier = CpuTier("cpu", {0: layout}, {0: 2 * layout.nbytes + 100}, pinned=False)
    assert tier.slots(0) == 2
    keys, blocks = make_keys(3), random_blocks(3, layout)
    assert asyncio.run(tier.put(keys, rows(blocks))) == [True, True, False]
    view = tier.views(keys[:1])[0]
    assert view.data_ptr() % PAGE == 0 or layout.nbytes % PAGE
    assert torch.equal(view, rows(blocks)[0])
    asyncio.run(tier.delete(keys[:1]))
    assert asyncio.run(tier.put(keys[2:], rows(blocks)[2:])) == [True]


def test_groups_have_separate_slabs() -> None:
    a, b = small_layout(16), small_layout(32)
    tier = CpuTier("cpu", {0: a, 1: b}, {0: a.nbytes, 1: b.nbytes}, pinned=False)
    ka, kb = make_keys(1, 0), make_keys(1, 1)
    assert asyncio.run(
        tier.put(ka + kb, rows(random_blocks(1, a)) + rows(random_blocks(1, b)))) == [True, True]
    assert sorted(k.group_id for k in tier.keys()) == [0, 1]


def test_wrong_buffer_is_named() -> None:
    layout = small_layout()
    tier = CpuTier("cpu", {0: layout}, {0: layout.nbytes}, pinned=False)
    with pytest.raises(LayoutMismatch, match=r"blocks\[0\].*16384 bytes"):
        asyncio.run(tier.put(make_keys(1), [torch.zeros(10, dtype=torch.uint8)]))
    with pytest.raises(LayoutMismatch, match="group 3"):
        asyncio.run(tier.put(make_keys(1, 3), [torch.zeros(layout.nbytes, dtype=torch.uint8)]))


def test_put_of_one_row_batch_tensor_matches_put_of_rows_and_fills_what_fits() -> None:
    layout = small_layout()
    keys, blocks = make_keys(5), random_blocks(5, layout, seed=3)
    batch = blocks.view(torch.uint8).reshape(5, -1)
    tier = CpuTier("cpu", {0: layout}, {0: 3 * layout.nbytes}, pinned=False)
    assert asyncio.run(tier.put(keys[1:3], batch[1:3])) == [True, True]
    # keys[1] and keys[2] keep their slots, keys[0] takes the last free one, the rest do not fit
    assert asyncio.run(tier.put(keys, batch)) == [True, True, True, False, False]
    assert tier.counters.blocks_written == 2 + 3
    assert asyncio.run(tier.contains(keys)) == [True, True, True, False, False]
    for i, view in enumerate(tier.views(keys[:3])):
        assert torch.equal(view, batch[i])


def test_put_of_a_wrong_batch_tensor_is_named() -> None:
    layout = small_layout()
    tier = CpuTier("cpu", {0: layout}, {0: 2 * layout.nbytes}, pinned=False)
    with pytest.raises(LayoutMismatch, match=r"blocks\[0\].*16384 bytes"):
        asyncio.run(tier.put(make_keys(2), torch.zeros((2, 10), dtype=torch.uint8)))
    with pytest.raises(LayoutMismatch, match="2 keys but 3 blocks"):
        asyncio.run(tier.put(make_keys(2), torch.zeros((3, layout.nbytes), dtype=torch.uint8)))
    with pytest.raises(LayoutMismatch, match=r"blocks\[0\] must be"):
        asyncio.run(tier.put(make_keys(2), torch.zeros((2, layout.nbytes), dtype=torch.int8)))


@given(st.lists(st.integers(0, 15), min_size=0, max_size=16))
@settings(max_examples=300, deadline=None)
def test_strided_rows_is_array_rows_or_none(slots: list[int]) -> None:
    """The one-call view of slab rows is exactly ``array[slots]``, and exists for every even step."""
    array = np.arange(16 * 3).reshape(16, 3)
    view = strided_rows(array, slots)
    steps = {b - a for a, b in zip(slots, slots[1:], strict=False)}
    even = len(slots) == 1 or (len(steps) == 1 and 0 not in steps)
    if not slots or not even:
        assert view is None
    else:
        assert view is not None and np.shares_memory(view, array)
        assert np.array_equal(view, array[slots])


@pytest.mark.parametrize("order", ["forward", "backward", "scattered"])
def test_batches_in_any_slot_order_round_trip(order: str) -> None:
    """Freed slots come back in reverse (a stack): batches over runs of slots and scattered ones
    both land in the right slots, into and out of the slab."""
    layout = small_layout()
    n = 8
    tier = CpuTier("cpu", {0: layout}, {0: n * layout.nbytes}, pinned=False)
    first, blocks = make_keys(n), random_blocks(n, layout)
    assert asyncio.run(tier.put(first, rows(blocks))) == [True] * n
    if order == "backward":
        asyncio.run(tier.delete(first))  # the stack now hands out n-1, n-2, ...
    elif order == "scattered":
        asyncio.run(tier.delete([first[i] for i in (3, 0, 6, 1, 7, 2, 5, 4)]))
    else:
        tier = CpuTier("cpu", {0: layout}, {0: n * layout.nbytes}, pinned=False)
    keys = make_keys(2 * n)[n:]
    new = random_blocks(n, layout).roll(1, 0).contiguous()
    assert asyncio.run(tier.put(keys, rows(new))) == [True] * n
    out = torch.zeros_like(new)
    assert asyncio.run(tier.get(keys, rows(out))) == [True] * n
    assert torch.equal(out.view(torch.uint8), new.view(torch.uint8))
    for k, block in zip(keys, rows(new), strict=True):
        assert torch.equal(tier.views([k])[0], block)


@given(st.integers(1, 8), st.lists(st.integers(0, 9), max_size=6),
       st.lists(st.integers(0, 9), min_size=1, max_size=8))
@settings(max_examples=60, deadline=None)
def test_put_of_a_batch_tensor_equals_put_of_its_rows(slots: int, before: list[int],
                                                      batch_keys: list[int]) -> None:
    layout = small_layout()
    keys, blocks = make_keys(10), random_blocks(10, layout, seed=5)
    data = blocks.view(torch.uint8).reshape(10, -1)
    tiers = [CpuTier("cpu", {0: layout}, {0: slots * layout.nbytes}, pinned=False) for _ in range(2)]
    for tier in tiers:
        asyncio.run(tier.put([keys[i] for i in before], [data[i] for i in before]))
    picked = [keys[i] for i in batch_keys]
    rows_batch = data[torch.tensor(batch_keys)]
    as_batch = asyncio.run(tiers[0].put(picked, rows_batch))
    assert as_batch == asyncio.run(tiers[1].put(picked, list(rows_batch)))
    held = [k for k in keys if k in set(tiers[1].keys())]
    assert sorted(tiers[0].keys()) == sorted(held)
    for a, b in zip(tiers[0].views(held), tiers[1].views(held), strict=True):
        assert torch.equal(a, b)


@given(st.integers(1, 8), st.lists(st.integers(0, 9), max_size=8),
       st.lists(st.integers(0, 9), min_size=1, max_size=8))
@settings(max_examples=60, deadline=None)
def test_get_into_a_batch_tensor_equals_get_into_its_rows(slots: int, stored: list[int],
                                                          asked: list[int]) -> None:
    layout = small_layout()
    keys, blocks = make_keys(10), random_blocks(10, layout, seed=7)
    data = blocks.view(torch.uint8).reshape(10, -1)
    tier = CpuTier("cpu", {0: layout}, {0: slots * layout.nbytes}, pinned=False)
    asyncio.run(tier.put([keys[i] for i in stored], [data[i] for i in stored]))
    picked = [keys[i] for i in asked]
    into_batch = torch.zeros(len(asked), layout.nbytes, dtype=torch.uint8)
    into_rows = torch.zeros_like(into_batch)
    hits = asyncio.run(tier.get(picked, into_batch))
    assert hits == asyncio.run(tier.get(picked, list(into_rows)))
    assert hits == asyncio.run(tier.contains(picked))
    assert tier.counters.blocks_read == 2 * sum(hits)
    for row, (i, hit) in enumerate(zip(asked, hits, strict=True)):
        assert torch.equal(into_batch[row], data[i] if hit else torch.zeros_like(data[i]))
        assert torch.equal(into_rows[row], into_batch[row])


def run_switching_often(*targets: Callable[[], None]) -> None:
    """Run each target on its own thread, all at once, the interpreter switching threads as often as
    it can (so that a read-modify-write without a lock gets interrupted)."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=target) for target in targets]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)


def test_counters_add_up_when_two_threads_write_and_read_at_once() -> None:
    """A cache copies into a CPU tier on the caller's thread while the loop thread runs the tier's own
    calls: neither may lose the other's counts."""
    layout = small_layout()
    tier = CpuTier("cpu", {0: layout}, {0: 64 * layout.nbytes}, pinned=False)
    blocks = rows(random_blocks(2, layout))
    rounds = 1000

    def writer(base: int) -> None:
        for n in range(rounds):
            keys = make_keys(2, start=base + 2 * (n % 16))
            if n % 2:
                tier.put_now(keys, blocks)
            else:
                tier.fill(tier.reserve(keys), lambda slab, slots, placed: None)
            tier.delete_now(keys)
            asyncio.run(tier.get(make_keys(1, start=10_000), blocks[:1]))  # a miss, counted as 0

    run_switching_often(lambda: writer(0), lambda: writer(32))
    assert tier.counters.blocks_written == 2 * 2 * rounds
    assert tier.counters.bytes_written == 2 * 2 * rounds * layout.nbytes
    assert tier.counters.blocks_read == 0


def test_tier_counters_lose_no_count_to_two_threads() -> None:
    """``errors[kind] = errors.get(kind, 0) + n`` can switch threads between the read and the write:
    without the counters' lock, two threads counting at once lost about a fifth of the counts here."""
    counters = TierCounters()
    rounds = 50_000

    def count() -> None:
        for _ in range(rounds):
            counters.error("timeout")
            counters.add_writes(1, 10, 0.5)
            counters.add_reads(2, 20, 0.25)

    run_switching_often(count, count)
    assert counters.errors == {"timeout": 2 * rounds}
    assert (counters.blocks_written, counters.bytes_written, counters.write_seconds) == (
        2 * rounds, 20 * rounds, 0.5 * 2 * rounds)
    assert (counters.blocks_read, counters.bytes_read, counters.read_seconds) == (
        4 * rounds, 40 * rounds, 0.25 * 2 * rounds)
