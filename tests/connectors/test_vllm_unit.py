"""The vLLM adapter's kvtier-side logic, without vLLM: keys, config merge, page moves, manager and worker.

A small harness plays vLLM's part (scheduler calls, worker calls, per-layer KV pages), so these run in
the main suite. ``test_vllm_e2e.py`` runs the same adapter inside a real vLLM engine.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.blocks import BlockKey
from kvtier.connectors.vllm import (
    EPOCH_BYTES,
    FIRST_EPOCH,
    LOST,
    STAGED,
    BlockTransferSpec,
    CudaPageMover,
    EngineGeometry,
    EngineGroup,
    KeyCodec,
    KVTierOffloadManager,
    KVTierOffloadWorkerCore,
    Lookup,
    ModelIdentity,
    OffloadRuntime,
    PageMover,
    UnsupportedVLLM,
    check_vllm_version,
    kvtier_config_for_engine,
    model_identity,
    page_movers,
)
from kvtier.errors import KVTierConfigError, LayoutMismatch
from tests.gpu_support import requires_gpu

HEADS, DIM = 2, 32


def redis_up() -> bool:
    try:
        import redis

        return bool(redis.Redis(host="127.0.0.1", port=6379, socket_connect_timeout=0.5).ping())
    except Exception:
        return False


@dataclass
class GpuSpec:
    """Stands in for vLLM's GPULoadStoreSpec."""

    block_ids: np.ndarray
    group_sizes: tuple[int, ...]
    block_indices: tuple[int, ...]


def geometry(groups: tuple[tuple[int, int, int], ...] = ((0, 32, 2),), bpc: int = 1,
             **kw: Any) -> EngineGeometry:
    tokens_per_hash = min(tpb for _, tpb, _ in groups)
    kw.setdefault("model_name", "tiny-llama")
    return EngineGeometry(dtype="bfloat16", tokens_per_hash=tokens_per_hash,
                          blocks_per_chunk=bpc, groups=tuple(EngineGroup(*g) for g in groups),
                          kv_cache_layout="LBHNC", num_kv_heads=HEADS, head_dim=DIM, mla=False, **kw)


class Harness:
    """A fake engine: per-layer KV pages, and vLLM's scheduler/worker call sequence around the adapter."""

    def __init__(self, tiers: list[dict[str, Any]], *,
                 groups: tuple[tuple[int, int, int], ...] = ((0, 32, 2),), bpc: int = 1, num_blocks: int = 32,
                 staging_bytes: int = 1 << 24, placement: dict[str, Any] | None = None, seed: int = 0,
                 enable_events: bool = False, device: str = "cpu") -> None:
        self.geometry = geometry(groups, bpc)
        source: dict[str, Any] = {"tiers": tiers}
        if placement:
            source["placement"] = placement
        config = kvtier_config_for_engine(source, self.geometry)
        self.runtime = OffloadRuntime(config, KeyCodec([g[0] for g in groups]), staging_bytes)
        gen = torch.Generator().manual_seed(seed)
        self.pages: list[list[torch.Tensor]] = []
        tensors: list[SimpleNamespace] = []
        refs: list[list[SimpleNamespace]] = []  # vLLM's CanonicalKVCaches, as page_movers reads it
        for _, tpb, layers in groups:
            page = 2 * tpb * HEADS * DIM * 2
            group_pages = [torch.randint(-128, 127, (num_blocks, page), dtype=torch.int8,
                                         generator=gen).to(device) for _ in range(layers)]
            self.pages.append(group_pages)
            refs.append([SimpleNamespace(tensor_idx=len(tensors) + i, page_size_bytes=page)
                         for i in range(layers)])
            tensors += [SimpleNamespace(tensor=t) for t in group_pages]
        movers = page_movers(SimpleNamespace(tensors=tensors, group_data_refs=refs), self.runtime, bpc)
        self.bpc = bpc
        self.manager = KVTierOffloadManager(self.runtime, enable_events=enable_events)
        self.worker = KVTierOffloadWorkerCore(self.runtime, movers, bpc)
        self._jobs = itertools.count()

    def close(self) -> None:
        self.worker.shutdown()
        self.runtime.close()

    def keys(self, n: int, group: int = 0, salt: int = 0) -> list[bytes]:
        return [(salt * 1000 + i).to_bytes(32, "little") + group.to_bytes(4, "big") for i in range(n)]

    def _run(self, submit: Any, *args: Any) -> Any:
        job = next(self._jobs)
        assert submit(job, *args)
        self.worker.wait({job})
        results = self.worker.get_finished()
        assert [r["job_id"] for r in results] == [job]
        return results[0]

    def store(self, keys: list[bytes], block_ids: list[int]) -> list[bytes]:
        planned = self.manager.plan_store(keys)
        assert planned is not None, "nothing could be stored"
        chosen, spec = planned
        if chosen:
            ids = [b for i, k in enumerate(keys) if k in chosen
                   for b in block_ids[i * self.bpc:(i + 1) * self.bpc]]
            result = self._run(self.worker.submit_store, GpuSpec(np.array(ids, np.int32), (len(ids),), (0,)),
                               spec)
            assert result["success"]
            self.manager.complete_store(chosen)
        return chosen

    def load(self, keys: list[bytes], block_ids: list[int], start: int = 0) -> dict[str, Any]:
        spec = self.manager.prepare_load(keys)
        result = self._run(self.worker.submit_load, spec,
                           GpuSpec(np.array(block_ids, np.int32), (len(block_ids),), (start,)))
        self.manager.complete_load(keys)
        return result

    def settle(self, keys: list[bytes]) -> list[Lookup]:
        """Lookup, start the reads (end of the scheduler step), wait for them, and lookup again."""
        first = [self.manager.lookup(k) for k in keys]
        self.manager.on_schedule_end()
        for fetch in list(self.manager._fetching.values()):
            if fetch.future is not None:
                fetch.future.result()
        assert not self.manager.has_pending_work()
        assert first  # keep the first answers for callers that check them
        return [self.manager.lookup(k) for k in keys]

    def block(self, group: int, block_id: int) -> list[torch.Tensor]:
        return [layer[block_id].clone() for layer in self.pages[group]]


def block_bytes() -> int:
    """Bytes of one block of the harness's model (a probe harness, closed again)."""
    probe = Harness([{"type": "cpu", "capacity": "1MiB"}])
    try:
        return probe.runtime.core.layouts[0].nbytes
    finally:
        probe.close()


@pytest.fixture
def cpu_tier() -> list[dict[str, Any]]:
    return [{"type": "cpu", "capacity": "4MiB"}]


# --- versions, imports, keys ---------------------------------------------------------------------------
def test_supported_vllm_versions() -> None:
    assert check_vllm_version("0.32.0") == (0, 32)
    assert check_vllm_version("0.34.2+cpu") == (0, 34)
    for bad in ("0.20.1", "0.35.0", "1.0.0", "dev"):
        with pytest.raises(UnsupportedVLLM, match=r"vLLM 0\.32–0\.34"):
            check_vllm_version(bad)


def test_importing_kvtier_and_the_adapter_never_imports_vllm() -> None:
    code = "import sys, kvtier, kvtier.connectors, kvtier.connectors.vllm; assert 'vllm' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True,
                   env={**os.environ, "PYTHONPATH": str(Path.cwd())})


def test_key_codec_maps_vllm_group_ids_to_kvtier_groups() -> None:
    codec = KeyCodec([0, 2])
    key = b"h" * 32 + (2).to_bytes(4, "big")
    assert codec.block_key(key) == BlockKey(FIRST_EPOCH + b"h" * 32, 1)
    assert codec.offload_key(codec.block_key(key)) == key
    with pytest.raises(LayoutMismatch, match="group 1"):
        codec.block_key(b"h" * 32 + (1).to_bytes(4, "big"))


@given(st.binary(min_size=1, max_size=48), st.sampled_from([0, 3, 7]))
def test_key_codec_epochs_round_trip_and_never_collide(block_hash: bytes, group: int) -> None:
    codec = KeyCodec([0, 3, 7])
    key = block_hash + group.to_bytes(4, "big")
    before = codec.block_key(key)
    assert codec.current(before) and codec.offload_key(before) == key
    codec.new_epoch()
    after = codec.block_key(key)
    assert after != before and codec.offload_key(after) == key
    assert codec.current(after) and not codec.current(before)
    assert len(after.block_hash) == EPOCH_BYTES + len(block_hash)


# --- the checkpoint's identity ---------------------------------------------------------------------------
def checkpoint(path: Path, weights: bytes = b"w" * 64) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 2}')
    (path / "model.safetensors").write_bytes(weights)
    return path


def test_one_checkpoint_named_two_ways_has_one_identity(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = checkpoint(tmp_path / "models" / "tiny")
    (tmp_path / "link").symlink_to(tmp_path / "models")
    monkeypatch.chdir(tmp_path)
    named = [model_identity(name)
             for name in ("models/tiny", str(ckpt), "./link/tiny/", str(tmp_path / "link/tiny"))]
    assert len(set(named)) == 1 and named[0].name == str(ckpt.resolve())
    configs = [kvtier_config_for_engine({"tiers": [{"type": "cpu", "capacity": "1MiB"}]},
                                        geometry(model_name=i.name, weights_id=i.weights)) for i in named]
    assert len({c.model.name for c in configs}) == 1


def test_a_checkpoint_overwritten_in_place_gets_a_new_identity(tmp_path: Path) -> None:
    ckpt = checkpoint(tmp_path / "tiny")
    before = model_identity(str(ckpt))
    checkpoint(ckpt, b"v" * 65)  # new weights, same path
    after = model_identity(str(ckpt))
    assert after.name == before.name and after.weights != before.weights
    stat = (ckpt / "model.safetensors").stat()
    os.utime(ckpt / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert model_identity(str(ckpt)).weights != after.weights  # same size, rewritten later
    (ckpt / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 3}')
    assert model_identity(str(ckpt)).weights != after.weights
    tiers = {"tiers": [{"type": "cpu", "capacity": "1MiB"}]}
    old = kvtier_config_for_engine(tiers, geometry(model_name=before.name, weights_id=before.weights))
    new = kvtier_config_for_engine(tiers, geometry(model_name=after.name, weights_id=after.weights))
    assert old.model.name != new.model.name


def test_a_hub_id_that_is_not_cached_is_named_by_its_revision(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))
    assert model_identity("org/never-downloaded", "abc123") \
        == ModelIdentity("org/never-downloaded", "rev-abc123")


# --- config merge ----------------------------------------------------------------------------------------
def test_engine_geometry_fills_the_config() -> None:
    cfg = kvtier_config_for_engine({"tiers": [{"type": "cpu", "capacity": "1MiB"}]}, geometry(bpc=2))
    assert cfg.hash_block_size == 32 and cfg.block_size == 64
    assert cfg.groups is not None and [g.block_size for g in cfg.groups] == [32]
    assert cfg.model.num_kv_heads == HEADS and cfg.model.token_layout == "HND"
    assert cfg.model.name == "tiny-llama|vllm:LBHNC:32"


def test_config_keys_that_contradict_the_engine_name_the_key() -> None:
    tiers = [{"type": "cpu", "capacity": "1MiB"}]
    model = {"name": "x", "num_layers": 2, "num_kv_heads": 8, "head_dim": DIM}
    with pytest.raises(KVTierConfigError, match=r"^model\.num_kv_heads: is 8"):
        kvtier_config_for_engine({"model": model, "tiers": tiers}, geometry())
    with pytest.raises(KVTierConfigError, match=r"^block_size: .*kv_connector_extra_config"):
        kvtier_config_for_engine({"block_size": 128, "tiers": tiers}, geometry())
    with pytest.raises(KVTierConfigError, match="different block sizes"):
        kvtier_config_for_engine({"tiers": tiers}, geometry(((0, 32, 1), (1, 64, 1)), bpc=2))
    with pytest.raises(KVTierConfigError, match=r"^tiers\[0\]\.capacity"):
        kvtier_config_for_engine({"tiers": [{"type": "cpu", "capacity": "lots"}]}, geometry())


def test_namespace_separates_engine_block_sizes() -> None:
    tiers = [{"type": "cpu", "capacity": "1MiB"}]
    a = kvtier_config_for_engine({"tiers": tiers}, geometry(((0, 32, 2),), bpc=2))
    b = kvtier_config_for_engine({"tiers": tiers}, geometry(((0, 64, 2),), bpc=1))
    assert a.model.name != b.model.name


# --- page moves ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cross_layer", [False, True])
def test_page_mover_round_trip_with_chunks_and_skip(cross_layer: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    page, layers, bpc = 64, 3, 2
    if cross_layer:
        regions = [(torch.randint(-128, 127, (10, page * layers), dtype=torch.int8, generator=gen),
                    page * layers)]
    else:
        regions = [(torch.randint(-128, 127, (10, page + 16), dtype=torch.int8, generator=gen), page)
                   for _ in range(layers)]  # rows padded past the page
    mover = PageMover(regions, bpc, page * layers * bpc)
    assert mover.cross_layer is cross_layer
    ids = torch.tensor([7, 2, 9, 4])
    out = torch.empty((2, page * layers * bpc), dtype=torch.uint8)
    mover.gather(ids, out)
    before = [rows.clone() for rows, _ in regions]
    for rows, _ in regions:
        rows.zero_()
    mover.scatter(out, torch.tensor([5, 6, 8]), skip=1)  # engine blocks 2, 9, 4
    for (rows, size), old in zip(regions, before, strict=True):
        assert torch.equal(rows[[5, 6, 8], :size], old[[2, 9, 4], :size])


def replay_with_memmove(pieces: list[tuple[int, torch.Tensor, torch.Tensor]], *, into_engine: bool) -> None:
    """Do what the CUDA page mover's kernel launches do with these addresses, with ``memmove`` on the host."""
    for page, engine, cross in pieces:
        for e, c in zip(engine.tolist(), cross.tolist(), strict=True):
            ctypes.memmove(e, c, page) if into_engine else ctypes.memmove(c, e, page)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), bpc=st.integers(1, 3), layers=st.integers(1, 4), mixed=st.booleans(),
       cross_layer=st.booleans())
def test_cuda_page_movers_addresses_move_what_the_torch_mover_moves(
    data: st.DataObject, bpc: int, layers: int, mixed: bool, cross_layer: bool,
) -> None:
    """The CUDA mover's whole address math (``piece_addresses``), replayed with memmove on CPU memory,
    gathers and scatters exactly the bytes of :class:`PageMover`'s torch copies (chunks, skip, padding,
    regions of two page sizes)."""
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    num_blocks = 12
    pages = [48 * layers] if cross_layer else [48 if not mixed or i % 2 == 0 else 32 for i in range(layers)]
    regions = [(torch.randint(-128, 127, (num_blocks, page + data.draw(st.sampled_from([0, 16]))),
                              dtype=torch.int8, generator=gen), page) for page in pages]
    mover = PageMover(regions, bpc, sum(pages) * bpc)
    chunks = data.draw(st.integers(1, num_blocks // bpc))
    ids = torch.tensor(data.draw(st.permutations(range(num_blocks)))[:chunks * bpc])

    expected = torch.empty((chunks, mover.block_bytes), dtype=torch.uint8)
    mover.gather(ids, expected)
    got = torch.full_like(expected, 0xAB)
    replay_with_memmove(mover.piece_addresses(ids, got.data_ptr()), into_engine=False)
    assert torch.equal(got, expected)

    skip = data.draw(st.integers(0, bpc - 1))
    count = data.draw(st.integers(1, chunks * bpc - skip))
    targets = torch.tensor(data.draw(st.permutations(range(num_blocks)))[:count])
    before = [rows.clone() for rows, _ in regions]
    mover.scatter(expected, targets, skip)
    scattered = [rows.clone() for rows, _ in regions]
    for rows, old in zip((rows for rows, _ in regions), before, strict=True):
        rows.copy_(old)
    replay_with_memmove(mover.piece_addresses(targets, expected.data_ptr(), skip), into_engine=True)
    for (rows, _), want in zip(regions, scattered, strict=True):
        assert torch.equal(rows, want)  # the same pages written, and padding past each page untouched


@settings(max_examples=40, deadline=None)
@given(data=st.data(), bpc=st.integers(1, 3), layers=st.integers(1, 3), cross_layer=st.booleans())
def test_cuda_page_movers_slab_row_addresses_move_what_the_torch_mover_moves(
    data: st.DataObject, bpc: int, layers: int, cross_layer: bool,
) -> None:
    """``piece_addresses`` with ``chunk_bases`` (the rows of a CPU tier's slab that a CUDA load reads or a
    store fills), replayed with memmove, moves exactly what :meth:`PageMover.gather_rows` /
    :meth:`PageMover.scatter_rows` move, and leaves the other rows alone."""
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    num_blocks, page = 12, 48
    widths = [page * layers] if cross_layer else [page] * layers
    regions = [(torch.randint(-128, 127, (num_blocks, width + 16), dtype=torch.int8, generator=gen), width)
               for width in widths]
    mover = PageMover(regions, bpc, page * layers * bpc)
    chunks = data.draw(st.integers(1, num_blocks // bpc))
    ids = torch.tensor(data.draw(st.permutations(range(num_blocks)))[:chunks * bpc])
    slots = data.draw(st.permutations(range(chunks + 3)))[:chunks]
    slab = torch.randint(0, 256, (chunks + 3, mover.block_bytes), dtype=torch.uint8, generator=gen)

    def bases(rows: torch.Tensor) -> torch.Tensor:
        return rows.data_ptr() + torch.tensor(slots, dtype=torch.int64) * rows.stride(0)

    expected, got = slab.clone(), slab.clone()
    mover.gather_rows(ids, expected, slots)
    replay_with_memmove(mover.piece_addresses(ids, 0, chunk_bases=bases(got)), into_engine=False)
    assert torch.equal(got, expected)

    skip = data.draw(st.integers(0, bpc - 1))
    count = data.draw(st.integers(1, chunks * bpc - skip))
    targets = torch.tensor(data.draw(st.permutations(range(num_blocks)))[:count])
    before = [rows.clone() for rows, _ in regions]
    mover.scatter_rows(slab, slots, targets, skip)
    scattered = [rows.clone() for rows, _ in regions]
    for rows, old in zip((rows for rows, _ in regions), before, strict=True):
        rows.copy_(old)
    replay_with_memmove(mover.piece_addresses(targets, 0, skip, chunk_bases=bases(slab)), into_engine=True)
    for (rows, _), want in zip(regions, scattered, strict=True):
        assert torch.equal(rows, want)


def test_cuda_page_mover_refuses_pages_that_are_not_on_a_cuda_device() -> None:
    with pytest.raises(LayoutMismatch, match="CUDA device, got cpu"):
        CudaPageMover([(torch.zeros((4, 64), dtype=torch.int8), 64)], 1, 64, stream=None)  # type: ignore[arg-type]


@requires_gpu
@pytest.mark.parametrize("cross_layer", [False, True])
def test_cuda_page_mover_equals_the_torch_mover_on_a_gpu(cross_layer: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    page, layers, bpc = 4096 + 48, 3, 2  # 48: a tail past the 16-byte units
    widths = [page * layers] if cross_layer else [page] * layers
    host = [torch.randint(-128, 127, (16, width + 32), dtype=torch.int8, generator=gen) for width in widths]
    device_regions = [(rows.cuda(), width) for rows, width in zip(host, widths, strict=True)]
    stream = torch.cuda.Stream()
    mover = CudaPageMover(device_regions, bpc, page * layers * bpc, stream)
    reference = PageMover([(rows.clone(), width) for rows, width in zip(host, widths, strict=True)], bpc,
                          page * layers * bpc)
    ids = torch.tensor([9, 2, 14, 5, 0, 11])
    got = torch.empty((3, mover.block_bytes), dtype=torch.uint8, pin_memory=True)
    expected = torch.empty_like(got)
    mover.gather(ids, got)
    reference.gather(ids, expected)
    stream.synchronize()
    assert torch.equal(got, expected)

    targets = torch.tensor([1, 3, 7, 8, 12])
    mover.scatter(got, targets, skip=1)
    reference.scatter(expected, targets, skip=1)
    stream.synchronize()
    for (rows, _), (want, _) in zip(mover.regions, reference.regions, strict=True):
        assert torch.equal(rows.cpu(), want)


@requires_gpu
def test_a_cuda_engine_stores_and_loads_bit_exact_through_the_kernels(cpu_tier: list[dict[str, Any]]) -> None:
    harness = Harness(cpu_tier, device="cuda", bpc=2)
    try:
        # page_movers chose the kernels
        assert all(isinstance(m, CudaPageMover) for m in harness.worker.movers)
        keys = harness.keys(3)
        assert harness.store(keys, [4, 5, 10, 11, 20, 21]) == keys
        originals = [harness.block(0, b) for b in (4, 5, 10, 11, 20, 21)]
        assert [harness.manager.lookup(k) for k in keys] == [Lookup.HIT] * 3
        result = harness.load(keys, [1, 2, 3, 6, 7], start=1)  # the first engine block was computed
        assert result["success"]
        for target, block in zip([1, 2, 3, 6, 7], originals[1:], strict=True):
            assert all(torch.equal(a.cpu(), b.cpu())
                       for a, b in zip(harness.block(0, target), block, strict=True))
    finally:
        harness.close()


@requires_gpu
@pytest.mark.parametrize("cross_layer", [False, True])
def test_cuda_page_mover_moves_slab_rows_as_the_torch_mover_does(cross_layer: bool) -> None:
    gen = torch.Generator().manual_seed(5)
    page, layers, bpc = 4096 + 48, 3, 2
    widths = [page * layers] if cross_layer else [page] * layers
    host = [torch.randint(-128, 127, (16, width + 32), dtype=torch.int8, generator=gen) for width in widths]
    stream = torch.cuda.Stream()
    mover = CudaPageMover([(rows.cuda(), width) for rows, width in zip(host, widths, strict=True)], bpc,
                          page * layers * bpc, stream)
    reference = PageMover([(rows.clone(), width) for rows, width in zip(host, widths, strict=True)], bpc,
                          page * layers * bpc)
    slab = torch.randint(0, 256, (6, mover.block_bytes), dtype=torch.uint8, generator=gen).pin_memory()
    expected = slab.clone()
    ids, slots = torch.tensor([9, 2, 14, 5, 0, 11]), [4, 0, 2]
    mover.gather_rows(ids, slab, slots)
    reference.gather_rows(ids, expected, slots)
    stream.synchronize()
    assert torch.equal(slab, expected)  # the other rows untouched

    targets = torch.tensor([1, 3, 7, 8, 12])
    mover.scatter_rows(slab, [2, 4, 0], targets, skip=1)
    reference.scatter_rows(expected, [2, 4, 0], targets, skip=1)
    stream.synchronize()
    for (rows, _), (want, _) in zip(mover.regions, reference.regions, strict=True):
        assert torch.equal(rows.cpu(), want)
    with pytest.raises(LayoutMismatch, match="page-locked host blocks"):
        mover.scatter_rows(torch.zeros_like(slab, device="cpu"), [0], torch.tensor([1]))


@requires_gpu
def test_a_cuda_engine_loads_straight_from_the_pinned_cpu_tier_and_releases_after_the_copy(
        cpu_tier: list[dict[str, Any]], caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One copy per load (pinned CPU-tier slot → engine page by the kernel): no staging buffer, the slots
    stay leased until the copy completed, and a good load logs no error."""
    harness = Harness(cpu_tier, device="cuda", bpc=1)
    try:
        keys = harness.keys(4)
        assert harness.store(keys, [4, 5, 10, 11]) == keys
        originals = [harness.block(0, b) for b in (4, 5, 10, 11)]
        assert harness.runtime.pinned_cpu_tier(0)

        def no_buffer(*args: Any, **kwargs: Any) -> torch.Tensor:
            raise AssertionError("a CUDA load from a pinned CPU tier allocated a staging buffer")

        monkeypatch.setattr(harness.runtime, "empty_rows", no_buffer)
        index = harness.runtime.residency.tiers[0]
        spec = harness.manager.prepare_load(keys)
        assert harness.worker.submit_load(
            77, spec, GpuSpec(np.array([20, 21, 22, 23], np.int32), (4,), (0,)))
        assert set(index.pins) >= set(spec.keys)  # leased while the kernels read the slots
        harness.worker.wait({77})
        with caplog.at_level(logging.ERROR, logger="kvtier"):
            results = harness.worker.get_finished()
        harness.manager.complete_load(keys)
        assert [(r["job_id"], r["success"]) for r in results] == [(77, True)]
        assert not caplog.records
        assert not index.pins  # released once the copies completed
        for target, block in zip([20, 21, 22, 23], originals, strict=True):
            assert all(torch.equal(a.cpu(), b.cpu())
                       for a, b in zip(harness.block(0, target), block, strict=True))
    finally:
        harness.close()


def test_page_mover_refuses_a_layout_of_another_size() -> None:
    with pytest.raises(LayoutMismatch, match="model.num_kv_heads"):
        PageMover([(torch.zeros((4, 64), dtype=torch.int8), 64)], 1, 128)


# --- manager + worker over real tiers ---------------------------------------------------------------------
def test_cpu_tier_store_then_hit_and_load_bit_exact(cpu_tier: list[dict[str, Any]]) -> None:
    h = Harness(cpu_tier)
    try:
        keys = h.keys(4)
        assert [h.manager.lookup(k) for k in keys] == [Lookup.MISS] * 4
        assert h.store(keys, [3, 4, 5, 6]) == keys
        # already cached: nothing to store again
        assert h.manager.plan_store(keys) == ([], BlockTransferSpec(keys=()))
        assert [h.manager.lookup(k) for k in keys] == [Lookup.HIT] * 4
        expected = [h.block(0, b) for b in (3, 4, 5, 6)]
        assert h.load(keys, [20, 21, 22, 23])["success"]
        for b, want in zip((20, 21, 22, 23), expected, strict=True):
            assert all(torch.equal(a, w) for a, w in zip(h.block(0, b), want, strict=True))
        stats = h.runtime.stats()
        assert stats.tiers[0].hits == 4 and stats.tiers[0].stores == 4
        assert not h.runtime.residency.tiers[0].pins  # the read released the leases
    finally:
        h.close()


def test_pending_store_answers_hit_pending(cpu_tier: list[dict[str, Any]]) -> None:
    h = Harness(cpu_tier)
    try:
        keys = h.keys(2)
        chosen, _ = h.manager.plan_store(keys)
        assert [h.manager.lookup(k) for k in chosen] == [Lookup.HIT_PENDING] * 2
        h.manager.complete_store(chosen, success=False)
        assert [h.manager.lookup(k) for k in keys] == [Lookup.MISS] * 2
    finally:
        h.close()


def test_file_tier_hit_is_promoted_verified_before_it_is_promised(tmp_path: Path) -> None:
    h = Harness([{"type": "file", "path": str(tmp_path), "capacity": "4MiB"}])
    try:
        keys = h.keys(3)
        h.store(keys, [1, 2, 3])
        assert [h.manager.lookup(k) for k in keys] == [Lookup.HIT_PENDING] * 3
        assert h.settle(keys) == [Lookup.HIT] * 3
        expected = [h.block(0, b) for b in (1, 2, 3)]
        assert h.load(keys, [10, 11, 12])["success"]
        assert all(torch.equal(a, w) for b, want in zip((10, 11, 12), expected, strict=True)
                   for a, w in zip(h.block(0, b), want, strict=True))
        assert h.runtime.stats().tiers[0].hits == 3
    finally:
        h.close()


def test_corrupt_file_block_is_a_miss_never_a_hit(tmp_path: Path) -> None:
    h = Harness([{"type": "file", "path": str(tmp_path), "capacity": "4MiB"}])
    try:
        keys = h.keys(3)
        h.store(keys, [1, 2, 3])
        tier = h.runtime.core.tiers[0]
        victim = tier.path_of(h.runtime.codec.block_key(keys[1]))  # type: ignore[attr-defined]
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
        assert h.settle(keys) == [Lookup.HIT, Lookup.MISS, Lookup.MISS]
        assert h.runtime.stats().tiers[0].corrupt_or_lost == 1
    finally:
        h.close()


def test_a_restarted_engine_hits_what_the_file_tier_kept(tmp_path: Path) -> None:
    tiers = [{"type": "cpu", "capacity": "1MiB"}, {"type": "file", "path": str(tmp_path), "capacity": "4MiB"}]
    first = Harness(tiers, placement={"write_mode": "write_through"})
    keys = first.keys(2)
    first.store(keys, [1, 2])
    expected = [first.block(0, b) for b in (1, 2)]
    first.close()
    second = Harness(tiers, seed=5)
    try:
        assert second.settle(keys) == [Lookup.HIT] * 2
        assert second.load(keys, [7, 8])["success"]
        assert all(torch.equal(a, w) for b, want in zip((7, 8), expected, strict=True)
                   for a, w in zip(second.block(0, b), want, strict=True))
        assert second.runtime.stats().tiers[1].hits == 2
    finally:
        second.close()


@pytest.mark.skipif(not redis_up(), reason="needs Redis on 127.0.0.1:6379")
def test_redis_tier_answers_retry_while_it_is_asked(tmp_path: Path) -> None:
    tiers = [{"type": "redis", "url": "redis://127.0.0.1:6379/0", "ttl_seconds": 60}]
    h = Harness(tiers, seed=int.from_bytes(os.urandom(2), "little"))
    try:
        keys = h.keys(2, salt=int.from_bytes(os.urandom(3), "little"))
        h.store(keys, [1, 2])
        assert [h.manager.lookup(k) for k in keys] == [Lookup.RETRY] * 2
        assert h.settle(keys) == [Lookup.HIT] * 2
        assert h.load(keys, [5, 6])["success"]
        assert h.runtime.stats().tiers[0].hits == 2
        unknown = h.keys(1, salt=int.from_bytes(os.urandom(3), "little") + 1)
        assert h.settle(unknown) == [Lookup.MISS]
        assert h.manager.lookup(unknown[0]) == Lookup.MISS  # remembered as absent: Redis is not asked again
    finally:
        h.close()


def test_leased_blocks_survive_stores_that_evict(tmp_path: Path) -> None:
    block = block_bytes()
    h = Harness([{"type": "cpu", "capacity": 4 * block}], num_blocks=16)
    try:
        keys = h.keys(4)
        h.store(keys, [0, 1, 2, 3])
        expected = [h.block(0, b) for b in (0, 1, 2, 3)]
        spec = h.manager.prepare_load(keys)
        assert set(spec.sources) == {0}
        assert h.manager.plan_store(h.keys(4, salt=1)) is None  # every block is leased: nothing can be stored
        assert not h.manager._storing
        assert [h.manager.lookup(k) for k in keys] == [Lookup.HIT] * 4
        job = 99
        h.worker.submit_load(job, spec, GpuSpec(np.array([8, 9, 10, 11], np.int32), (4,), (0,)))
        h.worker.wait({job})
        assert h.worker.get_finished()[0]["success"]
        assert all(torch.equal(a, w) for b, want in zip((8, 9, 10, 11), expected, strict=True)
                   for a, w in zip(h.block(0, b), want, strict=True))
    finally:
        h.close()


def two_block_cpu_tier_over_file(tmp_path: Path) -> Harness:
    """A CPU tier that holds two blocks over a file tier: the third block stored demotes one."""
    probe = Harness([{"type": "cpu", "capacity": "1MiB"}])
    block = probe.runtime.core.layouts[0].nbytes
    probe.close()
    return Harness([{"type": "cpu", "capacity": 2 * block},
                    {"type": "file", "path": str(tmp_path), "capacity": "4MiB"}])


def test_a_block_demoted_between_lookup_and_load_is_read_back_verified(tmp_path: Path) -> None:
    h = two_block_cpu_tier_over_file(tmp_path)
    try:
        keys = h.keys(2)
        h.store(keys, [0, 1])
        assert [h.manager.lookup(k) for k in keys] == [Lookup.HIT] * 2
        h.store(h.keys(2, salt=1), [2, 3])  # demotes both to the file tier before prepare_load
        spec = h.manager.prepare_load(keys)
        assert spec.sources == (STAGED, STAGED) and LOST not in spec.sources
        expected = [h.block(0, b) for b in (0, 1)]
        job = 7
        h.worker.submit_load(job, spec, GpuSpec(np.array([9, 10], np.int32), (2,), (0,)))
        h.worker.wait({job})
        assert h.worker.get_finished()[0]["success"]
        assert all(torch.equal(a, w) for b, want in zip((9, 10), expected, strict=True)
                   for a, w in zip(h.block(0, b), want, strict=True))
    finally:
        h.close()


def test_chunks_of_two_blocks_load_from_an_unaligned_start(cpu_tier: list[dict[str, Any]]) -> None:
    h = Harness(cpu_tier, bpc=2)
    try:
        keys = h.keys(2)
        h.store(keys, [4, 5, 6, 7])
        expected = [h.block(0, b) for b in (5, 6, 7)]
        assert h.load(keys, [12, 13, 14], start=1)["success"]  # the engine already has the first block
        assert all(torch.equal(a, w) for b, want in zip((12, 13, 14), expected, strict=True)
                   for a, w in zip(h.block(0, b), want, strict=True))
    finally:
        h.close()


def test_groups_with_their_own_block_sizes(cpu_tier: list[dict[str, Any]]) -> None:
    h = Harness(cpu_tier, groups=((0, 32, 2), (3, 64, 1)))
    try:
        full, window = h.keys(2, group=0), h.keys(1, group=3)
        chosen, spec = h.manager.plan_store(full + window)
        assert [k.group_id for k in spec.keys] == [0, 0, 1]
        ids = np.array([1, 2, 5], np.int32)
        h.worker.submit_store(0, GpuSpec(ids, (2, 1), (0, 0)), spec)
        h.worker.wait({0})
        assert h.worker.get_finished()[0]["success"]
        h.manager.complete_store(chosen)
        assert [h.manager.lookup(k) for k in full + window] == [Lookup.HIT] * 3
        expected = h.block(1, 5)
        load = h.manager.prepare_load(full + window)
        h.worker.submit_load(1, load, GpuSpec(np.array([8, 9, 10], np.int32), (2, 1), (0, 0)))
        h.worker.wait({1})
        assert h.worker.get_finished()[0]["success"]
        assert all(torch.equal(a, w) for a, w in zip(h.block(1, 10), expected, strict=True))
    finally:
        h.close()


def test_reset_cache_forgets_every_block_in_every_tier(tmp_path: Path) -> None:
    tiers = [{"type": "cpu", "capacity": "1MiB"}, {"type": "file", "path": str(tmp_path), "capacity": "4MiB"}]
    h = Harness(tiers, placement={"write_mode": "write_through"})
    try:
        keys = h.keys(2)
        h.store(keys, [1, 2])
        assert h.settle(keys) == [Lookup.HIT] * 2
        late = h.manager.plan_store(h.keys(1, salt=3))  # planned before the reset, run by the worker after it
        assert late is not None
        h.manager.reset_cache()
        assert not h.manager._storing
        ids = GpuSpec(np.array([5], np.int32), (1,), (0,))
        assert h._run(h.worker.submit_store, ids, late[1])["success"]
        assert not list(h.runtime.residency.tiers[0].keys())  # the memory tier is empty
        assert len(list(h.runtime.residency.tiers[1].keys())) == 2  # the file tier keeps them for others...
        assert h.settle(keys) == [Lookup.MISS] * 2  # ...but never serves them to this engine again
        assert h.manager.take_removed() == []  # vLLM's reset already forgot them: nothing to report
        assert h.store(keys, [3, 4]) == keys  # stored again in the new epoch, and served from it
        expected = [h.block(0, b) for b in (3, 4)]
        assert h.settle(keys) == [Lookup.HIT] * 2 and h.load(keys, [9, 10])["success"]
        assert all(torch.equal(a, w) for b, want in zip((9, 10), expected, strict=True)
                   for a, w in zip(h.block(0, b), want, strict=True))
    finally:
        h.close()


def test_after_a_reset_other_engines_still_share_the_persistent_blocks(tmp_path: Path) -> None:
    tiers = [{"type": "cpu", "capacity": "1MiB"}, {"type": "file", "path": str(tmp_path), "capacity": "4MiB"}]
    first = Harness(tiers, placement={"write_mode": "write_through"})
    keys = first.keys(2)
    first.store(keys, [1, 2])
    first.manager.reset_cache()
    first.close()
    second = Harness(tiers, seed=5)  # a fresh engine starts in the first epoch: the blocks are its own too
    try:
        assert second.settle(keys) == [Lookup.HIT] * 2
    finally:
        second.close()


def test_prepare_load_and_the_read_never_wait_for_kvtiers_loop_thread(cpu_tier: list[dict[str, Any]]) -> None:
    h = Harness(cpu_tier)
    try:
        keys = h.keys(3)
        h.store(keys, [1, 2, 3])
        expected = [h.block(0, b) for b in (1, 2, 3)]

        async def hog() -> None:
            time.sleep(1.5)  # blocks kvtier's loop thread, as a slow tier call would

        hogging = h.runtime.submit(hog())
        time.sleep(0.05)
        start = time.monotonic()
        spec = h.manager.prepare_load(keys)  # pins on this thread
        assert spec.sources == (0, 0, 0)
        assert h.worker.submit_load(5, spec, GpuSpec(np.array([20, 21, 22], np.int32), (3,), (0,)))
        results = h.worker.get_finished()  # the copies were made on this thread too
        assert time.monotonic() - start < 1.0 and not hogging.done()
        assert [r["job_id"] for r in results] == [5] and results[0]["success"]
        assert all(torch.equal(a, w) for b, want in zip((20, 21, 22), expected, strict=True)
                   for a, w in zip(h.block(0, b), want, strict=True))
        assert not h.runtime.residency.tiers[0].pins
        hogging.result(timeout=10)
    finally:
        h.close()


def test_lookups_follow_evictions_and_removals_are_reported_once() -> None:
    block = block_bytes()
    h = Harness([{"type": "cpu", "capacity": 4 * block}], num_blocks=16, enable_events=True)
    try:
        first, second = h.keys(4), h.keys(4, salt=1)
        h.store(first, [0, 1, 2, 3])
        assert [h.manager.lookup(k) for k in first] == [Lookup.HIT] * 4
        h.store(second, [4, 5, 6, 7])  # no tier below: the first four leave kvtier
        assert [h.manager.lookup(k) for k in first] == [Lookup.MISS] * 4
        assert [h.manager.lookup(k) for k in second] == [Lookup.HIT] * 4
        # the stored chunks are one chain: the default policy evicts its tail first
        assert h.manager.take_event_keys() == [(first, False), (second, False), (first[::-1], True)]
        assert h.manager.take_event_keys() == [] and h.manager.take_removed() == []
        third = h.keys(2, salt=2)
        h.store(third, [8, 9])
        removed = h.manager.take_removed()  # what the next prepare_store reports as evicted_keys
        assert len(removed) == 2 and set(removed) <= set(second)
        assert h.manager.take_event_keys() == [(third, False), (removed, True)]  # and once as events
    finally:
        h.close()


def test_demoted_blocks_are_not_reported_removed(tmp_path: Path) -> None:
    h = two_block_cpu_tier_over_file(tmp_path)
    try:
        keys = h.keys(2)
        h.store(keys, [0, 1])
        h.store(h.keys(2, salt=1), [2, 3])  # demotes the first two to the file tier
        assert h.manager.take_removed() == []
        assert [h.manager.lookup(k) for k in keys] == [Lookup.HIT_PENDING] * 2
    finally:
        h.close()


def test_a_block_read_again_after_its_staged_copy_was_loaded_is_never_absent(tmp_path: Path) -> None:
    h = Harness([{"type": "file", "path": str(tmp_path), "capacity": "4MiB"}])
    try:
        keys = h.keys(2)
        h.store(keys, [1, 2])
        assert h.settle(keys) == [Lookup.HIT] * 2
        assert h.load(keys, [10, 11])["success"]  # consumes the staged copies
        h.manager.on_schedule_end()
        # read again from the file tier
        assert [h.manager.lookup(k) for k in keys] == [Lookup.HIT_PENDING] * 2
        assert h.settle(keys) == [Lookup.HIT] * 2
    finally:
        h.close()


def test_the_store_that_evicts_reports_it_and_touch_decides_the_victim() -> None:
    block = block_bytes()
    h = Harness([{"type": "cpu", "capacity": 2 * block}])
    try:
        first, second, third = h.keys(3)
        h.store([first], [1])
        h.store([second], [2])
        h.manager.touch([first])  # the first block is now the most recently used
        planned = h.manager.plan_store([third])
        assert planned is not None and planned[0] == [third]
        assert h.manager.take_removed() == [second]  # reported by the call that evicted it, not a later one
        assert h.manager.lookup(second) == Lookup.MISS and h.manager.lookup(first) == Lookup.HIT
        ids = GpuSpec(np.array([3], np.int32), (1,), (0,))
        assert h._run(h.worker.submit_store, ids, planned[1])["success"]
        h.manager.complete_store([third])
        assert [h.manager.lookup(k) for k in (first, third)] == [Lookup.HIT] * 2
        assert h.manager.take_removed() == []  # once
    finally:
        h.close()


def test_a_load_does_not_refresh_recency_only_touch_does() -> None:
    block = block_bytes()
    h = Harness([{"type": "cpu", "capacity": 2 * block}])
    try:
        first, second, third = h.keys(3)
        h.store([first], [1])
        h.store([second], [2])
        assert h.load([first], [5])["success"]  # as vLLM's own manager: a load is not a use, touch is
        h.store([third], [3])
        assert h.manager.take_removed() == [first]
    finally:
        h.close()


# --- the scheduler and the workers in different processes (tensor parallel, vLLM's multiprocess executor) ---
class Ranks:
    """vLLM's split: one manager over an index-only runtime, and one worker per TP rank with its own tiers
    and its own KV pages (another seed per rank: the ranks' bytes differ, as their heads do)."""

    def __init__(self, tiers: list[dict[str, Any]], ranks: int = 2) -> None:
        self.workers = [Harness(tiers, seed=10 + r) for r in range(ranks)]
        config = kvtier_config_for_engine({"tiers": tiers}, geometry())
        self.manager = KVTierOffloadManager(OffloadRuntime(config, KeyCodec([0]), index_only=True))
        self._jobs = itertools.count()

    def close(self) -> None:
        for w in self.workers:
            w.close()
        self.manager.runtime.close()

    def run(self, submit: str, *args: Any) -> None:
        """The same job on every rank (vLLM sends each worker the same metadata)."""
        for w in self.workers:
            assert w._run(getattr(w.worker, submit), *args)["success"]

    def store(self, keys: list[bytes], block_ids: list[int]) -> list[bytes]:
        planned = self.manager.plan_store(keys)
        assert planned is not None
        chosen, spec = planned
        assert spec.placed and not chosen or spec.plan is not None
        if chosen:
            ids = [block_ids[keys.index(k)] for k in chosen]
            self.run("submit_store", GpuSpec(np.array(ids, np.int32), (len(ids),), (0,)), spec)
        self.manager.complete_store(chosen)
        return chosen

    def load(self, keys: list[bytes], block_ids: list[int]) -> None:
        spec = self.manager.prepare_load(keys)
        self.run("submit_load", spec, GpuSpec(np.array(block_ids, np.int32), (len(block_ids),), (0,)))
        self.manager.complete_load(keys)


def test_ranks_in_other_processes_hold_their_own_bytes_of_the_blocks_the_manager_placed() -> None:
    block = block_bytes()
    ranks = Ranks([{"type": "cpu", "capacity": 3 * block, "eviction": "lru"}])
    try:
        keys = ranks.workers[0].keys(3)
        expected = [[w.block(0, b) for b in (1, 2, 3)] for w in ranks.workers]
        assert ranks.store(keys, [1, 2, 3]) == keys
        assert [ranks.manager.lookup(k) for k in keys] == [Lookup.HIT] * 3
        ranks.load(keys, [7, 8, 9])
        for w, want in zip(ranks.workers, expected, strict=True):  # each rank got its own pages back
            assert all(torch.equal(a, b) for blk, exp in zip((7, 8, 9), want, strict=True)
                       for a, b in zip(w.block(0, blk), exp, strict=True))
        manager_index = ranks.manager.runtime.residency.tiers[0]
        assert not manager_index.pins  # complete_load dropped the manager's pins
        # workers decide nothing
        assert all(not list(w.runtime.residency.tiers[0].keys()) for w in ranks.workers)

        more = ranks.workers[0].keys(2, salt=1)
        assert ranks.store(more, [4, 5]) == more
        # evicted by that prepare_store (vLLM reports them there)...
        assert ranks.manager.take_removed() == keys[:2]
        assert [ranks.manager.lookup(k) for k in keys] == [Lookup.MISS, Lookup.MISS, Lookup.HIT]
        # ...and deleted
        assert all(w.runtime.core.tiers[0].usage_bytes() == 3 * block for w in ranks.workers)

        ranks.manager.reset_cache()
        assert [ranks.manager.lookup(k) for k in more] == [Lookup.MISS] * 2
        fresh = ranks.workers[0].keys(1, salt=2)
        assert ranks.store(fresh, [6]) == fresh  # its plan also deletes what the reset dropped, on every rank
        assert all(w.runtime.core.tiers[0].usage_bytes() == block for w in ranks.workers)
    finally:
        ranks.close()


def test_workers_in_other_processes_take_cpu_file_and_redis_tiers_not_gpu(tmp_path: Path) -> None:
    tiers = [{"type": "gpu", "capacity": "1MiB"}, {"type": "file", "path": str(tmp_path), "capacity": "4MiB"}]
    config = kvtier_config_for_engine({"tiers": tiers}, geometry())
    with pytest.raises(KVTierConfigError, match=r"^tiers\[0\]\.type: is 'gpu'.*cpu, file, redis tiers"):
        OffloadRuntime(config, KeyCodec([0]), index_only=True)
    config = kvtier_config_for_engine({"tiers": tiers[1:]}, geometry())
    runtime = OffloadRuntime(config, KeyCodec([0]), index_only=True)
    try:
        assert runtime.slow_tiers == (0,) and runtime.memory_tiers == ()
        assert not [p for p in tmp_path.rglob("*") if p.is_file()]  # the scheduler's index writes nothing
    finally:
        runtime.close()


@pytest.mark.parametrize(("layers", "bpc"), [(1, 1), (2, 1), (2, 2)])
def test_pages_move_straight_between_the_engine_and_the_cpu_tier_slots_bit_exact(
        layers: int, bpc: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A host engine's stores gather its pages straight into the CPU tier's slots, and its loads scatter
    them straight back (no buffer between: the worker never asks the runtime for one), bit-exact, with
    the slots a small tier hands out after evictions (not one even run) and chunks of several blocks."""
    per_block = block_bytes() // 2 * layers * bpc  # the probe's group has two layers, one block per chunk
    h = Harness([{"type": "cpu", "capacity": 5 * per_block}], groups=((0, 32, layers),), bpc=bpc)
    try:
        def no_buffer(*args: Any, **kwargs: Any) -> torch.Tensor:
            raise AssertionError("the worker staged pages through a buffer")

        monkeypatch.setattr(h.runtime, "empty_rows", no_buffer)
        rng = np.random.default_rng(7)
        held: dict[bytes, list[torch.Tensor]] = {}
        for salt in range(6):
            keys = h.keys(3, salt=salt)
            ids = [int(b) for b in rng.permutation(16)[:3 * bpc]]
            assert h.store(keys, ids) == keys
            for i, key in enumerate(keys):
                held[key] = [layer.clone() for b in ids[i * bpc:(i + 1) * bpc] for layer in h.block(0, b)]
            hits = [key for key in held if h.manager.lookup(key) == Lookup.HIT]
            assert set(keys) <= set(hits)
            targets = [int(b) for b in 16 + rng.permutation(16)[:len(hits) * bpc]]
            assert h.load(hits, targets)["success"]
            for i, key in enumerate(hits):
                got = [layer for b in targets[i * bpc:(i + 1) * bpc] for layer in h.block(0, b)]
                assert all(torch.equal(a, w) for a, w in zip(got, held[key], strict=True))
        assert not h.runtime.residency.tiers[0].pins
        assert h.runtime.core.tiers[0]._slots.problems() == []
    finally:
        h.close()
