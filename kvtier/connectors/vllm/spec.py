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
    read_config_source,
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
from kvtier.connectors.vllm.stage_channel import DEFAULT_STAGE_TIMEOUT, StageClient, StageServer, socket_path
from kvtier.connectors.vllm.worker import KVTierOffloadWorkerCore
from kvtier.errors import KVTierConfigError, LayoutMismatch
from kvtier.layout import parse_dtype

log = logging.getLogger(__name__)

VLLM_CLASSES = (
    "KVTierOffloadingSpec", "KVTierOffloadingManager", "KVTierOffloadingWorker", "KVTierLoadStoreSpec",
)
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


def _shape_from_block_bytes(config: Any, source: Any) -> tuple[int, int, bool] | None:
    """(KV heads, head size, MLA) that give each worker's block size, for a scheduler process that has no
    vLLM model config at hand; None when the kvtier config names them itself or the model has several
    groups."""
    model = read_config_source(source).get("model") or {}
    if model.get("num_kv_heads") is not None or len(config.groups) != 1:
        return None
    group = config.groups[0]
    per_value = (len(group.layer_names) * 2 * int(group.tokens_per_block)
                 * parse_dtype(str(config.model.dtype)).itemsize)
    per_block = int(config.worker_kv_bytes_per_block)
    if per_value == 0 or per_block % per_value:
        return None
    return 1, per_block // per_value, False


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

        def __init__(self, runtime: OffloadRuntime, enable_events: bool,
                     stage: StageClient | None = None) -> None:
            results = {Lookup.MISS: LookupResult.MISS, Lookup.HIT: LookupResult.HIT,
                       Lookup.HIT_PENDING: LookupResult.HIT_PENDING, Lookup.RETRY: LookupResult.RETRY}
            super().__init__(runtime, results=results, spec_type=KVTierLoadStoreSpec,
                             enable_events=enable_events, stage=stage)
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
            source = self.extra_config.get("kvtier_config")
            if source is None:
                raise KVTierConfigError("kv_connector_extra_config.kvtier_config",
                                        "is required: a kvtier YAML path, YAML text or a dict")
            self._source = source
            self._staging_bytes = parse_size(
                self.extra_config.get("kvtier_staging_bytes", DEFAULT_STAGING_BYTES))
            self._engine_id = str(config.engine_id)
            self._stage_timeout = float(self.extra_config.get("kvtier_stage_timeout", DEFAULT_STAGE_TIMEOUT))
            if not self._stage_timeout > 0:
                raise KVTierConfigError("kv_connector_extra_config.kvtier_stage_timeout",
                                        f"must be a positive number of seconds, got {self._stage_timeout}")
            self._manager: KVTierOffloadingManager | None = None
            self._worker: KVTierOffloadingWorker | None = None

        def get_manager(self) -> Any:
            if self._manager is None:
                runtime = _RUNTIMES.get(self._engine_id)
                stage = None
                if runtime is None:  # the workers are other processes: this scheduler keeps its own index
                    runtime = self._scheduler_runtime()
                    if runtime.slow_tiers:  # their blocks are promised once every rank staged them
                        ranks = int(self.config.parallel.world_size)
                        stage = StageClient([socket_path(self._engine_id, r) for r in range(ranks)],
                                            self._stage_timeout)
                self._manager = KVTierOffloadingManager(
                    runtime, enable_events=self.kv_events_config.enable_kv_cache_events, stage=stage)
            return self._manager

        def _scheduler_runtime(self) -> OffloadRuntime:
            """Indexes and policies for workers in other processes (see scheduler_index)."""
            shape = _engine_model_shape() or _shape_from_block_bytes(self.config, self._source)
            geometry = EngineGeometry.from_offloading_config(self.config, shape,
                                                              _engine_identity(self.config))
            kvtier_config = kvtier_config_for_engine(self._source, geometry)
            codec = KeyCodec([g.group_id for g in geometry.groups])
            runtime = OffloadRuntime(kvtier_config, codec, self._staging_bytes, index_only=True)
            expected = int(self.config.worker_kv_bytes_per_block) * self.blocks_per_chunk
            sizes = {layout.nbytes for layout in runtime.core.layouts.values()}
            if len(geometry.groups) == 1 and sizes != {expected}:
                runtime.close()
                raise LayoutMismatch(
                    f"kvtier's block of this engine would be {sizes.pop()} bytes but each vLLM "
                    f"worker stores {expected} per offloaded block; set model.num_kv_heads and "
                    f"model.head_dim in the kvtier config")
            log.info("kvtier offloading for vLLM engine %s: the scheduler plans for workers in other "
                     "processes (world size %d), tiers %s", self._engine_id, self.config.parallel.world_size,
                     [t.name for t in runtime.core.tiers])
            return runtime

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
                server = None
                if runtime.slow_tiers:  # a scheduler in another process asks this rank to stage blocks
                    try:
                        server = StageServer(socket_path(self._engine_id, geometry.tp_rank),
                                             runtime.stage_chains, runtime.release_staged)
                    except OSError:
                        runtime.close()
                        raise
                register_runtime(self._engine_id, runtime)
                engine_id = self._engine_id

                def shutdown() -> None:
                    if server is not None:
                        server.close()
                    release_runtime(engine_id, runtime)

                self._worker = KVTierOffloadingWorker(runtime, movers, self.blocks_per_chunk,
                                                      on_shutdown=shutdown)
                log.info("kvtier offloading for vLLM engine %s: tiers %s, %s, namespace %s", engine_id,
                         [t.name for t in runtime.core.tiers],
                         ("cross-layer blocks" if all(m.cross_layer for m in movers)
                          else "per-layer pages packed"),
                         runtime.core.namespace.id if runtime.core.namespace else "-")
            return self._worker

    api: dict[str, type] = {"KVTierOffloadingSpec": KVTierOffloadingSpec,
                            "KVTierOffloadingManager": KVTierOffloadingManager,
                            "KVTierOffloadingWorker": KVTierOffloadingWorker,
                            "KVTierLoadStoreSpec": KVTierLoadStoreSpec}
    # Pickled by name (specs travel to worker processes): the package serves them.
    for name, cls in api.items():
        cls.__module__, cls.__qualname__ = "kvtier.connectors.vllm", name
    return api


def vllm_api() -> dict[str, type]:
    """vLLM's classes over kvtier, built once (imports vLLM and checks its version)."""
    global _vllm_api
    if _vllm_api is None:
        _vllm_api = _build_vllm_api()
    return _vllm_api
