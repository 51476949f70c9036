"""vLLM's own manager contract (the scenarios of vLLM's ``tests/v1/kv_offload/cpu/test_manager.py``),
held against kvtier's scheduler-side manager over a real CPU tier of four blocks with LRU eviction.

Each test names the vLLM scenario it adapts. kvtier's manager answers with kvtier's ``Lookup`` (equal
to vLLM's ``LookupResult``; the vLLM subclass maps them) and a spec of kvtier keys and a placement
plan instead of CPU slot numbers, so slot numbers are not compared. Deviations, with their reasons,
are documented in docs/vllm.md ("vLLM's manager contract") and asserted here as kvtier's behaviour:

* a call that only part of fits stores the chunks some tier can take (kvtier places each chunk in
  the first tier with room, a write-back hierarchy) instead of refusing the whole call; None only
  when no chunk fits;
* a store's outcome is what the worker's execution of the plan reports (kvtier's index follows the
  bytes), not ``complete_store``'s ``success`` flag.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvtier.connectors.vllm import BlockTransferSpec, Lookup
from tests.connectors.test_vllm_unit import GpuSpec, Harness

H, P, M = Lookup.HIT, Lookup.HIT_PENDING, Lookup.MISS


def key(n: int) -> bytes:
    return n.to_bytes(32, "little") + (0).to_bytes(4, "big")


def keys(ns: Sequence[int]) -> list[bytes]:
    return [key(n) for n in ns]


def numbers(offload_keys: Sequence[bytes]) -> list[int]:
    return [int.from_bytes(k[:-4], "little") for k in offload_keys]


class Manager:
    """kvtier's manager and worker over a four-block LRU CPU tier, driven as vLLM's scheduler does."""

    def __init__(self, harness: Harness) -> None:
        self.h = harness
        self.m = harness.manager
        self._pending: dict[bytes, tuple[list[bytes], BlockTransferSpec]] = {}
        self._engine_blocks = itertools.count()

    def prepare_store(self, ns: Sequence[int], req: Any = None) -> tuple[list[int], list[int]] | None:
        """(chunks to store, chunks evicted) as numbers, or None."""
        planned = self.m.plan_store(keys(ns), req)
        if planned is None:
            return None
        chosen, spec = planned
        for k in chosen:
            self._pending[k] = (chosen, spec)
        return numbers(chosen), numbers(self.m.take_removed())

    def complete_store(self, ns: Sequence[int]) -> None:
        """The worker runs each store job that covers these chunks, then vLLM completes them."""
        jobs = {id(spec): (chosen, spec)
                for k in keys(ns) if (job := self._pending.get(k)) for chosen, spec in [job]}
        for chosen, spec in jobs.values():
            ids = np.array([next(self._engine_blocks) % 32 for _ in chosen], np.int32)
            assert self.h._run(self.h.worker.submit_store, GpuSpec(ids, (len(ids),), (0,)), spec)["success"]
            for k in chosen:
                self._pending.pop(k, None)
        self.m.complete_store(keys(ns))

    def lookup(self, ns: Sequence[int]) -> list[Lookup]:
        return [self.m.lookup(k) for k in keys(ns)]

    def events(self) -> tuple[list[set[int]], list[set[int]]]:
        """(stored key sets, removed key sets) since the last call."""
        stored, removed = [], []
        for event_keys, is_removal in self.m.take_event_keys():
            (removed if is_removal else stored).append(set(numbers(event_keys)))
        return stored, removed


@pytest.fixture
def manager() -> Iterator[Manager]:
    block = Harness([{"type": "cpu", "capacity": "1MiB"}]).runtime.core.layouts[0].nbytes
    h = Harness([{"type": "cpu", "capacity": 4 * block, "eviction": "lru"}], enable_events=True)
    try:
        yield Manager(h)
    finally:
        h.close()


def test_stores_are_pending_until_complete_then_hits_with_one_stored_event(manager: Manager) -> None:
    """test_cpu_manager, first half."""
    assert manager.prepare_store([1, 2]) == ([1, 2], [])
    assert manager.lookup([1, 2]) == [P, P]
    assert manager.events() == ([], [])
    manager.complete_store([1, 2])
    assert manager.events() == ([{1, 2}], [])
    assert manager.lookup([1, 2, 3]) == [H, H, M]


def test_already_stored_chunks_of_the_call_are_never_its_victims(manager: Manager) -> None:
    """test_already_stored_block_not_evicted_during_prepare_store (lru)."""
    manager.prepare_store([1, 2])
    manager.complete_store([1, 2])
    manager.m.touch(keys([1]))  # 2 is now the least recently used
    assert manager.prepare_store([2, 3, 4, 5]) == ([3, 4, 5], [1])  # reported by the call that evicted it
    assert manager.events()[1] == [{1}]
    manager.complete_store([2, 3, 4, 5])
    assert manager.lookup([1, 2, 3, 4, 5]) == [M, H, H, H, H]


def test_chunks_being_loaded_are_never_evicted_and_none_when_nothing_fits(manager: Manager) -> None:
    """test_cpu_manager: "prepare store with no space ([2, 3] is being loaded)"."""
    manager.prepare_store([2, 3, 4, 5])
    manager.complete_store([2, 3, 4, 5])
    load = manager.m.prepare_load(keys([2, 3, 4, 5]))
    assert load.keys == tuple(manager.h.runtime.codec.block_key(k) for k in keys([2, 3, 4, 5]))
    assert manager.prepare_store([6, 7, 8]) is None
    manager.h.runtime.release(load.keys, load.sources)  # the worker's read ends the leases
    manager.m.complete_load(keys([2, 3, 4, 5]))
    assert manager.prepare_store([6, 7, 8]) == ([6, 7, 8], [2, 3, 4])


def test_touch_moves_chunks_to_the_end_of_the_lru_order(manager: Manager) -> None:
    """test_cpu_manager: "touch [5, 6, 7]" then a store evicts 8."""
    manager.prepare_store([5, 6, 7, 8])
    manager.complete_store([5, 6, 7, 8])
    manager.m.touch(keys([5, 6, 7]))
    assert manager.prepare_store([9]) == ([9], [8])
    manager.complete_store([9])
    assert manager.events() == ([{5, 6, 7, 8}, {9}], [{8}])


def test_prepare_load_keeps_the_order_of_the_keys(manager: Manager) -> None:
    """test_prepare_load_preserves_key_order."""
    manager.prepare_store([0, 1, 2])
    manager.complete_store([0, 1, 2])
    block_key = manager.h.runtime.codec.block_key
    for order in ([0, 1, 2], [1, 2, 0]):
        spec = manager.m.prepare_load(keys(order))
        assert spec.keys == tuple(block_key(k) for k in keys(order))
        manager.h.runtime.release(spec.keys, spec.sources)
        manager.m.complete_load(keys(order))


def test_a_call_that_only_partly_fits_stores_what_fits(manager: Manager) -> None:
    """Deviation from test_cpu_manager ("prepare store with no space" answers None): kvtier stores the
    chunks a tier can take, oldest unpinned chunks evicted, and the rest are not stored."""
    manager.prepare_store([2, 3, 4, 5])
    manager.complete_store([2, 3, 4, 5])
    load = manager.m.prepare_load(keys([2, 3]))
    assert manager.prepare_store([6, 7, 8]) == ([6, 7], [4, 5])
    manager.h.runtime.release(load.keys, load.sources)


def test_reset_forgets_every_chunk(manager: Manager) -> None:
    """reset_cache: "Evict all tracked blocks and reset internal state"."""
    manager.prepare_store([1, 2])
    manager.complete_store([1, 2])
    manager.events()
    manager.m.reset_cache()
    assert manager.lookup([1, 2]) == [M, M]
    assert manager.prepare_store([1, 2, 3, 4]) == ([1, 2, 3, 4], [])  # the whole tier is free again


def test_a_finished_request_makes_every_block_it_used_recent_its_first_most(manager: Manager) -> None:
    """vLLM 0.32's LRU policy: a use is a store or a request-scoped access, applied at on_request_finished
    in reverse request order (the request's first block ends most recently used)."""
    first, second = SimpleNamespace(req_id="first"), SimpleNamespace(req_id="second")
    manager.prepare_store([1, 2], first)
    manager.complete_store([1, 2])
    manager.m.on_request_finished(first)
    load = manager.m.prepare_load(keys([1, 2]), second)  # the second request reuses 1 and 2 as its prefix...
    manager.h.runtime.release(load.keys, load.sources)
    manager.m.complete_load(keys([1, 2]), second)
    manager.prepare_store([3, 4], second)  # ...and stores 3 and 4 after them
    manager.complete_store([3, 4])
    manager.m.on_request_finished(second)  # uses 1, 2, 3, 4 in that order: 4 is now the oldest, 1 the newest
    assert manager.prepare_store([5]) == ([5], [4])
    assert manager.prepare_store([6]) == ([6], [3])
    assert manager.prepare_store([7]) == ([7], [2])
