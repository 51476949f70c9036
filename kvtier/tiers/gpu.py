"""GPU tier (a slab of device memory per group) and the engine's own KV cache as a transfer endpoint.

:class:`GpuTier` hands out fixed-size slots on one CUDA device as zero-copy views, like the CPU tier.
:class:`EngineKV` wraps an engine's paged KV cache so blocks addressed by engine block ids move to and
from tier slots on a stream of their own, never blocking the engine's stream. Each batch moves with
one kernel launch or through the copy engine, as :class:`TransferChoice` decides (the tier's
``transfer`` key). Without CUDA or CuPy both raise :class:`~kvtier.errors.TierUnavailable`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch

from kvtier.blocks import BlockKey
from kvtier.detect import DetectedKVLayout, detect_kv_layout
from kvtier.errors import KVTierConfigError, LayoutMismatch, TierUnavailable
from kvtier.kernels import copy_engine, cuda
from kvtier.layout import BlockLayout, PerLayerKind, PerLayerLayout
from kvtier.tiers.base import Tier
from kvtier.tiers.slots import SlotAllocator

#: ``kernel``: one launch of the CUDA kernels; ``copy_engine``: one cudaMemcpyAsync per contiguous run;
#: ``auto``: by piece size against the crossover.
TransferMethod = Literal["auto", "kernel", "copy_engine"]
#: Pieces below this size go through the kernel, larger ones through the copy engine. Measured on an H200
#: (benchmarks/results/gpu_nvidia_h200.md): the kernel is 1.1-9x faster than one cudaMemcpyAsync per
#: block under 1 MiB at 64 and 1024 blocks a call; from 1 MiB the copy engine is within a few percent
#: (ahead at 64 blocks a call) and leaves the SMs to the model, so it takes those.
DEFAULT_CROSSOVER_BYTES = 1024 * 1024


@dataclass(frozen=True)
class TransferChoice:
    """Kernel or copy engine for one transfer: forced by ``method``, or by piece size against a crossover.

    A *piece* is what one copy-engine call would move: a whole block when blocks are contiguous on
    both sides (cross-layer caches, tier slots), one layer's K or V of a block for per-layer
    caches. Small pieces pay the copy engine's per-call cost, so they go through the kernel, which
    moves a whole batch in one launch; pieces of ``crossover_bytes`` or more go through the copy
    engine. A transfer that needs a transpose (NHD ↔ HND) is not made of contiguous pieces and
    always takes the kernel under ``auto``. Built from a gpu tier's ``transfer`` key in YAML.
    """

    method: TransferMethod = "auto"
    crossover_bytes: int = DEFAULT_CROSSOVER_BYTES

    def __post_init__(self) -> None:
        if self.method not in ("auto", "kernel", "copy_engine"):
            raise KVTierConfigError("transfer.method",
                                    f"expected 'auto', 'kernel' or 'copy_engine', got {self.method!r}")
        if isinstance(self.crossover_bytes, bool) or not isinstance(self.crossover_bytes, int) \
                or self.crossover_bytes < 0:
            raise KVTierConfigError("transfer.crossover",
                                    f"expected a size in bytes >= 0, got {self.crossover_bytes!r}")

    def choose(self, piece_bytes: int, *, contiguous: bool = True) -> Literal["kernel", "copy_engine"]:
        """The path for a transfer of ``piece_bytes`` pieces (``contiguous=False``: rows need a transpose)."""
        if self.method != "auto":
            return self.method
        if not contiguous or piece_bytes < self.crossover_bytes:
            return "kernel"
        return "copy_engine"


def _require_device(device: torch.device | str | int | None) -> torch.device:
    if not torch.cuda.is_available():
        raise TierUnavailable("CUDA is unavailable: torch.cuda.is_available() is False, so the GPU tier "
                              "cannot run; configure a cpu tier as the top tier instead")
    resolved = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device) \
        if not isinstance(device, int) else torch.device("cuda", device)
    if resolved.type != "cuda" or (resolved.index or 0) >= torch.cuda.device_count():
        raise TierUnavailable(f"device {device!r} is not one of the {torch.cuda.device_count()} CUDA devices")
    cuda.require_cuda()
    return resolved if resolved.index is not None else torch.device("cuda", torch.cuda.current_device())


@dataclass
class TransferHandle:
    """An enqueued transfer: poll :meth:`done`, block in :meth:`wait`, or make a stream wait for it.

    Keeps the tensors the transfer reads or writes alive until it completes.
    """

    event: torch.cuda.Event
    device: torch.device
    num_blocks: int
    num_bytes: int
    method: str
    keepalive: list[Any] = field(default_factory=list, repr=False)

    def done(self) -> bool:
        """True once every byte has landed (never blocks)."""
        finished = self.event.query()
        if finished:
            self.keepalive.clear()
        return finished

    def wait(self) -> None:
        """Block the calling thread until the transfer completed."""
        self.event.synchronize()
        self.keepalive.clear()

    async def wait_async(self, poll_seconds: float = 50e-6) -> None:
        """Wait without blocking the event loop."""
        while not self.done():
            await asyncio.sleep(poll_seconds)

    def stream_wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make ``stream`` (default: the current one, e.g. the engine's) wait for the transfer, host not
        blocked."""
        self.event.wait(stream if stream is not None else torch.cuda.current_stream(self.device))


class EngineKV:
    """The engine's paged KV cache as the source of stores and the sink of loads, by engine block id.

    ``kv_caches`` are the engine's per-layer tensors (layer order = iteration order; vLLM hands a
    name → tensor mapping). Cross-layer caches move whole blocks (``copy_blocks``); per-layer ones
    are packed into / unpacked from cross-layer blocks. ``transfer`` picks kernel or copy engine
    (pass a :class:`GpuTier`'s ``transfer`` to follow its YAML key); the piece it weighs is a whole
    block when cross-layer, one layer's K or V of a block otherwise. Tier slots are 1-D uint8
    views of ``block.nbytes`` (:meth:`Tier.views` of a GPU tier or of a pinned CPU tier), or a
    slab, a 2-D uint8 tensor of ``block.nbytes`` rows, with ``slot_ids`` naming its rows: a batch of
    a thousand slots then costs no per-slot Python (views cost ~1 µs each on the host, which showed
    as 6-8 % of an H200's PCIe time at 640 KiB blocks).
    """

    def __init__(self, kv_caches: Mapping[str, torch.Tensor] | Sequence[torch.Tensor], *, block_size: int,
                 num_kv_heads: int, head_dim: int, hint: PerLayerKind | PerLayerLayout | None = None,
                 transfer: TransferChoice = TransferChoice()) -> None:
        cuda.require_cuda()
        self.detected: DetectedKVLayout = detect_kv_layout(kv_caches, block_size=block_size,
                                                           num_kv_heads=num_kv_heads, head_dim=head_dim,
                                                           hint=hint)
        self.layers = list(kv_caches.values()) if isinstance(kv_caches, Mapping) else list(kv_caches)
        self.device = self.layers[0].device
        if self.device.type != "cuda":
            raise LayoutMismatch(f"the engine KV cache must be on a CUDA device, got {self.device}")
        self.transfer = transfer
        self.stream = torch.cuda.Stream(self.device)
        if self.detected.cross_layer:
            self.piece_bytes = self.block.nbytes
            self.contiguous = True
        else:
            assert self.detected.per_layer is not None
            self.geometry = cuda.piece_geometry(self.layers, self.detected.per_layer, self.block)
            self.piece_bytes = self.geometry.piece_bytes
            self.contiguous = self.geometry.rows == 1

    @property
    def block(self) -> BlockLayout:
        return self.detected.block

    def choose(self) -> Literal["kernel", "copy_engine"]:
        """``kernel`` or ``copy_engine`` for this cache (its piece size against the crossover, unless
        forced)."""
        return self.transfer.choose(self.piece_bytes, contiguous=self.contiguous)

    def store(self, block_ids: Sequence[int] | torch.Tensor, slots: Slots,
              slot_ids: Sequence[int] | torch.Tensor | None = None) -> TransferHandle:
        """Copy engine blocks ``block_ids[i]`` into ``slots[i]`` (or row ``slot_ids[i]`` of a slab), after
        the compute stream's pending writes.

        Called by the worker when the scheduler asks to offload; returns at once. The engine may
        overwrite those blocks only after the handle is done.
        """
        return self._transfer(block_ids, slots, slot_ids, to_engine=False)

    def load(self, slots: Slots, block_ids: Sequence[int] | torch.Tensor,
             slot_ids: Sequence[int] | torch.Tensor | None = None) -> TransferHandle:
        """Copy ``slots[i]`` (or row ``slot_ids[i]`` of a slab) into engine blocks ``block_ids[i]`` (no
        repeats); the engine waits on the handle."""
        return self._transfer(block_ids, slots, slot_ids, to_engine=True)

    def _transfer(self, block_ids: Sequence[int] | torch.Tensor, slots: Slots,
                  slot_ids: Sequence[int] | torch.Tensor | None, *, to_engine: bool) -> TransferHandle:
        ids = torch.as_tensor(block_ids, dtype=torch.int64).reshape(-1)
        if isinstance(slots, torch.Tensor):
            rows = self._slab_rows(slots, slot_ids, ids.numel())
        elif slot_ids is not None:
            raise LayoutMismatch("slot_ids name rows of a slab tensor; a list of slot views takes none")
        elif ids.numel() != len(slots):
            raise LayoutMismatch(f"{ids.numel()} engine block ids but {len(slots)} slots")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.detected.num_blocks):
            raise LayoutMismatch(f"engine block ids must lie in [0, {self.detected.num_blocks}), got "
                                 f"{ids[(ids < 0) | (ids >= self.detected.num_blocks)][:8].tolist()}")
        method = self.choose()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        target: _Target = (slots, rows) if isinstance(slots, torch.Tensor) else list(slots)
        keepalive: list[Any] = [ids, target]
        if method == "kernel":
            self._kernel(ids, target, to_engine)
        else:
            self._copy_engine(ids, target, to_engine)
        event = torch.cuda.Event()
        event.record(self.stream)
        return TransferHandle(event, self.device, ids.numel(), ids.numel() * self.block.nbytes, method,
                              keepalive)

    def _slab_rows(self, slab: torch.Tensor, slot_ids: Sequence[int] | torch.Tensor | None,
                   count: int) -> torch.Tensor:
        """``slot_ids`` (default ``0..count-1``) as an int64 tensor, after checking the slab and the ids."""
        nbytes = self.block.nbytes
        if slab.dtype != torch.uint8 or slab.dim() != 2 or slab.shape[1] != nbytes or slab.stride(1) != 1:
            raise LayoutMismatch(f"a slab of slots must be a 2-D uint8 tensor of contiguous {nbytes}-byte "
                                 f"rows ({self.block.describe()}), got {slab.dtype} {tuple(slab.shape)} "
                                 f"with strides {slab.stride()}")
        if not cuda.reachable([slab], self.device):
            raise LayoutMismatch(f"the slab is on {slab.device}, which {self.device} cannot reach; use "
                                 f"{self.device} or page-locked host memory (a pinned CPU tier slab)")
        rows = (torch.arange(count) if slot_ids is None
                else torch.as_tensor(slot_ids, dtype=torch.int64).reshape(-1).cpu())
        if rows.numel() != count:
            raise LayoutMismatch(f"{count} engine block ids but {rows.numel()} slot ids")
        if count and (int(rows.min()) < 0 or int(rows.max()) >= slab.shape[0]):
            raise LayoutMismatch(f"slot ids must lie in [0, {slab.shape[0]}) (the slab's rows), got "
                                 f"{rows[(rows < 0) | (rows >= slab.shape[0])][:8].tolist()}")
        return rows

    def _kernel(self, ids: torch.Tensor, target: _Target, to_engine: bool) -> None:
        slab, rows = target if isinstance(target, tuple) else (target, None)
        if self.detected.cross_layer:
            base = self.detected.base
            assert base is not None
            if to_engine:
                cuda.copy_blocks(slab, rows, base, ids, stream=self.stream)
            else:
                cuda.copy_blocks(base, ids, slab, rows, stream=self.stream)
            return
        assert self.detected.per_layer is not None
        if to_engine:
            cuda.unpack_blocks(slab, self.layers, ids, self.detected.per_layer, self.block,
                               stream=self.stream, blocks_ids=rows)
        else:
            cuda.pack_blocks(self.layers, ids, self.detected.per_layer, self.block, slab, stream=self.stream,
                             out_ids=rows)

    def _copy_engine(self, ids: torch.Tensor, target: _Target, to_engine: bool) -> None:
        """One ``cudaMemcpyAsync`` per contiguous run of blocks (cross-layer) or pieces (per-layer)."""
        if isinstance(target, tuple):
            slab, rows = target
            slots: list[torch.Tensor] = [slab]
            slot_ptrs = (slab.data_ptr() + rows * slab.stride(0)).tolist()
        else:
            slots = target
            slot_ptrs = [slot.data_ptr() for slot in slots]
        if not cuda.reachable(slots, self.device):
            raise LayoutMismatch(f"slots must be on {self.device} or in page-locked host memory "
                                 f"(a pinned CPU tier slab) for the copy engine to move them asynchronously")
        if self.detected.cross_layer:
            base = self.detected.base
            assert base is not None
            stride = base.stride(0) * base.element_size()
            size = self.block.nbytes
            engine = [base.data_ptr() + b * stride for b in ids.tolist()]
            cross = slot_ptrs
        else:
            g = self.geometry
            if g.rows != 1:
                raise LayoutMismatch("the copy engine moves contiguous pieces only; this per-layer cache "
                                     "needs a token-layout transpose, so use method='kernel'")
            size = g.piece_bytes
            layer_ptrs = [layer.data_ptr() for layer in self.layers]
            engine, cross = [], []
            for b, slot_ptr in zip(ids.tolist(), slot_ptrs, strict=True):
                for layer_index, layer_ptr in enumerate(layer_ptrs):
                    for kv in range(g.kv_factor):
                        engine.append(layer_ptr + b * g.engine_block_stride + kv * g.engine_kv_stride)
                        cross.append(slot_ptr + (layer_index * g.kv_factor + kv) * size)
        runs = (copy_engine.coalesce(engine, cross, size) if to_engine
                else copy_engine.coalesce(cross, engine, size))
        copy_engine.memcpy_async(runs, self.device, self.stream)


#: Where a transfer's host side lies: 1-D slot views, or a slab of slot rows and the rows' ids.
Slots = Sequence[torch.Tensor] | torch.Tensor
_Target = list[torch.Tensor] | tuple[torch.Tensor, torch.Tensor]


#: Moves of one group in one call: the slots and, in the same order, the caller's buffers.
_Moves = dict[int, tuple[list[int], list[torch.Tensor]]]


class GpuTier(Tier):
    """Device memory on one CUDA device, ``capacity_bytes[g] // block_bytes`` slots per group.

    ``put`` and ``get`` move each group's blocks of a call as one batch on the tier's stream: one
    kernel launch, or the copy engine over coalesced runs, as ``transfer`` chooses for the group's
    block size. Buffers a kernel cannot reach (pageable host memory, another GPU) are staged through
    one batched copy instead. Each call returns once its bytes have landed.
    """

    kind: ClassVar[str] = "gpu"
    addressable: ClassVar[bool] = True

    def __init__(self, name: str, layouts: Mapping[int, BlockLayout], capacity_bytes: Mapping[int, int], *,
                 device: torch.device | str | int | None = None,
                 transfer: TransferChoice = TransferChoice()) -> None:
        self.device = _require_device(device)
        super().__init__(name, layouts, capacity_bytes)
        self.transfer = transfer
        self.stream = torch.cuda.Stream(self.device)
        self._slabs = {g: torch.empty((self.capacity_bytes.get(g, 0) // layout.nbytes, layout.nbytes),
                                      dtype=torch.uint8, device=self.device)
                       for g, layout in self.layouts.items()}
        self._slots = SlotAllocator({g: slab.shape[0] for g, slab in self._slabs.items()})

    def slots(self, group_id: int) -> int:
        return self._slabs[group_id].shape[0]

    async def put(self, keys: Sequence[BlockKey], blocks: Sequence[torch.Tensor]) -> list[bool]:
        """Copy blocks (device or host memory) into slots; False when the group's slab is full.

        A key given twice in one call is stored once, with its last block (as one copy per block
        in order would leave it).
        """
        self.check_buffers(keys, blocks, "blocks")
        start = time.perf_counter()
        last = {key: i for i, key in enumerate(keys)}
        moves: _Moves = {}
        placed: set[BlockKey] = set()
        nbytes = 0
        for key, i in last.items():
            slot = self._slots.assign(key)
            if slot is None:
                continue
            slots, buffers = moves.setdefault(key.group_id, ([], []))
            slots.append(slot)
            buffers.append(blocks[i])
            placed.add(key)
            nbytes += blocks[i].numel()
        await self._move(moves, into_slab=True)
        self.counters.add_writes(len(placed), nbytes, time.perf_counter() - start)
        return [key in placed for key in keys]

    async def get(self, keys: Sequence[BlockKey], out: Sequence[torch.Tensor]) -> list[bool]:
        """Copy resident blocks into ``out`` (device or host memory); a key without a slot is a miss."""
        self.check_buffers(keys, out, "out")
        start = time.perf_counter()
        ok = [False] * len(keys)
        moves: _Moves = {}
        nbytes = 0
        for i, key in enumerate(keys):
            slot = self._slots.slot(key)
            if slot is not None:
                slots, buffers = moves.setdefault(key.group_id, ([], []))
                slots.append(slot)
                buffers.append(out[i])
                ok[i] = True
                nbytes += out[i].numel()
        await self._move(moves, into_slab=False)
        self.counters.add_reads(sum(ok), nbytes, time.perf_counter() - start)
        return ok

    async def _move(self, moves: _Moves, *, into_slab: bool) -> None:
        """Enqueue each group's batch on the tier's stream after the caller's pending work; wait for it."""
        if not moves:
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        keepalive: list[Any] = [moves]
        finish: list[Callable[[], None]] = []
        methods = set()
        with torch.cuda.stream(self.stream):
            for group_id, (slots, buffers) in moves.items():
                methods.add(self._enqueue(self._slabs[group_id], slots, buffers, into_slab, keepalive,
                                          finish))
        event = torch.cuda.Event()
        event.record(self.stream)
        num_bytes = sum(len(slots) * self._slabs[g].shape[1] for g, (slots, _) in moves.items())
        await TransferHandle(event, self.device, sum(len(s) for s, _ in moves.values()), num_bytes,
                             "+".join(sorted(methods)), keepalive).wait_async()
        for step in finish:
            step()

    def _enqueue(self, slab: torch.Tensor, slots: list[int], buffers: list[torch.Tensor], into_slab: bool,
                 keepalive: list[Any], finish: list[Callable[[], None]]) -> str:
        """Enqueue one group's copies on the current (tier) stream; return the path taken.

        Reachable buffers (this device, page-locked host memory) move in one kernel launch or as
        coalesced copy-engine runs. Others are staged: into the slab, one stack and one copy of
        them, then one indexed copy; out of it, one indexed gather into page-locked staging that
        ``finish`` spreads into the buffers once the stream has passed it.
        """
        ids = torch.tensor(slots, dtype=torch.int64)
        if not cuda.reachable(buffers, self.device):
            device_ids = ids.to(self.device, non_blocking=True)
            if into_slab:
                first = buffers[0].device
                staged = torch.stack(buffers).to(self.device, non_blocking=True) \
                    if all(b.device == first for b in buffers) \
                    else torch.stack([b.to(self.device, non_blocking=True) for b in buffers])
                slab.index_copy_(0, device_ids, staged)
                keepalive.append(staged)
            else:
                staging = torch.empty((len(slots), slab.shape[1]), dtype=torch.uint8, pin_memory=True)
                staging.copy_(slab.index_select(0, device_ids), non_blocking=True)
                keepalive.append(staging)

                def spread() -> None:
                    for buf, row in zip(buffers, staging, strict=True):
                        buf.copy_(row)

                finish.append(spread)
            return "staged"
        method = self.transfer.choose(slab.shape[1])
        if method == "kernel":
            if into_slab:
                cuda.copy_blocks(buffers, None, slab, ids, stream=self.stream)
            else:
                cuda.copy_blocks(slab, ids, buffers, None, stream=self.stream)
            return method
        slot_addresses = [slab.data_ptr() + slot * slab.stride(0) for slot in slots]
        buffer_addresses = [buf.data_ptr() for buf in buffers]
        runs = copy_engine.coalesce(slot_addresses, buffer_addresses, slab.shape[1]) if into_slab \
            else copy_engine.coalesce(buffer_addresses, slot_addresses, slab.shape[1])
        copy_engine.memcpy_async(runs, self.device, self.stream)
        return method

    async def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        return [key in self._slots for key in keys]

    async def delete(self, keys: Sequence[BlockKey]) -> None:
        for key in keys:
            self._slots.release(key)

    def keys(self) -> Iterator[BlockKey]:
        return self._slots.keys()

    def usage_bytes(self) -> int:
        return sum(self._slots.used(g) * slab.shape[1] for g, slab in self._slabs.items())

    def views(self, keys: Sequence[BlockKey]) -> list[torch.Tensor]:
        """Zero-copy device slot views; valid until the key is deleted (the cache pins it meanwhile)."""
        views = []
        for key in keys:
            slot = self._slots.slot(key)
            if slot is None:
                raise KeyError(f"{key} holds no slot in GPU tier {self.name!r}")
            views.append(self._slabs[key.group_id][slot])
        return views
