"""kvtier as SGLang's HiCache L3 backend, against SGLang's real ``HiCacheStorage`` and backend factory.

SGLang's top-level package imports its whole runtime (triton, zmq, aiohttp …), none of which the
storage interface needs; ``hicache_storage`` and ``storage.backend_factory`` import only torch. So the
tests load those real modules with ``sglang/__init__`` skipped (:func:`_sglang_storage`), and drive
the backend with a host pool built here that has the shapes and page methods of SGLang's
``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` (the real pools need a GPU device pool to exist).

Without sglang installed the tests skip, unless ``CI`` is set: then they fail.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time
import types
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.errors import KVTierConfigError, LayoutMismatch

REDIS_URL = "redis://127.0.0.1:6379/0"


def _sglang_storage() -> types.ModuleType:
    """SGLang's real ``hicache_storage`` module, imported without running ``sglang/__init__``."""
    if importlib.util.find_spec("sglang") is None:
        message = "sglang is not installed (pip install --no-deps 'sglang==0.5.23')"
        if os.environ.get("CI"):
            pytest.fail(f"CI is set but {message}")
        pytest.skip(message, allow_module_level=True)
    if "sglang" not in sys.modules:
        spec = importlib.util.find_spec("sglang")
        assert spec is not None and spec.submodule_search_locations is not None
        package = types.ModuleType("sglang")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["sglang"] = package
    return importlib.import_module("sglang.srt.mem_cache.hicache_storage")


hicache = _sglang_storage()
backend_factory = importlib.import_module("sglang.srt.mem_cache.storage.backend_factory")


class HostPool:
    """A host KV pool with SGLang's buffer shapes and page methods, for ``layout`` and MHA or MLA.

    MHA ``kv_buffer``: page_first ``(2, tokens, L, H, D)``, page_first_direct ``(2, pages, L, P, H, D)``,
    layer_first ``(2, L, tokens, H, D)``; MLA drops the leading 2 and has one head.
    """

    def __init__(self, layout: str = "page_first", mla: bool = False, pages: int = 16, page_size: int = 4,
                 layers: int = 3, heads: int = 2, head_dim: int = 8, dtype: torch.dtype = torch.float16,
                 seed: int = 0) -> None:
        self.layout, self.mla, self.page_size, self.dtype = layout, mla, page_size, dtype
        self.layer_num, self.head_num, self.head_dim = layers, 1 if mla else heads, head_dim
        self.size = pages * page_size
        inner = {"page_first": (self.size, layers), "page_first_direct": (pages, layers, page_size),
                 "layer_first": (layers, self.size), "page_head": (pages, self.head_num, page_size)}[layout]
        tail = (1, head_dim) if mla else (heads, head_dim)
        shape = (*inner, *tail) if mla else (2, *inner, *tail)
        gen = torch.Generator().manual_seed(seed)
        self.kv_buffer = torch.randn(shape, generator=gen).to(dtype)

    def _page(self, index: int) -> torch.Tensor:
        kv = self.kv_buffer if self.mla else self.kv_buffer.movedim(0, -1)  # K/V last while slicing
        if self.layout == "page_first":
            page = kv[index:index + self.page_size]
        elif self.layout == "page_first_direct":
            page = kv[index // self.page_size:index // self.page_size + 1]
        else:
            page = kv[:, index:index + self.page_size]
        return page if self.mla else page.movedim(-1, 0)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self._page(index)
        return page.flatten() if flat else page

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        page = self._page(index)
        page.copy_(data_page.reshape(page.shape))

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self._page(0).numel(), dtype=self.dtype)

    def indices(self, first_page: int, pages: int) -> torch.Tensor:
        return torch.arange(first_page * self.page_size, (first_page + pages) * self.page_size)


def storage_config(extra: dict[str, Any], **fields: Any) -> Any:
    """A real ``HiCacheStorageConfig`` (only the fields this SGLang release has)."""
    values = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                  is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                  model_name="org/tiny-model",
                  extra_config=extra)
    values.update(fields)
    known = {f.name for f in dataclasses.fields(hicache.HiCacheStorageConfig)}
    return hicache.HiCacheStorageConfig(**{k: v for k, v in values.items() if k in known})


def dynamic_extra(kvtier_config: Any) -> dict[str, Any]:
    """The ``--hicache-storage-backend-extra-config`` of examples/sglang_backend.md."""
    return {"backend_name": "kvtier", "module_path": "kvtier.connectors.sglang",
            "class_name": "KVTierHiCacheStorage", "interface_v1": 1, "kvtier_config": kvtier_config}


def file_tiers(root: Path) -> dict[str, Any]:
    return {"tiers": [{"type": "file", "path": str(root), "capacity": "64MiB"}]}


@pytest.fixture
def make_backend(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """Backends created through SGLang's factory (``dynamic``) and registered with a host pool."""
    made: list[Any] = []

    def make(pool: HostPool | None = None, kvtier_config: Any = None, **fields: Any) -> Any:
        pool = pool or HostPool()
        config = storage_config(dynamic_extra(kvtier_config or file_tiers(tmp_path / "l3")),
                                is_mla_model=pool.mla, **fields)
        backend = backend_factory.StorageBackendFactory.create_backend("dynamic", config, pool)
        backend.register_mem_pool_host(pool)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()


def keys(*names: str) -> list[str]:
    return [f"{name:0>64}" for name in names]  # SGLang keys are 64 hex digits


# --- the real interface -------------------------------------------------------------------------------
def test_is_a_real_hicache_storage_loaded_by_the_dynamic_backend_option(
        make_backend: Callable[..., Any]) -> None:
    backend = make_backend()
    assert isinstance(backend, hicache.HiCacheStorage)
    assert type(backend).__name__ == "KVTierHiCacheStorage"
    assert type(backend).__module__ == "kvtier.connectors.sglang"


def test_set_get_round_trip_of_flat_pages(make_backend: Callable[..., Any]) -> None:
    pool = HostPool()
    backend = make_backend(pool)
    a, b, c = keys("a", "b", "c")
    assert backend.set(a, pool.get_data_page(0))
    assert backend.batch_set([b, c], [pool.get_data_page(4), pool.get_data_page(8)])
    got = backend.get(a, pool.get_dummy_flat_data_page())
    assert got is not None and torch.equal(got, pool.get_data_page(0))
    pages = backend.batch_get([b, c], [pool.get_dummy_flat_data_page() for _ in range(2)])
    assert [torch.equal(p, pool.get_data_page(i)) for p, i in zip(pages, (4, 8), strict=True)] == [True, True]
    assert backend.get(a) is not None  # no target: the backend allocates one


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("layout", ["page_first", "page_first_direct", "layer_first"])
def test_batch_set_v1_and_get_v1_move_pages_of_the_host_pool(make_backend: Callable[..., Any], layout: str,
                                                            mla: bool) -> None:
    pool = HostPool(layout=layout, mla=mla)
    backend = make_backend(pool)
    names = keys("p0", "p1", "p2")
    assert backend.batch_set_v1(names, pool.indices(0, 3)) == [True, True, True]
    written = [pool.get_data_page(i * pool.page_size).clone() for i in range(3)]
    pool.kv_buffer.zero_()
    assert backend.batch_get_v1(names, pool.indices(5, 3)) == [True, True, True]
    for i in range(3):
        assert torch.equal(pool.get_data_page((5 + i) * pool.page_size), written[i])
    assert not pool.get_data_page(0).any()  # nothing else was written


def test_page_first_pages_are_moved_without_a_copy(make_backend: Callable[..., Any]) -> None:
    pool = HostPool(layout="page_first")
    backend = make_backend(pool)
    views = backend.geometry.page_views(pool, 2 * pool.page_size)
    base = pool.kv_buffer.untyped_storage().data_ptr()
    assert [v.untyped_storage().data_ptr() for v in views] == [base, base]  # views of the pool itself
    assert backend.geometry.zero_copy


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("layout", ["page_first", "page_first_direct", "layer_first"])
def test_flat_and_zero_copy_paths_read_each_others_pages(make_backend: Callable[..., Any], layout: str,
                                                         mla: bool) -> None:
    """The page mover's blocks hold a page's bytes in the order of SGLang's own flat pages."""
    pool = HostPool(layout=layout, mla=mla)
    backend = make_backend(pool)
    a, b = keys("a", "b")
    assert backend.set(a, pool.get_data_page(0))
    assert backend.batch_set_v1([b], pool.indices(1, 1)) == [True]
    assert backend.batch_get_v1([a], pool.indices(6, 1)) == [True]
    assert torch.equal(pool.get_data_page(6 * pool.page_size), pool.get_data_page(0))
    got = backend.get(b, pool.get_dummy_flat_data_page())
    assert got is not None and torch.equal(got, pool.get_data_page(pool.page_size))


def test_a_batch_of_pages_is_stored_as_a_chain_per_component(make_backend: Callable[..., Any]) -> None:
    pool = HostPool()
    backend = make_backend(pool)
    names = keys("c0", "c1", "c2")
    assert backend.batch_set_v1(names, pool.indices(0, 3)) == [True] * 3
    pages = [backend._block_keys(name, backend.geometry) for name in names]
    index = backend._cache.core.residency.tiers[0]
    for component in range(len(pages[0])):
        assert pages[0][component] not in index.links  # the batch's first page: a chain head here
        for i in (1, 2):
            assert index.hint(pages[i][component]).predecessor == pages[i - 1][component]


def test_batch_exists_counts_the_leading_stored_pages(make_backend: Callable[..., Any]) -> None:
    pool = HostPool()
    backend = make_backend(pool)
    a, b, c, d = keys("a", "b", "c", "d")
    assert backend.batch_set_v1([a, b, d], torch.cat([pool.indices(0, 2), pool.indices(3, 1)])) == [True] * 3
    assert backend.batch_exists([a, b, c, d]) == 2
    assert backend.batch_exists([c, a]) == 0
    assert backend.batch_exists([a, b]) == 2
    assert backend.batch_exists([]) == 0
    assert backend.exists(d) and not backend.exists(c)


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_missing_keys_are_misses_and_do_not_hide_later_pages(make_backend: Callable[..., Any],
                                                             layout: str) -> None:
    pool = HostPool(layout=layout)
    backend = make_backend(pool)
    a, missing, b = keys("a", "missing", "b")
    assert backend.batch_set_v1([a, b], pool.indices(0, 2)) == [True, True]
    assert backend.get(missing) is None
    pages = backend.batch_get([a, missing, b])
    assert [p is not None for p in pages] == [True, False, True]
    untouched = pool.get_data_page(9 * pool.page_size).clone()
    assert backend.batch_get_v1([a, missing, b], pool.indices(8, 3)) == [True, False, True]
    assert torch.equal(pool.get_data_page(10 * pool.page_size), pool.get_data_page(pool.page_size))
    assert torch.equal(pool.get_data_page(8 * pool.page_size), pool.get_data_page(0))
    assert torch.equal(pool.get_data_page(9 * pool.page_size), untouched)  # the miss: its page left as it was


def test_storing_a_stored_key_again_keeps_one_valid_page(make_backend: Callable[..., Any]) -> None:
    """As SGLang's file backend: a key names its tokens' KV, so a second store of it is a no-op."""
    pool = HostPool()
    backend = make_backend(pool)
    (a,) = keys("a")
    first = pool.get_data_page(0).clone()
    assert backend.set(a, first)
    assert backend.set(a, pool.get_data_page(pool.page_size))
    assert backend.batch_set_v1([a], pool.indices(2, 1)) == [True]
    got = backend.get(a)
    assert got is not None and torch.equal(got, first)
    assert backend.kvtier_stats().tiers[0].blocks_written == 2  # K and V, once


# --- keys: model, TP rank, MLA --------------------------------------------------------------------------
def test_keys_carry_the_model_and_the_tp_rank(make_backend: Callable[..., Any], tmp_path: Path) -> None:
    shared = file_tiers(tmp_path / "shared")
    pool = HostPool()
    rank0 = make_backend(pool, shared, tp_rank=0, tp_size=2)
    rank1 = make_backend(pool, shared, tp_rank=1, tp_size=2)
    other_model = make_backend(pool, shared, tp_rank=0, tp_size=2, model_name="org/another-model")
    (a,) = keys("a")
    assert rank0.set(a, pool.get_data_page(0))
    assert not rank1.exists(a)
    assert not other_model.exists(a)
    restarted = make_backend(pool, shared, tp_rank=0, tp_size=2)  # rank 0 again: the file tier's index
    assert restarted.exists(a)                                   # is rebuilt from disk at start


def test_mla_pages_are_stored_once_by_the_writer_rank(make_backend: Callable[..., Any], tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    shared = file_tiers(tmp_path / "shared")
    pool = HostPool(mla=True)
    rank0 = make_backend(pool, shared, tp_rank=0, tp_size=2)
    rank1 = make_backend(pool, shared, tp_rank=1, tp_size=2)
    assert "see only the pages on disk when they started" in caplog.text  # file tier + MLA + TP: said once
    a, b = keys("a", "b")
    assert rank1.batch_set_v1([b], pool.indices(1, 1)) == [True]  # acknowledged, not written
    assert rank1.kvtier_stats().tiers[0].blocks_written == 0
    assert rank0.batch_set_v1([a], pool.indices(0, 1)) == [True]
    assert rank0.kvtier_stats().tiers[0].blocks_written == 1  # MLA: one latent block per page
    reader = make_backend(pool, shared, tp_rank=1, tp_size=2)  # rank 1 started after the write
    assert reader.exists(a) and not reader.exists(b)
    assert reader.batch_get_v1([a], pool.indices(4, 1)) == [True]
    assert torch.equal(pool.get_data_page(4 * pool.page_size), pool.get_data_page(0))


def test_attention_dp_ranks_get_a_file_namespace_each(make_backend: Callable[..., Any],
                                                       tmp_path: Path) -> None:
    if "dp_rank" not in {f.name for f in dataclasses.fields(hicache.HiCacheStorageConfig)}:
        pytest.skip("this SGLang release's HiCacheStorageConfig has no dp_rank")
    shared = file_tiers(tmp_path / "shared")
    pool = HostPool()
    (a,) = keys("a")
    assert make_backend(pool, shared, dp_rank=0).set(a, pool.get_data_page(0))
    assert not make_backend(pool, shared, dp_rank=1).exists(a)
    assert make_backend(pool, shared, dp_rank=0).exists(a)


# --- Redis ----------------------------------------------------------------------------------------------
def _redis_up(url: str = REDIS_URL) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 6379), timeout=0.5) as sock:
            sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _need_redis() -> None:
    if not _redis_up():
        message = "no Redis at 127.0.0.1:6379 (redis-server --port 6379 --save '' --daemonize yes)"
        if os.environ.get("CI"):
            pytest.fail(f"CI is set but {message}")
        pytest.skip(message)


def redis_tiers(url: str, **options: Any) -> dict[str, Any]:
    return {"tiers": [{"type": "redis", "url": url, "connect_timeout": 0.2, "timeout": 0.5, **options}]}


def test_redis_tier_is_shared_between_servers(make_backend: Callable[..., Any]) -> None:
    _need_redis()
    import redis

    model = f"org/model-{uuid.uuid4().hex[:8]}"
    pool = HostPool()
    writer = make_backend(pool, redis_tiers(REDIS_URL, ttl_seconds=300), model_name=model)
    reader = make_backend(pool, redis_tiers(REDIS_URL, ttl_seconds=300), model_name=model)
    names = keys("a", "b")
    try:
        assert writer.batch_set_v1(names, pool.indices(0, 2)) == [True, True]
        assert reader.batch_exists(names) == 2
        assert reader.batch_get_v1(names, pool.indices(9, 2)) == [True, True]
        assert torch.equal(pool.get_data_page(10 * pool.page_size), pool.get_data_page(pool.page_size))
    finally:
        client = redis.Redis.from_url(REDIS_URL)
        namespace = writer._cache.core.namespace.id
        for key in client.scan_iter(match=f"kvtier:{namespace}:*"):
            client.delete(key)
        client.close()


def test_redis_shares_mla_pages_across_ranks_as_they_are_written(make_backend: Callable[..., Any]) -> None:
    _need_redis()
    import redis

    config = redis_tiers(REDIS_URL, ttl_seconds=300)
    model = f"org/mla-{uuid.uuid4().hex[:8]}"
    pool = HostPool(mla=True)
    ranks = [make_backend(pool, config, tp_rank=r, tp_size=4, model_name=model) for r in range(4)]
    names = keys("a", "b")
    client = redis.Redis.from_url(REDIS_URL)
    pattern = f"kvtier:{ranks[0]._cache.core.namespace.id}:*"
    try:
        assert [rank.batch_set_v1(names, pool.indices(0, 2)) for rank in ranks] == [[True, True]] * 4
        assert len(list(client.scan_iter(match=pattern))) == 2  # one value per page, not one per rank
        for r, rank in enumerate(ranks):
            assert rank.batch_exists(names) == 2
            assert rank.batch_get_v1(names, pool.indices(4 + 2 * r, 2)) == [True, True]
        assert torch.equal(pool.get_data_page(11 * pool.page_size), pool.get_data_page(pool.page_size))
    finally:
        for key in client.scan_iter(match=pattern):
            client.delete(key)
        client.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_redis_down_is_a_miss_and_a_failed_store(make_backend: Callable[..., Any], tmp_path: Path) -> None:
    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("redis-server is not on PATH")
    port = _free_port()
    process = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                "--appendonly", "no", "--dir", str(tmp_path)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "private redis-server did not start"
                time.sleep(0.05)
        pool = HostPool()
        backend = make_backend(pool, redis_tiers(f"redis://127.0.0.1:{port}/0",
                                                 circuit_breaker={"failures": 1, "cooldown_seconds": 30}))
        a, b = keys("a", "b")
        assert backend.batch_set_v1([a], pool.indices(0, 1)) == [True]
        assert backend.exists(a)
    finally:
        process.kill()
        process.wait(timeout=10)
    started = time.monotonic()
    assert backend.batch_exists([a]) == 0
    assert not backend.exists(a)
    assert backend.get(a) is None
    assert backend.batch_get_v1([a], pool.indices(4, 1)) == [False]
    assert backend.batch_set_v1([b], pool.indices(1, 1)) == [False]
    assert not backend.set(b, pool.get_data_page(0))
    assert time.monotonic() - started < 5  # the circuit breaker answers at once
    assert backend.kvtier_stats().tiers[0].errors  # counted, never raised


def test_redis_never_reachable_is_a_miss(make_backend: Callable[..., Any]) -> None:
    pool = HostPool()
    backend = make_backend(pool, redis_tiers(f"redis://127.0.0.1:{_free_port()}/0"))
    (a,) = keys("a")
    assert backend.batch_set_v1([a], pool.indices(0, 1)) == [False]
    assert backend.batch_exists([a]) == 0
    assert backend.batch_get([a]) == [None]


# --- configuration and misuse ---------------------------------------------------------------------------
def _create(extra: dict[str, Any]) -> Any:
    return backend_factory.StorageBackendFactory.create_backend("dynamic", storage_config(extra), HostPool())


def test_config_errors_fail_the_launch_with_the_key_path(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVTIER_SGLANG_CONFIG", raising=False)
    with pytest.raises(KVTierConfigError, match="extra_config.kvtier_config"):
        _create(dynamic_extra(None))
    with pytest.raises(KVTierConfigError, match=r"^model: comes from SGLang"):
        _create(dynamic_extra({**file_tiers(tmp_path), "model": {"name": "x"}}))
    with pytest.raises(KVTierConfigError, match=r"tiers\[0\]\.capacity"):
        _create(dynamic_extra({"tiers": [{"type": "file", "path": str(tmp_path), "capacity": "lots"}]}))


def test_config_from_a_yaml_file_or_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "kvtier.yaml"
    path.write_text(f"tiers:\n  - type: file\n    path: {tmp_path / 'l3'}\n    capacity: 64MiB\n")
    pool = HostPool()
    without = {k: v for k, v in dynamic_extra(None).items() if k != "kvtier_config"}
    for extra in (dynamic_extra(str(path)), without):
        monkeypatch.setenv("KVTIER_SGLANG_CONFIG", str(path))
        backend = backend_factory.StorageBackendFactory.create_backend("dynamic", storage_config(extra), pool)
        backend.register_mem_pool_host(pool)
        try:
            assert backend.set(keys("a")[0], pool.get_data_page(0))
        finally:
            backend.close()


def test_unsupported_host_layout_is_refused_at_registration(tmp_path: Path) -> None:
    pool = HostPool(layout="page_head")
    backend = _create(dynamic_extra(file_tiers(tmp_path)))
    with pytest.raises(LayoutMismatch, match="page_first"):
        backend.register_mem_pool_host(pool)


def test_calls_before_registration_answer_a_miss(tmp_path: Path) -> None:
    backend = _create(dynamic_extra(file_tiers(tmp_path)))
    (a,) = keys("a")
    assert backend.batch_exists([a]) == 0
    assert backend.get(a) is None
    assert backend.batch_get_v1([a], torch.arange(4)) == [False]
    assert backend.set(a, torch.zeros(4)) is False
