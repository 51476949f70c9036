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

CHAINS, LENGTH = 4, 6  # four prompts of six hash blocks: 24 keys per 16-token group over 3 CPU + 8 file slots
DAMAGE = ["flip_payload", "flip_header", "truncate", "delete"]


class CacheUnderCalls(RuleBasedStateMachine):
    """One cache, its config (kept for restarts) and the oracle judging every answer."""

    redis_url = ""  # a real Redis (the test sets it)

    def __init__(self) -> None:
        super().__init__()
        self.folder = Path(tempfile.mkdtemp(prefix="kvtier-model-"))
        self.cache: TieredCache | None = None
        self.config: dict[str, Any] = {}
        self.tag = uuid.uuid4().hex
        self.chains: list[list[list[BlockKey]]] = []  # per group, per prompt: its keys in order
        self.oracles: list[Oracle] = []  # per group (each judges its group's block size)
        self.damaged = False  # a file was damaged: its key stays indexed until a read finds it out
        self.deleted = False  # a file was deleted under the running tier: its index and the disk differ
        self.rng = random.Random(self.tag)

    @initialize(with_redis=st.booleans(), write_mode=st.sampled_from(["write_back", "write_through"]),
                keep_lower_copy=st.booleans(), hybrid=st.booleans())
    def open_cache(self, with_redis: bool, write_mode: str, keep_lower_copy: bool, hybrid: bool) -> None:
        """One KV-cache group of 16-token blocks, or (``hybrid``) a second of 32-token blocks beside it
        (a sliding-window group: its blocks twice the bytes, keyed by every second hash)."""
        redis = redis_options(self.redis_url) if with_redis else None
        self.config = cache_config(file_dir=self.folder / "files", cpu_blocks=6 if hybrid else 3,
                                   file_blocks=16 if hybrid else 8, redis=redis, write_mode=write_mode,
                                   keep_lower_copy=keep_lower_copy)
        if hybrid:
            self.config["groups"] = [{"block_size": 16}, {"block_size": 32, "name": "sliding_window"}]
        self.cache = TieredCache.from_config(self.config)
        spec = self.live.spec
        hashes = [k.block_hash for k in universe(CHAINS * LENGTH, tag=self.tag)]
        per_prompt = [spec.block_keys(hashes[c * LENGTH:(c + 1) * LENGTH]) for c in range(CHAINS)]
        for g in spec.groups:
            self.chains.append([keys[g.group_id] for keys in per_prompt])
            self.oracles.append(Oracle(layout=g.layout, call_timeout=20.0))

    def _pick(self, group: int, chain: int) -> tuple[Oracle, list[BlockKey]]:
        g = group % len(self.chains)
        return self.oracles[g], self.chains[g][chain]

    @property
    def live(self) -> TieredCache:
        assert self.cache is not None
        return self.cache

    # --- an engine's calls (keys of one group per call, as engines store and load them) ----------------
    @rule(group=st.integers(0, 1), chain=st.integers(0, CHAINS - 1), n=st.integers(1, LENGTH))
    def store_prefix(self, group: int, chain: int, n: int) -> None:
        oracle, keys = self._pick(group, chain)
        stored = oracle.store(self.live, keys[:n])
        assert stored is None or 0 <= stored <= len(keys[:n])

    @rule(group=st.integers(0, 1), chain=st.integers(0, CHAINS - 1), start=st.integers(1, LENGTH - 1),
          n=st.integers(1, LENGTH))
    def store_continuation(self, group: int, chain: int, start: int, n: int) -> None:
        """The new blocks of a request whose first ``start`` blocks were cached: chained to the last."""
        oracle, chain_keys = self._pick(group, chain)
        keys = chain_keys[start:start + n]
        if not keys:
            return
        predecessors: list[BlockKey | None] = [chain_keys[start - 1], *keys[:-1]]
        oracle.offered.update(keys)
        stored = self.live.store(keys, blocks_for(keys, oracle.layout), predecessors=predecessors)
        assert 0 <= stored <= len(keys)
        if stored == len(keys):
            oracle.acked.update(keys)

    @rule(group=st.integers(0, 1), chain=st.integers(0, CHAINS - 1), n=st.integers(1, LENGTH))
    def lookup_then_load(self, group: int, chain: int, n: int) -> None:
        oracle, keys = self._pick(group, chain)
        promised = oracle.lookup(self.live, keys[:n])
        loaded = oracle.load(self.live, keys[:n])
        if not self.damaged:
            assert loaded == promised, f"lookup promised {promised} leading blocks, load returned {loaded}"

    @rule(calls=st.lists(st.tuples(st.booleans(), st.integers(0, 1), st.integers(0, CHAINS - 1),
                                   st.integers(1, LENGTH)), min_size=2, max_size=5))
    def calls_in_flight_together(self, calls: list[tuple[bool, int, int, int]]) -> None:
        """Stores and loads submitted at once (an engine's scheduler and its prefetchers), then awaited."""
        futures: list[tuple[Oracle, list[BlockKey], torch.Tensor | None, Future[int]]] = []
        for is_store, group, chain, n in calls:
            oracle, chain_keys = self._pick(group, chain)
            keys = chain_keys[:n]
            if is_store:
                oracle.offered.update(keys)
                stored = self.live.submit_store(keys, blocks_for(keys, oracle.layout))
                futures.append((oracle, keys, None, stored))
            else:
                into = blocks_for(keys, oracle.layout).zero_()
                futures.append((oracle, keys, into, self.live.submit_load(keys, into)))
        for oracle, keys, loaded, future in futures:
            n = future.result(timeout=20)
            assert 0 <= n <= len(keys)
            if loaded is None:
                if n == len(keys):
                    oracle.acked.update(keys)
            else:
                oracle.check(keys, loaded, n)

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
        for oracle in self.oracles:
            oracle.assert_clean()
        assert consistency_problems(self.live, disk=not self.deleted) == []

    def teardown(self) -> None:
        try:
            if self.cache is not None and not self.cache.closed:
                for oracle in self.oracles:
                    oracle.sweep(self.live)  # every key ever offered, alone: exact or missing
                    oracle.assert_clean()
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
