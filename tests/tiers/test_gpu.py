"""GPU tier and engine KV endpoint: the kernel/copy-engine choice, the no-CUDA refusal, and (on a GPU) that
every batch moves in one launch or one coalesced copy-engine pass and lands bit for bit."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from kvtier.errors import KVTierConfigError, LayoutMismatch, TierUnavailable
from kvtier.kernels import fallback
from kvtier.layout import BlockLayout, PerLayerKind, PerLayerLayout
from kvtier.tiers.gpu import DEFAULT_CROSSOVER_BYTES, TransferChoice
from tests.gpu_support import requires_gpu
from tests.helpers import make_keys

CUDA = torch.cuda.is_available()
BLOCK = BlockLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16)  # 32 KiB cross-layer blocks


# --- CPU: the choice between kernel and copy engine ---------------------------------------------------------


def test_auto_sends_small_pieces_to_the_kernel_and_large_ones_to_the_copy_engine() -> None:
    choice = TransferChoice()
    assert choice.crossover_bytes == DEFAULT_CROSSOVER_BYTES
    assert choice.choose(DEFAULT_CROSSOVER_BYTES - 1) == "kernel"
    assert choice.choose(DEFAULT_CROSSOVER_BYTES) == "copy_engine"
    assert choice.choose(2 << 20, contiguous=False) == "kernel"  # a transpose is no run of contiguous pieces
    assert TransferChoice(crossover_bytes=4 << 20).choose(2 << 20) == "kernel"


@pytest.mark.parametrize("method", ["kernel", "copy_engine"])
def test_a_forced_method_is_always_taken(method: Any) -> None:
    choice = TransferChoice(method)
    assert {choice.choose(1), choice.choose(1 << 30), choice.choose(1 << 30, contiguous=False)} == {method}


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"method": "dma"}, r"^transfer\.method: expected 'auto', 'kernel' or 'copy_engine', got 'dma'"),
    ({"crossover_bytes": -1}, r"^transfer\.crossover: expected a size in bytes >= 0, got -1"),
    ({"crossover_bytes": "64KiB"}, r"^transfer\.crossover: expected a size in bytes >= 0, got '64KiB'"),
])
def test_a_bad_choice_is_refused_with_its_key(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(KVTierConfigError, match=message):
        TransferChoice(**kwargs)


@pytest.mark.skipif(CUDA, reason="checks the no-CUDA message; this machine has CUDA")
def test_gpu_tier_and_engine_kv_raise_tier_unavailable_without_cuda() -> None:
    from kvtier.tiers.gpu import EngineKV, GpuTier

    with pytest.raises(TierUnavailable, match="CUDA is unavailable: torch.cuda.is_available"):
        GpuTier("gpu", {0: BLOCK}, {0: 4 * BLOCK.nbytes})
    layers = [torch.zeros(PerLayerLayout(PerLayerKind.FLASH_ATTN).layer_shape(4, BLOCK), dtype=BLOCK.dtype)
              for _ in range(BLOCK.num_layers)]
    with pytest.raises(TierUnavailable, match="CUDA is unavailable"):
        EngineKV(layers, block_size=16, num_kv_heads=2, head_dim=64)


# --- GPU: engine KV ↔ tier slots ----------------------------------------------------------------------------


def random_engine_kv(cross_layer: bool, method: Any,
                     per_layer: PerLayerLayout) -> tuple[Any, list[torch.Tensor]]:
    """An ``EngineKV`` over 10 random CUDA blocks of ``BLOCK``, cross-layer or per-layer, and its layers."""
    from kvtier.detect import make_cross_layer_kv
    from kvtier.tiers.gpu import EngineKV

    if cross_layer:
        base, layers = make_cross_layer_kv(10, BLOCK, "cuda")
        base.view(torch.uint8).copy_(torch.randint(0, 256, base.view(torch.uint8).shape, dtype=torch.uint8))
    else:
        layers = [torch.randint(0, 256, per_layer.layer_shape(10, BLOCK), dtype=torch.int16, device="cuda"
                                ).view(BLOCK.dtype) for _ in range(BLOCK.num_layers)]
    engine = EngineKV(layers, block_size=16, num_kv_heads=2, head_dim=64, transfer=TransferChoice(method))
    return engine, layers


@requires_gpu
@pytest.mark.parametrize("cross_layer", [True, False])
@pytest.mark.parametrize("method", ["kernel", "copy_engine", "auto"])
def test_engine_kv_store_load_round_trip_through_pinned_cpu_slots(cross_layer: bool, method: Any) -> None:
    from kvtier.tiers.cpu import CpuTier

    per_layer = PerLayerLayout(PerLayerKind.FLASH_ATTN)
    engine, layers = random_engine_kv(cross_layer, method, per_layer)
    assert engine.detected.cross_layer is cross_layer
    tier = CpuTier("cpu", {0: BLOCK}, {0: 8 * BLOCK.nbytes}, pinned=True)
    assert tier.pinned
    keys = make_keys(3)
    asyncio.run(tier.put(keys, list(torch.zeros((3, BLOCK.nbytes), dtype=torch.uint8))))
    slots = tier.views(keys)
    ids = [6, 2, 9]
    engine.store(ids, slots).wait()
    expected = torch.empty((3, *BLOCK.shape), dtype=BLOCK.dtype, device="cuda")
    fallback.pack_blocks(layers, torch.tensor(ids), per_layer, BLOCK, expected)
    assert torch.equal(torch.stack(slots).cuda(), expected.view(torch.uint8).view(3, -1))
    before = [layer.clone() for layer in layers]
    handle = engine.load(slots[::-1], [0, 1, 3])
    handle.stream_wait()
    torch.cuda.synchronize()
    fallback.unpack_blocks(expected.flip(0), before, torch.tensor([0, 1, 3]), per_layer, BLOCK)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(layers, before, strict=True))
    asyncio.run(tier.close())


@requires_gpu
@pytest.mark.parametrize("cross_layer", [True, False])
@pytest.mark.parametrize("method", ["kernel", "copy_engine"])
def test_engine_kv_moves_rows_of_a_pinned_slab_by_slot_id(cross_layer: bool, method: Any) -> None:
    """The slab form (one 2-D tensor + slot ids) writes and reads exactly the rows the ids name."""

    per_layer = PerLayerLayout(PerLayerKind.FLASH_ATTN)
    engine, layers = random_engine_kv(cross_layer, method, per_layer)
    slab = torch.full((8, BLOCK.nbytes), 7, dtype=torch.uint8).pin_memory()
    ids, rows = [6, 2, 9], [5, 0, 3]
    engine.store(ids, slab, rows).wait()
    expected = torch.empty((3, *BLOCK.shape), dtype=BLOCK.dtype, device="cuda")
    fallback.pack_blocks(layers, torch.tensor(ids), per_layer, BLOCK, expected)
    assert torch.equal(slab[rows].cuda(), expected.view(torch.uint8).view(3, -1))
    untouched = [row for row in range(8) if row not in rows]
    assert bool((slab[untouched] == 7).all())
    before = [layer.clone() for layer in layers]
    engine.load(slab, [0, 1, 4], torch.tensor([3, 5, 0])).wait()
    fallback.unpack_blocks(slab[[3, 5, 0]].cuda().view(BLOCK.dtype).view(3, *BLOCK.shape), before,
                           torch.tensor([0, 1, 4]), per_layer, BLOCK)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(layers, before, strict=True))

    with pytest.raises(LayoutMismatch, match=r"slot ids must lie in \[0, 8\).*\[8\]"):
        engine.store([1], slab, [8])
    with pytest.raises(LayoutMismatch, match=r"a slab of slots must be a 2-D uint8 tensor of contiguous"):
        engine.store([1], slab[:, :64], [0])
    with pytest.raises(LayoutMismatch, match=r"2 engine block ids but 1 slot ids"):
        engine.store([1, 2], slab, [0])
    with pytest.raises(LayoutMismatch, match=r"slot_ids name rows of a slab tensor"):
        engine.store([1], list(slab[:1]), [0])
    with pytest.raises(LayoutMismatch, match=r"the slab is on cpu, which cuda:0 cannot reach"):
        engine.store([1], torch.zeros((2, BLOCK.nbytes), dtype=torch.uint8), [0])


# --- GPU: the tier's own put/get ----------------------------------------------------------------------------


class Launches:
    """Counts kernel launches and copy-engine calls while still making them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from kvtier.kernels import copy_engine, cuda

        self.kernels = 0
        self.memcpy_runs = 0

        def counting_copy_blocks(*args: Any, **kwargs: Any) -> None:
            self.kernels += 1
            real_copy_blocks(*args, **kwargs)

        def counting_memcpy(runs: Any, *args: Any) -> None:
            self.memcpy_runs += len(runs)
            real_memcpy(runs, *args)

        real_copy_blocks, real_memcpy = cuda.copy_blocks, copy_engine.memcpy_async
        monkeypatch.setattr(cuda, "copy_blocks", counting_copy_blocks)
        monkeypatch.setattr(copy_engine, "memcpy_async", counting_memcpy)


def source_buffers(kind: str, data: torch.Tensor) -> list[torch.Tensor]:
    """``data``'s rows as 1-D block buffers in ``kind`` memory (``misaligned``: device, 2 bytes off 16)."""
    if kind == "device":
        return list(data.cuda())
    if kind == "pinned":
        return list(data.pin_memory())
    if kind == "pageable":
        return list(data.clone())
    assert kind == "misaligned"
    flat = torch.zeros(data.numel() + 2, dtype=torch.uint8, device="cuda")
    flat[2:].copy_(data.reshape(-1))
    return [flat[2 + i * data.shape[1]:2 + (i + 1) * data.shape[1]] for i in range(data.shape[0])]


@requires_gpu
@pytest.mark.parametrize("method", ["kernel", "copy_engine"])
@pytest.mark.parametrize("memory", ["device", "pinned", "pageable", "misaligned"])
def test_gpu_tier_moves_each_group_of_a_call_in_one_batch(method: Any, memory: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.tiers.gpu import GpuTier

    small = BlockLayout(num_layers=2, num_kv_heads=1, head_dim=8, block_size=16)  # 1 KiB: another slot size
    tier = GpuTier("gpu", {0: BLOCK, 1: small}, {0: 6 * BLOCK.nbytes, 1: 6 * small.nbytes},
                   transfer=TransferChoice(method))
    big_keys, small_keys = make_keys(5), make_keys(4, group_id=1, start=100)
    big = torch.randint(0, 256, (5, BLOCK.nbytes), dtype=torch.uint8)
    little = torch.randint(0, 256, (4, small.nbytes), dtype=torch.uint8)
    keys = [big_keys[0], small_keys[0], *big_keys[1:], *small_keys[1:]]
    data = [big[0], little[0], *big[1:], *little[1:]]
    buffers = source_buffers(memory, big) + source_buffers(memory, little)
    blocks = [buffers[0], buffers[5], *buffers[1:5], *buffers[6:]]

    launches = Launches(monkeypatch)
    assert asyncio.run(tier.put(keys, blocks)) == [True] * 9
    staged = memory == "pageable"
    assert launches.kernels == (0 if staged or method == "copy_engine" else 2)  # one launch per group
    # fresh slots are handed out in order and the rows are consecutive: one copy-engine run per group
    assert launches.memcpy_runs == (2 if method == "copy_engine" and not staged else 0)

    out = source_buffers(memory, torch.zeros((5, BLOCK.nbytes), dtype=torch.uint8)) \
        + source_buffers(memory, torch.zeros((4, small.nbytes), dtype=torch.uint8))
    out_order = [out[0], out[5], *out[1:5], *out[6:]]
    reversed_keys = keys[::-1]
    assert asyncio.run(tier.get(reversed_keys, out_order[::-1])) == [True] * 9
    assert all(torch.equal(got.cpu(), want) for got, want in zip(out_order, data, strict=True))
    assert tier.usage_bytes() == 5 * BLOCK.nbytes + 4 * small.nbytes


@requires_gpu
def test_gpu_tier_put_get_overwrite_repeat_and_full() -> None:
    from kvtier.tiers.gpu import GpuTier

    tier = GpuTier("gpu", {0: BLOCK}, {0: 2 * BLOCK.nbytes})
    keys = make_keys(3)
    data = torch.randint(0, 256, (4, BLOCK.nbytes), dtype=torch.uint8)
    assert asyncio.run(tier.put(keys, list(data[:3]))) == [True, True, False]  # the slab holds two
    assert asyncio.run(tier.put([keys[0], keys[0]], [data[2], data[3]])) == [True, True]  # last one wins
    out = torch.zeros((3, BLOCK.nbytes), dtype=torch.uint8)
    assert asyncio.run(tier.get(keys, list(out))) == [True, True, False]
    assert torch.equal(out[0], data[3]) and torch.equal(out[1], data[1])
    assert tier.usage_bytes() == 2 * BLOCK.nbytes and tier.views(keys[:1])[0].device.type == "cuda"
    asyncio.run(tier.delete(keys[:1]))
    assert asyncio.run(tier.put(keys[2:], list(data[2:3]))) == [True]


@requires_gpu
def test_gpu_tier_waits_for_the_callers_stream_before_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    """A block still being written on the caller's stream is read only after that write."""
    from kvtier.tiers.gpu import GpuTier

    tier = GpuTier("gpu", {0: BLOCK}, {0: 2 * BLOCK.nbytes}, transfer=TransferChoice("kernel"))
    block = torch.zeros(BLOCK.nbytes, dtype=torch.uint8, device="cuda")
    torch.cuda._sleep(50_000_000)  # keep the current stream busy, then write the block on it
    block.fill_(7)
    assert asyncio.run(tier.put(make_keys(1), [block])) == [True]
    out = torch.zeros(BLOCK.nbytes, dtype=torch.uint8)
    asyncio.run(tier.get(make_keys(1), [out]))
    assert bool((out == 7).all())
