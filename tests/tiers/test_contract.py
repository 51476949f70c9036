"""The contract every tier keeps (kvtier/tiers/base.py), checked the same way against each real tier.

CPU memory, files under tmp_path, the shared Redis on 127.0.0.1:6379, a 3-master Redis Cluster on
loopback, and GPU memory where CUDA is present: the same put/get/contains/delete/keys/usage
semantics, the same counters, and the same failure rule — an I/O fault is a ``False``, never an
exception; only a programming error (a wrong buffer, an unknown group) raises.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.blocks import BlockKey
from kvtier.codec import HEADER_SIZE
from kvtier.errors import LayoutMismatch
from kvtier.layout import BlockLayout
from kvtier.tiers.base import Tier
from kvtier.tiers.buffers import PAGE
from kvtier.tiers.file import WriteIO

#: Two groups of different block sizes: 16 KiB fp16 and 4 KiB bf16 (not a page multiple on disk).
LAYOUTS = {
    0: BlockLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16),
    1: BlockLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16, dtype=torch.bfloat16),
}
SLOTS = 24
CAPACITY = {g: SLOTS * layout.nbytes for g, layout in LAYOUTS.items()}


@dataclass
class Subject:
    """A tier under test and, where the tier does I/O, a way to make that I/O fail."""

    tier: Tier
    #: Makes every later operation of the tier meet a dead backend (None: the tier does no I/O).
    break_backend: Callable[[], None] | None = None


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def new_keys(n: int, group: int = 0) -> list[BlockKey]:
    return [BlockKey(os.urandom(32), group) for _ in range(n)]


def blocks_for(keys: list[BlockKey], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (LAYOUTS[k.group_id].nbytes,), dtype=torch.uint8, generator=gen)
            for k in keys]


def usage(tier: Tier, raw_bytes: int) -> int:
    """What ``usage_bytes`` must say: raw block bytes, or 0 for a self-evicting store (Redis owns it)."""
    return 0 if tier.self_evicting else raw_bytes


def buffers_for(keys: list[BlockKey]) -> list[torch.Tensor]:
    return [torch.full((LAYOUTS[k.group_id].nbytes,), 0xA5, dtype=torch.uint8) for k in keys]


# --- the tiers -------------------------------------------------------------------------------------------
def _cpu(tmp_path: Path, request: pytest.FixtureRequest) -> Subject:
    from kvtier.tiers.cpu import CpuTier

    return Subject(CpuTier("cpu", LAYOUTS, CAPACITY, pinned=False))


def _file(tmp_path: Path, request: pytest.FixtureRequest, write_io: WriteIO | None = None) -> Subject:
    from kvtier.tiers.file import FileTier

    root = tmp_path / "cache"
    tier = FileTier("file", LAYOUTS, CAPACITY, root=root, namespace="contract", io_threads=2,
                    write_io=write_io)

    def break_backend() -> None:
        # The tier's directory is replaced by a regular file: every open and write fails with ENOTDIR.
        shutil.rmtree(tier.directory)
        tier.directory.write_bytes(b"not a directory")

    return Subject(tier, break_backend)


def _redis_tier(url: str | None, startup_nodes: list[str] | None) -> Subject:
    from kvtier.tiers.redis import CircuitBreakerConfig, RedisTier

    namespace = f"contract-{uuid.uuid4().hex[:12]}"
    kwargs = {"url": url} if url else {"cluster": True, "startup_nodes": startup_nodes}
    tier = RedisTier("redis", LAYOUTS, CAPACITY, namespace=namespace, connect_timeout=0.3, timeout=0.5,
                     circuit_breaker=CircuitBreakerConfig(failures=1, cooldown_seconds=60), **kwargs)
    return Subject(tier)


def _redis(tmp_path: Path, request: pytest.FixtureRequest) -> Subject:
    url = request.getfixturevalue("redis_url")
    subject = _redis_tier(url, None)

    def break_backend() -> None:
        # A tier pointed at a loopback port nobody listens on stands for a dead server.
        from tests.tiers.conftest import free_port

        dead = _redis_tier(f"redis://127.0.0.1:{free_port()}/0", None)
        run(subject.tier.close())
        subject.tier = dead.tier

    subject.break_backend = break_backend
    return subject


def _redis_cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Subject:
    cluster = request.getfixturevalue("redis_cluster")
    subject = _redis_tier(None, cluster.startup_nodes)

    def break_backend() -> None:
        # Seeds on loopback ports nobody listens on stand for a cluster that is gone.
        from tests.tiers.conftest import free_port

        dead = _redis_tier(None, [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"])
        run(subject.tier.close())
        subject.tier = dead.tier

    subject.break_backend = break_backend
    return subject


def _gpu(tmp_path: Path, request: pytest.FixtureRequest) -> Subject:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device: torch.cuda.is_available() is False")
    from kvtier.tiers.gpu import GpuTier

    return Subject(GpuTier("gpu", LAYOUTS, CAPACITY, device=0))


def _file_direct(tmp_path: Path, request: pytest.FixtureRequest) -> Subject:
    return _file(tmp_path, request, "direct")


def _file_buffered(tmp_path: Path, request: pytest.FixtureRequest) -> Subject:
    return _file(tmp_path, request, "buffered")


MAKERS = {"cpu": _cpu, "file": _file, "file_direct": _file_direct, "file_buffered": _file_buffered,
          "redis": _redis, "redis_cluster": _redis_cluster,
          "gpu": pytest.param(_gpu, marks=pytest.mark.gpu)}


@pytest.fixture(params=list(MAKERS.values()), ids=list(MAKERS))
def subject(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Subject]:
    made: Subject = request.param(tmp_path, request)
    yield made
    tier = made.tier
    run(tier.delete(list(tier.keys())) if tier.health == "ok" else asyncio.sleep(0))
    run(tier.close())


# --- the contract -----------------------------------------------------------------------------------------
def test_round_trip_is_bit_exact_across_groups(subject: Subject) -> None:
    tier = subject.tier
    keys = new_keys(5, 0) + new_keys(4, 1)
    blocks = blocks_for(keys, seed=1)
    out = buffers_for(keys)
    assert run(tier.put(keys, blocks)) == [True] * len(keys)
    assert run(tier.get(keys, out)) == [True] * len(keys)
    for i, (block, got) in enumerate(zip(blocks, out, strict=True)):
        assert torch.equal(block, got.cpu()), f"block {i} (group {keys[i].group_id}) came back different"


def test_overwrite_replaces_the_value(subject: Subject) -> None:
    tier = subject.tier
    keys = new_keys(3)
    run(tier.put(keys, blocks_for(keys, seed=1)))
    newer = blocks_for(keys, seed=2)
    assert run(tier.put(keys, newer)) == [True] * 3
    out = buffers_for(keys)
    assert run(tier.get(keys, out)) == [True] * 3
    assert all(torch.equal(a, b.cpu()) for a, b in zip(newer, out, strict=True))
    assert tier.usage_bytes() == usage(tier, 3 * LAYOUTS[0].nbytes)


def test_contains_keys_usage_and_delete_agree(subject: Subject) -> None:
    tier = subject.tier
    stored, absent = new_keys(4, 0) + new_keys(2, 1), new_keys(2, 0) + new_keys(1, 1)
    run(tier.put(stored, blocks_for(stored, seed=3)))
    assert run(tier.contains(stored + absent)) == [True] * len(stored) + [False] * len(absent)
    assert set(tier.keys()) == set(stored)
    assert tier.usage_bytes() == usage(tier, 4 * LAYOUTS[0].nbytes + 2 * LAYOUTS[1].nbytes)

    gone = [stored[0], stored[4]]
    run(tier.delete(gone + absent))  # absent keys are ignored
    kept = [k for k in stored if k not in gone]
    assert run(tier.contains(gone)) == [False, False]
    assert set(tier.keys()) == set(kept)
    assert tier.usage_bytes() == usage(tier, 3 * LAYOUTS[0].nbytes + 1 * LAYOUTS[1].nbytes)
    out = buffers_for(stored)
    assert run(tier.get(stored, out)) == [k in kept for k in stored]


def test_absent_keys_are_misses_not_errors(subject: Subject) -> None:
    tier = subject.tier
    keys = new_keys(3, 0) + new_keys(2, 1)
    assert run(tier.get(keys, buffers_for(keys))) == [False] * 5
    assert run(tier.contains(keys)) == [False] * 5
    assert tier.counters.errors == {}
    assert tier.health == "ok"


def test_counters_count_blocks_and_raw_bytes(subject: Subject) -> None:
    tier = subject.tier
    keys = new_keys(3, 0) + new_keys(2, 1)
    raw = 3 * LAYOUTS[0].nbytes + 2 * LAYOUTS[1].nbytes
    before = (tier.counters.blocks_written, tier.counters.bytes_written,
              tier.counters.blocks_read, tier.counters.bytes_read)
    run(tier.put(keys, blocks_for(keys, seed=4)))
    run(tier.get(keys + new_keys(2), buffers_for(keys) + buffers_for(new_keys(2))))
    c = tier.counters
    # Bytes are what crossed the tier's boundary: the raw payload, plus what the tier adds per block
    # (Redis: the header; file: device bytes, header page and O_DIRECT padding). Compression is off
    # here, and misses read nothing.
    assert c.blocks_written - before[0] == 5 and c.blocks_read - before[2] == 5
    overhead = 0 if tier.kind in ("cpu", "gpu") else 5 * (HEADER_SIZE + PAGE)
    for moved in (c.bytes_written - before[1], c.bytes_read - before[3]):
        assert raw <= moved <= raw + overhead, (tier.kind, moved, raw)


def test_wrong_buffers_raise_layout_mismatch(subject: Subject) -> None:
    tier = subject.tier
    keys = new_keys(2)
    short = [torch.zeros(LAYOUTS[0].nbytes - 1, dtype=torch.uint8)] * 2
    with pytest.raises(LayoutMismatch, match="bytes for group 0"):
        run(tier.put(keys, short))
    with pytest.raises(LayoutMismatch, match="dtype"):
        run(tier.get(keys, [torch.zeros(LAYOUTS[0].nbytes // 2, dtype=torch.float16)] * 2))
    with pytest.raises(LayoutMismatch, match="2 keys but 1"):
        run(tier.put(keys, blocks_for(keys[:1], seed=0)))
    with pytest.raises(LayoutMismatch, match="group 7"):
        run(tier.put([BlockKey(os.urandom(32), 7)], [torch.zeros(16, dtype=torch.uint8)]))
    assert set(tier.keys()) == set()  # nothing half-stored


def test_a_dead_backend_is_a_miss_never_an_exception(subject: Subject) -> None:
    if subject.break_backend is None:
        pytest.skip(f"the {subject.tier.kind} tier does no I/O that can fail")
    keys = new_keys(3, 0) + new_keys(1, 1)
    blocks = blocks_for(keys, seed=5)
    assert run(subject.tier.put(keys, blocks)) == [True] * 4
    subject.break_backend()
    tier = subject.tier
    assert run(tier.get(keys, buffers_for(keys))) == [False] * 4
    assert run(tier.put(keys, blocks)) == [False] * 4
    run(tier.delete(keys))
    assert sum(tier.counters.errors.values()) > 0, "a failed operation must be counted"


@pytest.mark.parametrize("kind", ["cpu", "file"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["put", "delete"]), st.integers(0, 7), st.integers(0, 1)),
                    max_size=30))
def test_the_tier_agrees_with_a_dict(tmp_path: Path, kind: str, ops: list[tuple[str, int, int]]) -> None:
    """Any sequence of puts and deletes leaves exactly what a dict would (property; local tiers)."""
    from kvtier.tiers.cpu import CpuTier
    from kvtier.tiers.file import FileTier

    root = tmp_path / uuid.uuid4().hex
    tier: Tier = (FileTier("file", LAYOUTS, CAPACITY, root=root, namespace="model", io_threads=1)
                  if kind == "file" else CpuTier("cpu", LAYOUTS, CAPACITY, pinned=False))
    universe = {(i, g): BlockKey(bytes([i, g]) * 16, g) for i in range(8) for g in (0, 1)}
    model: dict[BlockKey, torch.Tensor] = {}
    try:
        for step, (op, i, g) in enumerate(ops):
            key = universe[(i, g)]
            if op == "put":
                block = blocks_for([key], seed=step)[0]
                assert run(tier.put([key], [block])) == [True]
                model[key] = block
            else:
                run(tier.delete([key]))
                model.pop(key, None)
        keys = list(universe.values())
        out = buffers_for(keys)
        assert run(tier.get(keys, out)) == [k in model for k in keys]
        assert all(torch.equal(model[k], o) for k, o in zip(keys, out, strict=True) if k in model)
        assert set(tier.keys()) == set(model)
        assert tier.usage_bytes() == sum(LAYOUTS[k.group_id].nbytes for k in model)
    finally:
        run(tier.close())
        shutil.rmtree(root, ignore_errors=True)
