"""Random sequences of engine calls, restarts and damaged files against one TieredCache (hypothesis).

The other reliability tests each drive one fault hard; this one lets hypothesis combine the calls an
engine makes (stores of whole prefixes and of continuations with their chain links, lookups, loads),
the operator's (clearing the top tier, restarting the process) and the disk's faults (a block file
flipped, truncated or deleted) in any order, over CPU → file (→ real Redis) tiers small enough that
every few calls evict, demote and promote. After every step: the oracle (every block served is the
key's own bytes; nothing raises), the index agreeing with the tiers and the disk (with the files
under it, unless one was deleted behind the running tier's back), and — while no file
has been damaged — a load returning exactly what the lookup before it promised. Shrunk failures read
as a short script of calls.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvtier import BlockKey, TieredCache
from kvtier.tiers.file import FileTier
from tests.reliability.conftest import (
    Oracle,
    blocks_for,
    cache_config,
    consistency_problems,
    corrupt_file,
    redis_options,
    universe,
)

CHAINS, LENGTH = 4, 6  # four prompts of six blocks: 24 keys over 3 CPU + 8 file slots
DAMAGE = ["flip_payload", "flip_header", "truncate", "delete"]


class CacheUnderCalls(RuleBasedStateMachine):
    """One cache, its config (kept for restarts) and the oracle judging every answer."""

    redis_url = ""  # a real Redis (the test sets it)

    def __init__(self) -> None:
        super().__init__()
        self.folder = Path(tempfile.mkdtemp(prefix="kvtier-model-"))
        self.cache: TieredCache | None = None
        self.config: dict[str, Any] = {}
        self.oracle = Oracle(call_timeout=20.0)
        tag = uuid.uuid4().hex
        keys = universe(CHAINS * LENGTH, tag=tag)
        self.chains = [keys[c * LENGTH:(c + 1) * LENGTH] for c in range(CHAINS)]
        self.damaged = False  # a file was damaged: its key stays indexed until a read finds it out
        self.deleted = False  # a file was deleted under the running tier: its index and the disk differ
        self.rng = random.Random(tag)

    @initialize(with_redis=st.booleans(), write_mode=st.sampled_from(["write_back", "write_through"]),
                keep_lower_copy=st.booleans())
    def open_cache(self, with_redis: bool, write_mode: str, keep_lower_copy: bool) -> None:
        redis = redis_options(self.redis_url) if with_redis else None
        self.config = cache_config(file_dir=self.folder / "files", cpu_blocks=3, file_blocks=8, redis=redis,
                                   write_mode=write_mode, keep_lower_copy=keep_lower_copy)
        self.cache = TieredCache.from_config(self.config)

    @property
    def live(self) -> TieredCache:
        assert self.cache is not None
        return self.cache

    # --- an engine's calls ----------------------------------------------------------------------------
    @rule(chain=st.integers(0, CHAINS - 1), n=st.integers(1, LENGTH))
    def store_prefix(self, chain: int, n: int) -> None:
        stored = self.oracle.store(self.live, self.chains[chain][:n])
        assert stored is None or 0 <= stored <= n

    @rule(chain=st.integers(0, CHAINS - 1), start=st.integers(1, LENGTH - 1), n=st.integers(1, LENGTH))
    def store_continuation(self, chain: int, start: int, n: int) -> None:
        """The new blocks of a request whose first ``start`` blocks were cached: chained to the last."""
        keys = self.chains[chain][start:start + n]
        predecessors: list[BlockKey | None] = [self.chains[chain][start - 1], *keys[:-1]]
        self.oracle.offered.update(keys)
        stored = self.live.store(keys, blocks_for(keys), predecessors=predecessors)
        assert 0 <= stored <= len(keys)
        if stored == len(keys):
            self.oracle.acked.update(keys)

    @rule(chain=st.integers(0, CHAINS - 1), n=st.integers(1, LENGTH))
    def lookup_then_load(self, chain: int, n: int) -> None:
        keys = self.chains[chain][:n]
        promised = self.oracle.lookup(self.live, keys)
        loaded = self.oracle.load(self.live, keys)
        if not self.damaged:
            assert loaded == promised, f"lookup promised {promised} leading blocks, load returned {loaded}"

    @rule(calls=st.lists(st.tuples(st.booleans(), st.integers(0, CHAINS - 1), st.integers(1, LENGTH)),
                         min_size=2, max_size=5))
    def calls_in_flight_together(self, calls: list[tuple[bool, int, int]]) -> None:
        """Stores and loads submitted at once (an engine's scheduler and its prefetchers), then awaited."""
        futures: list[tuple[list[BlockKey], torch.Tensor | None, Future[int]]] = []
        for is_store, chain, n in calls:
            keys = self.chains[chain][:n]
            if is_store:
                self.oracle.offered.update(keys)
                futures.append((keys, None, self.live.submit_store(keys, blocks_for(keys))))
            else:
                into = blocks_for(keys).zero_()
                futures.append((keys, into, self.live.submit_load(keys, into)))
        for keys, loaded, future in futures:
            n = future.result(timeout=20)
            assert 0 <= n <= len(keys)
            if loaded is None:
                if n == len(keys):
                    self.oracle.acked.update(keys)
            else:
                self.oracle.check(keys, loaded, n)

    # --- an operator's -------------------------------------------------------------------------------
    @rule()
    def clear_the_top_tier(self) -> None:
        self.live.clear([0])

    @rule()
    def restart(self) -> None:
        self.live.close()
        self.cache = TieredCache.from_config(self.config)
        self.deleted = False  # the file tier's index is rebuilt from the disk

    # --- the disk's ----------------------------------------------------------------------------------
    @precondition(lambda self: self.cache is not None)
    @rule(kind=st.sampled_from(DAMAGE), pick=st.integers(0, 1 << 16))
    def damage_a_block_file(self, kind: str, pick: int) -> None:
        tier = next(t for t in self.live.core.tiers if isinstance(t, FileTier))
        held = sorted(tier.keys())
        if not held:
            return
        key = held[pick % len(held)]
        if corrupt_file(tier.path_of(key), kind, key, self.rng, tier._fingerprints[0]):
            self.damaged = True
            self.deleted = self.deleted or kind == "delete"

    # --- after every step ----------------------------------------------------------------------------
    @invariant()
    def nothing_served_wrong_and_the_index_agrees(self) -> None:
        if self.cache is None:
            return
        self.oracle.assert_clean()
        assert consistency_problems(self.live, disk=not self.deleted) == []

    def teardown(self) -> None:
        try:
            if self.cache is not None and not self.cache.closed:
                self.oracle.sweep(self.live)  # every key ever offered, alone: exact or missing
                self.oracle.assert_clean()
                self.cache.clear(range(len(self.live.core.tiers)))  # Redis keeps nothing of this run
        finally:
            if self.cache is not None:
                self.cache.close()
            shutil.rmtree(self.folder, ignore_errors=True)


def test_any_sequence_of_calls_restarts_and_damaged_files_serves_nothing_wrong(redis_servers: Any) -> None:
    CacheUnderCalls.redis_url = redis_servers().url  # a private redis-server, as the fault suite uses
    run = CacheUnderCalls.TestCase
    # KVTIER_MODEL_EXAMPLES=1000 for a longer hunt; the suite's default keeps it to seconds
    run.settings = settings(max_examples=int(os.environ.get("KVTIER_MODEL_EXAMPLES", "60")),
                            stateful_step_count=30, deadline=None,
                            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    run().runTest()
