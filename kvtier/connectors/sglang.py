"""SGLang HiCache L3 storage backend over kvtier's tiers (file, Redis — any tier list kvtier builds).

:class:`KVTierHiCacheStorage` is what SGLang's ``dynamic`` storage backend loads: SGLang's host pool
is L2, so kvtier adds checksummed pages on local files (kept across restarts) and in Redis (shared by
servers). A host-pool page is one kvtier block per component (K and V, or one MLA latent block),
handed to the tiers as a view of the pool where its layout allows (zero copy). Every public method
turns a failure into a miss or ``False``: SGLang calls them on daemon threads it never restarts.
Pages move through the shared page mover (kvtier.pages). sglang is imported lazily (the class is
built on first attribute access). Setup, keys, namespaces and limits: examples/sglang_backend.md.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from kvtier.blocks import BlockKey
from kvtier.cache import TieredCache
from kvtier.config import load_config, read_config_mapping
from kvtier.errors import KVTierConfigError, LayoutMismatch
from kvtier.layout import dtype_name, parse_dtype
from kvtier.metrics import CacheStats
from kvtier.pages import PageMover

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Environment variable naming a kvtier YAML file when the extra config has no ``kvtier_config``.
CONFIG_ENV = "KVTIER_SGLANG_CONFIG"
#: Host-pool layouts whose pages this backend can store; the first two are moved without a copy.
ZERO_COPY_LAYOUTS = ("page_first", "page_first_direct")
SUPPORTED_LAYOUTS = (*ZERO_COPY_LAYOUTS, "layer_first")
#: Keys of a kvtier config this backend fills in from SGLang; a user config must not set them.
_DERIVED_KEYS = ("model", "hash_block_size", "block_size", "groups")
_PERSON = b"kvtier/sglang"


@dataclass(frozen=True)
class PageGeometry:
    """How one host-pool page maps to kvtier blocks: which components, and what each one's bytes are.

    ``block_layers``/``block_elements`` describe a component as ``block_layers`` × ``page_size`` tokens
    × ``block_elements`` elements, contiguous: the page's bytes in the host pool's own order.
    """

    host_layout: str
    mla: bool
    page_size: int
    num_layers: int
    #: Elements of one token of one layer of one component (``heads × head_dim``; MLA: ``head_dim``).
    token_elements: int
    dtype: torch.dtype

    @property
    def components(self) -> tuple[bytes, ...]:
        return (b"kv",) if self.mla else (b"k", b"v")

    @property
    def zero_copy(self) -> bool:
        return self.host_layout in ZERO_COPY_LAYOUTS

    @property
    def block_layers(self) -> int:
        return 1 if self.host_layout == "page_first" else self.num_layers

    @property
    def block_elements(self) -> int:
        return self.token_elements * (self.num_layers if self.host_layout == "page_first" else 1)

    @property
    def component_numel(self) -> int:
        return self.page_size * self.num_layers * self.token_elements

    @classmethod
    def of_host_pool(cls, pool: Any, mla: bool) -> PageGeometry:
        """Read the geometry from an SGLang host pool (``layout``, ``page_size``, ``kv_buffer``)."""
        layout = str(getattr(pool, "layout", ""))
        if layout not in SUPPORTED_LAYOUTS:
            raise LayoutMismatch(f"SGLang host pool layout {layout!r} is not supported by kvtier; use "
                                 f"--hicache-mem-layout page_first (zero copy), page_first_direct or "
                                 f"layer_first")
        buffer: torch.Tensor = pool.kv_buffer
        shape = tuple(buffer.shape)
        # MHA: (2, tokens, L, H, D) | (2, pages, L, P, H, D) | (2, L, tokens, H, D)
        # MLA: (tokens, L, 1, D)    | (pages, L, P, 1, D)    | (L, tokens, 1, D)
        dims = {"page_first": 5, "page_first_direct": 6, "layer_first": 5}
        expected_dims = dims[layout] - (1 if mla else 0)
        if len(shape) != expected_dims or (not mla and shape[0] != 2):
            raise LayoutMismatch(f"SGLang host pool kv_buffer has shape {shape}, which is not a "
                                 f"{'MLA' if mla else 'MHA'} {layout} pool")
        body = shape if mla else shape[1:]
        num_layers = body[0] if layout == "layer_first" else body[1]
        token_elements = int(torch.Size(body[-2:]).numel())
        try:
            parse_dtype(buffer.dtype)
        except LayoutMismatch as exc:
            raise LayoutMismatch(f"SGLang host pool dtype {buffer.dtype}: {exc}") from None
        return cls(host_layout=layout, mla=mla, page_size=int(pool.page_size), num_layers=int(num_layers),
                   token_elements=token_elements, dtype=buffer.dtype)

    def page_movers(self, pool: Any) -> list[PageMover]:
        """One :class:`~kvtier.pages.PageMover` per component over the host pool's ``kv_buffer``.

        Engine block ``b`` of a mover is the page that starts at token ``b`` (``page_first``,
        ``layer_first``: pages are runs of tokens, whatever their alignment) or page ``b``
        (``page_first_direct``); :meth:`block_id` maps a host index to it. ``page_first`` and
        ``page_first_direct`` pages are one contiguous region (moved as views of the pool, no copy);
        ``layer_first`` pages are one region per layer, gathered into / scattered from staged blocks.
        """
        buffer: torch.Tensor = pool.kv_buffer
        page_bytes = self.component_numel * buffer.element_size()
        movers = []
        for part in [buffer] if self.mla else [buffer[0], buffer[1]]:
            if self.host_layout == "page_first_direct":
                regions = [part.view(part.shape[0], -1)]
            elif self.host_layout == "page_first":
                regions = [_token_pages(part, self.page_size)]
            else:
                regions = [_token_pages(part[layer], self.page_size) for layer in range(self.num_layers)]
            movers.append(PageMover(regions, 1, page_bytes))
        return movers

    def block_id(self, token_index: int) -> int:
        """The engine block of the page starting at host index ``token_index`` (see :meth:`page_movers`)."""
        return token_index // self.page_size if self.host_layout == "page_first_direct" else token_index

    def page_views(self, pool: Any, token_index: int) -> list[torch.Tensor]:
        """Zero-copy views (block shaped) of the components of the page starting at ``token_index``."""
        if not self.zero_copy:
            raise LayoutMismatch(f"{self.host_layout} pages are not contiguous in the host pool")
        return self.page_blocks(self.page_movers(pool), self.block_id(token_index))

    def page_blocks(self, movers: Sequence[PageMover], block_id: int) -> list[torch.Tensor]:
        """The components of engine block ``block_id`` as block-shaped views of the pool (zero copy)."""
        return [self.as_block(view) for view in _views(movers, block_id, self)]

    def staged_blocks(self, staged: Sequence[torch.Tensor], page: int) -> list[torch.Tensor]:
        """The components of page ``page`` of :meth:`new_blocks` staging, block shaped."""
        return [self.as_block(blocks[page]) for blocks in staged]

    def split_flat_page(self, page: torch.Tensor) -> list[torch.Tensor]:
        """Block-shaped views of the components of a flat page (``get_data_page(..., flat=True)``)."""
        flat = page.reshape(-1) if page.is_contiguous() else None
        if flat is not None and flat.dtype != self.dtype and flat.element_size() == self.dtype.itemsize:
            flat = flat.view(self.dtype)  # e.g. an fp8 page held as uint8: the same bytes
        numel = self.component_numel * len(self.components)
        if flat is None or flat.numel() != numel or flat.dtype != self.dtype:
            raise LayoutMismatch(f"a flat page must be a contiguous {self.dtype} tensor of "
                                 f"{self.component_numel * len(self.components)} elements, got "
                                 f"{page.dtype} of shape {tuple(page.shape)}")
        n = self.component_numel
        return [self.as_block(flat[i * n:(i + 1) * n]) for i in range(len(self.components))]

    def as_block(self, region: torch.Tensor) -> torch.Tensor:
        if not region.is_contiguous() or region.numel() != self.component_numel:
            raise LayoutMismatch(f"page region of shape {tuple(region.shape)} is not {self.component_numel} "
                                 f"contiguous elements")
        return region.view(self.block_layers, 1, self.page_size, 1, self.block_elements)

    def new_flat_page(self) -> torch.Tensor:
        return torch.empty(self.component_numel * len(self.components), dtype=self.dtype)

    def new_blocks(self, pages: int) -> list[torch.Tensor]:
        """Staging for ``pages`` pages: one ``[pages, component_numel]`` tensor per component."""
        return [torch.empty((pages, self.component_numel), dtype=self.dtype) for _ in self.components]


def _token_pages(part: torch.Tensor, page_size: int) -> torch.Tensor:
    """``[tokens, ...]`` (each token contiguous, tokens dense) as overlapping pages: row ``t`` is the
    ``page_size`` tokens from token ``t`` on."""
    token = part[0].numel() if part.shape[0] else 0
    if part.shape[0] > 1 and (part.stride(0) != token or not part[0].is_contiguous()):
        raise LayoutMismatch(f"SGLang host pool tokens are not dense (shape {tuple(part.shape)}, strides "
                             f"{part.stride()})")
    return part.as_strided((max(part.shape[0] - page_size + 1, 0), page_size * token), (token, 1))


def _views(movers: Sequence[PageMover], block_id: int, geometry: PageGeometry) -> list[torch.Tensor]:
    """The components of one page as views of the pool, in the pool's dtype."""
    views = []
    for mover in movers:
        view = mover.block_view(block_id)
        if view is None:
            raise LayoutMismatch(f"{geometry.host_layout} pages are not contiguous in the host pool")
        views.append(view.view(geometry.dtype))
    return views


class _KVTierHiCache:
    """SGLang ``HiCacheStorage`` backend over a kvtier :class:`~kvtier.TieredCache`.

    Constructed by SGLang as ``cls(storage_config, kwargs)``; SGLang then calls
    :meth:`register_mem_pool_host` once, before any page I/O, and that builds the tiers. Safe to call
    from several threads (SGLang's prefetch and backup threads) at once.
    """

    mem_pool_host: Any

    def __init__(self, storage_config: Any, kwargs: Mapping[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        self._user_config = _user_config(extra)
        self.mla = bool(getattr(storage_config, "is_mla_model", False))
        self.tp_rank = int(getattr(storage_config, "tp_rank", 0))
        self.tp_size = int(getattr(storage_config, "tp_size", 1))
        writer = getattr(storage_config, "is_storage_writer", None)
        self.is_writer = bool(writer) if writer is not None else (not self.mla or self.tp_rank == 0)
        #: Tiers one process owns (cpu, file: an in-memory index per process) vs. tiers shared by design
        #: (Redis).
        self.process_local = any(tier.get("type") != "redis" for tier in self._user_config.get("tiers", []))
        self.geometry: PageGeometry | None = None
        self._movers: list[PageMover] = []
        self._cache: TieredCache | None = None
        self._lock = threading.Lock()
        self._failures: dict[str, int] = {}

    # --- lifecycle ----------------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Called by SGLang once with its host KV pool: reads the page geometry and builds the tiers.

        Raises (failing SGLang's attach, before any request) if the pool's layout or dtype cannot be
        stored, or a tier cannot be built (an unwritable directory).
        """
        self.mem_pool_host = mem_pool_host
        geometry = PageGeometry.of_host_pool(mem_pool_host, self.mla)
        movers = geometry.page_movers(mem_pool_host)
        config = {**self._user_config, "model": self._model_section(geometry, mem_pool_host),
                  "hash_block_size": geometry.page_size}
        cache = TieredCache.from_config(config)
        with self._lock:
            old, self._cache, self.geometry, self._movers = self._cache, cache, geometry, movers
        if old is not None:
            old.close()
        if self.mla and self.tp_size > 1 and self.process_local:
            log.warning("kvtier HiCache backend: MLA with TP %d over a file or CPU tier: ranks other than "
                        "the writer see only the pages on disk when they started (those tiers index at "
                        "start, per process); give the backend a Redis tier to share new MLA pages across "
                        "ranks", self.tp_size)
        log.info("kvtier HiCache backend: %s pages of %d tokens, %s, namespace %s, tiers %s%s",
                 geometry.host_layout, geometry.page_size, dtype_name(geometry.dtype),
                 cache.core.namespace.id if cache.core.namespace else "-", [t.name for t in cache.core.tiers],
                 "" if self.is_writer else " (reader only: another rank writes these MLA pages)")

    def close(self) -> None:
        with self._lock:
            cache, self._cache = self._cache, None
        if cache is not None:
            cache.close()

    def kvtier_stats(self) -> CacheStats | None:
        """kvtier's per-tier counters (hits, stores, bytes, errors); ``None`` before registration."""
        cache = self._cache
        return cache.stats() if cache is not None else None

    # --- HiCacheStorage: existence ------------------------------------------------------------------------
    def exists(self, key: str) -> bool:
        """Whether every component of page ``key`` is stored."""
        return self._guard("exists", False, lambda: self._leading_pages([key]) == 1)

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """Number of leading pages of ``keys`` stored in some tier (SGLang prefetches that many)."""
        return self._guard("batch_exists", 0, lambda: self._leading_pages(keys))

    # --- HiCacheStorage: zero-copy path (interface_v1) -----------------------------------------------------
    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Read pages straight into the host pool at ``host_indices`` (``page_size`` indices per key)."""
        return self._guard("batch_get_v1", [False] * len(keys),
                           lambda: self._get_into_pool(keys, host_indices))

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Store the host-pool pages at ``host_indices`` (``page_size`` indices per key)."""
        return self._guard("batch_set_v1", [False] * len(keys),
                           lambda: self._set_from_pool(keys, host_indices))

    # --- HiCacheStorage: copying path --------------------------------------------------------------------
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """The flat page of ``key`` (read into ``target_location`` when given), or ``None`` on a miss."""
        return self._guard("get", None, lambda: self._get_flat([key], [target_location])[0])

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """One flat page or ``None`` per key (each key independently, like SGLang's file backend)."""
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        return self._guard("batch_get", [None] * len(keys), lambda: self._get_flat(keys, targets))

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Store one flat page (``get_data_page(index, flat=True)``); a stored key is kept as it is."""
        return self._guard("set", False, lambda: all(self._set_flat([key], [value])))

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store flat pages; ``True`` when every page is stored."""
        return self._guard("batch_set", False, lambda: all(self._set_flat(keys, list(values or []))))

    # --- internals -----------------------------------------------------------------------------------------
    def _ready(self) -> tuple[TieredCache, PageGeometry]:
        cache, geometry = self._cache, self.geometry
        if cache is None or geometry is None:
            raise RuntimeError("register_mem_pool_host was not called (or close() was): no tiers to use")
        return cache, geometry

    def _block_keys(self, key: str, geometry: PageGeometry) -> list[BlockKey]:
        data = key.encode()
        return [BlockKey(hashlib.blake2b(part + b"\0" + data, digest_size=32, person=_PERSON).digest())
                for part in geometry.components]

    def _leading_pages(self, keys: Sequence[str]) -> int:
        cache, geometry = self._ready()
        block_keys = [k for key in keys for k in self._block_keys(key, geometry)]
        return cache.lookup(block_keys) // len(geometry.components)

    def _load_pages(self, keys: Sequence[str], outs: Sequence[list[torch.Tensor]]) -> list[bool]:
        """Load each page into its block views; per-page success (a missing page does not hide later ones)."""
        cache, geometry = self._ready()
        parts = len(geometry.components)
        block_keys = [self._block_keys(key, geometry) for key in keys]
        ok = [False] * len(keys)
        start = 0
        while start < len(keys):
            flat_keys = [k for page in block_keys[start:] for k in page]
            flat_outs = [b for page in outs[start:] for b in page]
            hit_pages = cache.load(flat_keys, flat_outs) // parts
            ok[start:start + hit_pages] = [True] * hit_pages
            start += hit_pages + 1  # page start + hit_pages missed; go on after it
        return ok

    def _store_pages(self, keys: Sequence[str], blocks: Sequence[list[torch.Tensor]]) -> list[bool]:
        cache, geometry = self._ready()
        if not self.is_writer:
            return [True] * len(keys)  # MLA: the writer rank stores the same bytes once
        block_keys = [self._block_keys(key, geometry) for key in keys]
        flat_keys = [k for page in block_keys for k in page]
        # SGLang backs up a radix node's pages in order, their keys chained: each component block's
        # predecessor is the same component of the page before (the batch's first page: unknown)
        predecessors = [block_keys[i - 1][c] if i else None
                        for i, page in enumerate(block_keys) for c in range(len(page))]
        stored = cache.store(flat_keys, [b for page in blocks for b in page], predecessors=predecessors)
        if stored == len(flat_keys):
            return [True] * len(keys)
        return [cache.lookup(page) == len(page) for page in block_keys]

    def _page_starts(self, keys: Sequence[str], host_indices: torch.Tensor,
                     geometry: PageGeometry) -> list[int]:
        indices = host_indices.reshape(-1)
        if indices.numel() != len(keys) * geometry.page_size:
            raise LayoutMismatch(f"{len(keys)} pages need {len(keys) * geometry.page_size} host indices, "
                                 f"got {indices.numel()}")
        starts: list[int] = indices[::geometry.page_size].tolist()
        return starts

    def _get_into_pool(self, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        _, geometry = self._ready()
        movers = self._movers
        ids = [geometry.block_id(s) for s in self._page_starts(keys, host_indices, geometry)]
        if geometry.zero_copy:
            return self._load_pages(keys, [geometry.page_blocks(movers, b) for b in ids])
        staged = geometry.new_blocks(len(keys))
        ok = self._load_pages(keys, [geometry.staged_blocks(staged, i) for i in range(len(keys))])
        hits = [i for i, hit in enumerate(ok) if hit]
        if hits:
            rows = torch.tensor(hits)
            for mover, blocks in zip(movers, staged, strict=True):
                mover.scatter(blocks if len(hits) == len(keys) else blocks[rows], torch.tensor(ids)[rows])
        return ok

    def _set_from_pool(self, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        _, geometry = self._ready()
        movers = self._movers
        ids = [geometry.block_id(s) for s in self._page_starts(keys, host_indices, geometry)]
        if geometry.zero_copy:
            return self._store_pages(keys, [geometry.page_blocks(movers, b) for b in ids])
        staged = geometry.new_blocks(len(keys))
        for mover, blocks in zip(movers, staged, strict=True):
            mover.gather(torch.tensor(ids), blocks)
        return self._store_pages(keys, [geometry.staged_blocks(staged, i) for i in range(len(keys))])

    def _get_flat(self, keys: list[str], targets: Sequence[Any]) -> list[torch.Tensor | None]:
        _, geometry = self._ready()
        pages = [t if isinstance(t, torch.Tensor) else geometry.new_flat_page() for t in targets]
        ok = self._load_pages(keys, [geometry.split_flat_page(p) for p in pages])
        return [page if hit else None for page, hit in zip(pages, ok, strict=True)]

    def _set_flat(self, keys: list[str], values: Sequence[Any]) -> list[bool]:
        _, geometry = self._ready()
        if len(values) != len(keys):
            raise LayoutMismatch(f"{len(keys)} keys but {len(values)} values")
        return self._store_pages(keys, [geometry.split_flat_page(v.contiguous()) for v in values])

    def _model_section(self, geometry: PageGeometry, pool: Any) -> dict[str, Any]:
        cfg = self.storage_config
        name = f"sglang:{getattr(cfg, 'model_name', None) or 'unnamed'}"
        pool_dtype = getattr(pool, "dtype", geometry.dtype)
        if pool_dtype != geometry.dtype:
            name += f":{dtype_name(pool_dtype) if isinstance(pool_dtype, torch.dtype) else pool_dtype}"
        for label, rank, size in (("pp", "pp_rank", "pp_size"), ("cp", "attn_cp_rank", "attn_cp_size"),
                                  ("dcp", "dcp_rank", "dcp_size")):
            if int(getattr(cfg, size, 1) or 1) > 1:
                name += f":{label}{getattr(cfg, rank, 0)}of{getattr(cfg, size)}"
        dp_rank = int(getattr(cfg, "dp_rank", 0) or 0)
        if dp_rank and self.process_local:
            name += f":dp{dp_rank}"  # attention-DP ranks are processes of their own: one file tier each
        shared = self.mla  # MLA pages are identical on every TP rank: one namespace for all of them
        return {"name": name, "num_layers": geometry.block_layers, "num_kv_heads": 1,
                "head_dim": geometry.block_elements, "dtype": dtype_name(geometry.dtype), "mla": True,
                "tp_rank": 0 if shared else self.tp_rank, "tp_size": 1 if shared else self.tp_size}

    def _guard(self, op: str, miss: T, call: Callable[[], T]) -> T:
        """Run ``call``; an exception becomes ``miss`` (logged with its traceback the first time)."""
        try:
            return call()
        except Exception as exc:
            count = self._failures[op] = self._failures.get(op, 0) + 1
            if count == 1:
                log.exception("kvtier HiCache backend: %s failed; answering a miss", op)
            else:
                log.warning("kvtier HiCache backend: %s failed (%d times): %r", op, count, exc)
            return miss


def _user_config(extra: Mapping[str, Any]) -> dict[str, Any]:
    """The user's kvtier config (tiers, placement), validated now so a bad key fails SGLang's launch."""
    source = extra.get("kvtier_config")
    path = "extra_config.kvtier_config"
    if source is None:
        source, path = os.environ.get(CONFIG_ENV), CONFIG_ENV
    if source is None:
        raise KVTierConfigError("extra_config.kvtier_config",
                                f"missing: give a kvtier YAML path (or an inline mapping with `tiers:`) in "
                                f"--hicache-storage-backend-extra-config, or set {CONFIG_ENV}")
    data = read_config_mapping(source if isinstance(source, Mapping) else Path(str(source)), where=path)
    for key in _DERIVED_KEYS:
        if key in data:
            raise KVTierConfigError(key, "comes from SGLang's host pool (model, page size); remove it from "
                                         "the kvtier config of the SGLang backend")
    probe = {"name": "config-check", "num_layers": 1, "num_kv_heads": 1, "head_dim": 1, "mla": True}
    load_config({**data, "model": probe})
    return dict(data)


_storage_class: type | None = None
_storage_class_lock = threading.Lock()


def storage_class() -> type:
    """``KVTierHiCacheStorage``: the backend as a real subclass of SGLang's ``HiCacheStorage``."""
    global _storage_class
    with _storage_class_lock:
        if _storage_class is None:
            try:
                from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
            except ImportError as exc:
                raise ImportError(f"kvtier's HiCache backend runs inside SGLang, which failed to import: "
                                  f"{exc} (pip install 'sglang>=0.5')") from exc

            class KVTierHiCacheStorage(_KVTierHiCache, HiCacheStorage):
                __doc__ = _KVTierHiCache.__doc__

            KVTierHiCacheStorage.__module__ = __name__
            KVTierHiCacheStorage.__qualname__ = "KVTierHiCacheStorage"
            _storage_class = KVTierHiCacheStorage
        return _storage_class


def __getattr__(name: str) -> Any:
    if name == "KVTierHiCacheStorage":
        return storage_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CONFIG_ENV", "SUPPORTED_LAYOUTS", "ZERO_COPY_LAYOUTS", "PageGeometry", "storage_class"]
