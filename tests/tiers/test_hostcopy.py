"""RowCopier: large copies split over threads land exactly where a plain copy puts them."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.kernels import host
from kvtier.layout import BlockLayout
from kvtier.tiers.cpu import CpuTier
from kvtier.tiers.hostcopy import RowCopier, default_copy_threads
from tests.helpers import make_keys, random_blocks

SLAB_ROWS = 12


def copier_threads(name: str) -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(name)]


@given(threads=st.integers(1, 3), width=st.integers(1, 3 * 4096 + 5),
       slots=st.lists(st.integers(0, SLAB_ROWS - 1), min_size=1, max_size=SLAB_ROWS, unique=True),
       into_slab=st.booleans(), separate=st.booleans(), streaming=st.booleans())
@settings(max_examples=120, deadline=None)
def test_split_copies_equal_a_plain_copy(threads: int, width: int, slots: list[int], into_slab: bool,
                                         separate: bool, streaming: bool) -> None:
    """Every batch shape (runs of slots or scattered ones, fewer rows than threads, widths that do not
    divide evenly), both directions, rows of one array or separate buffers, with streaming stores
    into the slab or without."""
    rng = np.random.default_rng(len(slots) * 7919 + width)
    slab = torch.from_numpy(rng.integers(0, 256, (SLAB_ROWS, width), dtype=np.uint8))
    rows = torch.from_numpy(rng.integers(0, 256, (len(slots), width), dtype=np.uint8))
    want_slab, want_rows = slab.clone(), rows.clone()
    for i, slot in enumerate(slots):
        if into_slab:
            want_slab[slot] = rows[i]
        else:
            want_rows[i] = slab[slot]
    copier = RowCopier(threads, name="test-copy", min_bytes=0, streaming=streaming)
    try:
        if separate:  # one buffer per row, not consecutive rows of one tensor
            buffers = [rows[i].clone() for i in range(len(slots))]
            copier.rows(buffers, slab, slots, into_slab=into_slab)
            rows = torch.stack(buffers)
        else:
            copier.batch(rows.numpy(), slab.numpy(), slots, into_slab=into_slab)
    finally:
        copier.close()
    assert torch.equal(slab, want_slab)
    assert torch.equal(rows, want_rows)


def test_only_batches_of_min_bytes_or_more_use_the_copiers_threads() -> None:
    slab = np.zeros((8, 4096), np.uint8)
    rows = np.ones((4, 4096), np.uint8)
    copier = RowCopier(2, name="kvtier-test-split", min_bytes=rows.nbytes)
    try:
        copier.batch(rows[:3], slab, [0, 1, 2], into_slab=True)  # under min_bytes: this thread only
        assert copier_threads("kvtier-test-split") == []
        copier.batch(rows, slab, [7, 5, 3, 1], into_slab=True)
        assert copier_threads("kvtier-test-split") == ["kvtier-test-split_0"]
        assert (slab[[0, 1, 2, 7, 5, 3, 1]] == 1).all() and (slab[[4, 6]] == 0).all()
    finally:
        copier.close()
    assert copier_threads("kvtier-test-split") == []
    copier.batch(rows * 2, slab, [4, 6, 0, 1], into_slab=True)  # after close: on the caller's thread
    assert (slab[[4, 6, 0, 1]] == 2).all()


def test_a_failing_copy_raises_and_the_copier_goes_on() -> None:
    """Parts that fail (rows that do not fit the slab) raise to the caller, once every part has
    returned; the copier's threads still copy the next batch."""
    slab = np.zeros((8, 4096), np.uint8)
    copier = RowCopier(2, name="kvtier-test-fail", min_bytes=0)
    try:
        with pytest.raises(ValueError):
            copier.batch(np.ones((4, 4000), np.uint8), slab, [0, 2, 4, 6], into_slab=True)
        copier.batch(np.full((4, 4096), 3, np.uint8), slab, [1, 3, 5, 7], into_slab=True)
        assert (slab[[1, 3, 5, 7]] == 3).all()
    finally:
        copier.close()


class ScriptedClock:
    """The clock of an adaptive copier whose copies take ``split`` seconds when split over its threads
    and ``one`` on the caller's thread alone (the copier reads it once before a copy, once after)."""

    def __init__(self, split: float, one: float) -> None:
        self.split_seconds, self.one_seconds = split, one
        self.now = 0.0
        self.started = False
        self.splits: list[bool] = []  # per copy: whether it ran split

    def __call__(self) -> float:
        if self.started:
            self.now += self.split_seconds if self.splits[-1] else self.one_seconds
        else:
            self.splits.append(False)
        self.started = not self.started
        return self.now

    def watch(self, copier: RowCopier) -> None:
        real = copier._run

        def run(parts: list) -> None:
            self.splits[-1] = True
            real(parts)

        copier._run = run  # type: ignore[method-assign]


@pytest.mark.parametrize("split_faster", [True, False])
@pytest.mark.parametrize("into_slab", [True, False])
def test_an_adaptive_copier_splits_only_where_splitting_measures_faster(split_faster: bool,
                                                                        into_slab: bool) -> None:
    """Copies where two threads take half (or twice) the time of one: after four copies each way, taken
    in turn, the faster way runs, and one copy in 16 tries the other; every copy lands exactly."""
    clock = ScriptedClock(split=0.001 if split_faster else 0.004, one=0.002)
    copier = RowCopier(2, name="kvtier-test-adapt", min_bytes=0, adaptive=True, clock=clock)
    clock.watch(copier)
    slab = np.zeros((8, 4096), np.uint8)
    try:
        for i in range(160):
            rows = np.full((4, 4096), i % 251, np.uint8)
            slots = [7, 5, 3, 1] if i % 2 else [0, 2, 4, 6]
            if into_slab:
                copier.batch(rows, slab, slots, into_slab=True)
                assert (slab[slots] == i % 251).all()
            else:
                slab[slots] = i % 251
                out = np.zeros_like(rows)
                copier.batch(out, slab, slots, into_slab=False)
                assert (out == i % 251).all()
    finally:
        copier.close()
    assert clock.splits[:8] == [False, True] * 4  # measured in turn, one thread first
    settled = clock.splits[8:]
    assert sum(settled) == (len(settled) - len(settled) // 16 if split_faster else len(settled) // 16)
    choice = copier.choices[into_slab, False]
    assert choice.rates == [pytest.approx(4096 * 4 / 0.002),
                            pytest.approx(4096 * 4 / (0.001 if split_faster else 0.004))]


def test_a_split_barely_faster_is_not_chosen() -> None:
    """A split costs more CPU per byte: 5 % faster than one thread is not enough to choose it."""
    clock = ScriptedClock(split=0.002 / 1.05, one=0.002)
    copier = RowCopier(2, name="kvtier-test-adapt", min_bytes=0, adaptive=True, clock=clock)
    clock.watch(copier)
    slab, rows = np.zeros((4, 4096), np.uint8), np.ones((4, 4096), np.uint8)
    try:
        for _ in range(40):
            copier.batch(rows, slab, [0, 1, 2, 3], into_slab=True)
    finally:
        copier.close()
    assert sum(clock.splits[8:]) == 2  # only the copies that try the other way


def test_copy_threads_given_split_every_large_copy_and_auto_measures() -> None:
    layout = BlockLayout(num_layers=8, num_kv_heads=4, head_dim=128, block_size=16)
    assert not CpuTier("given", {0: layout}, {0: layout.nbytes}, pinned=False, copy_threads=2).copier.adaptive
    assert CpuTier("auto", {0: layout}, {0: layout.nbytes}, pinned=False).copier.adaptive


def test_zero_copy_threads_is_refused() -> None:
    with pytest.raises(ValueError, match="copy threads must be at least 1, got 0"):
        RowCopier(0)
    assert 1 <= default_copy_threads() <= 2


@pytest.mark.parametrize("streaming", [True, False])
@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_tier_round_trips_megabyte_batches_on_its_copy_threads(threads: int, streaming: bool) -> None:
    """Batches over the split threshold, into scattered slots (freed by deletes) and back out, as rows
    of one tensor and as separate buffers: bit-exact either way, with streaming stores or memcpy."""
    layout = BlockLayout(num_layers=8, num_kv_heads=4, head_dim=128, block_size=16)  # 256 KiB blocks
    n = 8
    tier = CpuTier("big", {0: layout}, {0: 2 * n * layout.nbytes}, pinned=False, copy_threads=threads,
                   streaming_stores=streaming)
    assert tier.copier.threads == threads
    assert tier.copier.streaming == (streaming and host.available())
    try:
        old, new = make_keys(2 * n), make_keys(n, start=2 * n)
        data = random_blocks(2 * n, layout, seed=3).view(torch.uint8).reshape(2 * n, -1)
        assert asyncio.run(tier.put(old, data)) == [True] * (2 * n)
        asyncio.run(tier.delete(old[::2]))  # every other slot is free: the next batch is scattered
        fresh = random_blocks(n, layout, seed=4).view(torch.uint8).reshape(n, -1)
        assert asyncio.run(tier.put(new, fresh)) == [True] * n
        keys = new + old[1::2]
        want = torch.cat([fresh, data[1::2]])
        out = torch.zeros_like(want)
        assert asyncio.run(tier.get(keys, out)) == [True] * (2 * n)
        assert torch.equal(out, want)
        separate = [torch.zeros(layout.nbytes, dtype=torch.uint8) for _ in keys]
        assert asyncio.run(tier.get(keys, separate)) == [True] * (2 * n)
        assert torch.equal(torch.stack(separate), want)
        assert copier_threads("kvtier-cpu-big-copy") == (["kvtier-cpu-big-copy_0"] if threads == 2 else [])
    finally:
        asyncio.run(tier.close())
    assert copier_threads("kvtier-cpu-big-copy") == []
