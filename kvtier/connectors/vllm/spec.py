"""The classes vLLM loads: ``KVTierOffloadingSpec`` and the vLLM subclasses of kvtier's manager, worker
and transfer spec. Built on first use (:func:`vllm_api`), so importing kvtier never imports vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from kvtier.config import parse_size
from kvtier.connectors.vllm.geometry import (
    EngineGeometry,
    KeyCodec,
    Lookup,
    check_vllm_version,
    kvtier_config_for_engine,
)
from kvtier.connectors.vllm.identity import ModelIdentity, model_identity
from kvtier.connectors.vllm.manager import BlockTransferSpec, KVTierOffloadManager
from kvtier.connectors.vllm.page_mover import page_movers
from kvtier.connectors.vllm.runtime import (
    _RUNTIMES,
    DEFAULT_STAGING_BYTES,
    OffloadRuntime,
    register_runtime,
    release_runtime,
)
from kvtier.connectors.vllm.worker import KVTierOffloadWorkerCore
from kvtier.errors import KVTierConfigError, KVTierError

log = logging.getLogger(__name__)

VLLM_CLASSES = ("KVTierOffloadingSpec", "KVTierOffloadingManager", "KVTierOffloadingWorker", "KVTierLoadStoreSpec")
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


def _engine_identity(config: Any) -> ModelIdentity:
    """The checkpoint's canonical name and weights identity (with the hub revision vLLM was given)."""
    from vllm.config import get_current_vllm_config_or_none

    vllm_config = get_current_vllm_config_or_none()
    revision = getattr(vllm_config.model_config, "revision", None) if vllm_config is not None else None
    return model_identity(str(config.model.name), revision)


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
            planned = self.plan_store(keys, req_context)
            if planned is None:
                return None
            chosen, spec = planned
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
                        "must share one process (one worker and vLLM's 'uni' executor). vLLM's CPU backend moves the "
                        "worker to a process of its own when VLLM_ENABLE_V1_MULTIPROCESSING is on (its default): set "
                        "VLLM_ENABLE_V1_MULTIPROCESSING=0 there; on a GPU, do not set distributed_executor_backend='mp'")
                self._manager = KVTierOffloadingManager(
                    runtime, enable_events=self.kv_events_config.enable_kv_cache_events)
            return self._manager

        def get_worker(self, kv_caches: Any) -> Any:
            if self._worker is None:
                geometry = EngineGeometry.from_offloading_config(self.config, _engine_model_shape(),
                                                                  _engine_identity(self.config))
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


def vllm_api() -> dict[str, type]:
    """vLLM's classes over kvtier, built once (imports vLLM and checks its version)."""
    global _vllm_api
    if _vllm_api is None:
        _vllm_api = _build_vllm_api()
    return _vllm_api
