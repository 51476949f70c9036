"""TieredCache: lookup, load and store of KV blocks over an ordered list of tiers.

The orchestrator. It asks :class:`kvtier.residency.Residency` (index, pins, eviction, placement)
what to move, moves bytes between :mod:`kvtier.tiers` in batches, and turns every tier failure
into a miss or a failed store — it never raises an I/O fault into the engine (DESIGN.md §8).

Two faces, like redis-py: :class:`AsyncTieredCache` (coroutines, for async engines) and
:class:`TieredCache` (blocking calls, for everyone else; it runs the async core on a private event
loop thread, so transfers also run while the caller computes: ``submit_load``/``submit_store``).

Concurrency: every index mutation holds one ``threading.Lock`` (never across an ``await``), so
other threads may pin blocks synchronously with :meth:`AsyncTieredCache.lease` — an engine's
scheduler promises a block without a hop to the loop thread, and no eviction can take it in
between. Stores and promotions also hold one asyncio lock while planning and executing (their
room-making must not interleave); loads read pinned blocks without it, so reads overlap with writes.
:class:`ResidencyWatcher` objects hear of index changes as they happen (a connector mirrors what
is loadable, and reports blocks that left every tier).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Container, Coroutine, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch

from kvtier.blocks import BlockKey, KVCacheSpec
from kvtier.codec import MAX_HASH_BYTES
from kvtier.errors import KVTierConfigError, LayoutMismatch
from kvtier.hashing import Namespace
from kvtier.metrics import CacheStats, TierActivity, TierStats
from kvtier.policy import InsertHint
from kvtier.residency import READY, Plan, Residency
from kvtier.tiers.base import Tier
from kvtier.tiers.buffers import aligned_empty

if TYPE_CHECKING:
    from kvtier.prometheus import MetricsServer

log = logging.getLogger(__name__)
T = TypeVar("T")

Blocks = torch.Tensor | Sequence[torch.Tensor]


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


class AsyncTieredCache:
    """The async core. Create with :meth:`from_config` (or directly), then ``await start()``."""

    def __init__(self, spec: KVCacheSpec, tiers: Sequence[Tier], residency: Residency,
                 namespace: Namespace | None = None) -> None:
        if len(tiers) != len(residency.tiers):
            raise ValueError(f"{len(tiers)} tiers but an index for {len(residency.tiers)}")
        self.spec = spec
        self.tiers = list(tiers)
        self.residency = residency
        self.namespace = namespace
        self.layouts = {g.group_id: g.layout for g in spec.groups}
        self._activity = [TierActivity() for _ in self.tiers]
        self._remote = [t for t, tier in enumerate(self.tiers) if tier.self_evicting]
        self._mutation: asyncio.Lock | None = None
        self._index_lock = threading.Lock()
        self._watchers: list[ResidencyWatcher] = []
        self._counts = dict(lookups=0, lookup_blocks=0, lookup_hit_blocks=0, loads=0, load_blocks=0,
                            loaded_blocks=0, stored_blocks=0)
        self._started = False
        #: (address, port) of the Prometheus endpoint the blocking face should serve, if any
        self.metrics_endpoint: tuple[str, int] | None = None

    @classmethod
    def from_config(cls, config: Any) -> AsyncTieredCache:
        """Build from a YAML path, a dict, or a validated :class:`kvtier.config.KVTierConfig`."""
        from kvtier.config import build_cache_parts, load_config

        cfg = config if hasattr(config, "tiers") and not isinstance(config, dict) else load_config(config)
        spec, tiers, residency, namespace = build_cache_parts(cfg)
        core = cls(spec, tiers, residency, namespace)
        if cfg.metrics.port is not None:
            core.metrics_endpoint = (cfg.metrics.address, cfg.metrics.port)
        return core

    # --- lifecycle ------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Index what the persistent tiers already hold (a restart keeps a warm cache). Idempotent."""
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
                log.info("tier %s holds %d blocks beyond its capacity; deleting them", tier.name, len(surplus))
                await self._safe_delete(t, surplus)

    async def close(self) -> None:
        for tier in self.tiers:
            try:
                await tier.close()
            except Exception:
                log.exception("closing tier %s failed", tier.name)

    async def __aenter__(self) -> AsyncTieredCache:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- public API -----------------------------------------------------------------------------------
    async def lookup(self, keys: Sequence[BlockKey]) -> int:
        """Number of leading ``keys`` cached in some tier. Reads no block data; never raises for I/O."""
        await self.start()
        self._check_keys(keys)
        found = await self._locate(keys)
        self._counts["lookups"] += 1
        self._counts["lookup_blocks"] += len(keys)
        self._counts["lookup_hit_blocks"] += len(found)
        return len(found)

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
        with self._index_lock:
            where = self._still_ready(keys, located)
            for t, key in zip(where, keys, strict=False):
                self.residency.tiers[t].pin(key)
        n = len(where)
        ok = [False] * n
        try:
            by_tier: dict[int, list[int]] = {}
            for i, t in enumerate(where):
                by_tier.setdefault(t, []).append(i)
            results = await asyncio.gather(*(
                self._safe_io(t, "get", [keys[i] for i in idx], [buffers[i] for i in idx])
                for t, idx in by_tier.items()))
            for (t, idx), res in zip(by_tier.items(), results, strict=True):
                failed = []
                for i, hit in zip(idx, res, strict=True):
                    ok[i] = hit
                    if not hit:
                        self._activity[t].corrupt_or_lost += 1
                        failed.append(keys[i])
                await self._forget_lost(t, failed)
        finally:
            with self._index_lock:
                for t, key in zip(where, keys, strict=False):
                    self.residency.tiers[t].unpin(key)
        loaded = ok.index(False) if False in ok else n
        with self._index_lock:
            for i in range(loaded):
                t = where[i]
                self._activity[t].hits += 1
                if not self.tiers[t].self_evicting:
                    self.residency.touch(t, keys[i])
        # a tier misses every block the walk down the hierarchy asked it for and it did not serve
        for t, activity in enumerate(self._activity):
            activity.misses += sum(1 for i in range(loaded) if where[i] > t) + len(keys) - loaded
        self._counts["loaded_blocks"] += loaded
        await self._promote(keys[:loaded], where[:loaded], buffers[:loaded])
        return loaded

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
        count = len(set(stored) | set(plan.skipped))
        self._counts["stored_blocks"] += count
        return count

    def lease(self, keys: Sequence[BlockKey], tiers: Iterable[int] | None = None) -> list[int | None]:
        """Pin each key where a readable copy is, for a read that comes later; thread-safe, never blocks on I/O.

        Per key: the top-most of ``tiers`` (default: every tier kvtier indexes) holding it READY,
        now pinned there, or None (nothing pinned). Until :meth:`release`, a pinned copy is never
        evicted, demoted away or overwritten (DESIGN.md §8.2), so a :meth:`load` reads it. Meant for
        engines that promise blocks on another thread than the cache's loop (vLLM's scheduler):
        one lock instead of a hop to the loop. Self-evicting tiers (Redis) cannot be pinned.
        """
        indexes = self.residency.tiers
        candidates = [(t, indexes[t].entries, indexes[t].pins)
                      for t in (range(len(indexes)) if tiers is None else tiers) if not self.tiers[t].self_evicting]
        where: list[int | None] = []
        append = where.append
        with self._index_lock:
            for key in keys:
                for t, entries, pins in candidates:
                    if entries.get(key) == READY:
                        pins[key] = pins.get(key, 0) + 1  # TierIndex.pin, inlined: this is an engine's hot path
                        append(t)
                        break
                else:
                    append(None)
        return where

    def release(self, keys: Sequence[BlockKey], where: Sequence[int | None]) -> None:
        """Drop the pins :meth:`lease` took (``where`` is what it returned); thread-safe."""
        indexes = self.residency.tiers
        with self._index_lock:
            for key, t in zip(keys, where, strict=True):
                if t is not None:
                    pins = indexes[t].pins  # TierIndex.unpin, inlined (hot path)
                    count = pins.get(key, 0) - 1
                    if count > 0:
                        pins[key] = count
                    else:
                        pins.pop(key, None)

    def read_leased(self, keys: Sequence[BlockKey], where: Sequence[int], out: Blocks) -> None:
        """Copy blocks that :meth:`lease` pinned in memory tiers into ``out``, on the caller's thread.

        Thread-safe, no I/O: the copies are memory copies, with no hop to the loop thread — whose
        wake-ups cost milliseconds next to an engine thread that keeps the GIL busy. Counts hits and
        refreshes recency as :meth:`load` does; does not promote (the caller chose the copy where it
        is). The pins stay: :meth:`release` them after. Raises ``ValueError`` for a key that is not
        pinned READY in its memory tier (a caller bug: such a copy could change under the read).
        """
        buffers = self._byte_blocks(keys, out, "out")
        by_tier: dict[int, list[int]] = {}
        with self._index_lock:
            for i, (key, t) in enumerate(zip(keys, where, strict=True)):
                index = self.residency.tiers[t]
                if not self.tiers[t].addressable or key not in index.pins or not index.is_ready(key):
                    raise ValueError(f"{key} is not leased in memory tier {self.tiers[t].name}")
                by_tier.setdefault(t, []).append(i)
        for t, idx in by_tier.items():
            start = time.perf_counter()
            for i, view in zip(idx, self.tiers[t].views([keys[i] for i in idx]), strict=True):
                buffers[i].copy_(view)
            elapsed = time.perf_counter() - start
            with self._index_lock:
                tier, activity = self.tiers[t], self._activity[t]
                tier.counters.blocks_read += len(idx)
                tier.counters.bytes_read += sum(buffers[i].numel() for i in idx)
                tier.counters.read_seconds += elapsed
                activity.observe("get", elapsed)
                activity.hits += len(idx)
                for i in idx:
                    self.residency.touch(t, keys[i])
                for above in self._activity[:t]:
                    above.misses += len(idx)
        with self._index_lock:
            self._counts["loads"] += 1
            self._counts["load_blocks"] += len(keys)
            self._counts["loaded_blocks"] += len(keys)

    def add_watcher(self, watcher: ResidencyWatcher) -> None:
        """Tell ``watcher`` of index changes from now on, after reporting every indexed key to it once."""
        with self._index_lock:
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
    def _byte_blocks(self, keys: Sequence[BlockKey], blocks: Blocks, what: str) -> list[torch.Tensor]:
        """Validate caller blocks against their groups' layouts; return 1-D uint8 views (no copies)."""
        self._check_keys(keys)
        if isinstance(blocks, torch.Tensor):
            if blocks.dim() == 0 or blocks.shape[0] != len(keys):
                raise LayoutMismatch(f"{what} has shape {tuple(blocks.shape)}; expected {len(keys)} blocks "
                                     f"on its first dimension")
            groups = {k.group_id for k in keys}
            if len(groups) > 1:
                raise LayoutMismatch(f"{what} is one tensor but keys span groups {sorted(groups)}; "
                                     f"pass one tensor per block")
            if not keys:
                return []
            _check_device(blocks, what)
            rows = self.layouts[keys[0].group_id].check_blocks(blocks, what)
            return list(rows.unbind(0))
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

    def _check_keys(self, keys: Sequence[BlockKey]) -> None:
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
        for i, t in enumerate(where):
            if not self.tiers[t].self_evicting and not self.residency.tiers[t].is_ready(keys[i]):
                return where[:i]
        return where

    async def _forget_lost(self, t: int, keys: list[BlockKey]) -> None:
        """Drop blocks a tier failed to return from the index, unless the tier still holds them (an I/O
        error, not a lost block): those stay indexed and are retried by later loads (§8.3)."""
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
        where: list[int | None] = [self.residency.locate(k) for k in keys]
        if self._remote and None in where:
            for t in self._remote:
                pending = [i for i, known in enumerate(where) if known is None]
                if not pending:
                    break
                present = await self._safe_io(t, "contains", [keys[i] for i in pending])
                for i, hit in zip(pending, present, strict=True):
                    if hit:
                        where[i] = t
        found: list[int] = []
        for located in where:
            if located is None:
                break
            found.append(located)
        return found

    async def _promote(self, keys: Sequence[BlockKey], where: Sequence[int], buffers: list[torch.Tensor]) -> None:
        placement = self.residency.placement
        todo = [i for i, t in enumerate(where) if placement.should_promote(t)]
        if not todo:
            return
        target = placement.promote_to
        assert self._mutation is not None
        async with self._mutation:
            sub_keys = [keys[i] for i in todo]
            hints = [InsertHint(position=i) for i in todo]  # positions in the request's chain
            plan = self._plan_store(sub_keys, hints, only_tier=target)
            done = await self._execute(plan, sub_keys, [buffers[i] for i in todo])
            self._activity[target].promotions_in += len(done)
            if not placement.keep_lower_copy:
                moved: dict[int, list[BlockKey]] = {}
                with self._index_lock:
                    for j in done:
                        src, key = where[todo[j]], sub_keys[j]
                        index = self.residency.tiers[src]
                        if self.tiers[src].self_evicting or key in index.pins:
                            continue  # another load is reading that copy: it stays (inclusive for now)
                        if index.discard(key):
                            moved.setdefault(src, []).append(key)
                    self._changed(k for gone in moved.values() for k in gone)
                for src, gone in moved.items():
                    await self._safe_delete(src, gone)

    async def _execute(self, plan: Plan, keys: Sequence[BlockKey], buffers: list[torch.Tensor]) -> list[int]:
        """Run a plan bottom-up (demote, drop), then the writes; return caller indexes now stored."""
        copied: set[BlockKey] = set()
        for t in reversed(range(len(self.tiers))):
            if plan.demotions[t]:
                copied.update(await self._demote(t, plan.demotions[t]))
            if plan.drops[t]:
                self._activity[t].evictions += len(plan.drops[t])
                await self._safe_delete(t, plan.drops[t])
        stored: set[int] = set()
        writes = [(t, idx) for t, idx in enumerate(plan.writes) if idx]
        results = await asyncio.gather(*(
            self._safe_io(t, "put", [keys[i] for i in idx], [buffers[i] for i in idx]) for t, idx in writes),
            return_exceptions=True)
        refused: BaseException | None = None  # a tier refused the caller's buffers (LayoutMismatch)
        links: list[tuple[int, list[tuple[BlockKey, BlockKey]]]] = []
        with self._index_lock:
            for (t, idx), res in zip(writes, results, strict=True):
                if isinstance(res, BaseException):
                    refused = refused or res
                    res = [False] * len(idx)  # settle the plan's entries before raising: nothing leaks
                for i, ok in zip(idx, res, strict=True):
                    self.residency.finish_write(t, keys[i], ok)
                    if ok:
                        stored.add(i)
                        self._activity[t].stores += 1
                    else:
                        self._activity[t].failed_stores += 1
                self._changed(keys[i] for i in idx)
                links.append((t, self._links_of(t, [keys[i] for i, ok in zip(idx, res, strict=True) if ok])))
            self._report_removed((k for drops in plan.drops for k in drops), copied)
        for t, written in links:  # outside the index lock: a file append must not stall lease()
            if written:
                self.tiers[t].record_links(written)
        if refused is not None:
            raise refused
        return sorted(stored)

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
        hints = self.residency.tiers[t].hints
        return [(k, p) for k in keys if (p := hints[k].predecessor if k in hints else None) is not None]

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
            tier.counters.error(type(exc).__name__)
            log.warning("tier %s: %s of %d blocks failed: %r", tier.name, op, len(keys), exc)
            return [False] * len(keys)
        elapsed = time.perf_counter() - start
        self._activity[t].observe(op, elapsed)
        if op == "get":
            tier.counters.read_seconds += elapsed
        elif op == "put":
            tier.counters.write_seconds += elapsed
        return result

    async def _safe_delete(self, t: int, keys: list[BlockKey]) -> None:
        tier = self.tiers[t]
        start = time.perf_counter()
        try:
            await tier.delete(keys)
            self._activity[t].observe("delete", time.perf_counter() - start)
        except Exception as exc:
            tier.counters.error(type(exc).__name__)
            log.warning("tier %s: delete of %d blocks failed: %r", tier.name, len(keys), exc)


def _chain_hints(keys: Sequence[BlockKey], hints: Sequence[InsertHint] | None,
                 predecessors: Sequence[BlockKey | None] | None) -> Sequence[InsertHint]:
    """Insert hints for a store: given, or positions in the call; predecessors folded in, checked."""
    if hints is not None and len(hints) != len(keys):
        raise ValueError(f"hints has {len(hints)} entries for {len(keys)} keys")
    if predecessors is None:
        return hints if hints is not None else [InsertHint(position=i) for i in range(len(keys))]
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


class TieredCache:
    """Blocking face of :class:`AsyncTieredCache`; its coroutines run on a private loop thread.

    ``lookup``/``load``/``store`` block until done; ``submit_load``/``submit_store`` return a
    :class:`concurrent.futures.Future` at once, so an engine can overlap transfers with compute.
    Use as a context manager or call :meth:`close`.
    """

    def __init__(self, core: AsyncTieredCache) -> None:
        self.core = core
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvtier-loop", daemon=True)
        self._thread.start()
        self._closed = False
        self._call(core.start())
        self.metrics_server: MetricsServer | None = None
        if core.metrics_endpoint is not None:
            from kvtier.prometheus import MetricsServer

            address, port = core.metrics_endpoint
            namespace = core.namespace.id if core.namespace else ""
            try:
                self.metrics_server = MetricsServer(self.stats, port, address, namespace)
            except OSError as exc:  # the port is taken: stop what started, nothing half-starts (§8.4)
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
        """See :meth:`AsyncTieredCache.load`."""
        return self._call(self.core.load(keys, out))

    def store(self, keys: Sequence[BlockKey], blocks: Blocks, hints: Sequence[InsertHint] | None = None,
              predecessors: Sequence[BlockKey | None] | None = None) -> int:
        """See :meth:`AsyncTieredCache.store`."""
        return self._call(self.core.store(keys, blocks, hints, predecessors))

    def submit_load(self, keys: Sequence[BlockKey], out: Blocks) -> concurrent.futures.Future[int]:
        """Start a load; ``out`` must stay untouched until the future is done."""
        return self._submit(self.core.load(keys, out))

    def submit_store(self, keys: Sequence[BlockKey], blocks: Blocks, hints: Sequence[InsertHint] | None = None,
                     predecessors: Sequence[BlockKey | None] | None = None) -> concurrent.futures.Future[int]:
        """Start a store; ``blocks`` must stay unchanged until the future is done."""
        return self._submit(self.core.store(keys, blocks, hints, predecessors))

    def lease(self, keys: Sequence[BlockKey], tiers: Iterable[int] | None = None) -> list[int | None]:
        """See :meth:`AsyncTieredCache.lease` (thread-safe; runs on the caller's thread)."""
        return self.core.lease(keys, tiers)

    def release(self, keys: Sequence[BlockKey], where: Sequence[int | None]) -> None:
        """See :meth:`AsyncTieredCache.release`."""
        self.core.release(keys, where)

    def read_leased(self, keys: Sequence[BlockKey], where: Sequence[int], out: Blocks) -> None:
        """See :meth:`AsyncTieredCache.read_leased` (runs on the caller's thread)."""
        self.core.read_leased(keys, where, out)

    def add_watcher(self, watcher: ResidencyWatcher) -> None:
        """See :meth:`AsyncTieredCache.add_watcher`."""
        self.core.add_watcher(watcher)

    def stats(self) -> CacheStats:
        return self._call(self._snapshot())

    async def _snapshot(self) -> CacheStats:
        return self.core.stats()

    def close(self) -> None:
        if self._closed:
            return
        if self.metrics_server is not None:
            self.metrics_server.close()
        try:
            self._call(self.core.close())
        finally:
            self._closed = True
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        if self._closed:
            coro.close()
            raise RuntimeError("TieredCache is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._submit(coro).result()


__all__ = ["AsyncTieredCache", "ResidencyWatcher", "TieredCache"]
