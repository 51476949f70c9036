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

How vLLM's calls map onto kvtier (docs/vllm.md has the whole story):

* Keys: vLLM's ``OffloadKey`` (block hash ‖ 4-byte big-endian group index) is
  ``BlockKey(epoch ‖ block hash, kvtier group)``; kvtier's groups are vLLM's offloaded groups in
  order. The namespace names the checkpoint's weights (:mod:`.identity`); a connector reset moves
  the engine to a fresh epoch.
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
* ``prepare_store`` decides on the scheduler's thread where the chunks no memory tier holds yet go,
  and what that evicts or demotes (:meth:`AsyncTieredCache.plan_store`); the plan travels in the
  spec and the worker executes it with the pages it gathers (:meth:`AsyncTieredCache.execute`).
  None when no chunk can be stored. ``complete_store`` ends the pending state; a write a tier
  refused is simply a later miss.
* Removals: a block that leaves every tier kvtier indexes is reported in the ``evicted_keys`` of the
  ``prepare_store`` that evicted it (a loss or corruption: of the next one) and, with vLLM's KV
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

Modules (mirroring vLLM's ``kv_offload``): :mod:`.geometry` (versions, engine geometry, config
merge, keys), :mod:`.runtime` (the engine's cache, staging, index mirror), :mod:`.manager`
(scheduler side), :mod:`.scheduler_index` (the scheduler's tiers without bytes), :mod:`.worker`
(worker side), :mod:`.page_mover` (page copies), :mod:`.stage_channel` (the scheduler asks every
worker process to stage slow-tier blocks), :mod:`.spec` (the vLLM-facing classes, built when vLLM
asks for them).

Process model: when vLLM's scheduler and its one worker share a process (the ``uni`` executor), the
manager finds the worker's runtime in this process and both use it (every tier type). When the
workers are processes of their own (tensor parallelism, the multiprocess executor), the manager keeps
an index-only runtime (:mod:`.scheduler_index`), plans on it and settles what vLLM completes; each
worker executes the plans on its own tiers. A file or Redis block is promised only once every rank
staged it, verified and pinned, over the stage channel (docs/vllm.md).
"""

from __future__ import annotations

import sys
from typing import Any

from kvtier.connectors.vllm.geometry import (
    EPOCH_BYTES,
    FIRST_EPOCH,
    SUPPORTED_VLLM,
    EngineGeometry,
    EngineGroup,
    KeyCodec,
    Lookup,
    UnsupportedVLLM,
    check_vllm_version,
    kvtier_config_for_engine,
    read_config_source,
)
from kvtier.connectors.vllm.identity import ModelIdentity, model_identity
from kvtier.connectors.vllm.manager import BlockTransferSpec, KVTierOffloadManager, ManagerCounters
from kvtier.connectors.vllm.page_mover import CudaPageMover, PageMover, page_movers
from kvtier.connectors.vllm.runtime import (
    DEFAULT_STAGING_BYTES,
    LOST,
    MAX_REMOVED_KEYS,
    STAGED,
    IndexMirror,
    OffloadRuntime,
    Staging,
    engine_stats,
    register_runtime,
    release_runtime,
)
from kvtier.connectors.vllm.spec import VLLM_CLASSES
from kvtier.connectors.vllm.worker import KVTierOffloadWorkerCore, split_by_group

__all__ = [
    "EPOCH_BYTES", "FIRST_EPOCH", "ModelIdentity", "model_identity", "DEFAULT_STAGING_BYTES", "LOST", "MAX_REMOVED_KEYS", "STAGED", "SUPPORTED_VLLM", "BlockTransferSpec",
    "CudaPageMover", "EngineGeometry", "EngineGroup", "IndexMirror", "KVTierOffloadManager",
    "KVTierOffloadWorkerCore", "KeyCodec", "Lookup", "ManagerCounters", "OffloadRuntime", "PageMover", "Staging",
    "UnsupportedVLLM", "check_vllm_version", "engine_stats", "kvtier_config_for_engine", "page_movers",
    "read_config_source", "register_runtime", "release_runtime", "split_by_group",
]


def __getattr__(name: str) -> Any:
    """vLLM's factory does ``getattr(module, "KVTierOffloadingSpec")``: import vLLM and build its classes then."""
    if name in VLLM_CLASSES:
        from kvtier.connectors.vllm.spec import vllm_api

        return vllm_api()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if "vllm" in sys.modules:  # imported by vLLM itself: refuse an unsupported release at once
    check_vllm_version(str(getattr(sys.modules["vllm"], "__version__", "unknown")))
