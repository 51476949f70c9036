"""One engine's kvtier state: the async cache on a private loop thread, verified staging for loads,
and the mirror of kvtier's index that the scheduler's lookups read.

One module (over 500 lines) because the three share one engine's cache, lock and loop thread: the
mirror is updated by the cache's change notifications, the staging area is filled by the cache's
reads and emptied by the worker's loads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Coroutine, Sequence
from itertools import repeat
from operator import attrgetter
from typing import Any, TypeVar, cast

import torch

from kvtier.blocks import BlockKey
from kvtier.cache import AsyncTieredCache, BlockFill
from kvtier.config import KVTierConfig
from kvtier.connectors.vllm.geometry import EPOCH_BYTES, KeyCodec
from kvtier.connectors.vllm.scheduler_index import index_only_cache
from kvtier.errors import KVTierConfigError, KVTierError
from kvtier.metrics import CacheStats
from kvtier.prometheus import MetricsServer
from kvtier.residency import READY, Plan, Residency
from kvtier.tiers.cpu import CpuTier, SlotRead

log = logging.getLogger(__name__)
_BLOCK_HASH = attrgetter("block_hash")
T = TypeVar("T")

#: ``prepare_load`` source of a block served from staging, and of a block that could not be held.
STAGED = -1
LOST = -2

DEFAULT_STAGING_BYTES = 256 << 20


class Staging:
    """Verified blocks held in memory until a load copies them into the engine; LRU within a byte budget.

    Thread-safe: fetches add blocks on kvtier's loop thread, the scheduler pins them, the worker reads
    them. A pinned block is never dropped.
    """

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._blocks: OrderedDict[BlockKey, torch.Tensor] = OrderedDict()
        self._pins: dict[BlockKey, int] = {}
        self._lock = threading.Lock()

    def __contains__(self, key: object) -> bool:
        return key in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def put(self, key: BlockKey, block: torch.Tensor, *, pinned: bool = False) -> bool:
        """Hold ``block`` (1-D uint8, not copied); False when unpinned blocks cannot make room."""
        size = block.numel()
        with self._lock:
            if key in self._blocks:
                self._blocks.move_to_end(key)
                if pinned:
                    self._pins[key] = self._pins.get(key, 0) + 1
                return True
            for victim in [k for k in self._blocks if k not in self._pins]:
                if self.used_bytes + size <= self.capacity_bytes:
                    break
                self.used_bytes -= self._blocks.pop(victim).numel()
            if self.used_bytes + size > self.capacity_bytes:
                return False
            self._blocks[key] = block
            self.used_bytes += size
            if pinned:
                self._pins[key] = self._pins.get(key, 0) + 1
            return True

    def pin_each(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Pin every held key of ``keys`` (one lock for the batch); which ones were held."""
        held = []
        with self._lock:
            for key in keys:
                if key in self._blocks:
                    self._pins[key] = self._pins.get(key, 0) + 1
                    self._blocks.move_to_end(key)
                    held.append(True)
                else:
                    held.append(False)
        return held

    def unpin(self, key: BlockKey) -> None:
        with self._lock:
            count = self._pins.get(key, 0) - 1
            if count > 0:
                self._pins[key] = count
            else:
                self._pins.pop(key, None)

    def discard(self, key: BlockKey) -> None:
        """Drop a block unless a load still has it pinned."""
        with self._lock:
            if key in self._blocks and key not in self._pins:
                self.used_bytes -= self._blocks.pop(key).numel()

    def get(self, key: BlockKey) -> torch.Tensor:
        """The held block (the caller has it pinned)."""
        return self._blocks[key]

    def clear(self) -> None:
        with self._lock:
            for key in [k for k in self._blocks if k not in self._pins]:
                self.used_bytes -= self._blocks.pop(key).numel()


#: removals kept for vLLM until it asks (reported once; the oldest go first if it never asks)
MAX_REMOVED_KEYS = 1 << 16


class IndexMirror:
    """kvtier's index as vLLM's scheduler asks about it, kept current by the cache (a ``ResidencyWatcher``).

    ``loadable`` maps the offload key (vLLM's bytes) of every block a memory tier holds READY to its
    :class:`BlockKey`, so a lookup is one dict probe on the engine's own key and ``prepare_load``
    decodes nothing. It is written on kvtier's loop thread, with the cache's index lock held, and read
    on the scheduler's thread: each is one dict operation, atomic under the GIL. A lookup sees a change
    a moment late at most, as if it had looked a moment earlier; ``prepare_load`` never trusts the
    mirror but pins under the lock. ``removed`` collects the offload keys of blocks that left every
    tier, for vLLM's removal reports. Only keys of the codec's current epoch are mirrored or reported:
    after a reset (:meth:`new_epoch`) nothing stored before it reaches vLLM again.
    """

    def __init__(self, codec: KeyCodec, residency: Residency, memory_tiers: Sequence[int]) -> None:
        self.codec = codec
        self.loadable: dict[bytes, BlockKey] = {}
        self.removed: deque[bytes] = deque(maxlen=MAX_REMOVED_KEYS)
        self._memory = [residency.tiers[t].entries for t in memory_tiers]
        self._lock = threading.Lock()  # an epoch change and a change of the index never interleave
        #: (block keys, their offload keys) of the store running now (:meth:`expect`)
        self._expected: tuple[list[BlockKey], Sequence[bytes]] | None = None

    def expect(self, keys: list[BlockKey] | None, offload_keys: Sequence[bytes] = ()) -> None:
        """The store about to run writes ``keys``, of the current epoch, whose offload keys are
        ``offload_keys`` (the manager's): a change of exactly those keys, all READY, is mirrored under them
        in one ``dict.update``. None: no such store."""
        self._expected = (keys, offload_keys) if keys is not None and len(offload_keys) == len(keys) else None

    def residency_changed(self, keys: Sequence[BlockKey]) -> None:
        expected = self._expected
        if expected is not None and len(self._memory) == 1 and keys == expected[0]:
            get = self._memory[0].get
            if list(map(get, keys)).count(READY) == len(keys):
                self.stored(expected[1], keys)  # keys of the current epoch (store_with checked)
                return
        # KeyCodec.offload_key inlined (hash without its epoch tag + the group's suffix): every store
        # and every eviction lands here, once per block, on the scheduler's thread
        loadable, memory, suffixes = self.loadable, self._memory, self.codec.suffixes
        pop = loadable.pop
        with self._lock:
            epoch = self.codec.epoch
            if len(memory) == 1:  # the usual case, without a generator per key
                get = memory[0].get
                for key in keys:
                    block_hash = key.block_hash
                    if block_hash.startswith(epoch):
                        if get(key) == READY:
                            loadable[block_hash[EPOCH_BYTES:] + suffixes[key.group_id]] = key
                        else:
                            pop(block_hash[EPOCH_BYTES:] + suffixes[key.group_id], None)
                return
            for key in keys:
                block_hash = key.block_hash
                if not block_hash.startswith(epoch):
                    continue
                if any(entries.get(key) == READY for entries in memory):
                    loadable[block_hash[EPOCH_BYTES:] + suffixes[key.group_id]] = key
                else:
                    pop(block_hash[EPOCH_BYTES:] + suffixes[key.group_id], None)

    def blocks_removed(self, keys: Sequence[BlockKey]) -> None:
        suffixes = self.codec.suffixes
        with self._lock:
            epoch = self.codec.epoch
            self.removed.extend([key.block_hash[EPOCH_BYTES:] + suffixes[key.group_id]
                                 for key in keys if key.block_hash.startswith(epoch)])

    def stored(self, offload_keys: Sequence[bytes], keys: Sequence[BlockKey]) -> None:
        """``keys`` (vLLM's ``offload_keys``, in order) became READY in the memory tier: one batched update
        for a caller that has vLLM's keys at hand (:mod:`.single_tier_lru`); call with the index lock held.
        Keys of one batch share an epoch."""
        with self._lock:
            if keys and keys[0].block_hash.startswith(self.codec.epoch):
                self.loadable.update(zip(offload_keys, keys, strict=True))

    def evicted(self, keys: Sequence[BlockKey]) -> None:
        """``keys`` left every tier: :meth:`residency_changed` and :meth:`blocks_removed` in one pass (the
        offload key is derived once per block); call with the index lock held."""
        suffixes, pop = self.codec.suffixes, self.loadable.pop
        with self._lock:
            epoch = self.codec.epoch
            gone = [key.block_hash[EPOCH_BYTES:] + suffixes[key.group_id]
                    for key in keys if key.block_hash.startswith(epoch)]
            for offload_key in gone:
                pop(offload_key, None)
            self.removed.extend(gone)

    def new_epoch(self) -> None:
        """Move the codec to a fresh epoch and forget everything mirrored or pending report."""
        with self._lock:
            self.codec.new_epoch()
            self.loadable.clear()
            self.removed.clear()

    def take_removed(self) -> list[bytes]:
        """The removals not reported yet (each is returned once)."""
        with self._lock:  # the writers hold it: nothing lands between the copy and the clear
            out = list(self.removed)
            self.removed.clear()
        return out


class OffloadRuntime:
    """One engine's kvtier state in this process: the async cache on a private loop thread, staging,
    and the index mirror.

    When vLLM's scheduler and worker share a process, the manager and the worker share it. Pins are
    taken, and leased blocks copied, on the caller's thread under the cache's index lock (:meth:`lease`,
    :meth:`read`, :meth:`release`); stores and reads of slow tiers run on the loop thread; the
    manager's lookups read the mirror. When the workers are other processes, the scheduler's runtime
    is ``index_only`` (indexes and policies over no bytes) and each worker's runs the plans it is sent.
    """

    def __init__(self, config: KVTierConfig, codec: KeyCodec, staging_bytes: int = DEFAULT_STAGING_BYTES, *,
                 index_only: bool = False) -> None:
        self.config = config
        self.codec = codec
        #: the scheduler's runtime when the workers are other processes: indexes and policies, no bytes
        self.index_only = index_only
        self.core = index_only_cache(config) if index_only else AsyncTieredCache.from_config(config)
        self.residency = self.core.residency
        self.memory_tiers = tuple(t for t, tier in enumerate(self.core.tiers) if tier.addressable)
        #: file and Redis tiers: a rank can lose their blocks on its own (docs/vllm.md)
        self.slow_tiers = tuple(t for t, tier in enumerate(self.core.tiers) if not tier.addressable)
        self.has_remote = any(tier.self_evicting for tier in self.core.tiers)
        self.staging = Staging(staging_bytes)
        self._staged_from: dict[BlockKey, int] = {}  # the tier each copy staged for another process came from
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvtier-vllm", daemon=True)
        self._thread.start()
        self._closed = False
        self._last_write: concurrent.futures.Future[int] | None = None  # the newest store sent to the loop
        self.call(self.core.start())
        self.mirror = IndexMirror(codec, self.residency, self.memory_tiers)
        self.core.add_watcher(self.mirror)
        self.metrics_server: MetricsServer | None = None
        # metrics.port (+ the TP rank): kvtier's counters per worker
        if self.core.metrics_endpoint is not None:
            address, port = self.core.metrics_endpoint
            port += config.model.tp_rank
            namespace = self.core.namespace.id if self.core.namespace else ""
            try:
                self.metrics_server = MetricsServer(self.stats, port, address, namespace)
            except OSError as exc:  # the port is taken: stop what started, nothing half-starts
                self.close()
                raise KVTierConfigError("metrics.port", f"cannot serve metrics on {address}:{port}: "
                                                        f"{exc.strerror or exc}") from None

    # --- running on the loop ----------------------------------------------------------------------
    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        if self._closed:
            coro.close()
            raise KVTierError("the kvtier offloading runtime is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.submit(coro).result()

    def stats(self) -> CacheStats:
        return self.call(self._snapshot())

    async def _snapshot(self) -> CacheStats:
        return self.core.stats()

    def reset(self) -> list[BlockKey]:
        """Forget this engine's blocks (vLLM's connector reset); return the memory-tier blocks dropped.

        Moves to a fresh key epoch first, so no block stored before the reset is served again — from
        persistent tiers too, whose copies stay for other engines sharing them and age out by
        eviction — then empties staging and deletes every unpinned block of the memory tiers.
        """
        self.mirror.new_epoch()
        self.staging.clear()
        return self.call(self.core.clear(self.memory_tiers))

    def close(self) -> None:
        if self._closed:
            return
        server, self.metrics_server = getattr(self, "metrics_server", None), None
        if server is not None:
            server.close()
        try:
            self.call(self.core.close())
        finally:
            self._closed = True
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()

    # --- block buffers ------------------------------------------------------------------------------
    def empty_blocks(self, group_id: int, count: int, *,
                     pinned: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``count`` blocks of a group: (``[count, nbytes]`` uint8, the same memory typed as the layout).

        ``pinned``: page-locked (torch's caching host allocator reuses freed ones), for CUDA page moves.
        """
        layout = self.core.layouts[group_id]
        raw = self.empty_rows(group_id, count, pinned=pinned)
        return raw, raw.view(layout.dtype).view(count, *layout.shape)

    def empty_rows(self, group_id: int, count: int, *, pinned: bool = False) -> torch.Tensor:
        """``count`` blocks of a group as ``[count, nbytes]`` uint8 (:meth:`empty_blocks` without the
        typed view)."""
        nbytes = self.core.layouts[group_id].nbytes
        # vLLM's worker runs in inference mode; kvtier's loop writes these
        if torch.is_inference_mode_enabled():
            with torch.inference_mode(False):
                return torch.empty((count, nbytes), dtype=torch.uint8, pin_memory=pinned)
        return torch.empty((count, nbytes), dtype=torch.uint8, pin_memory=pinned)

    # --- coroutines (run on the loop thread) ------------------------------------------------------------
    async def fetch(self, keys: Sequence[BlockKey]) -> int:
        """Read a chain of one group's keys from wherever they are, verified, and stage the copies.

        Returns how many leading keys are now loadable. A block failing its checksum is a miss (and is
        dropped by the cache), so it is never promised to the engine. The staged copy, not the memory
        tier the cache may also promote it to, is what a later load reads: a small memory tier churned
        by other promotions cannot take a promised block away.
        """
        buffers = [self.empty_blocks(key.group_id, 1) for key in keys]
        loaded = await self.core.load(keys, [typed[0] for _, typed in buffers])
        ready = 0
        for i in range(loaded):
            if self.staging.put(keys[i], buffers[i][0][0]):
                ready += 1
            else:
                break
        return ready

    # --- pins (any thread) ---------------------------------------------------------------------------
    def lease(self, keys: Sequence[BlockKey]) -> tuple[int, ...]:
        """Pin each block where it is for a coming load; return its source per key. Thread-safe.

        Source: a memory tier index (pinned there), :data:`STAGED` (pinned in staging), or :data:`LOST`
        when a block vanished since lookup and could not be read back verified. Blocks in staging or
        a memory tier are pinned on the caller's thread; only one that left memory since its lookup
        costs a hop to the loop thread, which reads it back from a lower tier into staging.
        """
        staged = self.staging.pin_each(keys) if len(self.staging) else None
        rest = keys if staged is None else [key for key, held in zip(keys, staged, strict=True) if not held]
        where = self.core.lease(rest, self.memory_tiers)
        if staged is None and None not in where:
            return cast("tuple[int, ...]", tuple(where))  # no None in it
        leased = iter(where)
        sources: list[int | None] = [STAGED if staged is not None and staged[i] else next(leased)
                                     for i in range(len(keys))]
        missing = [i for i, source in enumerate(sources) if source is None]
        if missing:
            found = self.call(self._read_back([keys[i] for i in missing]))
            for i, source in zip(missing, found, strict=True):
                sources[i] = source
        return tuple(source if source is not None else LOST for source in sources)

    def release(self, keys: Sequence[BlockKey], sources: Sequence[int]) -> None:
        """Drop the pins :meth:`lease` took (done by :meth:`read`; only call it for a load never read)."""
        if STAGED in sources or LOST in sources:
            for key, source in zip(keys, sources, strict=True):
                if source == STAGED:
                    self.staging.unpin(key)
                    self.staging.discard(key)  # consumed: the tiers still hold the block
            self.core.release(keys, [source if source >= 0 else None for source in sources])
        else:
            self.core.release(keys, sources)

    def read(self, keys: Sequence[BlockKey], sources: Sequence[int], out: Sequence[torch.Tensor], *,
             placed: bool = False) -> bool:
        """Copy leased blocks into ``out`` (1-D uint8 each, or one ``[n, nbytes]`` uint8 tensor: typed by one
        view) on the caller's thread and release the leases.

        True if all arrived (False only when :meth:`lease` could not hold one: nothing is copied then).
        Every leased block is in memory — pinned in a memory tier or in staging — so this is memory
        copies, with no hop to the loop thread (whose wake-ups next to a busy engine thread cost
        milliseconds each). ``placed``: the scheduler, in another process, pinned the blocks in its own
        index and releases them itself (:meth:`AsyncTieredCache.read_placed`).
        """
        if placed:
            return self._read_placed(keys, sources, out)
        try:
            if LOST in sources:
                return False
            if STAGED not in sources:  # the usual case: every block pinned in a memory tier
                # a worker's [n, nbytes] load buffer goes as it is: the cache checks it once for the batch
                raw = isinstance(out, torch.Tensor) and out.dtype == torch.uint8 and out.dim() == 2
                self.core.read_leased(keys, sources, out if raw else self._typed_blocks(keys, out),
                                      touch=False)
                return True
            from_tiers = [i for i, source in enumerate(sources) if source >= 0]
            for i, source in enumerate(sources):
                if source == STAGED:
                    out[i].copy_(self.staging.get(keys[i]))
            if len(from_tiers) == len(keys):  # the usual case: every block pinned in a memory tier
                self.core.read_leased(keys, sources, self._typed_blocks(keys, out), touch=False)
            elif from_tiers:
                self.core.read_leased([keys[i] for i in from_tiers], [sources[i] for i in from_tiers],
                                      [self._typed(keys[i], out[i]) for i in from_tiers], touch=False)
            return True
        finally:
            self.release(keys, sources)

    def _read_placed(self, keys: Sequence[BlockKey], sources: Sequence[int],
                     out: Sequence[torch.Tensor]) -> bool:
        """A load the scheduler in another process placed: memory-tier blocks it pinned in its index, and
        :data:`STAGED` copies every rank staged and pinned for it (:meth:`stage_chains`); both stay pinned
        until the scheduler releases them, after vLLM completed the load on every rank."""
        if LOST in sources:  # the scheduler could not pin one: fail, never guess
            return False
        staged = [i for i, source in enumerate(sources) if source == STAGED]
        if not staged:  # the usual case: every block pinned in a memory tier, typed by one view
            self.core.read_placed(keys, sources, self._typed_blocks(keys, out))
            return True
        if staged:
            held = self.staging.pin_each([keys[i] for i in staged])  # pinned by the stage too: these stay
            try:
                if not all(held):
                    log.error("kvtier: a block the scheduler promised is not staged on this rank")
                    return False
                activity = self.core._activity
                for i in staged:
                    out[i].copy_(self.staging.get(keys[i]))
                    source = self._staged_from.get(keys[i])
                    if source is not None:  # a hit of that tier: its block reached the engine
                        activity[source].hits += 1
            finally:
                for i, was_held in zip(staged, held, strict=True):
                    if was_held:
                        self.staging.unpin(keys[i])
            if len(staged) == len(keys):
                return True
        rest = [i for i, source in enumerate(sources) if source != STAGED]
        self.core.read_placed([keys[i] for i in rest], [sources[i] for i in rest],
                              [self._typed(keys[i], out[i]) for i in rest])
        return True

    # --- the stage channel's worker end (workers in processes of their own) ---------------------------
    def stage_chains(self, chains: list[list[BlockKey]]) -> list[tuple[int, bool]]:
        """Stage chains of blocks from the slow tiers, verified and pinned, for loads the scheduler will
        place; per chain (leading blocks staged, whether the next one is missing or corrupt here).
        Thread-safe: the reads run on the loop thread."""
        futures = [self.submit(self._stage_chain(chain)) for chain in chains]
        return [future.result() for future in futures]

    def release_staged(self, keys: Sequence[BlockKey]) -> None:
        """Drop staged copies the scheduler will not load (or has loaded): unpinned and discarded."""
        for key in keys:
            self.staging.unpin(key)
            self.staging.discard(key)
            if key not in self.staging:
                self._staged_from.pop(key, None)

    async def _stage_chain(self, keys: Sequence[BlockKey]) -> tuple[int, bool]:
        if not keys:
            return 0, False
        rows = [self.empty_blocks(key.group_id, 1) for key in keys]
        found: list[int | None] = [None] * len(keys)
        lost = False
        core = self.core
        for t in self.slow_tiers:
            todo = [i for i, where in enumerate(found) if where is None]
            if not todo:
                break
            if not core.tiers[t].self_evicting:  # indexed: ask only what it holds; a failed read is a loss
                held = await core._safe_io(t, "contains", [keys[i] for i in todo])
                todo = [i for i, has in zip(todo, held, strict=True) if has]
            read = await core._safe_io(t, "get", [keys[i] for i in todo], [rows[i][0][0] for i in todo])
            for i, ok in zip(todo, read, strict=True):
                if ok:
                    found[i] = t
                elif not core.tiers[t].self_evicting:
                    core._activity[t].corrupt_or_lost += 1
        staged = 0
        for i, key in enumerate(keys):
            source = found[i]
            if source is None:
                lost = True  # missing or corrupt on this rank: the scheduler forgets it
                break
            if not self.staging.put(key, rows[i][0][0], pinned=True):
                break  # staging is full of pinned copies: a miss, not a loss
            self._staged_from[key] = source
            staged += 1
        return staged, lost

    # --- coroutines (run on the loop thread) ------------------------------------------------------------
    async def _read_back(self, keys: Sequence[BlockKey]) -> list[int]:
        """Read blocks that left memory since their lookup into staging, pinned: STAGED, or LOST."""
        sources = []
        for key in keys:
            raw, typed = self.empty_blocks(key.group_id, 1)
            if await self.core.load([key], typed) == 1 and self.staging.put(key, raw[0], pinned=True):
                sources.append(STAGED)
            else:
                log.error("kvtier: block %s vanished between lookup and load", key)
                sources.append(LOST)
        return sources

    def store(self, plan: Plan | None, keys: Sequence[BlockKey],
              rows: Sequence[torch.Tensor | None] | torch.Tensor, copied: Any = None, *,
              placed: bool = False) -> concurrent.futures.Future[int]:
        """Run the manager's store plan with the blocks' bytes (``[nbytes]`` uint8 rows, None for one whose
        pages never came; or one ``[n, nbytes]`` uint8 tensor of them all); the future says how many are
        now cached.

        With CPU tiers only and the bytes already there (no CUDA event to wait for), the plan runs on
        the caller's thread (:meth:`AsyncTieredCache.execute_now`): no wake-up of the loop thread per
        store, which cost several times the copies. Otherwise, or while a store sent to the loop has
        not finished (plans run in the order planned), it runs on the loop (:meth:`write`).
        """
        if copied is None and (self._last_write is None or self._last_write.done()):
            stored = self.core.execute_now(plan, keys, self._current_rows(keys, rows, placed)) \
                if plan is not None and keys else 0
            if stored is not None:
                future: concurrent.futures.Future[int] = concurrent.futures.Future()
                future.set_result(stored)
                return future
        blocks = [None if row is None else self._typed(key, row) for key, row in zip(keys, rows, strict=True)]
        self._last_write = self.submit(self.write(plan, keys, blocks, copied, placed=placed))
        return self._last_write

    def store_with(self, plan: Plan | None, keys: Sequence[BlockKey], fill: BlockFill, *,
                   placed: bool = False, offload_keys: Sequence[bytes] = ()
                   ) -> concurrent.futures.Future[int] | None:
        """:meth:`store` whose bytes ``fill`` writes straight into the CPU tiers' slots
        (:meth:`AsyncTieredCache.execute_with`): for a worker whose pages are on the host, with no buffer
        between its pages and the tier. None, nothing done, where the plan cannot run so on the caller's
        thread (a store still on the loop, tiers other than CPU tiers, keys of several groups or of an
        epoch before a reset): then :meth:`store` it. ``offload_keys``: vLLM's keys of ``keys`` (the
        manager's), which the mirror then takes as they are (:meth:`IndexMirror.expect`)."""
        if plan is None or not keys or (self._last_write is not None and not self._last_write.done()):
            return None
        if not placed and not all(map(bytes.startswith, map(_BLOCK_HASH, keys), repeat(self.codec.epoch))):
            return None
        keys = keys if isinstance(keys, list) else list(keys)
        if not placed and offload_keys:
            self.mirror.expect(keys, offload_keys)
        try:
            stored = self.core.execute_with(plan, keys, fill)
        finally:
            self.mirror.expect(None)
        if stored is None:
            return None
        future: concurrent.futures.Future[int] = concurrent.futures.Future()
        future.set_result(stored)
        return future

    def read_with(self, keys: Sequence[BlockKey], sources: Sequence[int], read: SlotRead, *,
                  placed: bool = False, keep_leases: bool = False) -> bool | None:
        """:meth:`read` where ``read(slab, slots)`` copies the leased blocks out of their CPU tier's slots
        itself (into the engine's pages, with no buffer between), and the leases are released. True when
        done; None, nothing done and nothing released, for a load it does not take (staged or lost
        blocks, several tiers or groups, a placed load): then :meth:`read` it. ``keep_leases``: ``read``
        only enqueued the copies (CUDA kernels), so the slots stay leased, also when ``read`` raised, and
        the caller :meth:`release` s them once the copies completed."""
        if placed or not keys or STAGED in sources or LOST in sources:
            return None
        try:
            done = self.core.read_leased_with(keys, sources, read, touch=False)
        except BaseException:
            if not keep_leases:
                self.release(keys, sources)
            raise
        if not done:
            return None
        if not keep_leases:
            self.release(keys, sources)
        return True

    def pinned_cpu_tier(self, source: int) -> bool:
        """Whether tier ``source`` is a CPU tier in page-locked memory (the CUDA kernels reach its slots)."""
        tiers = self.core.tiers
        tier = tiers[source] if type(source) is int and 0 <= source < len(tiers) else None
        return isinstance(tier, CpuTier) and tier.pinned

    def _current_rows(self, keys: Sequence[BlockKey], rows: Sequence[torch.Tensor | None] | torch.Tensor,
                      placed: bool) -> Sequence[torch.Tensor | None] | torch.Tensor:
        """``rows`` without the blocks of an epoch before a reset (never stored: never served again)."""
        epoch = self.codec.epoch
        if placed or all([key.block_hash.startswith(epoch) for key in keys]):  # KeyCodec.current, inlined
            return rows
        current = self.codec.current
        return [row if current(key) else None for key, row in zip(keys, rows, strict=True)]

    async def write(self, plan: Plan | None, keys: Sequence[BlockKey], blocks: Sequence[torch.Tensor | None],
                    copied: Any = None, *, placed: bool = False) -> int:
        """Run the manager's store plan with the blocks' bytes; return how many are now cached.

        ``copied``: a CUDA event after the copies that fill the blocks; waited for first (on this
        thread, with the GIL released by torch), so nothing is stored before its bytes arrived.
        A store a tier refused is simply a later miss. A store planned before a reset writes nothing
        (its blocks belong to the old epoch, which is never served again). ``placed``: the plan comes from
        a scheduler in another process, which owns the epoch and the index (this runtime's stays empty).
        """
        if copied is not None:
            copied.synchronize()
        if plan is None or not keys:
            return 0
        current = self.codec.current
        if not placed and not all(current(key) for key in keys):
            blocks = [block if current(key) else None for key, block in zip(keys, blocks, strict=True)]
        return await self.core.execute(plan, keys, blocks)

    def _typed_blocks(self, keys: Sequence[BlockKey], out: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        """``out`` typed as its blocks' layout: one view of a ``[n, nbytes]`` tensor whose keys are all of one
        group (a worker's load buffer), else one view per block."""
        if isinstance(out, torch.Tensor) and out.dim() == 2 and keys:
            group_id = keys[0].group_id
            layout = self.core.layouts[group_id]
            if all(key.group_id == group_id for key in keys) and out.shape == (len(keys), layout.nbytes):
                return out.view(layout.dtype).view(len(keys), *layout.shape)
        return [self._typed(key, raw) for key, raw in zip(keys, out, strict=True)]

    def _typed(self, key: BlockKey, raw: torch.Tensor) -> torch.Tensor:
        layout = self.core.layouts[key.group_id]
        return raw.view(layout.dtype).view(layout.shape)


_RUNTIMES: dict[str, OffloadRuntime] = {}
_LAST_STATS: dict[str, CacheStats] = {}
_REGISTRY_LOCK = threading.Lock()


def register_runtime(engine_id: str, runtime: OffloadRuntime) -> None:
    """Make ``runtime`` the one of ``engine_id`` in this process (a re-created worker replaces the old
    one)."""
    with _REGISTRY_LOCK:
        previous = _RUNTIMES.get(engine_id)
        _RUNTIMES[engine_id] = runtime
    if previous is not None and previous is not runtime:
        previous.close()


def release_runtime(engine_id: str, runtime: OffloadRuntime) -> None:
    """Close ``runtime`` and keep its final counters for :func:`engine_stats`."""
    with _REGISTRY_LOCK:
        if _RUNTIMES.get(engine_id) is runtime:
            del _RUNTIMES[engine_id]
    if not runtime._closed:
        _LAST_STATS.pop(engine_id, None)
        _LAST_STATS[engine_id] = runtime.stats()
        runtime.close()


def engine_stats(engine_id: str | None = None) -> CacheStats:
    """kvtier's counters for an engine in this process.

    Without ``engine_id``: the running engine if there is exactly one, else the last one shut down.
    """
    with _REGISTRY_LOCK:
        runtimes = dict(_RUNTIMES)
    if engine_id is None:
        if len(runtimes) > 1:
            raise KVTierError(f"{len(runtimes)} engines use kvtier in this process; pass engine_id "
                              f"(one of {sorted(runtimes)})")
        if runtimes:
            engine_id = next(iter(runtimes))
        elif _LAST_STATS:
            engine_id = next(reversed(_LAST_STATS))
        else:
            raise KVTierError("no vLLM engine has used kvtier in this process")
    if engine_id in runtimes:
        return runtimes[engine_id].stats()
    if engine_id in _LAST_STATS:
        return _LAST_STATS[engine_id]
    raise KVTierError(f"no kvtier runtime for engine {engine_id!r} in this process")
