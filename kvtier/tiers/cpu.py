"""Host-memory tier: one slab of fixed-size slots per KV-cache group.

Slabs are page-aligned anonymous mappings (aligned buffers are what make file I/O and DMA fast) and,
when CUDA is present, page-locked with ``cudaHostRegister`` — exactly the bytes asked for, unlike
``pin_memory()``, whose caching allocator rounds up to powers of two. Slots are zero-copy views: the
GPU kernels, the file tier and demotions read and write them in place.

Copies of a MiB or more run on two threads where two CPUs are usable (:mod:`kvtier.tiers.hostcopy`:
one thread's copy does not reach the memory's bandwidth).

Not here: deciding what to evict (the cache does that before ``put``), compression, checksums (the
bytes never leave process memory).
"""

from __future__ import annotations

import logging
import mmap
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import ClassVar, NamedTuple, cast

import numpy as np
import torch

from kvtier.blocks import BlockKey, all_of_group, positions_by_group
from kvtier.layout import BlockLayout
from kvtier.tiers.base import Tier
from kvtier.tiers.hostcopy import SERIAL, RowCopier, default_copy_threads
from kvtier.tiers.slots import SlotAllocator

log = logging.getLogger(__name__)


class _Slab:
    """``num_slots`` contiguous slots of ``slot_bytes`` in one page-aligned mapping."""

    def __init__(self, num_slots: int, slot_bytes: int, pin: bool) -> None:
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        size = max(num_slots * slot_bytes, 1)
        self._map = mmap.mmap(-1, size)
        self.tensor = torch.from_numpy(np.frombuffer(self._map, dtype=np.uint8, count=num_slots * slot_bytes)
                                       ).view(num_slots, slot_bytes)
        self.pinned = False
        if pin and num_slots:
            self.pinned = _host_register(self.tensor)

    def release(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False


def _host_register(tensor: torch.Tensor) -> bool:
    """Page-lock ``tensor``'s memory in place; False (and a log line) if CUDA refuses."""
    try:
        err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel(), 0)
    except Exception as exc:  # CUDA present but the runtime call is unusable
        log.warning("cudaHostRegister failed (%s); the CPU tier uses pageable memory", exc)
        return False
    if int(err) != 0:
        log.warning("cudaHostRegister returned %s; the CPU tier uses pageable memory", err)
        return False
    return True


#: ``fill(slab, slots, placed)`` of :meth:`CpuTier.put_with`: write blocks into rows ``slots`` of ``slab``
SlotFill = Callable[[torch.Tensor, list[int], "list[int] | None"], None]
#: ``read(slab, slots)`` of :meth:`CpuTier.get_with`: copy the blocks in rows ``slots`` of ``slab`` out
SlotRead = Callable[[torch.Tensor, list[int]], None]


class SlotReservation(NamedTuple):
    """Slots a :meth:`CpuTier.reserve` gave a batch, to be written by :meth:`CpuTier.fill`."""

    keys: Sequence[BlockKey]
    #: the group's ``[num_slots, nbytes]`` uint8 slab
    slab: torch.Tensor
    #: the slots given, in key order
    slots: list[int]
    #: the positions in ``keys`` that got them; None when every key got one
    placed: list[int] | None
    #: per key: whether it got a slot (False: the slab is full)
    ok: list[bool]


class CpuTier(Tier):
    """Pinned (when CUDA is there) or plain host memory, ``capacity_bytes[g] // block_bytes`` slots per
    group."""

    kind: ClassVar[str] = "cpu"
    addressable: ClassVar[bool] = True

    def __init__(self, name: str, layouts: Mapping[int, BlockLayout], capacity_bytes: Mapping[int, int], *,
                 pinned: bool | None = None, copy_threads: int | None = None,
                 streaming_stores: bool = True) -> None:
        super().__init__(name, layouts, capacity_bytes)
        #: copies a batch of a MiB or more on ``copy_threads`` threads (default: two, CPUs allowing);
        #: ``streaming_stores``: into the slab with non-temporal stores where the helper builds
        #: (:mod:`kvtier.kernels.host`): a stored block is not read again soon, so it skips the caches
        #: (``copy_threads`` not given: split only while splitting measures faster, hostcopy.SplitChoice)
        self.copier = RowCopier(default_copy_threads() if copy_threads is None else copy_threads,
                                name=f"kvtier-cpu-{name}-copy", streaming=streaming_stores,
                                adaptive=copy_threads is None)
        pin = torch.cuda.is_available() if pinned is None else pinned
        if pin and not torch.cuda.is_available():
            log.info("CPU tier %r: pinned memory asked for but CUDA is unavailable; using plain memory", name)
            pin = False
        self._slabs = {g: _Slab(self.capacity_bytes.get(g, 0) // layout.nbytes, layout.nbytes, pin)
                       for g, layout in self.layouts.items()}
        self._slots = SlotAllocator({g: slab.num_slots for g, slab in self._slabs.items()})

    @property
    def pinned(self) -> bool:
        return any(s.pinned for s in self._slabs.values())

    def slots(self, group_id: int) -> int:
        return self._slabs[group_id].num_slots

    async def put(self, keys: Sequence[BlockKey],
                  blocks: Sequence[torch.Tensor] | torch.Tensor) -> list[bool]:
        """Copy blocks into slots (an existing key keeps its slot). False when the group's slab is full.

        ``blocks``: one 1-D uint8 tensor per key, or one ``[n, nbytes]`` uint8 tensor whose rows are the
        keys' blocks (keys of one group): checked once and copied with one call, not one per block.
        """
        return self.put_now(keys, blocks)

    def put_now(self, keys: Sequence[BlockKey], blocks: Sequence[torch.Tensor] | torch.Tensor) -> list[bool]:
        """:meth:`put` on the caller's thread (it never waits): for a cache running a plan there, without
        a coroutine per call."""
        if isinstance(blocks, torch.Tensor):
            if self._is_row_batch(keys, blocks):
                return self.put_rows(keys, blocks)
            # not such a batch: one block per row, and the check below names the fault
            blocks = list(blocks.unbind(0)) if blocks.dim() > 1 else [blocks]
        self.check_buffers(keys, blocks, "blocks")
        start = time.perf_counter()
        ok = [False] * len(keys)
        written = nbytes = 0
        for group_id, idx in positions_by_group(keys).items():
            slab = self._slabs[group_id]
            assigned = self._slots.assign_many(group_id, [keys[i] for i in idx])
            placed = [i for i, slot in zip(idx, assigned, strict=True) if slot is not None]
            slots = [slot for slot in assigned if slot is not None]
            self.copier.rows([blocks[i] for i in placed], slab.tensor, slots, into_slab=True)
            for i in placed:
                ok[i] = True
            written += len(placed)
            nbytes += len(placed) * slab.slot_bytes
        self.counters.add_writes(written, nbytes, time.perf_counter() - start)
        return ok

    def put_rows(self, keys: Sequence[BlockKey], rows: torch.Tensor) -> list[bool]:
        """:meth:`put_now` of a batch the caller checked (a contiguous ``[len(keys), nbytes]`` uint8 CPU
        tensor, keys of one group of this tier, as :meth:`_is_row_batch` says): :meth:`put_with` with one
        copy for the batch."""
        return self.put_with(keys, rows_fill(rows, self.copier))

    def _slab_of(self, keys: Sequence[BlockKey], caller: str) -> tuple[int, _Slab]:
        """The group and slab of a batch whose keys all belong to one of this tier's groups."""
        group_id = keys[0].group_id
        slab = self._slabs.get(group_id)
        if slab is None or not all_of_group(keys, group_id):
            raise ValueError(f"{caller} takes keys of one group of CPU tier {self.name!r}")
        return group_id, slab

    def put_with(self, keys: Sequence[BlockKey], fill: SlotFill) -> list[bool]:
        """:meth:`put_now` of blocks of one group that ``fill`` writes straight into their slots (an engine's
        pages gathered into the slab, with no buffer between): ``fill(slab, slots, placed)`` gets the
        group's ``[num_slots, nbytes]`` uint8 slab, the slots given to the keys, and which of ``keys`` they
        belong to (their positions; None when every key got one, in order). False for a key whose group's
        slab is full. If ``fill`` raises, the keys' slots are freed (they hold no block) and it propagates.
        """
        if not keys:
            return []
        reservation = self.reserve(keys)
        self.fill(reservation, fill)
        return reservation.ok

    def reserve(self, keys: Sequence[BlockKey]) -> SlotReservation:
        """The first half of :meth:`put_with`: give ``keys`` (one group's) their slots, copying nothing.

        A cache that stores on the caller's thread reserves under its index lock and fills after
        releasing it, so other threads' lookups and loads do not wait for the copies.
        """
        group_id, slab = self._slab_of(keys, "put_with")
        slots = self._slots.assign_many(group_id, keys)
        if None in slots:  # the slab filled up: the keys that got a slot
            placed = [i for i, slot in enumerate(slots) if slot is not None]
            return SlotReservation(keys, slab.tensor, [cast("int", slots[i]) for i in placed], placed,
                                   [slot is not None for slot in slots])
        return SlotReservation(keys, slab.tensor, cast("list[int]", slots), None, [True] * len(keys))

    def fill(self, reservation: SlotReservation, fill: SlotFill) -> None:
        """The second half of :meth:`put_with`: ``fill`` the reserved slots (safe beside other threads'
        calls: only these slots are written). If ``fill`` raises, the slots are freed and it propagates."""
        slab, taken, placed = reservation.slab, reservation.slots, reservation.placed
        if not taken:
            return
        start = time.perf_counter()
        try:
            fill(slab, taken, placed)
        except BaseException:
            self.cancel(reservation)
            raise
        self.counters.add_writes(len(taken), len(taken) * slab.shape[1], time.perf_counter() - start)

    def cancel(self, reservation: SlotReservation) -> None:
        """Free the slots of a :meth:`reserve` that will not be filled (its fill failed, or never ran)."""
        keys, placed = reservation.keys, reservation.placed
        self._slots.release_many(keys if placed is None else [keys[i] for i in placed])

    def get_with(self, keys: Sequence[BlockKey], read: SlotRead) -> None:
        """Hand the slots of ``keys`` (one group's, each holding a block) to ``read(slab, slots)``, which
        copies them out of the slab itself (into an engine's pages, with no buffer between). Raises
        ``KeyError`` for a key without a slot, as :meth:`views` does."""
        if not keys:
            return
        group_id, slab = self._slab_of(keys, "get_with")
        slots = self._slots.slots_of(group_id, keys)
        if None in slots:
            raise KeyError(f"{keys[slots.index(None)]} holds no slot in CPU tier {self.name!r}")
        read(slab.tensor, cast("list[int]", slots))  # counted by the cache (read_leased_with), as read_rows

    async def get(self, keys: Sequence[BlockKey], out: Sequence[torch.Tensor] | torch.Tensor) -> list[bool]:
        """Copy resident blocks into ``out``; a key without a slot is a miss.

        ``out``: one 1-D uint8 tensor per key, or one ``[n, nbytes]`` uint8 tensor whose rows receive
        the keys' blocks (keys of one group): checked once and filled with one call.
        """
        if isinstance(out, torch.Tensor):
            if self._is_row_batch(keys, out):
                return self._get_rows(keys, out)
            out = list(out.unbind(0)) if out.dim() > 1 else [out]
        self.check_buffers(keys, out, "out")
        start = time.perf_counter()
        ok = [False] * len(keys)
        read = nbytes = 0
        for group_id, idx in positions_by_group(keys).items():
            slab = self._slabs[group_id]
            slots = self._slots.slots_of(group_id, [keys[i] for i in idx])
            hits = [i for i, slot in zip(idx, slots, strict=True) if slot is not None]
            self.copier.rows([out[i] for i in hits], slab.tensor,
                             [slot for slot in slots if slot is not None], into_slab=False)
            for i in hits:
                ok[i] = True
            read += len(hits)
            nbytes += len(hits) * slab.slot_bytes
        self.counters.add_reads(read, nbytes, time.perf_counter() - start)
        return ok

    def _get_rows(self, keys: Sequence[BlockKey], rows: torch.Tensor) -> list[bool]:
        """:meth:`get` into a checked ``[n, nbytes]`` batch of one group: one copy when every key hits."""
        start = time.perf_counter()
        slab = self._slabs[keys[0].group_id]
        slots = self._slots.slots_of(keys[0].group_id, keys)
        if None in slots:  # some misses: copy the hits' rows (their rows of ``rows`` are views)
            hits = [i for i, slot in enumerate(slots) if slot is not None]
            self.copier.rows([rows[i] for i in hits], slab.tensor, [cast("int", slots[i]) for i in hits],
                             into_slab=False)
            ok = [slot is not None for slot in slots]
        else:
            self.copier.batch(rows.numpy(), slab.tensor.numpy(), cast("list[int]", slots), into_slab=False)
            ok = [True] * len(keys)
        read = sum(ok)
        self.counters.add_reads(read, read * slab.slot_bytes, time.perf_counter() - start)
        return ok

    async def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        return [key in self._slots for key in keys]

    async def delete(self, keys: Sequence[BlockKey]) -> None:
        self.delete_now(keys)

    def delete_now(self, keys: Sequence[BlockKey]) -> None:
        """:meth:`delete` on the caller's thread (see :meth:`put_now`)."""
        self._slots.release_many(keys)

    def keys(self) -> Iterator[BlockKey]:
        return self._slots.keys()

    def usage_bytes(self) -> int:
        return sum(self._slots.used(g) * slab.slot_bytes for g, slab in self._slabs.items())

    def views(self, keys: Sequence[BlockKey]) -> list[torch.Tensor]:
        """Zero-copy slot views; valid until the key is deleted (the cache pins it meanwhile)."""
        views = []
        for key in keys:
            slot = self._slots.slot(key)
            if slot is None:
                raise KeyError(f"{key} holds no slot in CPU tier {self.name!r}")
            views.append(self._slabs[key.group_id].tensor[slot])
        return views

    def read_rows(self, keys: Sequence[BlockKey], rows: torch.Tensor) -> bool:
        """Copy the blocks of ``keys`` into ``rows``, a contiguous ``[n, nbytes]`` uint8 CPU tensor, when
        the keys are of one group: :meth:`views` and a copy per block in one call. False (nothing
        copied) when ``rows`` is not such a batch. Raises ``KeyError`` for a key without a slot, as
        :meth:`views` does."""
        if not self._is_row_batch(keys, rows):
            return False
        slots = self._slots.slots_of(keys[0].group_id, keys)
        if None in slots:
            raise KeyError(f"{keys[slots.index(None)]} holds no slot in CPU tier {self.name!r}")
        slab = self._slabs[keys[0].group_id]
        self.copier.batch(rows.numpy(), slab.tensor.numpy(), cast("list[int]", slots), into_slab=False)
        return True

    async def close(self) -> None:
        self.copier.close()
        for slab in self._slabs.values():
            slab.release()


def rows_fill(rows: torch.Tensor, copier: RowCopier = SERIAL) -> SlotFill:
    """A :data:`SlotFill` copying a checked contiguous ``[n, nbytes]`` uint8 CPU batch, one row per key
    (one copy for the batch)."""
    def fill(slab: torch.Tensor, slots: list[int], placed: list[int] | None) -> None:
        src = rows if placed is None else rows[torch.tensor(placed, dtype=torch.long)]
        copier.batch(src.numpy(), slab.numpy(), slots, into_slab=True)
    return fill


def buffers_fill(buffers: list[torch.Tensor], copier: RowCopier = SERIAL) -> SlotFill:
    """A :data:`SlotFill` copying checked 1-D uint8 ``buffers``, one per key."""
    def fill(slab: torch.Tensor, slots: list[int], placed: list[int] | None) -> None:
        copier.rows(buffers if placed is None else [buffers[p] for p in placed], slab, slots, into_slab=True)
    return fill
