"""TieredCache: lookup, load and store of KV blocks over an ordered list of tiers.

The orchestrator: :class:`kvtier.residency.Residency` decides what to move, this moves bytes between
:mod:`kvtier.tiers` in batches and turns every tier failure into a miss or a failed store
(docs/architecture.md#failure-contract). Two faces: :class:`AsyncTieredCache` (coroutines) and
:class:`TieredCache` (blocking calls over a private event-loop thread). Index mutations hold one
``threading.Lock`` (never across an ``await``), so an engine thread may pin blocks synchronously
(:meth:`AsyncTieredCache.lease`); stores and promotions also hold one asyncio lock while they plan
and execute; loads read pinned blocks without it.

One module because :class:`AsyncTieredCache` is one object with one set of invariants: the index
lock, the mutation lock, the pins a load or lease holds, the per-tier counters and the plan executor
are shared by every public method and by the lifecycle (start-up indexing, close, persist-on-close).
The decisions already live in :mod:`kvtier.residency` and :mod:`kvtier.policy`, the bytes in the
tiers. :class:`TieredCache` is thin delegation kept here so both faces import from one place.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import functools
import logging
import os
import signal
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Container, Coroutine, Iterable, Iterator, Sequence
from itertools import repeat
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, Protocol, TypeVar, cast

import torch

from kvtier.blocks import BlockKey, KVCacheSpec, all_of_group, positions_by_group
from kvtier.codec import MAX_HASH_BYTES
from kvtier.errors import CacheClosed, CacheForked, CalledOnLoopThread, KVTierConfigError, LayoutMismatch
from kvtier.hashing import Namespace
from kvtier.metrics import CacheStats, TierActivity, TierStats
from kvtier.policy import InsertHint
from kvtier.policy.admission import AdmitAll
from kvtier.residency import READY, Plan, Residency
from kvtier.tiers.base import Tier
from kvtier.tiers.buffers import RowBatch, aligned_empty, as_rows
from kvtier.tiers.cpu import CpuTier, SlotFill, SlotRead, SlotReservation, buffers_fill, rows_fill
from kvtier.tiers.file import FileTier

if TYPE_CHECKING:
    from kvtier.prometheus import MetricsServer

log = logging.getLogger(__name__)
T = TypeVar("T")
P = ParamSpec("P")
#: Seconds ``close()`` lets calls already in flight finish before it cuts them short with CacheClosed.
INFLIGHT_GRACE_SECONDS = 10.0

Blocks = torch.Tensor | Sequence[torch.Tensor]


_BLOCK_HASH = attrgetter("block_hash")
_GROUP = attrgetter("group_id")


class ResidencyWatcher(Protocol):
    """Hears of index changes (:meth:`AsyncTieredCache.add_watcher`).

    Called on the thread that made the change, with the cache's index lock held, right after it:
    a watcher must be quick and must not call back into the cache. ``residency_changed`` names keys
    whose entry in some tier was added, became readable, or was removed (a connector re-reads what
    it mirrors; registering reports every indexed key once). ``blocks_removed`` names keys that no
    tier holds any more as far as kvtier knows: evicted with no lower copy written, or lost or
    corrupt with no other copy (a self-evicting tier such as Redis expires keys unseen).
    """

    def residency_changed(self, keys: Sequence[BlockKey]) -> None: ...

    def blocks_removed(self, keys: Sequence[BlockKey]) -> None: ...


def _operation(method: Callable[Concatenate[AsyncTieredCache, P], Awaitable[T]]
               ) -> Callable[Concatenate[AsyncTieredCache, P], Coroutine[Any, Any, T]]:
    """A public coroutine of the cache: refused once closed, and known to ``close()`` while in flight."""

    @functools.wraps(method)
    async def tracked(self: AsyncTieredCache, *args: P.args, **kwargs: P.kwargs) -> T:
        task = asyncio.current_task()
        ops = self._operations
        with self._index_lock:  # execute_now reads it under the lock: it never runs beside a call on the loop
            self._check_open()
            ops[task] = ops.get(task, 0) + 1
        try:
            return await method(self, *args, **kwargs)
        except asyncio.CancelledError:
            if task in self._cut_short:
                raise CacheClosed(f"the cache was closed while this {method.__name__} was in flight "
                                  f"(it did not finish within {INFLIGHT_GRACE_SECONDS:g} s)") from None
            raise
        finally:
            with self._index_lock:
                count = ops.pop(task, 1) - 1
                if count:
                    ops[task] = count

    return tracked


class AsyncTieredCache:
    """The async core. Create with :meth:`from_config` (or directly), then ``await start()``."""

    def __init__(self, spec: KVCacheSpec, tiers: Sequence[Tier], residency: Residency,
                 namespace: Namespace | None = None, *, persist_on_close: bool | None = None,
                 persist_budget_seconds: float = 10.0) -> None:
        if len(tiers) != len(residency.tiers):
            raise ValueError(f"{len(tiers)} tiers but an index for {len(residency.tiers)}")
        self.spec = spec
        self.tiers = list(tiers)
        self.residency = residency
        self.namespace = namespace
        self.layouts = {g.group_id: g.layout for g in spec.groups}
        self._block_bytes = {g: layout.nbytes for g, layout in self.layouts.items()}
        self._activity = [TierActivity() for _ in self.tiers]
        self._capacity_seen = [tier.capacity_version for tier in self.tiers]
        self._remote = [t for t, tier in enumerate(self.tiers) if tier.self_evicting]
        #: every tier is kvtier's CPU tier, whose calls never wait: plans can run on the caller's thread
        #: (execute_now); a subclass or another kind of tier may wait, so its plans run on the loop
        self._inline = bool(self.tiers) and all(type(tier) is CpuTier for tier in self.tiers)
        #: tiers that take a caller's batch as one ``[n, nbytes]`` tensor (see :meth:`_blocks_for`)
        self._row_tiers = frozenset(t for t, tier in enumerate(self.tiers) if type(tier) is CpuTier)
        #: tiers whose get also takes a run of a caller's rows as one ``[n, nbytes]`` tensor (checked once)
        self._row_reading_tiers = self._row_tiers | {t for t, tier in enumerate(self.tiers)
                                                      if type(tier) is FileTier}
        self._mutation: asyncio.Lock | None = None
        self._index_lock = threading.Lock()
        self._watchers: list[ResidencyWatcher] = []
        self._counts = dict(lookups=0, lookup_blocks=0, lookup_hit_blocks=0, loads=0, load_blocks=0,
                            loaded_blocks=0, stored_blocks=0)
        self._started = False
        self._closed = False
        #: the process that made the cache; ``_forked`` turns True in a forked child (see _after_fork)
        self._pid = os.getpid()
        self._forked = False
        _LIVE_CORES.add(self)
        #: write the memory tiers' blocks down to the persistent tier below on close (default: when there
        #: is one, i.e. a file or Redis tier), within ``persist_budget_seconds``
        self.persist_on_close = (any(not tier.addressable for tier in self.tiers) if persist_on_close is None
                                 else persist_on_close)
        self.persist_budget_seconds = persist_budget_seconds
        #: tasks inside a public coroutine now (with their nesting count), and those close() cancelled
        self._operations: dict[asyncio.Task[Any] | None, int] = {}
        self._cut_short: set[asyncio.Task[Any] | None] = set()
        #: threads copying into or out of memory tiers outside the index lock now (load_now, store_now,
        #: execute_now, read_leased): close() waits for them before it releases the tiers' memory
        self._unlocked_copies = 0
        #: (address, port) of the Prometheus endpoint the blocking face should serve, if any
        self.metrics_endpoint: tuple[str, int] | None = None

    @classmethod
    def from_config(cls, config: Any) -> AsyncTieredCache:
        """Build from a YAML path, a dict, or a validated :class:`kvtier.config.KVTierConfig`."""
        from kvtier.config import build_cache_parts, load_config

        cfg = config if hasattr(config, "tiers") and not isinstance(config, dict) else load_config(config)
        spec, tiers, residency, namespace = build_cache_parts(cfg)
        core = cls(spec, tiers, residency, namespace, persist_on_close=cfg.placement.persist_on_close,
                   persist_budget_seconds=cfg.placement.persist_budget_seconds)
        if cfg.metrics.port is not None:
            core.metrics_endpoint = (cfg.metrics.address, cfg.metrics.port)
        return core

    # --- lifecycle ------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Index what the persistent tiers already hold (a restart keeps a warm cache). Idempotent."""
        self._check_open()
        if self._started:
            return
        self._started = True
        self._mutation = asyncio.Lock()
        for t, tier in enumerate(self.tiers):
            index = self.residency.tiers[t]
            if tier.self_evicting:
                continue
            surplus: list[BlockKey] = []
            links = tier.chain_links()  # chains survive a restart: eviction still knows tails from heads
            with self._index_lock:
                for key in tier.keys():
                    if key.group_id not in index.block_bytes or key in index:
                        continue
                    if index.victims_for(key.group_id, index.block_bytes[key.group_id]) != []:
                        surplus.append(key)
                        continue
                    index.add(key, InsertHint(predecessor=links.get(key)), ready=True)
                self._changed(index.keys())
            if surplus:
                log.info("tier %s holds %d blocks beyond its capacity; deleting them",
                         tier.name, len(surplus))
                await self._safe_delete(t, surplus)

    @property
    def closed(self) -> bool:
        return self._closed

    async def close(self) -> None:
        """Close the cache: later calls raise :class:`CacheClosed`; then close the tiers. Idempotent.

        Calls already in flight (other tasks, or other threads through :class:`TieredCache`) finish
        first; one still running after ``INFLIGHT_GRACE_SECONDS`` is cancelled and raises
        :class:`CacheClosed` to its caller, so no caller waits forever and no tier is closed under a call.
        """
        if self._closed:
            return
        with self._index_lock:  # an execute_now running on another thread finishes before this returns
            self._closed = True
        await self._settle_operations()
        if self.persist_on_close and self._started:
            await self.persist(self.persist_budget_seconds)
        for tier in self.tiers:
            try:
                await tier.close()
            except Exception:
                log.exception("closing tier %s failed", tier.name)

    async def persist(self, budget_seconds: float) -> int:
        """Write the memory tiers' blocks to the first persistent tier below them; return how many.

        Called by :meth:`close` (``placement.persist_on_close``) so that a clean restart — or a SIGTERM,
        see :class:`TieredCache` — comes back warm even with ``write_back``, which writes a block down
        only when it is evicted. Hottest blocks first; blocks a persistent tier already holds are
        skipped; the target's admission policy is bypassed (shutdown is the last chance), its eviction
        is not. Stops when ``budget_seconds`` run out (logged). Never raises for I/O.
        """
        start = time.monotonic()
        counts = [0, 0]  # written, already persistent

        async def every_tier() -> None:
            for src, target in self._persist_pairs():
                await self._persist_tier(src, target, counts)

        try:
            await asyncio.wait_for(every_tier(), budget_seconds)
        except asyncio.TimeoutError:
            log.warning("persist on close: the budget of %g s ran out after %d blocks (raise "
                        "placement.persist_budget_seconds to keep more across restarts)",
                        budget_seconds, counts[0])
        except Exception:
            log.exception("persist on close failed after %d blocks", counts[0])
        if any(counts):
            log.info("persist on close: %d blocks written down, %d already persistent, in %.2f s",
                     counts[0], counts[1], time.monotonic() - start)
        return counts[0]

    def _persist_pairs(self) -> list[tuple[int, int]]:
        """(memory tier, the first persistent tier below it) for every memory tier above a persistent one."""
        pairs = []
        for src, tier in enumerate(self.tiers):
            if not tier.addressable:
                continue
            below = [t for t in range(src + 1, len(self.tiers)) if not self.tiers[t].addressable]
            if below:
                pairs.append((src, below[0]))
        return pairs

    async def _persist_tier(self, src: int, target: int, counts: list[int], batch: int = 32) -> None:
        index = self.residency.tiers[src]
        with self._index_lock:
            keys = [key for gid, policy in index.policies.items()
                    for key in reversed(policy.victims(len(policy), ())) if index.is_ready(key)]
        lower = [t for t in range(src + 1, len(self.tiers)) if not self.tiers[t].addressable]
        assert self._mutation is not None
        for first in range(0, len(keys), batch):
            chunk = keys[first:first + batch]
            missing = [k for k in chunk if not any(k in self.residency.tiers[t] for t in lower)]
            for t in lower:
                if self.tiers[t].self_evicting and missing:
                    there = await self._safe_io(t, "contains", missing)
                    missing = [k for k, present in zip(missing, there, strict=True) if not present]
            counts[1] += len(chunk) - len(missing)
            if not missing:
                continue
            async with self._mutation:
                with self._admitting_all(target):
                    plan = self._plan_store(missing, [InsertHint(position=i) for i in range(len(missing))],
                                            only_tier=target)
                views = self.tiers[src].views(missing)
                host = [v if v.device.type == "cpu" else v.cpu() for v in views]  # GPU slabs: via host memory
                done = await self._execute(plan, missing, host)
            counts[0] += len(done)

    @contextlib.contextmanager
    def _admitting_all(self, t: int) -> Iterator[None]:
        admissions = self.residency.placement.admission
        if not isinstance(admissions, list):
            yield
            return
        saved, admissions[t] = admissions[t], AdmitAll()
        try:
            yield
        finally:
            admissions[t] = saved

    async def _settle_operations(self) -> None:
        """Wait for in-flight calls (bounded), then cancel the stragglers and wait for them to unwind."""
        me = asyncio.current_task()
        deadline = time.monotonic() + INFLIGHT_GRACE_SECONDS

        def busy() -> bool:
            return any(task is not me for task in self._operations) or self._unlocked_copies > 0

        while busy() and time.monotonic() < deadline:
            await asyncio.sleep(0.002)
        stragglers = [task for task in self._operations if task is not None and task is not me]
        if stragglers:
            log.warning("closing the cache: %d calls still in flight after %g s are cut short",
                        len(stragglers), INFLIGHT_GRACE_SECONDS)
            self._cut_short.update(stragglers)
            for task in stragglers:
                task.cancel()
            await asyncio.wait(stragglers, timeout=INFLIGHT_GRACE_SECONDS)

    def _check_open(self) -> None:
        self._check_process()
        if self._closed:
            raise CacheClosed("the cache is closed")

    def _check_process(self) -> None:
        """Refuse every call in a forked child: the loop and the tiers' I/O and copy threads stayed in
        the parent, so a call would wait for them forever (the index lock is a new one there, see
        _after_fork, so the check under it is reached)."""
        if self._forked:
            raise CacheForked(f"this cache was made in process {self._pid} and this is its forked child "
                              f"{os.getpid()}: its loop and I/O threads did not survive the fork; make a "
                              f"new cache in the child (or start it with the 'spawn' method)")

    async def __aenter__(self) -> AsyncTieredCache:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- public API -----------------------------------------------------------------------------------
    @_operation
    async def lookup(self, keys: Sequence[BlockKey]) -> int:
        """Number of leading ``keys`` cached in some tier. Reads no block data; never raises for I/O."""
        await self.start()
        self._check_keys(keys)
        found = await self._locate(keys)
        self._counts["lookups"] += 1
        self._counts["lookup_blocks"] += len(keys)
        self._counts["lookup_hit_blocks"] += len(found)
        return len(found)

    @_operation
    async def load(self, keys: Sequence[BlockKey], out: Blocks) -> int:
        """Fill ``out`` with the leading cached blocks of ``keys``; return how many are valid.

        Blocks ``[0, n)`` of ``out`` are bit-exact copies of what was stored; blocks from ``n`` on
        are unspecified. A block that fails validation in a tier is a miss there (and is deleted).
        Hits in a lower tier are promoted per the placement policy before this returns (the copy
        reads ``out``, so the caller may reuse ``out`` as soon as this returns).
        """
        await self.start()
        buffers = self._byte_blocks(keys, out, "out")
        self._counts["loads"] += 1
        self._counts["load_blocks"] += len(keys)
        located = await self._locate(keys)
        indexes = self.residency.tiers
        with self._index_lock:
            where = self._still_ready(keys, located)
            n = len(where)
            one_tier = n > 0 and where.count(where[0]) == n  # the usual load: per-key steps in one call each
            if one_tier:
                indexes[where[0]].pin_many(keys[:n])
            else:
                for t, key in zip(where, keys, strict=False):
                    indexes[t].pin(key)
        ok = [False] * n
        try:
            by_tier: dict[int, list[int]] = {}
            if one_tier:
                by_tier[where[0]] = list(range(n))
            else:
                for i, t in enumerate(where):
                    by_tier.setdefault(t, []).append(i)
            results = await _together([
                self._safe_io(t, "get", [keys[i] for i in idx],
                              self._blocks_for(t, buffers, idx, writable=True, reading=True))
                for t, idx in by_tier.items()])
            for (t, idx), res in zip(by_tier.items(), results, strict=True):
                if one_tier and len(res) == n and False not in res:
                    ok = [True] * n
                    continue
                failed = []
                for i, hit in zip(idx, res, strict=True):
                    ok[i] = hit
                    if not hit:
                        self._activity[t].corrupt_or_lost += 1
                        failed.append(keys[i])
                await self._forget_lost(t, failed)
        finally:
            with self._index_lock:
                if one_tier:
                    indexes[where[0]].unpin_many(keys[:n])
                else:
                    for t, key in zip(where, keys, strict=False):
                        indexes[t].unpin(key)
        loaded = ok.index(False) if False in ok else n
        served = [0] * len(self.tiers)  # hits per tier
        with self._index_lock:
            if one_tier and loaded:
                served[where[0]] = loaded
                if not self.tiers[where[0]].self_evicting:
                    self.residency.touch_all(where[0], keys[:loaded])
            else:
                for t, key in zip(where[:loaded], keys, strict=False):
                    served[t] += 1
                    if not self.tiers[t].self_evicting:
                        self.residency.touch(t, key)
        # a tier misses every block the walk down the hierarchy asked it for and it did not serve
        below = loaded
        for activity, hits in zip(self._activity, served, strict=True):
            activity.hits += hits
            below -= hits
            activity.misses += below + len(keys) - loaded
        self._counts["loaded_blocks"] += loaded
        await self._promote(keys[:loaded], where[:loaded], buffers[:loaded])
        return loaded

    @_operation
    async def store(self, keys: Sequence[BlockKey], blocks: Blocks,
                    hints: Sequence[InsertHint] | None = None,
                    predecessors: Sequence[BlockKey | None] | None = None) -> int:
        """Store blocks (already cached keys are only touched); return how many are now cached.

        ``blocks`` is a ``[n, *layout.shape]`` tensor of the group's dtype, or one such block per key.
        The bytes are copied before this returns. A block no tier could take is simply not cached.
        ``predecessors`` (aligned with ``keys``; ``None`` = a chain head or unknown) names the block
        before each one in its prefix chain: chain-aware eviction (the default) then evicts a
        chain's tail before its head, and file tiers keep the link across restarts.
        """
        await self.start()
        buffers = self._byte_blocks(keys, blocks, "blocks")
        hints = _chain_hints(keys, hints, predecessors)
        assert self._mutation is not None
        async with self._mutation:
            plan = self._plan_store(keys, hints)
            stored = await self._execute(plan, keys, buffers)
        count = len(set(stored) | set(plan.skipped)) if plan.skipped else len(stored)  # stored: distinct
        self._counts["stored_blocks"] += count
        return count

    def plan_store(self, keys: Sequence[BlockKey], hints: Sequence[InsertHint] | None = None) -> Plan:
        """Decide a store now, on the caller's thread (thread-safe, no I/O); :meth:`execute` runs it later.

        For an engine whose scheduler owns placement while its workers move the bytes (vLLM): room is
        made in the index at once, and victims that leave every tier are reported to the watchers now,
        so the scheduler hears of an eviction from the call that caused it. The planned writes stay
        pending (invisible to lookups, never victims) until executed. Every plan must be executed,
        with or without its bytes, in the order planned.
        """
        self._check_keys(keys)
        if hints is None:
            hints = [InsertHint(position=i) for i in range(len(keys))]
        with self._index_lock:
            self._check_open()
            plan = self.residency.plan_store(keys, hints)
            drops = [key for dropped in plan.drops for key in dropped]
            if drops:
                self._changed(drops)
                demoted = {key for moves in plan.demotions for key, _ in moves}
                self._report_removed([key for key in drops if key not in demoted])
        return plan

    @_operation
    async def execute(self, plan: Plan, keys: Sequence[BlockKey],
                      blocks: Sequence[torch.Tensor | None]) -> int:
        """Run a plan from :meth:`plan_store` with the blocks' bytes; return how many of ``keys`` are
        now cached.

        ``blocks[i]`` is key ``i``'s block, or None when its bytes never came (its planned writes fail,
        the rest of the plan still runs). Plans run one at a time, in the order they were submitted.
        """
        await self.start()
        buffers: list[torch.Tensor | None] = list(blocks)
        present = [i for i, block in enumerate(buffers) if block is not None]
        checked = self._byte_blocks([keys[i] for i in present],
                                    [cast("torch.Tensor", buffers[i]) for i in present], "blocks")
        for i, row in zip(present, checked, strict=True):
            buffers[i] = row
        assert self._mutation is not None
        async with self._mutation:
            stored = await self._execute(plan, keys, buffers, planned=True)
        count = len(stored)
        self._counts["stored_blocks"] += count
        return count

    def execute_now(self, plan: Plan, keys: Sequence[BlockKey],
                    rows: Sequence[torch.Tensor | None] | torch.Tensor) -> int | None:
        """Run a plan from :meth:`plan_store` on the caller's thread if it can be; else None (then
        :meth:`execute` it).

        For an engine's worker storing into CPU tiers (vLLM's, next to its scheduler): the index updates
        run under the index lock and the copies with it released (other threads' lookups and loads go on
        meanwhile), without a hop to the loop thread, whose wake-ups cost more CPU than the copies. It
        runs only when every tier is a CPU tier (their calls never wait) and no call is in flight on the
        loop; the caller keeps plans in order (none of its plans may be
        queued on the loop meanwhile). ``rows[i]``: key ``i``'s block as ``[nbytes]`` uint8 on the CPU
        (no copy), or None when its bytes never came (its planned writes fail); or ``rows`` is one
        contiguous ``[len(keys), nbytes]`` uint8 CPU tensor holding every key's block (keys of one
        group), checked once and copied into each tier with one call. Returns how many of ``keys``
        are now cached.
        """
        count = rows.shape[0] if isinstance(rows, torch.Tensor) and rows.dim() else len(rows)
        if count != len(keys):
            raise LayoutMismatch(f"{len(keys)} keys but {count} rows")
        batch = self._row_batch(keys, rows) if isinstance(rows, torch.Tensor) else None
        if batch is None:
            self._check_rows(keys, rows)
        return self._execute_inline(plan, keys, rows, batch, None)

    def execute_with(self, plan: Plan, keys: Sequence[BlockKey], fill: BlockFill) -> int | None:
        """:meth:`execute_now` whose blocks ``fill`` writes straight into the CPU tiers' slots, with no
        buffer between (an engine's worker gathering its pages into the slab rows).

        ``fill(slab, slots, idx)``: write the blocks of ``keys[i] for i in idx`` (every key, in order,
        when ``idx`` is None) into rows ``slots`` of ``slab``, a CPU tier's ``[num_slots, nbytes]`` uint8
        slab (:meth:`CpuTier.put_with`); it may be called once per tier the plan writes. None (nothing
        done) where :meth:`execute_now` would return None, or when ``keys`` are not of one group.
        """
        if not keys:
            return None
        group_id = getattr(keys[0], "group_id", None)
        if type(group_id) is not int or group_id not in self._block_bytes or not all(
                map(isinstance, keys, repeat(BlockKey))) or not all_of_group(keys, group_id):
            return None
        return self._execute_inline(plan, keys, None, None, fill)

    def store_now(self, keys: Sequence[BlockKey], blocks: Blocks,
                  hints: Sequence[InsertHint] | None = None,
                  predecessors: Sequence[BlockKey | None] | None = None) -> int | None:
        """:meth:`store` on the caller's thread, if it can run there; else None, nothing done (then
        ``await store``).

        It runs there when every tier is a CPU tier and no call runs on the loop: planning and index
        updates under the index lock, the copies with it released, as :meth:`execute_now` runs a plan.
        Handing such a store
        to the loop thread costs more than its own work (docs/architecture.md, "Calls on the caller's
        thread"). Same checks (raised here), counts and result as :meth:`store`.
        """
        if not keys or not self._inline or not self._started:
            return None
        buffers = self._byte_blocks(keys, blocks, "blocks")
        batch = _cpu_rows(buffers)
        hints = _chain_hints(keys, hints, predecessors)
        with self._index_lock:
            self._check_open()
            if not self._runs_inline():
                return None
            plan = self.residency.plan_store(keys, hints)
            drops = [key for dropped in plan.drops for key in dropped]
            self._changed(drops)
            writes = self._begin_inline(plan, keys, None if batch is not None else buffers, batch, None)
        return self._end_inline(writes, self._fill_inline(writes), drops, plan.skipped)

    def load_now(self, keys: Sequence[BlockKey], out: Blocks) -> int | None:
        """:meth:`load` on the caller's thread, if every key sits READY in the top tier and that is a CPU
        tier (the load is then memory copies, with nothing to promote); else None, nothing done (then
        ``await load``).

        The keys are pinned while their blocks are copied, as :meth:`read_leased` copies leased blocks;
        same checks (raised here), counts, recency and result as :meth:`load`.
        """
        if not keys or not self._started or type(self.tiers[0]) is not CpuTier:
            return None
        buffers = self._byte_blocks(keys, out, "out")
        batch = _cpu_rows(buffers)
        index = self.residency.tiers[0]
        with self._index_lock:
            self._check_open()
            if list(map(index.entries.get, keys)).count(READY) != len(keys):
                return None
            index.pin_many(keys)
            self._unlocked_copies += 1
        try:
            every = {0: list(range(len(keys)))}
            self._copy_leased(keys, batch, None if batch is not None else buffers, every, touch=True)
        finally:
            with self._index_lock:
                index.unpin_many(keys)
                self._unlocked_copies -= 1
        return len(keys)

    def _execute_inline(self, plan: Plan, keys: Sequence[BlockKey],
                        rows: Sequence[torch.Tensor | None] | torch.Tensor | None, batch: torch.Tensor | None,
                        fill: BlockFill | None) -> int | None:
        """:meth:`execute_now` (``rows``, or their checked ``batch``) or :meth:`execute_with` (``fill``)."""
        with self._index_lock:
            self._check_open()
            if not self._runs_inline():
                return None
            writes = self._begin_inline(plan, keys, rows, batch, fill)
        return self._end_inline(writes, self._fill_inline(writes),
                                [k for moves in plan.demotions for k, _ in moves], ())

    def _runs_inline(self) -> bool:
        """Whether a plan may run on the caller's thread now (index lock held): every tier is a CPU tier,
        nothing runs on the loop, and no tier changed its capacity since the index last followed it."""
        return self._inline and self._started and not self._operations and all(
            tier.capacity_version == seen for tier, seen in zip(self.tiers, self._capacity_seen, strict=True))

    def _begin_inline(self, plan: Plan, keys: Sequence[BlockKey],
                      rows: Sequence[torch.Tensor | None] | torch.Tensor | None, batch: torch.Tensor | None,
                      fill: BlockFill | None) -> list[_InlineWrite]:
        """Start running ``plan`` through the CPU tiers' synchronous calls (index lock held,
        :meth:`_runs_inline` true): demotions and drops bottom-up, then a slot for each write. The
        writes' copies (:meth:`_fill_inline`) then run with the lock released, and
        :meth:`_end_inline` settles them: a copy of megabytes never holds up another thread's lookup
        or load (docs/architecture.md, "Calls on the caller's thread")."""
        for t in reversed(range(len(self.tiers))):
            if plan.demotions[t]:
                self._demote_now(t, plan.demotions[t])
            if plan.drops[t]:
                self._activity[t].evictions += len(plan.drops[t])
                self._io_now(t, "delete", plan.drops[t])
        writes: list[_InlineWrite] = []
        for t, all_idx in enumerate(plan.writes):
            if not all_idx:
                continue
            # a tier reserves one group's slots at a time; only separate buffers can span groups
            parts = [all_idx] if fill is not None or batch is not None else _by_group(keys, all_idx)
            writes += [self._reserve_inline(t, idx, keys, rows, batch, fill) for idx in parts]
        self._unlocked_copies += 1
        return writes

    def _reserve_inline(self, t: int, idx: list[int], keys: Sequence[BlockKey],
                        rows: Sequence[torch.Tensor | None] | torch.Tensor | None, batch: torch.Tensor | None,
                        fill: BlockFill | None) -> _InlineWrite:
        """:meth:`_begin_inline`'s slots in tier ``t`` for ``keys[i] for i in idx`` (one group's)."""
        tier = cast("CpuTier", self.tiers[t])
        write = _InlineWrite(t, idx, [keys[i] for i in idx])
        if fill is not None:  # the tier hands its slots to the caller's fill: no buffer between
            write.fill = _fill_of(fill, idx, len(keys))
        elif batch is not None:  # every row is there, checked: the tier copies the batch in one call
            write.fill = rows_fill(_take_rows(batch, idx), tier.copier)
        else:
            assert rows is not None
            present = [j for j, i in enumerate(idx) if rows[i] is not None]
            write.fill = buffers_fill([cast("torch.Tensor", rows[idx[j]]) for j in present], tier.copier)
            if len(present) != len(idx):
                write.present = present
        reserved = [write.keys[j] for j in write.present] if write.present is not None else write.keys
        if reserved:
            try:
                write.reservation = tier.reserve(reserved)
            except Exception as exc:  # as _io_now: logged, counted, all-False
                self._tier_failed(t, "put", len(reserved), exc)
        return write

    def _fill_inline(self, writes: list[_InlineWrite]) -> BaseException | None:
        """The copies of :meth:`_begin_inline`'s writes, index lock released. A failed copy fails its
        blocks (logged, counted). A :class:`LayoutMismatch` from a caller's fill, or anything that is not
        an ``Exception`` (``KeyboardInterrupt``), is returned, to be raised once the writes are settled;
        after the latter, no further write is filled (their slots are freed, their blocks fail)."""
        raised: BaseException | None = None
        for write in writes:
            reservation = write.reservation
            if reservation is None or write.fill is None:
                continue
            tier = cast("CpuTier", self.tiers[write.t])
            if raised is not None and not isinstance(raised, Exception):
                write.failed = True
                tier.cancel(reservation)
                continue
            start = time.perf_counter()
            try:
                tier.fill(reservation, write.fill)
            except BaseException as exc:
                write.failed = True
                if isinstance(exc, Exception) and not isinstance(exc, LayoutMismatch):
                    self._tier_failed(write.t, "put", len(reservation.keys), exc)  # a tier fault
                else:  # the caller's fault or an interrupt: raised once settled, no key left pending
                    raised = exc
            else:
                write.seconds = time.perf_counter() - start
        return raised

    def _end_inline(self, writes: list[_InlineWrite], raised: BaseException | None,
                    removed: Iterable[BlockKey], skipped: Sequence[int]) -> int:
        """Settle :meth:`_begin_inline`'s writes (taking the index lock; it runs even if the cache closed
        meanwhile: close() waits for it) and count them. Returns how many of the plan's keys are now
        stored in some tier, with ``skipped`` (already there; a key written to two tiers counts once);
        raises ``raised`` (from :meth:`_fill_inline`) after settling."""
        stored: set[int] = set()
        with self._index_lock:
            try:
                for write in writes:
                    oks = write.outcomes()
                    index, activity = self.residency.tiers[write.t], self._activity[write.t]
                    written, idx = write.keys, write.idx
                    if all(oks):
                        index.settle_many(written, True)  # Residency.finish_write of each
                        stored.update(idx)
                        good = len(written)
                    else:
                        index.settle_many([k for k, ok in zip(written, oks, strict=True) if ok], True)
                        index.settle_many([k for k, ok in zip(written, oks, strict=True) if not ok], False)
                        stored.update(i for i, ok in zip(idx, oks, strict=True) if ok)
                        good = sum(oks)
                    if write.seconds is not None:
                        activity.observe("put", write.seconds)
                    activity.stores += good
                    activity.failed_stores += len(written) - good
                    self._changed(written)
                self._report_removed(removed)
                count = len(stored.union(skipped)) if skipped else len(stored)
                self._counts["stored_blocks"] += count
            finally:
                self._unlocked_copies -= 1
        if raised is not None:
            raise raised
        return count

    def _tier_failed(self, t: int, op: str, count: int, exc: BaseException) -> None:
        """A call of tier ``t`` on ``count`` blocks raised ``exc``: counted by kind and logged (its blocks
        fail; the cache goes on)."""
        tier = self.tiers[t]
        tier.counters.error(type(exc).__name__)
        log.warning("tier %s: %s of %d blocks failed: %r", tier.name, op, count, exc)

    def _row_batch(self, keys: Sequence[BlockKey], rows: torch.Tensor) -> torch.Tensor | None:
        """``rows`` if it is one contiguous ``[len(keys), nbytes]`` uint8 CPU tensor of one group's
        blocks (checked once for the batch); None for a caller's tensor that is not (an empty batch,
        keys of several groups): :meth:`_check_rows` then names what is wrong row by row."""
        group_id = getattr(keys[0], "group_id", None) if keys else None
        nbytes = self._block_bytes.get(group_id) if type(group_id) is int else None
        if (nbytes is None or rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != nbytes
                or rows.device.type != "cpu" or not rows.is_contiguous()):
            return None
        for key in keys:
            if not isinstance(key, BlockKey) or key.group_id != group_id:
                return None
        return rows

    def _check_rows(self, keys: Sequence[BlockKey],
                    rows: Sequence[torch.Tensor | None] | torch.Tensor) -> None:
        """Raise naming the first key or row of :meth:`execute_now` that is not a valid block."""
        block_bytes, uint8, cpu = self._block_bytes, torch.uint8, torch.device("cpu")
        for i, (key, row) in enumerate(zip(keys, rows, strict=True)):
            if row is None:
                continue
            nbytes = block_bytes.get(key.group_id) if isinstance(key, BlockKey) else None
            if nbytes is None:
                self._check_keys([key])  # raises, naming what is wrong with it
                raise AssertionError  # pragma: no cover - _check_keys raised
            if (not isinstance(row, torch.Tensor) or row.dtype != uint8 or row.dim() != 1
                    or row.numel() != nbytes or row.device != cpu or not row.is_contiguous()):
                raise LayoutMismatch(f"rows[{i}] must be a contiguous [{nbytes}] uint8 CPU tensor, got "
                                     + (f"{row.dtype} {tuple(row.shape)} on {row.device}"
                                        if isinstance(row, torch.Tensor) else type(row).__name__))

    def _demote_now(self, src: int, moves: list[tuple[BlockKey, int]]) -> None:
        """:meth:`_demote` between CPU tiers, on the caller's thread (index lock held)."""
        keys = [k for k, _ in moves]
        views = self.tiers[src].views(keys)
        by_dst: dict[int, list[int]] = {}
        for i, (_, dst) in enumerate(moves):
            by_dst.setdefault(dst, []).append(i)
        for dst, idx in by_dst.items():
            res = self._io_now(dst, "put", [keys[i] for i in idx], [views[i] for i in idx])
            for i, ok in zip(idx, res, strict=True):
                self.residency.finish_demotion(src, dst, keys[i], ok)
                if ok:
                    self._activity[src].demotions_out += 1
                    self._activity[dst].stores += 1
                else:
                    self._activity[dst].failed_stores += 1
            self._changed(keys[i] for i in idx)

    def _io_now(self, t: int, op: str, keys: list[BlockKey], *args: Any,
                call: Callable[..., list[bool] | None] | None = None) -> list[bool]:
        """:meth:`_safe_io` for a CPU tier, on the caller's thread: ``call`` or its synchronous ``<op>_now``
        when it has one (no coroutine per call: a store's hot path), else its coroutine, which finishes
        without waiting."""
        if not keys:
            return []
        tier = self.tiers[t]
        if call is None:
            call = getattr(tier, f"{op}_now", None)
        if call is None:
            try:
                result = _run_now(self._safe_io(t, op, keys, *args))
            except RuntimeError as exc:  # the tier's call waited: it cannot run here
                self._tier_failed(t, op, len(keys), exc)
                return [False] * len(keys)
            return [True] * len(keys) if result is None else result
        start = time.perf_counter()
        try:
            done = call(keys, *args)
        except LayoutMismatch:
            raise
        except Exception as exc:  # as _safe_io: logged, counted, all-False
            self._tier_failed(t, op, len(keys), exc)
            return [False] * len(keys)
        self._activity[t].observe(op, time.perf_counter() - start)
        return [True] * len(keys) if done is None else done

    def touch(self, keys: Sequence[BlockKey]) -> None:
        """Mark each key recently used in the top-most tier holding it READY (thread-safe, no I/O)."""
        tiers = [(index.entries, index.policies) for index in self.residency.tiers]
        with self._index_lock:
            self._check_open()
            for key in keys:
                for entries, policies in tiers:
                    if entries.get(key) == READY:
                        policies[key.group_id].access(key)  # Residency.touch, inlined: an engine's hot path
                        break

    def settle(self, plan: Plan, keys: Sequence[BlockKey], ok: bool = True) -> None:
        """Record a plan as executed elsewhere (thread-safe, no I/O): its writes and demotions become
        readable (or are forgotten when ``ok`` is False). For a scheduler whose workers, in other
        processes, ran the plan on their own tiers (:meth:`execute` there). Like :meth:`release`, a no-op
        once closed (an engine's shutdown path may still settle), and in a forked child."""
        with self._index_lock:
            if self._closed or self._forked:
                return
            changed: list[BlockKey] = []
            for t in reversed(range(len(self.tiers))):
                for key, dst in plan.demotions[t]:
                    self.residency.finish_demotion(t, dst, key, ok)
                    changed.append(key)
                    if ok:
                        self._activity[t].demotions_out += 1
                        self._activity[dst].stores += 1
                self._activity[t].evictions += len(plan.drops[t])
            for t, idx in enumerate(plan.writes):
                if not idx:
                    continue
                written = [keys[i] for i in idx]
                self.residency.tiers[t].settle_many(written, ok)  # Residency.finish_write of each
                changed += written
                if ok:
                    self._activity[t].stores += len(idx)
                else:
                    self._activity[t].failed_stores += len(idx)
            self._changed(changed)
            if not ok:
                self._report_removed(key for moves in plan.demotions for key, _ in moves)

    def read_placed(self, keys: Sequence[BlockKey], where: Sequence[int], out: Blocks) -> None:
        """Copy blocks from memory tiers where another process's index placed and pinned them.

        For a worker whose scheduler (in another process) owns the index: it pinned the blocks until
        this read is acknowledged, so they are there. Raises ``ValueError`` for a block a tier does not
        hold (a scheduler and worker out of step: a bug, never served as data).
        """
        self._check_open()
        buffers = self._byte_blocks(keys, out, "out")
        by_tier: dict[int, list[int]] = {}
        for i, t in enumerate(where):
            by_tier.setdefault(t, []).append(i)
        for t, idx in by_tier.items():
            start = time.perf_counter()
            try:
                views = self.tiers[t].views([keys[i] for i in idx])
            except KeyError as exc:
                raise ValueError(f"{exc.args[0]} is not in memory tier {self.tiers[t].name}: the scheduler's "
                                 f"index and this worker's tiers are out of step") from None
            for i, view in zip(idx, views, strict=True):
                buffers[i].copy_(view)
            self._count_memory_read(t, idx, keys, sum(buffers[i].numel() for i in idx),
                                    time.perf_counter() - start, touch=False, misses_above=False)
        self._count_load(len(keys))

    def lease(self, keys: Sequence[BlockKey], tiers: Iterable[int] | None = None) -> list[int | None]:
        """Pin each key where a readable copy is, for a read that comes later; thread-safe, never
        blocks on I/O.

        Per key: the top-most of ``tiers`` (default: every tier kvtier indexes) holding it READY,
        now pinned there, or None (nothing pinned). Until :meth:`release`, a pinned copy is never
        evicted, demoted away or overwritten (docs/architecture.md#pins), so a :meth:`load` reads it.
        Meant for engines that promise blocks on another thread than the cache's loop (vLLM's scheduler):
        one lock instead of a hop to the loop. Self-evicting tiers (Redis) cannot be pinned.
        """
        indexes = self.residency.tiers
        candidates = [(t, indexes[t].entries, indexes[t].pins)
                      for t in (range(len(indexes)) if tiers is None else tiers)
                      if not self.tiers[t].self_evicting]
        where: list[int | None] = []
        append = where.append
        with self._index_lock:
            self._check_open()
            for key in keys:
                for t, entries, pins in candidates:
                    if entries.get(key) == READY:
                        # TierIndex.pin, inlined: this is an engine's hot path
                        pins[key] = pins.get(key, 0) + 1
                        append(t)
                        break
                else:
                    append(None)
        return where

    def release(self, keys: Sequence[BlockKey], where: Sequence[int | None]) -> None:
        """Drop the pins :meth:`lease` took (``where`` is what it returned); thread-safe.

        The one call that does not raise :class:`CacheClosed` after close (or in a forked child): it has
        nothing left to do."""
        indexes = self.residency.tiers
        with self._index_lock:
            if self._closed or self._forked:
                return  # pins die with the cache: an engine's shutdown path may still release them
            for key, t in zip(keys, where, strict=True):
                if t is not None:
                    pins = indexes[t].pins  # TierIndex.unpin, inlined (hot path)
                    count = pins.get(key, 0) - 1
                    if count > 0:
                        pins[key] = count
                    else:
                        pins.pop(key, None)

    def read_leased(self, keys: Sequence[BlockKey], where: Sequence[int], out: Blocks, *,
                    touch: bool = True) -> None:
        """Copy blocks that :meth:`lease` pinned in memory tiers into ``out``, on the caller's thread.

        Thread-safe, no I/O: the copies are memory copies, with no hop to the loop thread — whose
        wake-ups cost milliseconds next to an engine thread that keeps the GIL busy. Counts hits and
        refreshes recency as :meth:`load` does (unless ``touch`` is False: an engine that reports recency
        itself, through :meth:`touch`); does not promote (the caller chose the copy where it
        is). The pins stay: :meth:`release` them after. Raises ``ValueError`` for a key that is not
        pinned READY in its memory tier (a caller bug: such a copy could change under the read).
        ``out`` may also be one contiguous ``[len(keys), nbytes]`` uint8 CPU tensor of one group's rows
        (an engine's load buffer): checked once for the batch and filled with one copy per tier.
        """
        # one [n, nbytes] uint8 tensor of one group's rows (an engine's load buffer): checked once, never
        # split into a tensor per block
        batch = self._row_batch(keys, out) if isinstance(out, torch.Tensor) and keys else None
        buffers = None if batch is not None else self._byte_blocks(keys, out, "out")
        by_tier: dict[int, list[int]] = {}
        indexes, tiers = self.residency.tiers, self.tiers
        with self._index_lock:
            self._check_open()
            first = where[0] if len(where) == len(keys) and keys else None
            if first is not None and where.count(first) == len(where) and tiers[first].addressable:
                # one memory tier holds them all (the usual case): one pass over the keys, no per-key tier
                pins, entries = indexes[first].pins, indexes[first].entries
                for key in keys:
                    if key not in pins or entries.get(key) != READY:
                        raise ValueError(f"{key} is not leased in memory tier {tiers[first].name}")
                by_tier[first] = list(range(len(keys)))
            for i, (key, t) in enumerate(zip(keys, where, strict=True) if not by_tier else ()):
                index = indexes[t]
                if not tiers[t].addressable or key not in index.pins or index.entries.get(key) != READY:
                    raise ValueError(f"{key} is not leased in memory tier {tiers[t].name}")
                idx = by_tier.get(t)
                if idx is None:
                    by_tier[t] = [i]
                else:
                    idx.append(i)
            self._unlocked_copies += 1
        try:
            self._copy_leased(keys, batch, buffers, by_tier, touch)
        finally:
            with self._index_lock:
                self._unlocked_copies -= 1

    def read_leased_with(self, keys: Sequence[BlockKey], where: Sequence[int], read: SlotRead, *,
                         touch: bool = True) -> bool:
        """:meth:`read_leased` where ``read(slab, slots)`` copies the blocks out of their slots itself (into
        an engine's pages, with no buffer between; :meth:`CpuTier.get_with`).

        Only for keys of one group that one CPU tier holds (the usual load): False, nothing done, for any
        other (then :meth:`read_leased`). Raises ``ValueError`` for a key not pinned READY there, as
        :meth:`read_leased` does. The pins stay: :meth:`release` them after.
        """
        if not keys or len(where) != len(keys):
            return False
        first = where[0]
        tier = self.tiers[first] if type(first) is int and 0 <= first < len(self.tiers) else None
        group_id = keys[0].group_id
        if type(tier) is not CpuTier or where.count(first) != len(where) or not all_of_group(keys, group_id):
            return False
        index = self.residency.tiers[first]
        with self._index_lock:
            self._check_open()
            pins, entries = index.pins, index.entries
            if not pins.keys() >= set(keys) or list(map(entries.get, keys)).count(READY) != len(keys):
                bad = next(key for key in keys if key not in pins or entries.get(key) != READY)
                raise ValueError(f"{bad} is not leased in memory tier {tier.name}")
            self._unlocked_copies += 1
        try:
            start = time.perf_counter()
            tier.get_with(keys, read)
            nbytes = len(keys) * self._block_bytes[group_id]
            self._count_memory_read(first, list(range(len(keys))), keys, nbytes, time.perf_counter() - start,
                                    touch=touch, misses_above=True)
            self._count_load(len(keys))
        finally:
            with self._index_lock:
                self._unlocked_copies -= 1
        return True

    def _copy_leased(self, keys: Sequence[BlockKey], batch: torch.Tensor | None,
                     buffers: Sequence[torch.Tensor] | None, by_tier: dict[int, list[int]],
                     touch: bool) -> None:
        """Copy leased blocks into ``batch`` (``[n, nbytes]`` rows) or ``buffers`` (1-D, one per key)."""
        for t, idx in by_tier.items():
            start = time.perf_counter()
            tier = self.tiers[t]
            whole = len(idx) == len(keys)
            tier_keys = keys if whole else [keys[i] for i in idx]
            # rows of one caller tensor (an engine's load buffer) out of a CPU tier: one call for the batch
            if batch is not None:
                rows = batch if whole else None
                nbytes = len(idx) * batch.shape[1]
            else:
                assert buffers is not None
                rows = as_rows([buffers[i] for i in idx]) if type(tier) is CpuTier and len(idx) > 1 else None
                nbytes = sum(buffers[i].numel() for i in idx)
            if rows is None or type(tier) is not CpuTier or \
                    not cast("CpuTier", tier).read_rows(tier_keys, rows):
                targets = batch.unbind(0) if batch is not None else cast("Sequence[torch.Tensor]", buffers)
                for i, view in zip(idx, tier.views(tier_keys), strict=True):
                    targets[i].copy_(view)
            self._count_memory_read(t, idx, keys, nbytes, time.perf_counter() - start, touch=touch,
                                    misses_above=True)
        self._count_load(len(keys))

    def _count_memory_read(self, t: int, idx: list[int], keys: Sequence[BlockKey], nbytes: int,
                           elapsed: float, *, touch: bool, misses_above: bool) -> None:
        """Counters (and recency, with ``touch``) of blocks copied out of memory tier ``t`` on the
        caller's thread (``nbytes`` of them)."""
        with self._index_lock:
            tier, activity = self.tiers[t], self._activity[t]
            tier.counters.add_reads(len(idx), nbytes, elapsed)
            activity.observe("get", elapsed)
            activity.hits += len(idx)
            if touch:
                self.residency.touch_all(t, keys if len(idx) == len(keys) else [keys[i] for i in idx])
            if misses_above:
                for above in self._activity[:t]:
                    above.misses += len(idx)

    def _count_load(self, blocks: int) -> None:
        with self._index_lock:
            self._counts["loads"] += 1
            self._counts["load_blocks"] += blocks
            self._counts["loaded_blocks"] += blocks

    @_operation
    async def clear(self, tiers: Iterable[int]) -> list[BlockKey]:
        """Delete every block of ``tiers`` that no read has pinned (an engine's cache reset); return
        their keys.

        Self-evicting tiers (Redis) are skipped: kvtier does not know what they hold.
        """
        await self.start()
        assert self._mutation is not None
        dropped: list[BlockKey] = []
        async with self._mutation:  # no store is planning room in these tiers meanwhile
            for t in tiers:
                if self.tiers[t].self_evicting:
                    continue
                index = self.residency.tiers[t]
                with self._index_lock:
                    keys = [key for key in index.keys() if key not in index.pins]
                    for key in keys:
                        self.residency.forget(t, key)
                    self._changed(keys)
                    self._report_removed(keys)
                await self._safe_delete(t, keys)
                self._activity[t].evictions += len(keys)
                dropped += keys
        return dropped

    def add_watcher(self, watcher: ResidencyWatcher) -> None:
        """Tell ``watcher`` of index changes from now on, after reporting every indexed key to it once."""
        with self._index_lock:
            self._check_open()
            self._watchers.append(watcher)
            known: set[BlockKey] = set()
            for index in self.residency.tiers:
                known.update(index.keys())
            if known:
                watcher.residency_changed(list(known))

    def stats(self) -> CacheStats:
        """A snapshot of counters; cheap, safe to call at any time."""
        tiers = []
        for t, tier in enumerate(self.tiers):
            a, c = self._activity[t], tier.counters
            tiers.append(TierStats(
                name=tier.name, kind=tier.kind, hits=a.hits, misses=a.misses, stores=a.stores,
                failed_stores=a.failed_stores,
                evictions=a.evictions, demotions_out=a.demotions_out, promotions_in=a.promotions_in,
                corrupt_or_lost=a.corrupt_or_lost, blocks_read=c.blocks_read, blocks_written=c.blocks_written,
                bytes_read=c.bytes_read, bytes_written=c.bytes_written, read_seconds=c.read_seconds,
                write_seconds=c.write_seconds,
                usage_bytes=(tier.usage_bytes() if tier.self_evicting else self.residency.tiers[t].usage()),
                capacity_bytes=sum(tier.capacity_bytes.values()), errors=dict(c.errors),
                latency={op: h.copy() for op, h in a.latency.items()}, health=tier.health))
        return CacheStats(tiers=tuple(tiers), **self._counts)

    # --- internals ------------------------------------------------------------------------------------
    def _byte_blocks(self, keys: Sequence[BlockKey], blocks: Blocks, what: str) -> Sequence[torch.Tensor]:
        """Validate caller blocks against their groups' layouts; return 1-D uint8 views (no copies): a
        :class:`RowBatch` over a caller's one tensor, else a list."""
        checked = self._check_keys(keys)
        if isinstance(blocks, torch.Tensor):
            if blocks.dim() == 0 or blocks.shape[0] != len(keys):
                raise LayoutMismatch(f"{what} has shape {tuple(blocks.shape)}; expected {len(keys)} blocks "
                                     f"on its first dimension")
            groups = checked if checked is not None else {k.group_id for k in keys}
            if len(groups) > 1:
                raise LayoutMismatch(f"{what} is one tensor but keys span groups {sorted(groups)}; "
                                     f"pass one tensor per block")
            if not keys:
                return []
            _check_device(blocks, what)
            return RowBatch(self.layouts[keys[0].group_id].check_blocks(blocks, what))
        if len(blocks) != len(keys):
            raise LayoutMismatch(f"{len(keys)} keys but {len(blocks)} {what}")
        out = []
        for i, (key, block) in enumerate(zip(keys, blocks, strict=True)):
            layout = self.layouts[key.group_id]
            if not isinstance(block, torch.Tensor):
                raise LayoutMismatch(f"{what}[{i}] must be a torch.Tensor, got {type(block).__name__}")
            _check_device(block, f"{what}[{i}]")
            out.append(layout.check_blocks(block.unsqueeze(0), f"{what}[{i}]")[0])
        return out

    def _blocks_for(self, t: int, buffers: Sequence[torch.Tensor | None], idx: list[int], *,
                    writable: bool, reading: bool = False) -> Sequence[torch.Tensor | None] | torch.Tensor:
        """Blocks ``idx`` of ``buffers`` as tier ``t``'s put/get takes them: for a CPU tier (and for a
        file tier's get, ``reading``), a caller's batch as one ``[n, nbytes]`` tensor (one check and
        one copy per batch; a view when the tier writes into it); otherwise one tensor per block."""
        if t in (self._row_reading_tiers if reading else self._row_tiers) and isinstance(buffers, RowBatch):
            rows = buffers.take(idx, writable=writable)
            if rows is not None:
                return rows
        return [buffers[i] for i in idx]

    def _check_keys(self, keys: Sequence[BlockKey]) -> set[int] | None:
        """Raise naming the first key that is not a valid :class:`BlockKey` of this model's groups.

        Returns the keys' group ids when the batch is all plain BlockKeys (checked in a few C-level
        passes: a store's hot path), else None (checked key by key, with the same outcome)."""
        if keys and set(map(type, keys)) == {BlockKey}:
            hashes = list(map(_BLOCK_HASH, keys))
            if set(map(type, hashes)) == {bytes}:
                sizes = set(map(len, hashes))
                groups = set(map(_GROUP, keys))
                if (min(sizes) > 0 and max(sizes) <= MAX_HASH_BYTES and set(map(type, groups)) == {int}
                        and groups <= self.layouts.keys()):
                    return groups
        for key in keys:
            if not isinstance(key, BlockKey):
                raise TypeError(f"keys must be BlockKey, got {type(key).__name__}")
            if type(key.block_hash) is not bytes or not 0 < len(key.block_hash) <= MAX_HASH_BYTES:
                raise TypeError(f"BlockKey.block_hash must be 1 to {MAX_HASH_BYTES} bytes, got "
                                f"{type(key.block_hash).__name__} of length {_length(key.block_hash)}")
            if type(key.group_id) is not int:
                raise TypeError(f"BlockKey.group_id must be an int, got {type(key.group_id).__name__}")
            if key.group_id not in self.layouts:
                raise LayoutMismatch(f"{key} names group {key.group_id}; the model's groups are "
                                     f"{sorted(self.layouts)}")
        return None

    def _changed(self, keys: Iterable[BlockKey]) -> None:
        """Tell the watchers (index lock held)."""
        if self._watchers:
            changed = list(keys)
            if changed:
                for watcher in self._watchers:
                    watcher.residency_changed(changed)

    def _report_removed(self, keys: Iterable[BlockKey], copied: Container[BlockKey] = ()) -> None:
        """Tell the watchers which of ``keys`` (just dropped from a tier) no tier holds now (index lock held).

        ``copied``: keys a self-evicting tier accepted (the index cannot see those copies)."""
        if self._watchers:
            gone = [k for k in keys if k not in copied and self.residency.locate(k) is None]
            if gone:
                for watcher in self._watchers:
                    watcher.blocks_removed(gone)

    def _plan_store(self, keys: Sequence[BlockKey], hints: Sequence[InsertHint] | None,
                    only_tier: int | None = None) -> Plan:
        with self._index_lock:
            plan = self.residency.plan_store(keys, hints, only_tier=only_tier)
            self._changed(k for drops in plan.drops for k in drops)
        return plan

    def _still_ready(self, keys: Sequence[BlockKey], where: list[int]) -> list[int]:
        """Cut ``where`` at the first local copy that stopped being READY while ``_locate`` awaited a
        remote tier (evicted, or rewritten and pending): a load must pin only what it can read."""
        n = len(where)
        if n and where.count(t := where[0]) == n and not self.tiers[t].self_evicting and list(
                map(self.residency.tiers[t].entries.get, keys[:n])).count(READY) == n:
            return where  # the usual case, in C-level passes
        for i, t in enumerate(where):
            if not self.tiers[t].self_evicting and not self.residency.tiers[t].is_ready(keys[i]):
                return where[:i]
        return where

    async def _forget_lost(self, t: int, keys: list[BlockKey]) -> None:
        """Drop blocks a tier failed to return from the index, unless the tier still holds them (an I/O
        error, not a lost block): those stay indexed and are retried by later loads
        (docs/architecture.md#failure-contract)."""
        if not keys or self.tiers[t].self_evicting:
            return
        held = await self._safe_io(t, "contains", keys)
        lost = [key for key, still in zip(keys, held, strict=True) if not still]
        with self._index_lock:
            for key in lost:
                self.residency.forget(t, key)
            self._changed(lost)
            self._report_removed(lost)

    async def _locate(self, keys: Sequence[BlockKey]) -> list[int]:
        """Tier of each leading cached key (top-most copy); asks self-evicting tiers for the rest."""
        where = self.residency.locate_all(keys)
        if self._remote and None in where:
            for t in self._remote:
                pending = [i for i, known in enumerate(where) if known is None]
                if not pending:
                    break
                present = await self._safe_io(t, "contains", [keys[i] for i in pending])
                for i, hit in zip(pending, present, strict=True):
                    if hit:
                        where[i] = t
        return cast("list[int]", where[:where.index(None)] if None in where else where)  # the leading run

    async def _promote(self, keys: Sequence[BlockKey], where: Sequence[int],
                       buffers: Sequence[torch.Tensor]) -> None:
        """Copy the hits ``keys`` (read from tiers ``where`` into ``buffers``) up: the residency plans it
        (:meth:`Residency.plan_promotion`, shared with ``kvtier replay``), this moves the bytes."""
        placement = self.residency.placement
        if not (placement.promote_on_hit and where and max(where) > placement.promote_to):
            return  # no lock taken on a load served from the top (no hit should_promote, in one pass)
        assert self._mutation is not None
        async with self._mutation:
            with self._index_lock:
                promotion = self.residency.plan_promotion(keys, where)
                if promotion is None:
                    return
                plan = promotion.plan
                self._changed(k for drops in plan.drops for k in drops)
            done = await self._execute(plan, promotion.keys, [buffers[i] for i in promotion.indexes])
            self._activity[promotion.target].promotions_in += len(done)
            with self._index_lock:
                dropped = self.residency.finish_promotion(promotion, done)
                self._changed(k for gone in dropped.values() for k in gone)
            for src, gone in dropped.items():
                await self._safe_delete(src, gone)

    async def _execute(self, plan: Plan, keys: Sequence[BlockKey], buffers: Sequence[torch.Tensor | None],
                       planned: bool = False) -> list[int]:
        """Run a plan bottom-up (demote, drop), then the writes; return caller indexes now stored.

        A write whose buffer is None fails. ``planned``: the plan came from :meth:`plan_store`, which
        reported its victims already; only a demotion that failed is reported here.
        """
        copied: set[BlockKey] = set()
        for t in reversed(range(len(self.tiers))):
            if plan.demotions[t]:
                copied.update(await self._demote(t, plan.demotions[t]))
            if plan.drops[t]:
                self._activity[t].evictions += len(plan.drops[t])
                await self._safe_delete(t, plan.drops[t])
        stored: list[int] = []
        whole = isinstance(buffers, RowBatch)  # a caller's batch: every block is there
        writes = [(t, idx if whole else [i for i in idx if buffers[i] is not None])
                  for t, idx in enumerate(plan.writes) if idx]
        results = await _outcomes([
            self._safe_io(t, "put", [keys[i] for i in idx], self._blocks_for(t, buffers, idx, writable=True))
            for t, idx in writes])
        refused: BaseException | None = None  # a tier refused the caller's buffers (LayoutMismatch)
        links: list[tuple[int, list[tuple[BlockKey, BlockKey]]]] = []
        with self._index_lock:
            if not whole:
                for t, idx in enumerate(plan.writes):
                    missing = [keys[i] for i in idx if buffers[i] is None]
                    self.residency.tiers[t].settle_many(missing, False)  # the bytes never came: it fails
                    self._activity[t].failed_stores += len(missing)
                    self._changed(missing)
            for (t, idx), res in zip(writes, results, strict=True):
                if isinstance(res, BaseException):
                    refused = refused or res
                    res = [False] * len(idx)  # settle the plan's entries before raising: nothing leaks
                written = (idx if len(res) == len(idx) and all(res)  # the usual batch: every write went in
                           else [i for i, ok in zip(idx, res, strict=True) if ok])
                good = [keys[i] for i in written]
                index = self.residency.tiers[t]
                index.settle_many(good, True)  # Residency.finish_write of each
                if len(good) != len(idx):
                    index.settle_many([keys[i] for i, ok in zip(idx, res, strict=True) if not ok], False)
                stored.extend(written)
                self._activity[t].stores += len(good)
                self._activity[t].failed_stores += len(idx) - len(good)
                self._changed(keys[i] for i in idx)
                links.append((t, self._links_of(t, good)))
            if planned:
                self._report_removed((k for moves in plan.demotions for k, _ in moves), copied)
            else:
                self._report_removed((k for drops in plan.drops for k in drops), copied)
        for t, linked in links:  # outside the index lock: a file append must not stall lease()
            if linked:
                self.tiers[t].record_links(linked)
        for t, tier in enumerate(self.tiers):
            if tier.capacity_version != self._capacity_seen[t]:
                await self._follow_capacity(t)
        if refused is not None:
            raise refused
        return sorted(set(stored))

    async def _follow_capacity(self, t: int) -> None:
        """A tier changed its own capacity (a full disk): index it, and evict what no longer fits.

        Runs under the mutation lock, after a plan's writes settled: no entry is pending then."""
        tier, index = self.tiers[t], self.residency.tiers[t]
        self._capacity_seen[t] = tier.capacity_version
        surplus: list[BlockKey] = []
        with self._index_lock:
            index.capacity.update(tier.capacity_bytes)
            for gid in index.capacity:
                for victim in index.victims_for(gid, 0) or ():
                    index.discard(victim)
                    surplus.append(victim)
            self._changed(surplus)
            self._report_removed(surplus)
        if surplus:
            self._activity[t].evictions += len(surplus)
            await self._safe_delete(t, surplus)

    async def _demote(self, src: int, moves: list[tuple[BlockKey, int]]) -> list[BlockKey]:
        """Copy evicted blocks from ``src`` to their lower tiers (zero-copy when ``src`` is memory).

        Returns the keys a self-evicting tier accepted (the index cannot see those copies)."""
        keys = [k for k, _ in moves]
        tier = self.tiers[src]
        if tier.addressable:
            buffers = tier.views(keys)
            readable = [True] * len(keys)
        else:
            buffers = [aligned_empty(tier.block_bytes(k.group_id)) for k in keys]
            readable = await self._safe_io(src, "get", keys, buffers)
        by_dst: dict[int, list[int]] = {}
        with self._index_lock:
            for i, (_, dst) in enumerate(moves):
                if readable[i]:
                    by_dst.setdefault(dst, []).append(i)
                else:
                    self.residency.finish_demotion(src, dst, keys[i], False)
        copied: list[BlockKey] = []
        for dst, idx in by_dst.items():
            res = await self._safe_io(dst, "put", [keys[i] for i in idx], [buffers[i] for i in idx])
            with self._index_lock:
                for i, ok in zip(idx, res, strict=True):
                    self.residency.finish_demotion(src, dst, keys[i], ok)
                    if ok:
                        self._activity[src].demotions_out += 1
                        self._activity[dst].stores += 1
                        if self.tiers[dst].self_evicting:
                            copied.append(keys[i])
                    else:
                        self._activity[dst].failed_stores += 1
                self._changed(keys[i] for i in idx)
                written = self._links_of(dst, [keys[i] for i, ok in zip(idx, res, strict=True) if ok])
            if written:  # outside the index lock: a file append must not stall lease()
                self.tiers[dst].record_links(written)
        return copied

    def _links_of(self, t: int, keys: Sequence[BlockKey]) -> list[tuple[BlockKey, BlockKey]]:
        """(key, predecessor) of blocks just written to tier ``t``, for it to keep (a file tier persists
        them); call under the index lock."""
        links = self.residency.tiers[t].links
        if not links:  # no block of the tier carries a chain link
            return []
        return [(k, p) for k in keys if (p := links.get(k)) is not None]

    async def _safe_io(self, t: int, op: str, keys: list[BlockKey], *args: Any) -> list[bool]:
        """Call a tier's batched op; an unexpected exception is logged, counted and becomes all-False."""
        if not keys:
            return []
        tier = self.tiers[t]
        start = time.perf_counter()
        try:
            result: list[bool] = await getattr(tier, op)(keys, *args)
        except LayoutMismatch:
            raise
        except Exception as exc:
            self._tier_failed(t, op, len(keys), exc)
            return [False] * len(keys)
        self._activity[t].observe(op, time.perf_counter() - start)
        return result  # the tier counts its own bytes and seconds (TierCounters): one owner per counter

    async def _safe_delete(self, t: int, keys: list[BlockKey]) -> None:
        tier = self.tiers[t]
        start = time.perf_counter()
        try:
            await tier.delete(keys)
            self._activity[t].observe("delete", time.perf_counter() - start)
        except Exception as exc:
            self._tier_failed(t, "delete", len(keys), exc)


#: ``fill(slab, slots, idx)`` of :meth:`AsyncTieredCache.execute_with`
BlockFill = Callable[[torch.Tensor, list[int], "list[int] | None"], None]


class _InlineWrite:
    """One tier's writes of a plan run on the caller's thread: reserved under the index lock, filled
    outside it, settled under it again (AsyncTieredCache._begin_inline)."""

    __slots__ = ("t", "idx", "keys", "fill", "present", "reservation", "failed", "seconds")

    def __init__(self, t: int, idx: list[int], keys: list[BlockKey]) -> None:
        self.t, self.idx, self.keys = t, idx, keys
        self.fill: SlotFill | None = None
        #: positions in ``keys`` whose bytes came (None: all); the others fail
        self.present: list[int] | None = None
        self.reservation: SlotReservation | None = None
        self.failed = False
        self.seconds: float | None = None

    def outcomes(self) -> list[bool]:
        """Per key of ``keys``: whether its block is now in the tier."""
        reservation = self.reservation
        if reservation is None or self.failed:
            return [False] * len(self.keys)
        if self.present is None:
            return reservation.ok
        oks = [False] * len(self.keys)
        for j, ok in zip(self.present, reservation.ok, strict=True):
            oks[j] = ok
        return oks


def _by_group(keys: Sequence[BlockKey], idx: list[int]) -> list[list[int]]:
    """``idx`` split by the group of ``keys[i]``, each part in order (one part: the usual batch)."""
    chosen = [keys[i] for i in idx]
    if all_of_group(chosen, chosen[0].group_id):
        return [idx]
    return [[idx[j] for j in part] for part in positions_by_group(chosen).values()]


def _fill_of(fill: BlockFill, idx: list[int], count: int) -> SlotFill:
    """A tier's :data:`SlotFill` for the plan's writes ``idx`` of ``count`` keys: its positions mapped back
    to the keys' indexes (None: every key, in order)."""
    every = len(idx) == count and idx == list(range(count))

    def tier_fill(slab: torch.Tensor, slots: list[int], placed: list[int] | None) -> None:
        if placed is None:
            fill(slab, slots, None if every else idx)
        else:
            fill(slab, slots, placed if every else [idx[p] for p in placed])

    return tier_fill


def _cpu_rows(buffers: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The caller's one ``[n, nbytes]`` tensor behind ``buffers`` (as :meth:`AsyncTieredCache._byte_blocks`
    returns them: checked, contiguous, one group) when it is on the CPU; None otherwise."""
    if isinstance(buffers, RowBatch) and buffers.rows.device.type == "cpu":
        return buffers.rows
    return None


def _take_rows(rows: torch.Tensor, idx: list[int]) -> torch.Tensor:
    """``rows[idx]``: a view when ``idx`` is a run of consecutive rows (a store's usual case), else a copy."""
    first = idx[0]
    if idx[-1] - first == len(idx) - 1 and idx == list(range(first, first + len(idx))):
        return rows[first:first + len(idx)]
    return rows[torch.tensor(idx, dtype=torch.long)]


async def _together(calls: list[Coroutine[Any, Any, T]]) -> list[T]:
    """``asyncio.gather`` of ``calls``, but one call (the usual case: one tier holds a whole batch)
    is awaited in place: no task, no extra turn of the event loop per load or store."""
    if len(calls) == 1:
        return [await calls[0]]
    return list(await asyncio.gather(*calls))


async def _outcomes(calls: list[Coroutine[Any, Any, T]]) -> list[T | BaseException]:
    """:func:`_together` that returns each call's exception instead of raising it."""
    if len(calls) != 1:
        return list(await asyncio.gather(*calls, return_exceptions=True))
    try:
        return [await calls[0]]
    except Exception as exc:
        return [exc]


def _run_now(coro: Coroutine[Any, Any, T]) -> T:
    """The result of a coroutine that finishes without waiting (a CPU tier's call); RuntimeError if it
    waits."""
    try:
        coro.send(None)
    except StopIteration as done:
        return cast("T", done.value)
    coro.close()
    raise RuntimeError("a tier call run on the caller's thread waited; only CPU tiers may run there")


def _chain_hints(keys: Sequence[BlockKey], hints: Sequence[InsertHint] | None,
                 predecessors: Sequence[BlockKey | None] | None) -> Sequence[InsertHint] | None:
    """Insert hints for a store: given, or positions in the call; predecessors folded in, checked.
    None when neither is given (the residency then uses the positions, without a hint per key)."""
    if hints is not None and len(hints) != len(keys):
        raise ValueError(f"hints has {len(hints)} entries for {len(keys)} keys")
    if predecessors is None:
        return hints
    if isinstance(predecessors, (str, bytes)) or len(predecessors) != len(keys):
        raise ValueError(f"predecessors must be a sequence of BlockKey or None aligned with keys "
                         f"({len(keys)} keys), got {_length(predecessors)} entries")
    out = []
    for i, pred in enumerate(predecessors):
        if pred is not None and not isinstance(pred, BlockKey):
            raise TypeError(f"predecessors[{i}] must be a BlockKey or None, got {type(pred).__name__}")
        hint = hints[i] if hints is not None else InsertHint(position=i)
        out.append(hint._replace(predecessor=pred))
    return out


def _check_device(blocks: torch.Tensor, what: str) -> None:
    if blocks.device.type == "meta":
        raise LayoutMismatch(f"{what} is on the meta device: it has no data to store or load into")


def _length(value: object) -> str:
    try:
        return str(len(value))  # type: ignore[arg-type]
    except TypeError:
        return "-"


# --- a forked child: the caches it inherited are unusable there -----------------------------------------
#: every cache core made in this process (weakly): a forked child marks them all (see _after_fork)
_LIVE_CORES: weakref.WeakSet[AsyncTieredCache] = weakref.WeakSet()


def _after_fork() -> None:
    """In a forked child: every inherited cache refuses its calls (:class:`CacheForked`), and exit and
    SIGTERM close none of them (closing would wait on the parent's threads, and persisting would write
    the parent's blocks from a copy of them)."""
    global _sigterm_closer
    for core in list(_LIVE_CORES):
        core._forked = True
        core._index_lock = threading.Lock()  # a parent's thread may have held it at the fork, for good
    _sigterm_closer = None  # (a SIGTERM close under way in the parent is the parent's)
    _OPEN_CACHES.clear()
    _CLOSING.clear()


# --- persisting on exit: caches still open at interpreter exit or on SIGTERM are closed (and persist) ---
_OPEN_CACHES: weakref.WeakSet[TieredCache] = weakref.WeakSet()
#: caches whose close() started (maybe on the thread a SIGTERM interrupted): exit waits for their persist
_CLOSING: dict[int, concurrent.futures.Future[None]] = {}
os.register_at_fork(after_in_child=_after_fork)
_exit_hooks_lock = threading.Lock()
_atexit_installed = False
_sigterm_installed = False
_previous_sigterm: Any = None


def _close_open_caches() -> None:
    for cache in list(_OPEN_CACHES):
        try:
            cache.close()
        except Exception:
            log.exception("closing a cache at exit failed")
    for closing in list(_CLOSING.values()):
        with contextlib.suppress(Exception):
            closing.result(timeout=INFLIGHT_GRACE_SECONDS * 2 + 60)


#: set once a SIGTERM's deferred close has finished: the SIGTERM it then sends itself exits the process
_sigterm_closed = threading.Event()
_sigterm_closer: threading.Thread | None = None
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _on_sigterm(signum: int, frame: Any) -> None:
    """Close (and so persist) every open cache, then do what SIGTERM did before kvtier hooked it.

    The handler runs on the main thread, between two of its bytecodes. Where that thread was inside
    kvtier (a load on the caller's thread, say), it may hold the index lock that closing needs, or be
    halfway through a copy that closing waits for: closing there would wait on itself (measured: 7 of
    20 SIGTERMs during a loop of loads took 70 s and persisted nothing). Then the caches close on a
    thread of their own while the main thread finishes its call (a later call there waits for the close:
    :func:`_wait_for_sigterm_close`), and that thread sends SIGTERM again when done, which this handler
    passes on.
    """
    global _sigterm_closer
    if _sigterm_closed.is_set():
        _after_sigterm(signum, frame)
        return
    if _sigterm_closer is not None:
        return  # closing already (a second SIGTERM): the closer re-sends it when done
    log.warning("SIGTERM: closing %d open kvtier caches (persist_on_close) before exiting", len(_OPEN_CACHES))
    if not _inside_kvtier(frame):
        _close_open_caches()
        _after_sigterm(signum, frame)
        return
    _sigterm_closer = threading.Thread(target=_close_then_signal, name="kvtier-sigterm-close", daemon=True)
    _sigterm_closer.start()


def _wait_for_sigterm_close() -> None:
    """Before a call on a closed cache raises :class:`CacheClosed`: on the main thread while a SIGTERM's
    deferred close runs, wait for that close to end. The SIGTERM it then sends ends the process there,
    as SIGTERM did before kvtier hooked it, instead of the application dying of the error first. Never
    called with a cache's lock held."""
    if (_sigterm_closer is not None and not _sigterm_closed.is_set()
            and threading.current_thread() is threading.main_thread()):
        _sigterm_closed.wait()  # (the signal's handler runs during the wait)


def _inside_kvtier(frame: Any) -> bool:
    """Whether the interrupted thread is running kvtier's code (only there can it hold a cache's lock)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith(_PACKAGE_DIR):
            return True
        frame = frame.f_back
    return False


def _close_then_signal() -> None:
    try:
        _close_open_caches()
    finally:
        _sigterm_closed.set()
        os.kill(os.getpid(), signal.SIGTERM)


def _after_sigterm(signum: int, frame: Any) -> None:
    """What SIGTERM did before kvtier hooked it: the application's handler, or the default (exit)."""
    if callable(_previous_sigterm):
        _previous_sigterm(signum, frame)
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _install_exit_hooks() -> None:
    """An ``atexit`` hook, and a SIGTERM handler when called on the main thread and SIGTERM is not ignored
    (a handler already there is called after ours). Once per process."""
    global _atexit_installed, _sigterm_installed, _previous_sigterm
    with _exit_hooks_lock:
        if not _atexit_installed:
            _atexit_installed = True
            # threading's exit hooks run before concurrent.futures refuses new work at interpreter exit
            # (the tiers' I/O threads are executors); plain atexit runs too late. Private, so optional.
            register = getattr(threading, "_register_atexit", atexit.register)
            register(_close_open_caches)
        if _sigterm_installed or threading.current_thread() is not threading.main_thread():
            return
        _sigterm_installed = True
        previous = signal.getsignal(signal.SIGTERM)
        if previous == signal.SIG_DFL or callable(previous):
            _previous_sigterm = previous
            signal.signal(signal.SIGTERM, _on_sigterm)


class TieredCache:
    """Blocking face of :class:`AsyncTieredCache`; its coroutines run on a private loop thread.

    ``lookup``/``load``/``store`` block until done; ``submit_load``/``submit_store`` return a
    :class:`concurrent.futures.Future` at once, so an engine can overlap transfers with compute (their
    done-callbacks may run on the loop thread, where a blocking call raises :class:`CalledOnLoopThread`).
    Use as a context manager or call :meth:`close`.
    """

    def __init__(self, core: AsyncTieredCache) -> None:
        self.core = core
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvtier-loop", daemon=True)
        self._thread.start()
        self._closed = False
        # orders submissions with close(): none is submitted after it (re-entrant: close() may run in a
        # SIGTERM handler on a thread that was inside _submit)
        self._state = threading.RLock()
        self._pending: set[concurrent.futures.Future[Any]] = set()
        self._call(core.start())
        if core.persist_on_close:
            _OPEN_CACHES.add(self)
            _install_exit_hooks()
        self.metrics_server: MetricsServer | None = None
        if core.metrics_endpoint is not None:
            from kvtier.prometheus import MetricsServer

            address, port = core.metrics_endpoint
            namespace = core.namespace.id if core.namespace else ""
            try:
                self.metrics_server = MetricsServer(self.stats, port, address, namespace)
            except OSError as exc:
                # the port is taken: stop what started, nothing half-starts
                # (docs/architecture.md#config-errors)
                self.close()
                raise KVTierConfigError("metrics.port", f"cannot serve metrics on {address}:{port}: "
                                                        f"{exc.strerror or exc}") from None

    @classmethod
    def from_config(cls, config: str | Path | dict[str, Any] | Any) -> TieredCache:
        """Build from a YAML path, a dict, or a validated config; errors name the bad key's path."""
        return cls(AsyncTieredCache.from_config(config))

    @property
    def spec(self) -> KVCacheSpec:
        return self.core.spec

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        """See :meth:`AsyncTieredCache.lookup`."""
        return self._call(self.core.lookup(keys))

    def load(self, keys: Sequence[BlockKey], out: Blocks) -> int:
        """See :meth:`AsyncTieredCache.load`. Blocks that all sit in a top CPU tier are copied on the
        caller's thread (:meth:`AsyncTieredCache.load_now`), with no hop to the loop."""
        self._not_on_loop("load")
        loaded = self._now(self.core.load_now, keys, out)
        return loaded if loaded is not None else self._call(self.core.load(keys, out))

    def store(self, keys: Sequence[BlockKey], blocks: Blocks, hints: Sequence[InsertHint] | None = None,
              predecessors: Sequence[BlockKey | None] | None = None) -> int:
        """See :meth:`AsyncTieredCache.store`. Into CPU tiers only, it runs on the caller's thread
        (:meth:`AsyncTieredCache.store_now`), with no hop to the loop."""
        self._not_on_loop("store")
        stored = self._now(self.core.store_now, keys, blocks, hints, predecessors)
        if stored is not None:
            return stored
        return self._call(self.core.store(keys, blocks, hints, predecessors))

    def submit_load(self, keys: Sequence[BlockKey], out: Blocks) -> concurrent.futures.Future[int]:
        """Start a load; ``out`` must stay untouched until the future is done. A load :meth:`load` would
        copy on the caller's thread is done when this returns (its future too)."""
        return self._submit_now(self.core.load_now, keys, out) or self._submit(self.core.load(keys, out))

    def submit_store(self, keys: Sequence[BlockKey], blocks: Blocks,
                     hints: Sequence[InsertHint] | None = None,
                     predecessors: Sequence[BlockKey | None] | None = None) -> concurrent.futures.Future[int]:
        """Start a store; ``blocks`` must stay unchanged until the future is done. A store :meth:`store`
        would run on the caller's thread is done when this returns (its future too)."""
        return (self._submit_now(self.core.store_now, keys, blocks, hints, predecessors)
                or self._submit(self.core.store(keys, blocks, hints, predecessors)))

    def lease(self, keys: Sequence[BlockKey], tiers: Iterable[int] | None = None) -> list[int | None]:
        """See :meth:`AsyncTieredCache.lease` (thread-safe; runs on the caller's thread)."""
        return self._direct(self.core.lease, keys, tiers)

    def release(self, keys: Sequence[BlockKey], where: Sequence[int | None]) -> None:
        """See :meth:`AsyncTieredCache.release`."""
        self.core.release(keys, where)

    def read_leased(self, keys: Sequence[BlockKey], where: Sequence[int], out: Blocks, *,
                    touch: bool = True) -> None:
        """See :meth:`AsyncTieredCache.read_leased` (runs on the caller's thread)."""
        self._direct(functools.partial(self.core.read_leased, touch=touch), keys, where, out)

    def clear(self, tiers: Iterable[int]) -> list[BlockKey]:
        """See :meth:`AsyncTieredCache.clear`."""
        return self._call(self.core.clear(tiers))

    def add_watcher(self, watcher: ResidencyWatcher) -> None:
        """See :meth:`AsyncTieredCache.add_watcher`."""
        self._direct(self.core.add_watcher, watcher)

    def stats(self) -> CacheStats:
        """A snapshot of the counters; still answers after :meth:`close` (the final figures)."""
        self.core._check_process()
        if self._closed or threading.get_ident() == self._thread.ident:  # (the loop's own thread: no hop)
            return self.core.stats()
        return self._call(self._snapshot())

    async def _snapshot(self) -> CacheStats:
        return self.core.stats()

    @property
    def closed(self) -> bool:
        return self._closed or self.core._forked

    def close(self) -> None:
        """Close the cache (see :meth:`AsyncTieredCache.close`); thread-safe and idempotent.

        Calls in flight on other threads finish, or raise :class:`CacheClosed` if they are cut short;
        every later call raises :class:`CacheClosed` (``stats()`` still answers, with the final figures).
        In a forked child it does nothing: the parent's cache is the parent's to close.
        """
        if self.core._forked:
            self._closed = True
            return
        self._not_on_loop("close")
        with self._state:
            if self._closed:
                return
            self._closed = True
        done = asyncio.run_coroutine_threadsafe(self.core.close(), self._loop)
        _CLOSING[id(self)] = done
        _OPEN_CACHES.discard(self)
        try:
            if self.metrics_server is not None:
                self.metrics_server.close()
            done.result(timeout=INFLIGHT_GRACE_SECONDS * 2 + self.core.persist_budget_seconds + 30)
        except concurrent.futures.TimeoutError:
            log.error("closing the cache did not finish in time; stopping its loop anyway")
        finally:
            _CLOSING.pop(id(self), None)
            with self._state:
                stranded = list(self._pending)
            for future in stranded:  # never started or never settled: the callers must not wait forever
                future.cancel()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            if not self._thread.is_alive():
                self._loop.close()

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        if self.core._forked:
            coro.close()
            self.core._check_process()
        with self._state:
            closed = self._closed
            if not closed:
                future = asyncio.run_coroutine_threadsafe(coro, self._loop)
                self._pending.add(future)
        if closed:  # raised outside the lock, which close() takes (the wait below may last)
            coro.close()
            _wait_for_sigterm_close()
            raise CacheClosed("TieredCache is closed")
        future.add_done_callback(self._settled)
        return future

    def _now(self, call: Callable[..., T | None], *args: Any) -> T | None:
        """``call(*args)``, an ``AsyncTieredCache.*_now`` method, on the caller's thread: None (nothing
        done) when it cannot run there, or while a call handed to the loop is unsettled (a call made
        after it must not overtake it)."""
        self.core._check_process()
        with self._state:
            closed, pending = self._closed, bool(self._pending)
        if closed:  # raised outside the lock, as in _submit
            _wait_for_sigterm_close()
            raise CacheClosed("TieredCache is closed")
        return None if pending else self._direct(call, *args)

    @staticmethod
    def _direct(call: Callable[..., T], *args: Any) -> T:
        """``call(*args)``, a core method run on the caller's thread; its :class:`CacheClosed` (the cache
        closed meanwhile) is raised after :func:`_wait_for_sigterm_close`, with the core's lock released."""
        try:
            return call(*args)
        except CacheClosed:
            _wait_for_sigterm_close()
            raise

    def _submit_now(self, call: Callable[..., T | None], *args: Any) -> concurrent.futures.Future[T] | None:
        """:meth:`_now` as a future that is already done (with the call's exception, as a submitted call's
        future would hold it); None when the call cannot run here."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        try:
            result = self._now(call, *args)
        except CacheClosed:
            raise
        except Exception as exc:
            future.set_exception(exc)
            return future
        if result is None:
            return None
        future.set_result(result)
        return future

    def _settled(self, future: concurrent.futures.Future[Any]) -> None:
        # Without ``_state``: one C-level set operation, as are the others' (``add``, ``bool``, ``list``),
        # so it needs no lock, and this runs on the loop thread, which must not wait for a caller that
        # holds ``_state`` while its submission hands the GIL over (the loop's wake-up write).
        self._pending.discard(future)

    def _not_on_loop(self, call: str, coro: Coroutine[Any, Any, Any] | None = None) -> None:
        """Refuse a blocking call on the loop's own thread, where it would wait on itself forever (closing
        ``coro``, the call it would have waited for)."""
        if threading.get_ident() == self._thread.ident:
            if coro is not None:
                coro.close()
            raise CalledOnLoopThread(
                f"TieredCache.{call}() was called on kvtier's loop thread (from a done-callback of a "
                f"submit_load/submit_store future, or from a watcher), where it would wait for itself "
                f"forever; call it from another thread, or use submit_load/submit_store there")

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        self._not_on_loop(getattr(coro, "__qualname__", "call").rpartition(".")[2], coro)
        try:
            return self._submit(coro).result()
        except concurrent.futures.CancelledError:
            _wait_for_sigterm_close()
            raise CacheClosed("TieredCache was closed while this call was in flight") from None


__all__ = ["AsyncTieredCache", "ResidencyWatcher", "TieredCache"]
