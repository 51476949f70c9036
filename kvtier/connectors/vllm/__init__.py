"""kvtier as vLLM's KV-cache offloading backend: an ``OffloadingSpec`` for vLLM 0.32–0.34.

Configuration only: vLLM's own ``OffloadingConnector`` loads :class:`KVTierOffloadingSpec` from here
(``spec_module_path: kvtier.connectors.vllm``, a ``kvtier_config`` in ``kv_connector_extra_config``).
docs/vllm.md has the setup and how vLLM's calls map onto kvtier: keys (vLLM's ``OffloadKey`` becomes
``BlockKey(epoch ‖ block hash, group)``, kvtier's groups being vLLM's offloaded groups in order),
lookups that never block, leases, store plans made by the manager, removals, page copies and the
process model. The modules mirror vLLM's ``kv_offload``: :mod:`.geometry` (versions, engine geometry,
config merge, keys), :mod:`.runtime` (the engine's cache, staging, index mirror), :mod:`.manager`
(scheduler side), :mod:`.single_tier_lru` (its batched path for one LRU CPU tier),
:mod:`.scheduler_index` (the scheduler's tiers without bytes), :mod:`.worker`
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
    "EPOCH_BYTES", "FIRST_EPOCH", "ModelIdentity", "model_identity", "DEFAULT_STAGING_BYTES", "LOST",
    "MAX_REMOVED_KEYS", "STAGED", "SUPPORTED_VLLM", "BlockTransferSpec",
    "CudaPageMover", "EngineGeometry", "EngineGroup", "IndexMirror", "KVTierOffloadManager",
    "KVTierOffloadWorkerCore", "KeyCodec", "Lookup", "ManagerCounters", "OffloadRuntime", "PageMover",
    "Staging",
    "UnsupportedVLLM", "check_vllm_version", "engine_stats", "kvtier_config_for_engine", "page_movers",
    "read_config_source", "register_runtime", "release_runtime", "split_by_group",
]


def __getattr__(name: str) -> Any:
    """vLLM's factory does ``getattr(module, "KVTierOffloadingSpec")``: import vLLM and build its classes
    then."""
    if name in VLLM_CLASSES:
        from kvtier.connectors.vllm.spec import vllm_api

        return vllm_api()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if "vllm" in sys.modules:  # imported by vLLM itself: refuse an unsupported release at once
    check_vllm_version(str(getattr(sys.modules["vllm"], "__version__", "unknown")))
